"""Exact DSA: does every buffer fit under a capacity? MiniMalloc's search over canonical plans.

The method is that of MiniMalloc (Moffitt, ASPLOS 2024), written anew in plain Python.

*Canonical plans.* Gravity turns any plan into one no higher where every buffer sits at offset 0
or on the top of a buffer alive with it. Taken in order of (offset, rank), for a fixed ranking
of the buffers, each buffer of such a plan sits at its *floor*: the highest top among the
buffers already placed that are alive with it. The search builds plans in that order: at a
node, every unplaced buffer whose floor keeps the order increasing is a candidate, and each is
tried at its floor. Every canonical plan is reached exactly once, so a failed search proves that
nothing fits. Three rules cut the search without losing completeness, since some canonical plan
obeys them whenever any plan fits (take the canonical plan with the least sum of offsets):

* dominance: a candidate at or above the top a buffer would have at its own floor would leave a
  gap that buffer could drop into, so it is not tried;
* hatless: a candidate with no unplaced buffer alive with it has its final offset now; any plan
  below this node places it before the candidates that follow it, so they are not tried;
* sections: over each section of time (the instants just before a lifetime ends), the unplaced
  buffers are all alive together, so they stack above the lowest floor among them and above
  the current offset; together they must fit under the capacity.

When no unplaced buffer spans some boundary between sections, the two sides no longer interact
and each is searched on its own (the placed buffers only leave floors behind), with a ranking
of its own; either side failing fails the node. The ranking is MiniMalloc's: a few static orders
(lifetime, area, the fullest section a buffer is in) tried in turn with a doubling node budget,
so that one lucky order ends the search early; every run is complete, so a run that ends
without hitting its budget decides the answer.

Sizes are divided by their greatest common divisor first: canonical offsets are sums of sizes.
"""

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from memo.dsa.buffers import Buffer

_INF = 1 << 62  # an int: comparisons of ints with floats are slow
# Buffer orders tried in turn, as MiniMalloc's defaults: W lifetime, A area (size × lifetime),
# T the most bytes alive in a section the buffer is in; each from the largest down.
HEURISTICS = ("WAT", "TAW", "TWA")


@dataclass(frozen=True)
class SearchResult:
    """``offsets`` if a plan fits, ``None`` if none does (``proven``) or time ran out."""

    offsets: Optional[list[int]]
    proven: bool  # True: the answer is final; False: the time limit ended the search
    nodes: int
    seconds: float


class _Stop(Exception):
    """The node budget or the deadline ended a run; its state is rebuilt before the next."""


