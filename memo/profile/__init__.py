"""Profiling: one iteration's allocation trace (fake, CPU or CUDA tensors), its phases, and each
layer's skeletal and transient bytes, for the planners of :mod:`memo.plan` and :mod:`memo.fit`."""
