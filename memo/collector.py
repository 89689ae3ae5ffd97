"""Python's cyclic garbage collector in a process that imports torch and megatron-core.

Such a process holds millions of long-lived objects (modules, functions, torch's operator tables,
sympy's caches), and every full collection walks all of them again: eight while the training
mode is imported (1.1 s of CPU), more while a job runs, and once more while the interpreter shuts
down (1.4 s). An object made before a freeze is never walked again; the garbage a job makes after
it is collected as before.
"""

import atexit
import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_after() -> Iterator[None]:
    """Run the body (the imports of a job's modules) with the collector paused, then freeze every
    object that exists, so that later collections walk only what the job makes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def freeze_at_exit() -> None:
    """Freeze every object in an exit callback: the collector's passes while the interpreter shuts
    down are skipped, and what is left (cycles included) is the operating system's to free, as
    Python leaves it at exit anyway. Callbacks registered after this one run before it."""
    atexit.register(gc.freeze)
