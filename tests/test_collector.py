"""The collector in memo's processes: what a job's imports made is frozen, what the job makes is
collected as before, and at exit the heap is left to the operating system after every exit
callback registered after ``import memo`` has run."""

import gc
import subprocess
import sys
import weakref

from memo.collector import frozen_after

# An exit callback registered before `import memo` runs after memo's; the log's last line is
# written by logging's own callback, which runs after the freeze here (logging is imported first).
PROGRAM = """
import atexit, gc, logging, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
import memo
handler = logging.FileHandler(sys.argv[1])
logging.getLogger("memo").addHandler(handler)
logging.getLogger("memo").warning("the last line")
print("frozen before exit", gc.get_freeze_count() > 0, flush=True)
"""


def test_a_process_that_imports_memo_freezes_its_heap_last_and_loses_no_line(tmp_path):
    log = tmp_path / "run.log"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(log)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["frozen before exit False", "frozen True"]
    assert log.read_text() == "the last line\n"


def test_what_the_imports_made_is_frozen_and_what_comes_after_is_collected():
    class Node:
        pass

    before = gc.get_freeze_count()
    was = gc.isenabled()
    try:
        gc.enable()
        with frozen_after():
            assert not gc.isenabled()  # no collection walks the heap while it grows
            made = [Node() for _ in range(100)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # a cycle made after the freeze is collected
    finally:
        if not was:
            gc.disable()
