"""The memory plan in a training run, and the allocator figures every training row carries.

The last warm-up step (the first step when there is none) is recorded: every allocation request
with its phase. Requests, their order and sizes do not depend on the data, so that one step
stands for all others, and it is the run's own: every method, MEMO's swapping included, is
recorded as it really allocates. With ``plan=true`` the step is then planned (bi-level, on the
512-byte grid PyTorch aligns tensors to) and every later step is served from it:

* on a GPU, the planned requests (the whole iteration, as level 2 plans it) are placed in one
  arena by :mod:`memo.plan.cuda_arena`; what departs from the plan goes to CUDA's
  stream-ordered pool;
* on the CPU, tensors are not placed (the CPU allocator is not replaceable): each step's
  requests are recorded and replayed through the same :class:`PlanServer`, which validates the
  plan against the live run and gives the same counts.

The row's ``allocator.*`` columns are the iteration's allocator figures: measured on a GPU, and
on the CPU those of PyTorch's caching allocator replaying the recorded step (with the plan, of
the arena plus the caching allocator serving the rest), so the ablation can be previewed on a
laptop. On the CPU the recorded step also gives ``peak_tensor_bytes``, the most bytes of tensors
alive at once, model states included (:mod:`memo.plan.tensor_bytes`).
"""

import contextlib
import dataclasses
import logging
import time
from typing import Iterator, Optional

import torch

from memo.config import PlannerConfig
from memo.plan.server import PlanServer, serve_events
from memo.plan.bilevel import RUNTIME_ALIGNMENT, plan_iteration
from memo.dsa.caching_allocator import simulate
from memo.model.placement import LayerRuntime, NullRuntime
from memo.profile.recorder import AllocationRecorder, PhaseMarker
from memo.plan.tensor_bytes import ResidentBytes, step_peak
from memo.profile.trace import Trace

log = logging.getLogger("memo")

CPU_SERVING = "validated on the CPU: tensors are not placed in the arena, the run's requests are matched"


def record_step(warmup_steps: int) -> int:
    """The 0-based step that is recorded (and planned): the last warm-up step, else the first."""
    return max(warmup_steps - 1, 0)


