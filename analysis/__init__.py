"""Turning result rows into tables and figures."""
