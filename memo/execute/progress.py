"""How far a run has got: the time left for the step log lines, and a bar on a terminal."""

import contextlib
import sys
from typing import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class StepProgress:
    """Counts finished steps and estimates the time left from their mean duration (seconds)."""

    def __init__(self, total_steps: int, bar: tqdm):
        self.total_steps = total_steps
        self.bar = bar
        self.done = 0
        self.elapsed_s = 0.0

    def step(self, seconds: float, loss: float) -> float:
        """Record a finished step of ``seconds``; returns the estimated seconds left."""
        self.done += 1
        self.elapsed_s += seconds
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update()
        return self.elapsed_s / self.done * (self.total_steps - self.done)


@contextlib.contextmanager
def step_progress(total_steps: int, show_bar: bool) -> Iterator[StepProgress]:
    """A :class:`StepProgress`; with ``show_bar`` and a terminal on stderr, a progress bar that
    the log lines are printed above."""
    enabled = show_bar and sys.stderr.isatty()
    with tqdm(total=total_steps, unit="step", disable=not enabled, leave=False, dynamic_ncols=True) as bar:
        redirect = logging_redirect_tqdm() if enabled else contextlib.nullcontext()
        with redirect:
            yield StepProgress(total_steps, bar)


def format_seconds(seconds: float) -> str:
    """``seconds`` as ``42s``, ``3m05s`` or ``2h07m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
