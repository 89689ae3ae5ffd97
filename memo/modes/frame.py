"""The frame every mode runs in: claim the run directory, record where and what ran, turn however
the job ends into the row's ``status``, and write the row.

Statuses: ``ok``; ``oom`` (the device ran out of memory); ``oohm`` (host memory for swapped
activations ran out); ``error`` (with the message: one line for a configuration mistake, the
traceback in the log for anything else); ``interrupted`` (Ctrl-C, SIGTERM, or a scheduler's
timeout or preemption signal, with the steps done). Out-of-memory is a result, not a crash, so a
sweep goes on with its next job; an interrupt is passed on after the row is written, so a sweep
stops and the process ends.
"""

import dataclasses
import logging
import platform
import signal
import socket
import threading
import traceback
import weakref
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from omegaconf import DictConfig
from torch.distributed.checkpoint.api import CheckpointException

from memo.config import ConfigError, DoesNotFit
from memo.swap.alpha import HostMemoryError
from memo.results import ResultWriter, claim_run_dir, config_row, git_revision, now

log = logging.getLogger("memo")
REPO = Path(__file__).resolve().parents[2]


class Interrupted(KeyboardInterrupt):
    """A stop signal other than Ctrl-C (SIGTERM) received while a job runs; ends it as Ctrl-C does."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclasses.dataclass
class Job:
    """What a mode fills in while it runs: the row and the writer of its step logs."""

    row: dict[str, Any]
    writer: ResultWriter
    # what each stop signal raised where the job was, in order: Interrupted (SIGTERM),
    # KeyboardInterrupt (SIGINT), a scheduler's exit (submitit's SystemExit once it has requeued)
    stops: list[BaseException] = dataclasses.field(default_factory=list)

    def stop_if_signalled(self) -> None:
        """Raise again what the first stop signal raised. Python drops an exception raised inside
        a finalizer, a ``__del__`` or a fork's callback (a weakly referenced table's, a checkpoint
        writer's fork) after printing it; a mode calls this between steps so that such a signal
        still ends the job.

        Raises:
            KeyboardInterrupt, SystemExit: if a stop signal came.
        """
        if self.stops:
            raise self.stops[0]


def provenance() -> dict[str, Any]:
    """Where and with what a row was made: host, commit, library versions."""
    commit, dirty = git_revision(REPO)
    return {
        "host": socket.gethostname(),
        "git_commit": commit,
        "git_dirty": dirty,
        "torch_version": torch.__version__,
        "megatron_core_version": _version("megatron-core"),
        "python_version": platform.python_version(),
    }


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _is_oom(error: BaseException) -> bool:
    """Whether ``error`` says the device or the host ran out of memory: the allocators' own errors,
    and a CUDA runtime error ("CUDA error: out of memory", raised by the kernel that first met a
    request the plan's allocator could not satisfy)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "can't allocate memory" in text or "CUDA error: out of memory" in text)


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs in a weak reference's finalizer or a ``__del__`` (a rotary table's,
    a storage's), where an exception raised is printed with its traceback and dropped."""
    while frame is not None:
        if frame.f_code is weakref.finalize.__call__.__code__ or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


# A scheduler's wrapper stops a job for its timeout or preemption on one of these, with a handler
# that requeues the job and exits (submitit: SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL names another;
# Lightning: SIGUSR1). A handler of another signal runs unwrapped: its exit, if dropped, is lost.
_SCHEDULER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


@contextmanager
def _stop_signals(stops: list[BaseException]) -> Iterator[None]:
    """While the job runs, SIGTERM raises :class:`Interrupted` and SIGINT ``KeyboardInterrupt`` in
    the main thread, each where nobody else (a scheduler's wrapper, a shell that started the job in
    the background) has claimed or ignored it; a scheduler's handler of its own signal runs as
    before. What each raises is also appended to ``stops`` (see :meth:`Job.stop_if_signalled`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        stops.append(Interrupted(signum) if signum != signal.SIGINT else KeyboardInterrupt())
        if _in_finalizer(frame):  # Python would print the interrupt and drop it: the step's end raises it
            return
        raise stops[-1]

    def kept_by_the_job(handler):
        def stop(signum, frame):
            try:
                handler(signum, frame)
            except BaseException as stopping:
                stops.append(stopping)
                raise
        return stop

    replaced = {}  # signal: (the handler before the job, the job's)
    for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(signum) is default:
            replaced[signum] = (default, interrupt)
    for signum in _SCHEDULER_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):
            replaced[signum] = (handler, kept_by_the_job(handler))
    for signum, (_, handler) in replaced.items():
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, (handler, _) in replaced.items():
            signal.signal(signum, handler)


def _interrupt_name(error: BaseException) -> str:
    if isinstance(error, Interrupted):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "SIGINT (Ctrl-C)"
    return "the scheduler (timeout or preemption)"


def _interrupted(row: dict[str, Any], stop: BaseException, steps: int) -> BaseException:
    row["status"] = "interrupted"
    row["error"] = f"interrupted by {_interrupt_name(stop)} after {steps} step(s)"
    return stop


def _first_line(error: BaseException) -> str:
    """``error`` as one line, its type and its message's first line (the traceback goes to the
    log); torch's CheckpointException as the first failing rank's error, not its report of every
    rank's traceback."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _failed(row: dict[str, Any], error: BaseException) -> None:
    if isinstance(error, DoesNotFit):  # predicted, before anything was allocated
        row["status"] = "oom"
        row["error"] = str(error)
    elif isinstance(error, ConfigError):
        row["status"] = "error"
        row["error"] = str(error)
    elif isinstance(error, HostMemoryError):
        row["status"] = "oohm"
        row["error"] = str(error)
        log.warning("%s", error)
    elif _is_oom(error):
        row["status"] = "oom"
        row["error"] = str(error).splitlines()[0]
        log.warning("out of memory: %s", row["error"])
    else:
        row["status"] = "error"
        row["error"] = _first_line(error)
        log.error("job failed:\n%s", traceback.format_exc())


