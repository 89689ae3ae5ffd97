"""``launch.processes``: the command that starts a job's ranks ends as its job does (the rank that
failed first named, the others stopped; a stop signal passed on to every rank)."""

import signal
import subprocess
import sys
import time

import psutil

from memo.execute.launch import launch

# a rank: rank 1 refuses at once (as run.py does, its line left for the command), the others wait
RANK = """
import os, sys, time
from memo.execute.launch import leave_error
rank = int(os.environ["RANK"])
if rank == 1:
    leave_error(rank, "rank one refuses")
    sys.exit(2)
print(f"rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
time.sleep(600)
"""


def test_the_rank_that_fails_first_is_named_and_the_others_are_stopped(capfd):
    started = time.monotonic()
    assert launch(3, [sys.executable, "-c", RANK], grace_s=0.5) == 2
    assert time.monotonic() - started < 30  # the waiting ranks were stopped, not waited for
    out, err = capfd.readouterr()
    assert err.strip().splitlines() == ["error: rank 1 of 3 failed first: rank one refuses"]
    started_ranks = sorted(line.split()[1] for line in out.splitlines())
    assert started_ranks == ["0", "2"] and {line.split()[3] for line in out.splitlines()} == {"3"}


def test_a_stop_signal_reaches_every_rank_and_ends_the_command_with_its_status(tmp_path):
    ranks = 'import time\ntime.sleep(600)'
    command = f"import sys; from memo.execute.launch import launch; sys.exit(launch(2, [sys.executable, '-c', {ranks!r}]))"
    parent = subprocess.Popen([sys.executable, "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(3)  # the ranks started
    children = [child.pid for child in psutil.Process(parent.pid).children()]  # (no procps needed)
    assert len(children) == 2
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    for pid in children:  # every rank ended with it
        assert not psutil.pid_exists(pid)