class _Search:
    """One instance under one capacity: static data, the search state, and the search."""

    def __init__(self, buffers: Sequence[Buffer], capacity: int, deadline: float):
        n = len(buffers)
        self.n = n
        self.capacity = capacity
        self.deadline = deadline
        self.size = [b.size for b in buffers]
        self.width = [b.upper - b.lower for b in buffers]
        self.area = [b.size * (b.upper - b.lower) for b in buffers]
        # Sections: the instants just before each distinct end of a lifetime. A buffer is in
        # the sections whose instant it is alive at, a contiguous range [lo, hi).
        ends = sorted({b.upper for b in buffers})
        index = {t: i for i, t in enumerate(ends)}
        self.sections = len(ends)
        self.hi = [index[b.upper] + 1 for b in buffers]
        self.lo = [bisect_right(ends, b.lower) for b in buffers]
        self.section_buffers = [[] for _ in ends]
        for k in range(n):
            for s in range(self.lo[k], self.hi[k]):
                self.section_buffers[s].append(k)
        # Two buffers overlap in time exactly when they share a section.
        by_lower = sorted(range(n), key=lambda k: buffers[k].lower)
        self.nbrs = [[] for _ in range(n)]
        for x, k in enumerate(by_lower):
            upper = buffers[k].upper
            for q in by_lower[x + 1:]:
                if buffers[q].lower >= upper:
                    break
                self.nbrs[k].append(q)
                self.nbrs[q].append(k)
        # Twins: buffers of one size, alive together, alive with the same others. Swapping two
        # twins changes nothing, so a twin waits until the one before it is placed.
        self.twin = [-1] * n
        seen = {}
        for k in range(n):
            group = (self.size[k], frozenset(self.nbrs[k]) | {k})
            self.twin[k] = seen.get(group, -1)
            seen[group] = k
        self.span_lo = [min([self.lo[q] for q in self.nbrs[k]], default=self.lo[k]) for k in range(n)]
        self.span_hi = [max([self.hi[q] for q in self.nbrs[k]], default=self.hi[k]) for k in range(n)]
        self.load = [0] * self.sections
        for k in range(n):
            for s in range(self.lo[k], self.hi[k]):
                self.load[s] += self.size[k]
        self.rank = [0] * n
        self.nodes = 0

    def reset(self) -> None:
        n, sections = self.n, self.sections
        # A buffer's floor: the highest top of a placed buffer alive with it; infinity once placed.
        self.floor_of = [0] * n
        self.total = list(self.load)  # bytes of unplaced buffers per section
        # holder[s]: an unplaced buffer of section s with the lowest floor among them, or n
        # where that is not kept up to date (see _dfs)
        self.holder = [m[0] for m in self.section_buffers]
        self.members = [list(m) for m in self.section_buffers]  # the unplaced ones
        self.where = [[0] * (self.hi[k] - self.lo[k]) for k in range(n)]  # their places there
        for s, row in enumerate(self.members):
            for i, k in enumerate(row):
                self.where[k][s - self.lo[k]] = i
        self.mark = [0] * (n + 1)  # the stamp of the last placement that moved the buffer
        self.stamp = 0
        # cuts[s]: unplaced buffers in both section s and s + 1; none: the sides are independent.
        self.cuts = [0] * max(sections - 1, 0)
        for k in range(n):
            for s in range(self.lo[k], self.hi[k] - 1):
                self.cuts[s] += 1
        self.solution = [0] * n

    def run(self, heuristic: str, node_limit: float) -> bool:
        """Whether a plan fits (then in ``solution``); raises ``_Stop`` past the budget."""
        self.reset()
        self.heuristic = heuristic
        self.node_limit = self.nodes + node_limit
        if max(self.load) > self.capacity:
            return False
        cuts = [s + 1 for s, c in enumerate(self.cuts) if c == 0]
        return self._split(list(range(self.n)), 0, self.sections, cuts)

    def _split(self, unplaced: list[int], a: int, b: int, cutpoints: list[int]) -> bool:
        """Search each side of the boundaries ``cutpoints`` in sections ``[a, b)`` on its own."""
        bounds = [a] + sorted(cutpoints) + [b]
        lo, rank = self.lo, self.rank
        for c0, c1 in zip(bounds, bounds[1:]):
            part = [k for k in unplaced if c0 <= lo[k] < c1]
            if not part:
                continue
            saved = [rank[k] for k in part]
            self._rank(part)
            found = self._dfs(part, c0, c1, 0, -1)
            for k, r in zip(part, saved):
                rank[k] = r
            if not found:
                return False
        return True

    def _rank(self, part: list[int]) -> None:
        """Rank the buffers of a part by the heuristic (0 first), as MiniMalloc's preordering."""
        total, lo, hi = self.total, self.lo, self.hi
        fullest = {k: max(total[lo[k]:hi[k]]) for k in part}
        keys = {"W": self.width, "A": self.area, "Z": self.size, "T": fullest}
        columns = [keys[c] for c in self.heuristic]
        order = sorted(part, key=lambda k: tuple(-col[k] for col in columns) + (k,))
        for r, k in enumerate(order):
            self.rank[k] = r

    def _dfs(self, unplaced: list[int], a: int, b: int, level: int, last_rank: int) -> bool:
        """Place the buffers ``unplaced`` of sections ``[a, b)``, at offsets from ``level`` up,
        in canonical order after the buffer ranked ``last_rank`` at ``level``."""
        self.nodes += 1
        if self.nodes >= self.node_limit:
            raise _Stop
        if not self.nodes & 255 and time.perf_counter() > self.deadline:
            raise _Stop
        floor_of = self.floor_of
        unplaced = [k for k in unplaced if floor_of[k] != _INF]
        if not unplaced:
            return True
        # the node's fullest section's unplaced bytes, then its hot sections once a candidate needs them
        hot = [max(self.total[a:b])]
        for j in self._candidates(unplaced, level, last_rank):
            o = floor_of[j]
            if not self._fits_above(j, o, a, b, hot):
                continue
            raised, below, saved, ok = self._place(j, o)
            found = ok and self._descend(j, unplaced, a, b, o)
            self._unplace(j, o, raised, below, saved)
            if found:
                self.solution[j] = o
                return True
            if not raised and not any(floor_of[k] != _INF for k in self.nbrs[j]):
                break  # hatless
        return False

    def _candidates(self, unplaced: list[int], level: int, last_rank: int) -> list[int]:
        """The buffers that may come next in canonical order, each at its floor, lowest first:
        not above the lowest top any of them would have (dominance), after the last placed
        buffer's rank at its level, and after their twin."""
        floor_of, size, rank, twin = self.floor_of, self.size, self.rank, self.twin
        lowest_top = min([floor_of[k] + size[k] for k in unplaced])
        candidates = [
            k for k in unplaced
            if level <= floor_of[k] < lowest_top and (floor_of[k] > level or rank[k] > last_rank)
            and (twin[k] < 0 or floor_of[twin[k]] == _INF)
        ]
        width = self.n + 1
        candidates.sort(key=lambda k: floor_of[k] * width + rank[k])
        return candidates

    def _fits_above(self, j: int, o: int, a: int, b: int, hot: list) -> bool:
        """Whether every section's unplaced bytes of ``[a, b)``, less ``j``'s own, fit above ``o``:
        the sections too full for that (hot) must all be ``j``'s. ``hot`` holds, per node, the
        most unplaced bytes of a section, then (made once needed) the sections from the fullest
        down and their running first and last, for the first and last hot section of any room
        (by bisection)."""
        most, room = hot[0], self.capacity - o
        if most <= room:
            return True
        if len(hot) == 1:
            total = self.total
            order = sorted(range(a, b), key=total.__getitem__, reverse=True)
            hot += [-total[s] for s in order], list(accumulate(order, min)), list(accumulate(order, max))
        c = bisect_left(hot[1], -room) - 1
        return not (hot[2][c] < self.lo[j] or hot[3][c] >= self.hi[j] or most - self.size[j] > room)

    def _place(self, j: int, o: int) -> tuple[list[int], list[int], list, bool]:
        """Place ``j`` at ``o``: raise the floors of the buffers alive with it, take it out of its
        sections, and bring the sections' lowest floors up to date. Returns what
        :meth:`_unplace` needs (the raised buffers, their floors before, the holders replaced)
        and whether every section still fits."""
        floor_of, size, nbrs, lo, hi = self.floor_of, self.size, self.nbrs, self.lo, self.hi
        total, members, where, holder, mark, n = self.total, self.members, self.where, self.holder, self.mark, self.n
        first, end, sz = lo[j], hi[j], size[j]
        top = o + sz
        floor_of[j] = _INF  # placed
        raised = [k for k in nbrs[j] if floor_of[k] < top]  # placed ones are at infinity
        below = [floor_of[k] for k in raised]
        self.stamp = stamp = self.stamp + 1
        mark[j] = mark[n] = stamp
        for k in raised:
            floor_of[k] = top
            mark[k] = stamp
        # Take j out of its sections' member lists: swap the last member into its place.
        wj = where[j]
        for s in range(first, end):
            total[s] -= sz
            row = members[s]
            last = row.pop()
            if last != j:
                i = wj[s - first]
                row[i] = last
                where[last][s - lo[last]] = i
        # A section's lowest floor moves only where the buffer holding it rose or left (or
        # where nothing holds it: see below).
        changed = [s for s in range(self.span_lo[j], self.span_hi[j]) if mark[holder[s]] == stamp]
        saved = []
        capacity = self.capacity
        floor_at = floor_of.__getitem__
        for s in changed:
            t = total[s]
            if not t:
                continue
            if top + t <= capacity and not first <= s < end:
                # The floor is at most top, where everything fits: leave it unknown until
                # a placement with a higher top touches the section.
                if holder[s] != n:
                    saved.append((s, holder[s]))
                    holder[s] = n
                continue
            saved.append((s, holder[s]))
            k = holder[s] = min(members[s], key=floor_at)
            if floor_of[k] + t > capacity:
                return raised, below, saved, False
        return raised, below, saved, True

    def _descend(self, j: int, unplaced: list[int], a: int, b: int, o: int) -> bool:
        """The search below ``j``'s placement at ``o``: each side on its own where ``j`` was the
        last buffer to span a boundary between sections, else on from ``j``."""
        cuts = self.cuts
        first, end = self.lo[j], self.hi[j]
        cut = []
        for s in range(first, end - 1):
            cuts[s] -= 1
            if not cuts[s]:
                cut.append(s + 1)
        try:
            return self._split(unplaced, a, b, cut) if cut else self._dfs(unplaced, a, b, o, self.rank[j])
        finally:
            for s in range(first, end - 1):
                cuts[s] += 1

    def _unplace(self, j: int, o: int, raised: list[int], below: list[int], saved: list) -> None:
        """Undo :meth:`_place`: ``j`` back in its sections at ``o``, the floors it raised back down."""
        floor_of, lo, members, where, holder, total = self.floor_of, self.lo, self.members, self.where, self.holder, self.total
        first, end, sz = lo[j], self.hi[j], self.size[j]
        for s, k in saved:
            holder[s] = k
        wj = where[j]
        for s in range(end - 1, first - 1, -1):
            total[s] += sz
            row = members[s]
            i = wj[s - first]
            if i < len(row):
                last = row[i]
                where[last][s - lo[last]] = len(row)
                row.append(last)
                row[i] = j
            else:
                row.append(j)
        for k, f in zip(raised, below):
            floor_of[k] = f
        floor_of[j] = o


