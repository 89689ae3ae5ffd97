"""The collector in memo's processes: what a job's imports made is frozen, what the job makes is
collected as before, and an entry point's heap is left to the operating system at exit, after the
exit callbacks registered after it."""

import gc
import subprocess
import sys
import weakref

from memo.collector import frozen_after

# callbacks run last registered, first run: "before" sees the freeze, "after" runs ahead of it
PROGRAM = """
import atexit, gc
atexit.register(lambda: print("registered before: frozen", gc.get_freeze_count() > 0, flush=True))
from memo.collector import freeze_at_exit
freeze_at_exit()
atexit.register(lambda: print("registered after: frozen", gc.get_freeze_count() > 0, flush=True))
"""


def test_the_exit_freeze_comes_after_the_callbacks_registered_after_it():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["registered after: frozen False", "registered before: frozen True"]


def test_what_imports_made_is_frozen_what_comes_after_is_collected_and_no_import_freezes_nothing(tmp_path,
                                                                                              monkeypatch):
    class Node:
        pass

    (tmp_path / "memo_collector_probe.py").write_text("made = [object() for _ in range(3)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    was = gc.isenabled()
    try:
        gc.enable()
        before = gc.get_freeze_count()
        with frozen_after():  # imports nothing: what exists stays the collector's
            left = Node()
            left.self = left
        assert gc.isenabled() and gc.get_freeze_count() == before
        alive = weakref.ref(left)
        del left
        gc.collect()
        assert alive() is None
        with frozen_after():
            assert not gc.isenabled()  # no collection walks the heap while it grows
            import memo_collector_probe  # noqa: F401
        assert gc.isenabled() and gc.get_freeze_count() > before
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # a cycle made after the freeze is collected
    finally:
        sys.modules.pop("memo_collector_probe", None)
        if not was:
            gc.disable()
