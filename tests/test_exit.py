"""A process that imports memo leaves its heap to the operating system at exit, after every exit
callback registered after the import has run."""

import subprocess
import sys

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
