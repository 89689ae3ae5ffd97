"""``launch.processes=N``: one ``python run.py ...`` starts the N processes of a job on this machine.

The command starts ``python run.py`` again N times, as torchrun would: ranks 0..N-1 of one job,
each with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free
port of this machine), which :func:`memo.execute.distributed.process_info` reads, and
:data:`LAUNCHED`, so that they run the job instead of launching again. Rank 0 claims the run
directory and writes the row; the layout is the run's ``parallel`` or ``parallel=auto``'s choice
among the N.

The command ends as its job does: 0, or the exit status of the first rank that failed (2 for a
refusal, which rank 0 alone prints), the others stopped once they have had a while to end on
their own (a rank left alone would wait in a collective forever). SIGTERM and SIGINT sent to the command go on to
every rank, which writes its ``interrupted`` row as a single process does.

Nothing here imports torch: the command only waits.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

LAUNCHED = "MEMO_LAUNCHED"  # in a launched rank's environment: it runs the job
# in a launched rank's environment: a directory where a rank other than 0 leaves the one line of
# its refusal (rank-N), which the command prints where that rank failed first
RANK_ERRORS = "MEMO_RANK_ERRORS"
_PR_SET_PDEATHSIG = 1  # Linux's prctl: a signal for this process when its parent ends
_GRACE_S = 20.0  # how long the other ranks have to end on their own once one has failed


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (the job's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, processes: int, port: int, errors: str) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCHED: "1", RANK_ERRORS: errors}


def leave_error(rank: int, message: str) -> None:
    """In a launched rank other than 0: leave ``message`` (one line) for the command to print."""
    directory = os.environ.get(RANK_ERRORS)
    if directory and rank != 0:
        with open(os.path.join(directory, f"rank-{rank}"), "w") as f:
            f.write(message)


def _end_with_parent() -> None:
    """In a rank, before it runs: SIGTERM when the command that started it ends, however it ends
    (killed, its terminal closed), so that no rank trains on, holding its devices, alone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _status(code: int) -> int:
    """A child's exit status as a shell reports it: 128 + the signal that ended it."""
    return 128 - code if code < 0 else code


def launch(processes: int, command: Sequence[str], grace_s: float = _GRACE_S) -> int:
    """Run ``command`` (``python run.py OVERRIDES``) as the ``processes`` ranks of one job and
    return the job's exit status (see the module's docstring); ``grace_s``: seconds the other
    ranks have to end on their own once one has failed."""
    with tempfile.TemporaryDirectory(prefix="memo-ranks-") as errors:
        return _run_ranks(processes, command, errors, grace_s)


def _run_ranks(processes: int, command: Sequence[str], errors: str, grace_s: float) -> int:
    port = free_port()
    # each rank in a session of its own: a terminal's Ctrl-C reaches this process alone, which
    # passes it on once (a rank interrupted twice could not finish writing its row)
    ranks = [subprocess.Popen(list(command), env=_rank_env(rank, processes, port, errors), start_new_session=True,
                              preexec_fn=_end_with_parent) for rank in range(processes)]
    stopping: list[int] = []

    def pass_on(signum, _frame):
        stopping.append(signum)
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    first_failed, failed_at = None, 0.0
    try:
        while None in [rank.poll() for rank in ranks]:  # (every rank polled: any() would stop at the first)
            if first_failed is None:
                first_failed = next((i for i, r in enumerate(ranks) if r.returncode not in (None, 0)), None)
                failed_at = time.monotonic()
            elif time.monotonic() - failed_at > grace_s:  # the others wait for it: stopped, then killed
                late = time.monotonic() - failed_at > 2 * grace_s
                for rank in ranks:
                    if rank.poll() is None:
                        (rank.kill if late else rank.terminate)()
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        return 128 + stopping[0]
    if first_failed is None:  # (all ended in one poll)
        first_failed = next((i for i, r in enumerate(ranks) if r.returncode != 0), None)
    if first_failed is None:
        return 0
    if first_failed != 0 and _status(ranks[0].returncode) != 2:
        # rank 0 alone prints refusals (where it refused too, it has); its row holds what followed, not the cause
        left = os.path.join(errors, f"rank-{first_failed}")
        cause = open(left).read().strip() if os.path.exists(left) else (
            f"exit status {_status(ranks[first_failed].returncode)}; its traceback is above")
        print(f"error: rank {first_failed} of {processes} failed first: {cause}", file=sys.stderr)
    return _status(ranks[first_failed].returncode)
