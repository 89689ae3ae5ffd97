"""Serve allocation requests at their planned arena offsets, and fall back safely where the run
departs from the plan.

The runtime names a request as the plan does (:func:`memo.plan.bilevel.planned_requests`): by
the phase it is made in and its rank among that phase's mallocs of the iteration. Within a served
phase (every phase of the plan by default, or the layer regions alone) the ``k``-th request gets the ``k``-th
planned offset when three things hold: the plan has a ``k``-th request, its size rounded up to the
plan's alignment is the planned size, and the planned range overlaps no arena range still live.
The first request that fails one of them is a *divergence*: it and every later request of that
phase in this iteration go to the ordinary allocator (``None``), and the divergence is counted and
kept for a one-time warning. The live-range check makes the arena safe whatever the run does:
a request is never handed bytes that another live request holds.

This is the whole serving logic; :mod:`memo.plan.cuda_arena` asks it for every request of a
served region on a GPU, and on the CPU :func:`serve_events` replays a recorded step through it to
validate the plan against what the run really asked for.
"""

import logging
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from memo.plan.bilevel import MemoryPlan, PlacedRequest, planned_requests
from memo.profile.trace import Event

log = logging.getLogger("memo")


def every_phase(phase: str) -> bool:
    """The phases served by default: all the plan has, the whole iteration as level 2 plans it."""
    return True


def is_layer_region(phase: str) -> bool:
    """Every transformer layer's forward and backward: the layer regions alone."""
    return phase.startswith("layer.")


@dataclass(frozen=True)
class Divergence:
    """Where a served phase first departed from the plan in one iteration."""

    phase: str
    rank: int  # the malloc's rank in its phase
    size: int  # bytes asked for
    planned_size: Optional[int]  # bytes planned there (None: the plan has no such request)
    reason: str  # "extra request", "size" or "overlap"

    def __str__(self) -> str:
        if self.reason == "extra request":
            return f"{self.phase}: malloc number {self.rank} ({self.size} bytes) is not in the plan"
        if self.reason == "size":
            return (f"{self.phase}: malloc number {self.rank} asks for {self.size} bytes, "
                    f"the plan has {self.planned_size}")
        return (f"{self.phase}: malloc number {self.rank} ({self.size} bytes) would overlap a live "
                "arena tensor")


@dataclass(frozen=True)
class ServingStats:
    """What the server did so far (counts of requests, bytes as asked for)."""

    arena_bytes: int  # the extent of the served phases' placements
    planned_peak_bytes: int  # the plan's peak for the whole iteration
    served: int  # requests given their planned offset
    served_bytes: int
    fallback: int  # requests of served phases sent to the ordinary allocator
    fallback_bytes: int
    missing: int  # planned requests of served phases that never came
    divergences: int  # (phase, iteration) pairs that departed from the plan
    iterations: int
    peak_live_bytes: int  # most served bytes live at once (within the arena)
    first_divergence: str  # "" when there was none

    def row(self) -> dict:
        """The figures as ``plan.*`` result-row columns."""
        return {f"plan.{name}": value for name, value in self.__dict__.items()}