def fits(buffers: Sequence[Buffer], capacity: int, time_limit_s: float = 60.0) -> SearchResult:
    """Search for a plan of ``buffers`` whose peak is at most ``capacity`` bytes, for at most
    about ``time_limit_s`` seconds.

    Buffers of size 0 take offset 0 and play no part.
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    live = [i for i, b in enumerate(buffers) if b.size > 0]
    offsets = [0] * len(buffers)
    if not live:
        return SearchResult(offsets, True, 0, 0.0)
    if max(buffers[i].size for i in live) > capacity:
        return SearchResult(None, True, 0, time.perf_counter() - start)
    unit = 0
    for i in live:
        unit = math.gcd(unit, buffers[i].size)
    scaled = [Buffer(buffers[i].id, buffers[i].lower, buffers[i].upper, buffers[i].size // unit)
              for i in live]
    search = _Search(scaled, capacity // unit, deadline)
    recursion = sys.getrecursionlimit()
    sys.setrecursionlimit(max(recursion, 4 * len(live) + 1000))
    try:
        limit = len(live)
        while True:
            limit *= 2
            for heuristic in HEURISTICS:
                try:
                    if time.perf_counter() >= deadline:
                        raise _Stop
                    found = search.run(heuristic, limit)
                except _Stop:
                    if time.perf_counter() > deadline:
                        return SearchResult(None, False, search.nodes, time.perf_counter() - start)
                    continue
                if found:
                    for k, i in enumerate(live):
                        offsets[i] = search.solution[k] * unit
                    return SearchResult(offsets, True, search.nodes, time.perf_counter() - start)
                return SearchResult(None, True, search.nodes, time.perf_counter() - start)
    finally:
        sys.setrecursionlimit(recursion)
