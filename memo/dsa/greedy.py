"""Greedy DSA placement: a fast upper bound on the optimal peak, and a warm start for search.

Placing buffers one by one, each at the lowest offset where it fits among the buffers already
placed that are alive with it, reaches the optimum for *some* order (take the buffers in the
order of their offsets in an optimal plan: none lands higher than there). The portfolio tries
the orders that work well in practice and keeps the best plan.
"""

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from memo.dsa.buffers import Buffer


@dataclass(frozen=True)
class GreedyResult:
    offsets: list[int]
    peak: int  # bytes
    order: str  # the name of the order that gave it
    seconds: float


def lowest_fit(buffers: Sequence[Buffer], order: Sequence[int]) -> list[int]:
    """Offsets from placing ``buffers`` in ``order``, each at its lowest free offset."""
    n = len(buffers)
    lower = np.array([b.lower for b in buffers], dtype=np.int64)
    upper = np.array([b.upper for b in buffers], dtype=np.int64)
    size = np.array([b.size for b in buffers], dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        mask = placed & (lower < upper[i]) & (lower[i] < upper) & (size > 0)
        offset = 0
        if mask.any():
            by_start = np.argsort(start[mask], kind="stable")
            begins = start[mask][by_start]
            # Below the k-th neighbour (by offset) lies the gap [top of the ones before, its begin).
            tops = np.concatenate(([0], np.maximum.accumulate((start[mask] + size[mask])[by_start])))
            room = np.concatenate((begins, [np.iinfo(np.int64).max])) - tops
            offset = int(tops[np.argmax(room >= size[i])])
        start[i] = offset
        placed[i] = True
    return start.tolist()


def _orders(buffers: Sequence[Buffer]) -> dict[str, Callable[[int], tuple]]:
    length = [b.upper - b.lower for b in buffers]
    return {
        "size": lambda i: (-buffers[i].size, -length[i], buffers[i].lower),
        "area": lambda i: (-buffers[i].size * length[i], -buffers[i].size),
        "lifetime": lambda i: (-length[i], -buffers[i].size),
        "start": lambda i: (buffers[i].lower, -buffers[i].size),
        "end": lambda i: (-buffers[i].upper, -buffers[i].size),
    }


def greedy_portfolio(buffers: Sequence[Buffer]) -> GreedyResult:
    """The best lowest-fit plan over several buffer orders."""
    start = time.perf_counter()
    best = None
    for name, key in _orders(buffers).items():
        offsets = lowest_fit(buffers, sorted(range(len(buffers)), key=key))
        peak = max((o + b.size for o, b in zip(offsets, buffers, strict=True)), default=0)
        if best is None or peak < best[1]:
            best = (offsets, peak, name)
    return GreedyResult(*best, time.perf_counter() - start)
