"""Predict whether a configuration fits, and how fast it runs, without running it (mode=fit)."""
