"""``parallel=search`` and ``seq=max``: every valid layout of a cluster, and the longest sequence
that fits one.

A layout is valid when ``tp·cp·pp·dp`` is the number of devices, tensor parallelism stays within
a node and divides the attention heads, the key/value groups and the FFN width (Ulysses' ``tp·cp``
divides the heads and the groups), and pipeline parallelism divides the layers; a layout with
context parallelism is tried with each exchange (``all_gather``, ``p2p``, ``a2a``). Whether a length fits is monotone in the length
(every activation grows with it), so the longest one is found by binary search over multiples of
``fit.seq_step`` that every layout can split (``2·cp``, and ``tp`` under sequence parallelism).
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

from memo.config import ModelConfig, ParallelConfig
from memo.config.validate import CP_COMM_TYPES, sequence_divisor
from memo.fit.predict import Prediction


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    model: ModelConfig, devices: int, devices_per_node: int, sequence_parallel: bool = True,
    cp_comm_types: tuple[str, ...] = CP_COMM_TYPES,
) -> list[ParallelConfig]:
    """Every valid ``(tp, cp, pp, dp)`` for ``devices`` (see the module docstring), tp first; one
    with context parallelism once per exchange of ``cp_comm_types`` that can split it."""
    groups = model.num_query_groups or model.num_attention_heads
    found = []
    for tp in _divisors(devices):
        if tp > devices_per_node or any(n % tp for n in (model.num_attention_heads, groups, model.ffn_hidden_size)):
            continue
        for cp in _divisors(devices // tp):
            for comm in cp_comm_types if cp > 1 else cp_comm_types[:1]:
                if cp > 1 and comm == "a2a" and (model.num_attention_heads % (tp * cp) or groups % (tp * cp)):
                    continue
                for pp in _divisors(devices // (tp * cp)):
                    if model.num_layers % pp:
                        continue
                    found.append(
                        ParallelConfig(
                            tp=tp,
                            cp=cp,
                            pp=pp,
                            dp=devices // (tp * cp * pp),
                            sequence_parallel=sequence_parallel and tp > 1,
                            cp_comm_type=comm,
                        )
                    )
    return found


def seq_grid_step(step: int, parallel: ParallelConfig, tile_tokens: Optional[int] = None) -> int:
    """The smallest multiple of ``step`` that ``parallel`` can split (tokens), into whole tiles of
    ``tile_tokens`` (each of the ``2·cp`` chunks under context parallelism) where given."""
    grid = math.lcm(step, sequence_divisor(parallel.tp, parallel.cp, parallel.sequence_parallel))
    return grid if tile_tokens is None else math.lcm(grid, tile_tokens * (2 * parallel.cp if parallel.cp > 1 else 1))


def longest(
    predict: Callable[[int], Prediction], step: int, limit: int
) -> tuple[Optional[Prediction], Optional[Prediction]]:
    """The prediction at the longest multiple of ``step`` up to ``limit`` that fits (None if none
    does), and the shortest prediction tried that did not fit (None if every one did)."""
    low, high = 0, limit // step  # fits at low·step (none at 0), unknown up to high
    best: Optional[Prediction] = None
    failed: Optional[Prediction] = None
    while low < high:
        middle = (low + high + 1) // 2
        prediction = predict(middle * step)
        if prediction.fits:
            low, best = middle, prediction
        else:
            high, failed = middle - 1, prediction
    return best, failed


@dataclass(frozen=True)
class Candidate:
    """A way to run the job to try: a layout, the layers' tiles (None: whole layers), the share
    of Adam's states on the host, the loss's tile, whether its whole layers keep every activation
    instead of running the method's own way; and why training cannot run it for the method (None:
    it can)."""

    parallel: ParallelConfig
    unrunnable: Optional[str] = None
    tile_tokens: Optional[int] = None
    optimizer_offload: float = 0.0
    loss_tile_tokens: Optional[int] = None  # the tiled loss's tile (None: the run's own)
    keeps_all: bool = False


@dataclass(frozen=True)
class LayoutResult:
    """One candidate's outcome: its longest sequence (``best``; None if none fits), or the first
    prediction that did not fit."""

    candidate: Candidate
    best: Optional[Prediction]
    failed: Optional[Prediction]

    @property
    def parallel(self) -> ParallelConfig:
        return self.candidate.parallel

    @property
    def unrunnable(self) -> Optional[str]:
        return self.candidate.unrunnable

    @property
    def shown(self) -> Prediction:
        return self.best or self.failed

    def rank(self) -> tuple:
        """Sort key: longest sequence first, then highest predicted MFU, then fewest pipeline stages;
        layouts where nothing fits after, the one needing least device memory first."""
        if self.best is None:
            return (1, 0, self.failed.device_total, self.parallel.pp)
        return (0, -self.best.seq, -self.best.time.mfu, self.parallel.pp)


def layout_label(parallel: ParallelConfig) -> str:
    """``tp4 cp2 pp1 dp1`` (``+sp`` with sequence parallelism, then the context-parallel exchange)."""
    p = parallel
    return (f"tp{p.tp} cp{p.cp} pp{p.pp} dp{p.dp}" + (" +sp" if p.sequence_parallel else "")
            + (f" {p.cp_comm_type}" if p.cp > 1 else ""))


def candidate_label(candidate: Candidate) -> str:
    """:func:`layout_label`, then ``tiles 16384`` for layers walked in tiles and ``adam@host 1``
    for Adam's states on the host (the share)."""
    return (layout_label(candidate.parallel)
            + (f" tiles {candidate.tile_tokens}" if candidate.tile_tokens else "")
            + (f" adam@host {candidate.optimizer_offload:g}" if candidate.optimizer_offload else ""))