class PlanRuntime:
    """Records one step of ``gpt``'s training and, with ``plan``, serves the later ones.

    Wrap each step in :meth:`step`; the marker it yields (None when the step is neither recorded
    nor served) must be told of the backward pass and the optimizer step. ``arena`` is the
    installed :class:`memo.plan.cuda_arena.ArenaAllocator` on a GPU with ``plan``, else None.
    ``layers`` is what runs the model's layers: the marker names the parts of their passes it
    reports (a walk in tiles: each tile's phases and its attention blocks') as they go. ``gpt``
    None: nothing is recorded (a pipeline stage, whose micro-batches' passes interleave).
    """

    def __init__(self, gpt: Optional[torch.nn.Module], plan: bool, planner: PlannerConfig, warmup_steps: int,
                 device_type: str, arena=None, layers: LayerRuntime = NullRuntime()):
        if plan and device_type == "cuda" and arena is None:
            raise ValueError("plan=true on a GPU needs the installed arena allocator")
        self.gpt, self.plan, self.planner = gpt, plan, planner
        self.record_at = record_step(warmup_steps)
        self.device_type = device_type
        self.arena = arena
        self.layers = layers
        self.server: Optional[PlanServer] = None
        self.marker: Optional[PhaseMarker] = None
        self.row: dict = {"plan.serving": None}
        self._recorder: Optional[AllocationRecorder] = None  # the CPU's, over all served steps
        self._cursor = 0
        self._live: dict[int, int] = {}
        self._last_step: Optional[tuple[list, dict]] = None  # the CPU's last served step

    def phase(self) -> str:
        return self.marker.phase if self.marker is not None else "setup"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Optional[PhaseMarker]]:
        """The context of 0-based training step ``step``."""
        # On a GPU without the plan the allocator's figures are measured: nothing to record.
        recorded = (self.plan or self.device_type == "cpu") and self.gpt is not None
        if not recorded or step < self.record_at or (step > self.record_at and self.server is None):
            yield None
            return
        self.marker = PhaseMarker(self.gpt, on_change=self._on_phase)
        self.layers.name_phases(self.marker.enter_layer)
        try:
            if step == self.record_at:
                with self._recording() as events:
                    yield self.marker
                self._planned(Trace(events, {"step": step + 1}))
            else:
                with self._serving():
                    yield self.marker
        finally:
            self.layers.name_phases(None)
            self.marker.remove()
            self.marker = None

    def _on_phase(self, phase: str) -> None:
        if self.server is not None and self.device_type == "cuda":
            self.server.begin(phase)

    @contextlib.contextmanager
    def _recording(self) -> Iterator[list]:
        events: list = []
        if self.arena is not None:
            # the step's own requests, on its compute stream: those the arena will serve
            self.arena.serve_stream(torch.cuda.current_stream().cuda_stream)
            self.arena.set_modes(serve=False, record=True)
            try:
                yield events
            finally:
                self.arena.set_modes(serve=False, record=False)
            events.extend(self.arena.take_events())
        else:
            recorder = AllocationRecorder(self.phase)
            resident = ResidentBytes(self.gpt, [*self.layers.device_buffers(), *self.layers.device_stores()],
                                     recorder.events, self.phase)
            with recorder:
                yield events
            recorder.stop()
            resident.stop()
            events.extend(e for e in recorder.events if e.id >= 0)  # the plan's requests
            peak, phase = step_peak(recorder.events, resident.bytes)
            self.row.update(peak_tensor_bytes=peak, peak_tensor_phase=phase)

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        if self.arena is not None:
            self.server.start_iteration()
            self.server.begin(self.phase())
            self.arena.serve_stream(torch.cuda.current_stream().cuda_stream)
            self.arena.set_modes(serve=True, record=False)
            try:
                yield
            finally:
                self.arena.set_modes(serve=False, record=False)
            return
        if self._recorder is None:
            self._recorder = AllocationRecorder(self.phase)
        with self._recorder:
            yield
        events = self._recorder.events[self._cursor:]
        self._cursor = len(self._recorder.events)
        self._last_step = (events, serve_events(self.server, events, self._live))

    def _planned(self, trace: Trace) -> None:
        """Simulate the recorded step's allocator, and plan it when asked."""
        if self.device_type == "cpu":
            stats = simulate(trace.events)
            self.row.update(_allocator_row(stats, "simulated caching allocator"))
        if not self.plan:
            return
        start = time.perf_counter()
        try:
            memory_plan = plan_iteration(trace, self.planner.time_limit_s, self.planner.mip, RUNTIME_ALIGNMENT,
                                         identical_layers=False)
        except ValueError as error:  # a step the planner cannot serve: the run goes on without the plan
            self.row["plan.serving"] = f"not served: {error}"
            log.warning("the memory plan of step %d is not served: %s", self.record_at + 1, error)
            return
        self.server = PlanServer(memory_plan)
        seconds = time.perf_counter() - start
        self.row.update({
            "plan.seconds": seconds, "plan.solver": memory_plan.iteration.solver,
            "plan.recorded_step": self.record_at + 1, "plan.recorded_requests": sum(
                e.op == "malloc" and e.size > 0 for e in trace.events),
            "plan.serving": "arena" if self.arena is not None else CPU_SERVING,
        })
        log.info("memory plan of step %d: %d requests, arena %.1f MiB for the served phases (iteration "
                 "peak %.1f MiB), planned in %.1f s", self.record_at + 1, self.row["plan.recorded_requests"],
                 self.server.arena_bytes / 2**20, memory_plan.arena_bytes / 2**20, seconds)
        if self.arena is not None:
            from memo.plan.cuda_arena import allocate_arena

            allocate_arena(self.arena, self.server.arena_bytes)
            self.arena.server = self.server

    def finish(self) -> dict:
        """The plan's and the allocator's figures for the result row (``plan.*``,
        ``allocator.*``). On the CPU with the plan, the caching allocator's figures are those of
        the last served step: the arena, plus the caching allocator serving what it did not place."""
        row = dict(self.row)
        if self.server is None:
            return row
        row.update(self.server.finish().row())
        if self.arena is not None and self.arena.errors:
            row["plan.errors"] = "; ".join(self.arena.errors[:3])
        if self._last_step is not None:
            events, offsets = self._last_step
            made = {e.id for e in events if e.op == "malloc"}
            rest = [e for e in events if e.id in made and offsets.get(e.id) is None]
            stats = simulate(rest)
            peak = simulate([e for e in events if e.id in made]).peak_allocated
            row.update(_allocator_row(dataclasses.replace(stats, peak_allocated=peak),
                                      "simulated caching allocator and arena", self.server.arena_bytes))
        return row


ALLOCATOR_FIELDS = (
    "allocator.source", "allocator.peak_allocated_bytes", "allocator.peak_reserved_bytes",
    "allocator.num_alloc_retries", "allocator.cuda_malloc_count", "allocator.cuda_free_count",
)


TENSOR_BYTES_FIELDS = ("peak_tensor_bytes", "peak_tensor_phase")  # the CPU's (memo.plan.tensor_bytes)


def _allocator_row(stats, source: str, arena_bytes: int = 0) -> dict:
    """``allocator.*`` columns of an :class:`memo.dsa.caching_allocator.AllocatorStats`, with
    an arena of ``arena_bytes`` (one more device allocation) reserved beside it."""
    values = (source, stats.peak_allocated, stats.peak_reserved + arena_bytes, stats.num_alloc_retries,
              stats.num_device_alloc + (1 if arena_bytes else 0), stats.num_device_free)
    return dict(zip(ALLOCATOR_FIELDS, values, strict=True))


def measured_allocator_row(figures: dict, planned: bool) -> dict:
    """``allocator.*`` columns of a GPU run's measured peak-memory ``figures``
    (:meth:`memo.metrics.PeakMemory.read`), from the plan's allocator when ``planned``."""
    source = "plan arena and cudaMallocAsync" if planned else "caching allocator"
    names = ("peak_allocated_bytes", "peak_reserved_bytes", "alloc_retries", "cuda_malloc_count",
             "cuda_free_count")
    values = (source, *(figures[name] for name in names))
    return dict(zip(ALLOCATOR_FIELDS, values, strict=True))
