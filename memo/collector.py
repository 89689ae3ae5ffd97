"""Python's cyclic garbage collector in a process that imports torch and megatron-core.

Such a process holds millions of long-lived objects (modules, functions, torch's operator tables,
sympy's caches), and every full collection walks all of them again: eight while the training
mode is imported (1.1 s of CPU), more while a job runs, and once more while the interpreter shuts
down (1.4 s). An object made before a freeze is never walked again, and never collected if it
ends in a reference cycle: a freeze follows imports only, and the garbage a job makes after it is
collected as before.
"""

import atexit
import gc
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_after() -> Iterator[None]:
    """Run the body (the imports of a job's modules) with the collector paused, then, if it
    imported anything, freeze every object that exists, so that later collections walk only what
    the job makes. (The second job of a sweep in one process imports nothing: what the first left
    for the collector is not frozen with it.)"""
    enabled, modules = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        if enabled:
            gc.enable()


def freeze_at_exit() -> None:
    """Freeze every object in an exit callback: the collector's passes while the interpreter shuts
    down are skipped and what is left is the operating system's to free, but a finalizer of an
    object in a reference cycle (a buffered file's flush, say) no longer runs. For an entry point
    that owns its process and closes what it writes (``run.py``), never for a library import.
    Callbacks registered after this one run before it."""
    atexit.register(gc.freeze)
