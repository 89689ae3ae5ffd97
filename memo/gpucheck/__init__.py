"""The GPU validation pack: ``python -m memo.gpucheck`` proves the GPU path on a lent GPU in one go.

Each step (:data:`memo.gpucheck.__main__.STEPS`) runs in a process of its own with its own time
budget and writes its rows into the pack's directory (``results/gpu/<date>-<device>/`` by
default): a step whose result is there is skipped on the next run unless ``--redo``, so a pack cut
short goes on where it stopped. A step that fails records why and the pack goes on. ``--cpu`` runs
every step with the tiny model on the CPU (the test suite does), and the GPU-only parts say they
were skipped and why.
"""
