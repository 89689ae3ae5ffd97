"""Bi-level memory planning of one iteration's trace (MEMO, "Bi-level memory planning").

Level 1 plans the transient requests of one block: a request made and freed inside one phase.
All transformer layers allocate alike (the profiler checks it), so one layer's forward and one
layer's backward are planned once and every layer reuses those offsets; the other phases
(embedding, head, loss, optimizer) are planned once each. Level 2 plans the whole iteration: every
request that crosses phases keeps its lifetime, and each phase's transient requests become one
*pseudo* request of the level-1 peak, alive over the whole phase. A transient request's address
is then its pseudo request's offset plus its level-1 offset.

The plan records requests by phase and rank among that phase's mallocs (and size), which is how
the runtime recognises them (:func:`planned_requests`); it round-trips through :func:`write_plan` /
:func:`read_plan`. A plan the runtime serves is made with ``alignment`` (512 bytes, as PyTorch's
caching allocator aligns blocks): every size is rounded up to it and every offset is a multiple.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memo.dsa.buffers import Buffer, max_load, validate
from memo.dsa.solve import DsaPlan, plan
from memo.profile.layers import check_identical_layers
from memo.profile.trace import Trace, phase_layers
from memo.results import create_file_atomic

PLAN_FORMAT = 1
# bytes: the CUDA caching allocator's block alignment, which a plan served at run time keeps
RUNTIME_ALIGNMENT = 512


@dataclass(frozen=True)
class Placement:
    """Where one request goes: the ``rank``-th malloc of ``phase`` (``size`` bytes) at ``offset``."""

    phase: str
    rank: int
    size: int
    offset: int


@dataclass(frozen=True)
class LevelPlan:
    """A solved DSA instance: offsets relative to its arena, and how good they are."""

    placements: list[Placement]
    peak: int  # bytes
    lower_bound: int  # bytes
    solver: str
    seconds: float
    mip_message: str = ""  # what the MIP solver said, if it was asked

    @property
    def gap(self) -> float:
        return self.peak / self.lower_bound - 1 if self.lower_bound else 0.0


@dataclass(frozen=True)
class MemoryPlan:
    """Level-1 plans per block (``layer.fwd``, ``layer.bwd`` and every other phase) and the
    level-2 plan of the iteration, whose peak is the arena size in bytes."""

    blocks: dict[str, LevelPlan]
    phase_blocks: dict[str, str]  # phase -> the block whose offsets it uses
    iteration: LevelPlan  # placements of crossing requests; pseudo requests have rank -1
    flat_lower_bound: int  # bytes alive at once in the original trace: no plan can do better
    layers_checked: list[int]
    meta: dict = field(default_factory=dict)

    @property
    def arena_bytes(self) -> int:
        return self.iteration.peak


def _solve(buffers: list[Buffer], keys: list[tuple[str, int, int]], time_limit_s: float,
           mip: str, alignment: int) -> LevelPlan:
    """Solve in units of ``alignment`` bytes, so that every offset is a multiple of it."""
    start = time.perf_counter()
    units = [Buffer(b.id, b.lower, b.upper, -(-b.size // alignment)) for b in buffers]
    result: DsaPlan = plan(units, time_limit_s, mip)
    validate(units, result.offsets)  # independent check: a wrong plan must never leave here
    placements = [Placement(phase, rank, unit.size * alignment, offset * alignment)
                  for (phase, rank, _), unit, offset in zip(keys, units, result.offsets, strict=True)]
    return LevelPlan(placements, result.peak * alignment, result.lower_bound * alignment, result.solver,
                     time.perf_counter() - start, result.mip_message)


def plan_iteration(trace: Trace, time_limit_s: float = 60.0, mip: str = "gurobi",
                   alignment: int = 1, identical_layers: bool = True) -> MemoryPlan:
    """Bi-level plan of ``trace`` within about ``time_limit_s`` seconds in all; ``mip`` is the
    MIP solver each DSA solve may use (see :func:`memo.dsa.solve.plan`); sizes are rounded up
    to, and offsets placed at, multiples of ``alignment`` bytes.

    The level-1 blocks share a quarter of the time (they are small and usually meet their
    bound at once); level 2 gets the rest.

    With ``identical_layers`` (the profiler's check of the method), all inner layers must
    allocate alike; without it (a run's own recorded step, where MEMO keeps its last two layers
    on the device, say), layers whose transients differ from the second layer's get blocks of
    their own.

    Raises:
        memo.profile.layers.LayerMismatchError: if two inner layers allocate differently and
            ``identical_layers`` is set.
    """
    deadline = time.perf_counter() + time_limit_s
    requests = trace.requests()
    layers_checked = check_identical_layers(trace, requests) if identical_layers else []
    # The layer whose transients the shared layer blocks are planned from: the second, as the
    # first may differ (it receives the embedding's output).
    layers = phase_layers(trace.phases)
    reference = (layers_checked or layers[1:2] or layers or [0])[0]
    rank = trace.malloc_ranks()

    transient = [r for r in requests if r.free_phase == r.malloc_phase]
    by_phase: dict[str, list] = {}
    for r in transient:
        by_phase.setdefault(r.malloc_phase, []).append(r)

    def shape(phase: str) -> list[tuple[int, int]]:
        return [(rank[r.id], r.size) for r in by_phase.get(phase, [])]

    # Layers share the blocks of the first inner layer; a layer whose transients differ (the
    # first and last may: their neighbours are the embedding and the head) gets its own.
    phase_blocks, blocks = {}, {}
    for phase in trace.phases:
        block = phase
        if phase.startswith("layer."):
            direction = phase.split(".")[2]
            if shape(phase) == shape(f"layer.{reference}.{direction}"):
                block = f"layer.{direction}"
        phase_blocks[phase] = block
        if block not in blocks:
            members = by_phase.get(phase, [])
            first = min((r.lower for r in members), default=0)
            buffers = [Buffer(str(r.id), r.lower - first, r.upper - first, r.size) for r in members]
            keys = [(block, rank[r.id], r.size) for r in members]
            share = (deadline - time.perf_counter()) / 4 / len(trace.phases)
            blocks[block] = _solve(buffers, keys, max(share, 0.0), mip, alignment)

    buffers, keys = [], []
    for r in requests:
        if r.free_phase != r.malloc_phase:
            buffers.append(Buffer(str(r.id), r.lower, r.upper, r.size))
            keys.append((r.malloc_phase, rank[r.id], r.size))
    for phase, (lower, upper) in trace.phase_spans().items():
        peak = blocks[phase_blocks[phase]].peak
        if peak > 0:
            buffers.append(Buffer(f"pseudo:{phase}", lower, upper, peak))
            keys.append((phase, -1, peak))
    iteration = _solve(buffers, keys, max(deadline - time.perf_counter(), 0.0), mip, alignment)
    meta = {**trace.meta, "format": PLAN_FORMAT, "alignment": alignment}
    flat = max_load([Buffer(str(r.id), r.lower, r.upper, r.size) for r in requests])
    return MemoryPlan(blocks, phase_blocks, iteration, flat, layers_checked, meta)


def planned_requests(memory_plan: MemoryPlan) -> dict[str, list[Placement]]:
    """Every phase's requests in malloc order, each with its arena offset (bytes): a crossing
    request's level-2 offset, or a transient one's level-1 offset above its phase's pseudo request.

    Raises:
        ValueError: if a phase's ranks are not 0, 1, 2, ... (the plan is not of one trace).
    """
    crossing: dict[str, dict[int, Placement]] = {}
    pseudo: dict[str, int] = {}
    for p in memory_plan.iteration.placements:
        if p.rank < 0:
            pseudo[p.phase] = p.offset
        else:
            crossing.setdefault(p.phase, {})[p.rank] = p
    planned = {}
    for phase, block in memory_plan.phase_blocks.items():
        ranks = dict(crossing.get(phase, {}))
        for p in memory_plan.blocks[block].placements:
            if p.rank in ranks:
                raise ValueError(f"malloc number {p.rank} of phase {phase!r} is placed twice")
            ranks[p.rank] = Placement(phase, p.rank, p.size, pseudo.get(phase, 0) + p.offset)
        if sorted(ranks) != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
            raise ValueError(f"phase {phase!r} has no place for malloc number {missing[0]}")
        planned[phase] = [ranks[r] for r in range(len(ranks))]
    return planned


def addresses(memory_plan: MemoryPlan, trace: Trace) -> dict[int, int]:
    """Arena offset (bytes) of every request of ``trace``, by request id (see
    :func:`planned_requests`).

    Raises:
        KeyError: naming the first request the plan does not place.
    """
    planned = planned_requests(memory_plan)
    placed = {}
    ranks = trace.malloc_ranks()
    for event in trace.events:
        if event.op != "malloc":
            continue
        phase, rank = event.phase, ranks[event.id]
        if rank >= len(planned.get(phase, ())):
            raise KeyError(f"the plan has no place for malloc number {rank} of phase {phase!r}")
        placed[event.id] = planned[phase][rank].offset
    return placed


def _level_dict(level: LevelPlan) -> dict:
    return {**{k: v for k, v in asdict(level).items() if k != "placements"},
            "placements": [[p.phase, p.rank, p.size, p.offset] for p in level.placements]}


def _level(data: dict) -> LevelPlan:
    return LevelPlan([Placement(*row) for row in data["placements"]], data["peak"], data["lower_bound"],
                     data["solver"], data["seconds"], data.get("mip_message", ""))


def write_plan(path: Path, memory_plan: MemoryPlan) -> None:
    """Save ``memory_plan`` as JSON, atomically; an existing file is never replaced.

    Raises:
        FileExistsError: if ``path`` exists.
    """
    data = {
        "format": PLAN_FORMAT,
        "arena_bytes": memory_plan.arena_bytes,
        "flat_lower_bound": memory_plan.flat_lower_bound,
        "layers_checked": memory_plan.layers_checked,
        "meta": memory_plan.meta,
        "blocks": {name: _level_dict(level) for name, level in memory_plan.blocks.items()},
        "phase_blocks": memory_plan.phase_blocks,
        "iteration": _level_dict(memory_plan.iteration),
    }
    create_file_atomic(path, json.dumps(data))


def read_plan(path: Path) -> MemoryPlan:
    """The plan saved by :func:`write_plan`.

    Raises:
        ValueError: if the file is not a plan of this format, naming the file.
    """
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {PLAN_FORMAT}")
        return MemoryPlan(
            blocks={name: _level(level) for name, level in data["blocks"].items()},
            phase_blocks=data["phase_blocks"],
            iteration=_level(data["iteration"]),
            flat_lower_bound=data["flat_lower_bound"],
            layers_checked=data["layers_checked"],
            meta=data["meta"],
        )
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a memory plan ({error})") from None
