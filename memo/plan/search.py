"""Exact DSA: does every buffer fit under a capacity? A complete search over compact plans.

Some optimal plan is *compact*: no buffer can move down, so each one sits at offset 0 or on the
top of a buffer alive with it. Taken in order of offset, every buffer of a compact plan sits at
``top(j)``, the highest top among the already placed buffers alive with it. The search builds
plans in that order, with a binary choice for the eligible buffer ``j`` of lowest ``top(j)``:

* place ``j`` at ``top(j)``; or
* *defer* ``j``: it will sit higher, on a buffer not placed yet, so it waits until a newly
  placed buffer raises ``top(j)``.

Every compact plan is reached this way (a buffer below ``top(j)`` would be eligible with a lower
top), so a failed search proves that nothing fits. Pruning, at every node: over each section of
time (between consecutive lifetime ends), the buffers still to place are all alive together, so
they stack, starting no lower than the lowest offset any of them can still take (its top, the
current level, one more for a deferred buffer), and must fit under the capacity together.
"""

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from memo.plan.dsa import Buffer


@dataclass(frozen=True)
class SearchResult:
    """``offsets`` if a plan fits, ``None`` if none does (``proven``) or time ran out."""

    offsets: Optional[list[int]]
    proven: bool  # True: the answer is final; False: the time limit ended the search
    nodes: int
    seconds: float


class _Instance:
    """Arrays the search reads but never changes."""

    def __init__(self, buffers: Sequence[Buffer]):
        points = sorted({b.lower for b in buffers} | {b.upper for b in buffers})
        index = {t: i for i, t in enumerate(points)}
        self.size = np.array([b.size for b in buffers], dtype=np.int64)
        self.first = np.array([index[b.lower] for b in buffers], dtype=np.int64)  # first section
        self.last = np.array([index[b.upper] for b in buffers], dtype=np.int64)  # one past the last
        self.sections = max(len(points) - 1, 0)
        lower = np.array([b.lower for b in buffers], dtype=np.int64)
        upper = np.array([b.upper for b in buffers], dtype=np.int64)
        self.neighbours = [
            np.flatnonzero((lower < upper[j]) & (lower[j] < upper) & (np.arange(len(buffers)) != j))
            for j in range(len(buffers))
        ]
        self.length = upper - lower
        self.cover = np.zeros((len(buffers), self.sections), dtype=bool)
        for j in range(len(buffers)):
            self.cover[j, self.first[j]:self.last[j]] = True


def fits(buffers: Sequence[Buffer], capacity: int, time_limit_s: float = 60.0) -> SearchResult:
    """Search for a plan of ``buffers`` whose peak is at most ``capacity`` bytes.

    Buffers of size 0 take offset 0 and play no part.
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    live = [i for i, b in enumerate(buffers) if b.size > 0]
    offsets = [0] * len(buffers)
    if not live:
        return SearchResult(offsets, True, 0, 0.0)
    inst = _Instance([buffers[i] for i in live])
    n = len(live)
    load = np.zeros(inst.sections, dtype=np.int64)
    for j in range(n):
        load[inst.first[j]:inst.last[j]] += inst.size[j]
    # A node: which buffers are placed, their offsets, top(j) of every buffer, the top at which
    # each was last deferred (-1: never), bytes still to place per section, the last offset.
    root = (np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64),
            load, 0)
    stack = [root]
    nodes = 0
    while stack:
        nodes += 1
        if nodes % 256 == 1 and time.perf_counter() > deadline:
            return SearchResult(None, False, nodes, time.perf_counter() - start)
        placed, offset, top, deferred_at, load, level = stack.pop()
        if placed.all():
            for k, i in enumerate(live):
                offsets[i] = int(offset[k])
            return SearchResult(offsets, True, nodes, time.perf_counter() - start)
        unplaced = ~placed
        lowest = np.maximum(top, level)
        if ((lowest + inst.size)[unplaced] > capacity).any():
            continue
        # Each section's unplaced buffers stack above the lowest place any of them can take.
        waiting = unplaced & (deferred_at == top)
        lowest = np.where(waiting, np.maximum(lowest, top + 1), lowest)
        base = np.where(inst.cover & unplaced[:, None], lowest[:, None], capacity).min(axis=0)
        if (base + load).max() > capacity:  # sections nobody is left in have base + 0 = capacity
            continue
        eligible = unplaced & (top >= level) & (deferred_at != top)
        if not eligible.any():
            continue  # what is left can never rest on anything: not compact
        candidates = np.flatnonzero(eligible)
        keys = np.lexsort((-inst.length[candidates], -inst.size[candidates], top[candidates]))
        j = int(candidates[keys[0]])
        p = int(top[j])
        if unplaced[inst.neighbours[j]].any():  # something could still come under it
            deferred = deferred_at.copy()
            deferred[j] = p
            stack.append((placed, offset, top, deferred, load, level))
        stack.append(_place(inst, j, p, placed, offset, top, deferred_at, load))
    return SearchResult(None, True, nodes, time.perf_counter() - start)


def _place(inst: _Instance, j: int, p: int, placed, offset, top, deferred_at, load):
    """The node after putting buffer ``j`` at offset ``p`` (arrays copied, never changed)."""
    placed, offset, top, load = placed.copy(), offset.copy(), top.copy(), load.copy()
    placed[j] = True
    offset[j] = p
    near = inst.neighbours[j]
    top[near] = np.maximum(top[near], p + inst.size[j])
    load[inst.first[j]:inst.last[j]] -= inst.size[j]
    return placed, offset, top, deferred_at, load, p