@contextmanager
def job_frame(
    cfg: DictConfig,
    output_dir: Path,
    overrides: Sequence[str] = (),
    *,
    rank: int = 0,
    claimed: bool = False,
    columns: Sequence[str] = (),
) -> Iterator[Job]:
    """Run the body of a job inside the frame and write its row on the way out.

    Args:
        cfg: the composed configuration, flattened into the row.
        output_dir: the run directory; rank 0 claims it first unless ``claimed``.
        overrides: the command-line overrides, recorded in the row.
        rank: only rank 0 claims the directory and writes.
        claimed: the caller (``run.py``) has claimed ``output_dir`` already.
        columns: fields every row of this mode carries (None until known).

    Raises:
        RunDirTaken: if ``output_dir`` belongs to another run (nothing is written then).
        ConfigError: if the row cannot be written (a full disk, a read-only directory).
        KeyboardInterrupt, SystemExit: passed on after the ``interrupted`` row is written.
    """
    if rank == 0 and not claimed:
        claim_run_dir(output_dir)
    writer = ResultWriter(output_dir, enabled=rank == 0)
    row: dict[str, Any] = {
        **config_row(cfg),
        **dict.fromkeys(columns),
        "status": None,  # a mode may set its own (a prediction's "oom"); "ok" otherwise
        "error": None,
        "overrides": " ".join(overrides),
        "output_dir": str(output_dir),
        **provenance(),
        "start_time": now(),
    }
    stop: Optional[BaseException] = None
    job = Job(row, writer)
    try:
        with _stop_signals(job.stops):
            yield job
        row["status"] = row["status"] or "ok"  # (also with a stop dropped after the last step's check)
    except (KeyboardInterrupt, SystemExit) as error:
        stop = _interrupted(row, error, writer.steps)
    except GeneratorExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure must leave its row (torch's
        # CheckpointException is a BaseException)
        if job.stops:  # what fails once the job is stopping is the stop's (a save whose helper the scheduler ended)
            log.warning("after the stop: %s: %s", type(error).__name__, error)
            stop = _interrupted(row, job.stops[0], writer.steps)
        else:
            _failed(row, error)
    row["steps_done"] = writer.steps
    row["end_time"] = now()
    try:
        path = writer.write_result(row)
    except ConfigError:
        if stop is None:
            raise
        path = None
    if path is not None:
        log.info("status %s; row written to %s", row["status"], path)
    if stop is not None:
        log.warning("%s", row["error"])
        raise stop
