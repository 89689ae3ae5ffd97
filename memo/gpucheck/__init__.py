"""The GPU validation pack: ``python -m memo.gpucheck`` proves the GPU path on a lent GPU.

Each step (:data:`memo.gpucheck.__main__.STEPS`) runs in a process of its own with its own time
budget and writes its rows into the pack's directory (``results/gpu/<date>-<device>/`` by
default). A plain run makes the first, most informative steps within one command of eight
minutes; the others run by name (``--only``) or with ``--all``. A step whose result there was made
by the code checked out now is skipped unless ``--redo``, so a pack cut short goes on where it
stopped; a result of other code is set aside, never overwritten. A step that fails records why and
the pack goes on. ``--cpu`` rehearses the steps with the tiny model on the CPU (the test suite
does), and the GPU-only parts say they were skipped and why.
"""