class PlanServer:
    """Hands out arena offsets (bytes) for the requests of the served phases of ``memory_plan``.

    Call :meth:`start_iteration` before each iteration's first request, :meth:`begin` at every
    phase change, then :meth:`malloc` / :meth:`free` for the requests. Not thread-safe: the
    caller serialises calls (the CUDA binding calls in under the GIL).

    Raises:
        ValueError: if the plan's placements of a served phase are not aligned to its alignment.
    """

    def __init__(self, memory_plan: MemoryPlan, served: Callable[[str], bool] = every_phase):
        self.alignment = int(memory_plan.meta.get("alignment", 1))
        # Zero-byte requests never reach an allocator (PyTorch hands out a null pointer).
        self._planned: dict[str, list[PlacedRequest]] = {
            phase: [p for p in placements if p.size > 0]
            for phase, placements in planned_requests(memory_plan).items() if served(phase)
        }
        for placements in self._planned.values():
            for p in placements:
                if p.offset % self.alignment or p.size % self.alignment:
                    raise ValueError(f"{p.phase}: malloc number {p.rank} is placed at {p.offset} "
                                     f"({p.size} bytes), not on the plan's {self.alignment}-byte grid")
        self.arena_bytes = max((p.offset + p.size for ps in self._planned.values() for p in ps), default=0)
        self.planned_peak_bytes = memory_plan.arena_bytes
        self._phase: Optional[str] = None
        self._ranks: dict[str, int] = {}
        self._open = False  # an iteration has started and not been closed
        self._diverged: set[str] = set()
        self._starts: list[int] = []  # offsets of the live served requests, sorted
        self._ends: dict[int, int] = {}  # offset -> end of each live served request
        self._live_bytes = 0
        self._counts = dict(served=0, served_bytes=0, fallback=0, fallback_bytes=0, missing=0,
                            divergences=0, iterations=0, peak_live_bytes=0)
        self._first: Optional[Divergence] = None

    def _round(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def start_iteration(self) -> None:
        """Begin a new iteration: ranks count from 0 again, every phase matches again."""
        self._close_iteration()
        self._ranks, self._diverged, self._phase, self._open = {}, set(), None, True
        self._counts["iterations"] += 1

    def _close_iteration(self) -> None:
        if not self._open:
            return
        self._open = False
        for phase, placements in self._planned.items():
            if phase not in self._diverged:
                self._counts["missing"] += max(len(placements) - self._ranks.get(phase, 0), 0)

    def begin(self, phase: str) -> None:
        """The run has entered ``phase``."""
        self._phase = phase

    def malloc(self, size: int) -> Optional[int]:
        """The arena offset for a request of ``size`` bytes, or None: the ordinary allocator's."""
        phase = self._phase
        planned = self._planned.get(phase) if phase is not None else None
        if planned is None or size == 0:
            return None
        rank = self._ranks.get(phase, 0)
        self._ranks[phase] = rank + 1
        if phase in self._diverged:
            return self._fall_back(size)
        if rank >= len(planned):
            return self._diverge(Divergence(phase, rank, size, None, "extra request"))
        place = planned[rank]
        if self._round(size) != place.size:
            return self._diverge(Divergence(phase, rank, size, place.size, "size"))
        if self._overlaps_live(place.offset, place.offset + place.size):
            return self._diverge(Divergence(phase, rank, size, place.size, "overlap"))
        insort(self._starts, place.offset)
        self._ends[place.offset] = place.offset + place.size
        self._live_bytes += place.size
        self._counts["served"] += 1
        self._counts["served_bytes"] += size
        self._counts["peak_live_bytes"] = max(self._counts["peak_live_bytes"], self._live_bytes)
        return place.offset

    def free(self, offset: int) -> None:
        """Release the served request at ``offset``.

        Raises:
            KeyError: if no served request lives there.
        """
        end = self._ends.pop(offset)
        del self._starts[bisect_left(self._starts, offset)]
        self._live_bytes -= end - offset

    def _overlaps_live(self, start: int, end: int) -> bool:
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < end:
            return True
        return i > 0 and self._ends[self._starts[i - 1]] > start

    def _diverge(self, divergence: Divergence) -> None:  # always None: the request falls back
        self._diverged.add(divergence.phase)
        self._counts["divergences"] += 1
        # The rest of the phase was planned too, and will never come as planned.
        self._counts["missing"] += len(self._planned[divergence.phase]) - min(
            divergence.rank, len(self._planned[divergence.phase]))
        if self._first is None:
            self._first = divergence
            log.warning("the run departs from the memory plan (%s); the rest of that phase comes "
                        "from the ordinary allocator, and later departures are only counted", divergence)
        return self._fall_back(divergence.size)

    def _fall_back(self, size: int) -> None:  # always None
        self._counts["fallback"] += 1
        self._counts["fallback_bytes"] += size
        return None

    def stats(self) -> ServingStats:
        """The figures so far; requests still to come in the current iteration are not missing yet."""
        return ServingStats(arena_bytes=self.arena_bytes, planned_peak_bytes=self.planned_peak_bytes,
                            first_divergence=str(self._first or ""), **self._counts)

    def finish(self) -> ServingStats:
        """Close the current iteration (its unmade planned requests count as missing) and
        return the figures."""
        self._close_iteration()
        return self.stats()


def serve_events(server: PlanServer, events: Iterable[Event],
                 live: Optional[dict[int, int]] = None) -> dict[int, Optional[int]]:
    """Replay one iteration's recorded ``events`` through ``server``: the offset given to each
    request id made (None: the ordinary allocator's).

    ``live`` maps the ids of served requests still live to their offsets, and is kept up to
    date: pass the previous iteration's back in so that frees of its requests (gradients freed
    at the next step's start, say) reach the arena. Frees of requests not served are skipped.
    """
    live = {} if live is None else live
    offsets: dict[int, Optional[int]] = {}
    server.start_iteration()
    phase = None
    for event in events:
        if event.phase != phase:
            phase = event.phase
            server.begin(phase)
        if event.op == "malloc":
            offsets[event.id] = offset = server.malloc(event.size)
            if offset is not None:
                live[event.id] = offset
        elif event.id in live:
            server.free(live.pop(event.id))
    return offsets
