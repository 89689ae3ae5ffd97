"""One training step under ``torch.profiler`` (``train.timeline_step``): its trace and where its
time went, written into the run's directory.

    timeline.json.gz   the step's trace in Chrome's format (chrome://tracing, Perfetto), gzipped
    timeline.csv       its device time by category (:func:`memo.metrics.timeline.table`)
    timeline_kernels.csv  the kernels that took the most time, with their category

The profiler starts as the step does and stops as it ends; its files are written after the step's
clock stopped (:func:`memo.execute.train.run_steps`' scope), by rank 0 only. Its cost falls on the
step it watches: a warm-up step's time is not in the run's figures.
"""

import contextlib
import gzip
import json
import logging
import tempfile
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

import pandas as pd
from torch.profiler import ProfilerActivity, profile

from memo.metrics.timeline import table, top_kernels
from memo.results import create_file_atomic

log = logging.getLogger("memo")


class StepTimeline:
    """The scope of each step (:func:`memo.execute.train.run_steps`' ``scope``): the profiler around
    step ``step`` (1-based; None: none), its files into ``out``, where ``writes`` (rank 0)."""

    def __init__(self, step: Optional[int], start_step: int, out: Path, device_type: str, writes: bool):
        self.step, self.start_step, self.out, self.writes = step, start_step, Path(out), writes
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])

    def around(self, k: int) -> ContextManager[None]:
        """The scope of this process's ``k``-th step (from 0)."""
        if self.step is None or self.start_step + k + 1 != self.step:
            return contextlib.nullcontext()
        return self._profiled()

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        with profile(activities=self.activities) as profiler:
            yield
        if not self.writes:
            return
        try:
            self._write(profiler)
        except (OSError, ValueError) as failed:  # (a full disk, a file there already): the run goes on
            log.warning("the timeline of step %d was not written: %s", self.step, failed)

    def _write(self, profiler) -> None:
        with tempfile.TemporaryDirectory(dir=self.out) as scratch:
            raw = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(raw))
            data = raw.read_bytes()
        create_file_atomic(self.out / "timeline.json.gz", gzip.compress(data, compresslevel=6))
        trace = json.loads(data)
        del data
        rows = table(trace)
        create_file_atomic(self.out / "timeline.csv", pd.DataFrame(rows).to_csv(index=False))
        create_file_atomic(self.out / "timeline_kernels.csv", pd.DataFrame(top_kernels(trace)).to_csv(index=False))
        shown = ", ".join(f"{r['category']} {r['seconds']:.3f} s" for r in rows)
        log.info("timeline of step %d (%s): %s", self.step, self.out / "timeline.json.gz", shown)


def combined(*scopes: Callable[[int], ContextManager]) -> Callable[[int], ContextManager]:
    """One ``run_steps`` scope from several (each a function of the step's ``k``), the first's
    phase marker given to the step."""

    @contextlib.contextmanager
    def scope(k: int):
        with contextlib.ExitStack() as stack:
            markers = [stack.enter_context(s(k)) for s in scopes]
            yield markers[0]

    return scope
