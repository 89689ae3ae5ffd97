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
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from memo.dsa.buffers import Buffer, max_load, validate
from memo.dsa.solve import DsaPlan, plan
from memo.profile.layers import check_identical_layers
from memo.profile.trace import Trace, phase_layers
from memo.results import create_file_atomic

PLAN_FORMAT = 2  # 2: tiles' loops of attention blocks (``loops``); format 1 is read as a plan without them
# bytes: the CUDA caching allocator's block alignment, which a plan served at run time keeps
RUNTIME_ALIGNMENT = 512
# a block of a tile's attention: <tile phase>.b<j> (forward kernels) or .db<j> (backward kernels)
_ATTENTION_BLOCK = re.compile(r"^(?P<tile>.+\.t\d+)\.(?P<loop>d?b)\d+$")
_LAYER = re.compile(r"^layer\.\d+")
_NUMBERED = re.compile(r"\.(t|b|db)\d+")


@dataclass(frozen=True)
class PlacedRequest:
    """Where one request goes: the ``rank``-th malloc of ``phase`` (``size`` bytes) at ``offset``."""

    phase: str
    rank: int
    size: int
    offset: int


@dataclass(frozen=True)
class LevelPlan:
    """A solved DSA instance: offsets relative to its arena, and how good they are."""

    placements: list[PlacedRequest]
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
    # a block of a tile's attention -> the loop of its tile it runs in (0 for the tile's first):
    # its requests are placed at that loop's pseudo request (rank -1 - loop) of the tile's block
    loops: dict[str, int] = field(default_factory=dict)

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
    placements = [PlacedRequest(phase, rank, unit.size * alignment, offset * alignment)
                  for (phase, rank, _), unit, offset in zip(keys, units, result.offsets, strict=True)]
    return LevelPlan(placements, result.peak * alignment, result.lower_bound * alignment, result.solver,
                     time.perf_counter() - start, result.mip_message)


def attention_block(phase: str) -> Optional[tuple[str, str]]:
    """``(tile phase, loop)`` when ``phase`` is one block of a tile's attention
    (``<tile phase>.b<j>`` or ``.db<j>``, :mod:`memo.swap.tiled_layer`), else None."""
    match = _ATTENTION_BLOCK.match(phase)
    return None if match is None else (match["tile"], match["loop"])


def phase_kind(phase: str) -> str:
    """``phase`` without its numbers of layer, tile and attention block: ``layer.3.fwd.t5.b2`` is
    ``layer.fwd.t.b``; phases planned alike share a kind."""
    return _NUMBERED.sub(r".\1", _LAYER.sub("layer", phase))


def _folded(trace: Trace) -> dict[str, str]:
    """Every phase's *home*: the phase itself, or the tile whose attention block it is."""
    return {phase: (attention_block(phase) or (phase,))[0] for phase in trace.phases}


def _check_closed_blocks(requests) -> None:
    for r in requests:
        if (attention_block(r.malloc_phase) or (r.free_phase and attention_block(r.free_phase))) \
                and r.malloc_phase != r.free_phase:
            raise ValueError(f"a request made in {r.malloc_phase} is freed in {r.free_phase}: each block of a "
                             "tile's attention must free what it makes, so that one plan serves every block")


def plan_iteration(trace: Trace, time_limit_s: float = 60.0, mip: str = "gurobi",
                   alignment: int = 1, identical_layers: bool = True) -> MemoryPlan:
    """Bi-level plan of ``trace`` within about ``time_limit_s`` seconds in all; ``mip`` is the
    MIP solver each DSA solve may use (see :func:`memo.dsa.solve.plan`); sizes are rounded up
    to, and offsets placed at, multiples of ``alignment`` bytes.

    The level-1 blocks share a quarter of the time (they are small and usually meet their
    bound at once); level 2 gets the rest.

    Phases of one kind (:func:`phase_kind`) whose transient requests are alike (sizes, ranks and
    lifetimes) share one level-1 block, named by the kind for the second layer's (``layer.fwd``;
    the first and last layers may differ, their neighbours being the embedding and the head) and
    numbered for other variants, in the order they first occur (``layer.fwd#1``). With
    ``identical_layers`` (the profiler's check of the method), all inner layers must allocate
    alike.

    A layer walked in tiles has a phase per tile, and within it one per block of the tile's
    attention. Each block makes and frees its own requests (checked), and the blocks of one loop
    run one after another: a block is planned once per kind, and the whole loop is one pseudo
    request of the tile's level-1 block, as large as the largest block of its kind anywhere. Tiles
    then differ only in how long their loops run, so one level-1 block serves every tile of a
    layer, however many tiles and blocks the run has; level 2 has a pseudo request per tile.

    Raises:
        memo.profile.layers.LayerMismatchError: if two inner layers allocate differently and
            ``identical_layers`` is set.
        ValueError: if a block of a tile's attention frees a request it did not make, or keeps
            one it made.
    """
    deadline = time.perf_counter() + time_limit_s
    requests = trace.requests()
    _check_closed_blocks(requests)
    layers_checked = check_identical_layers(trace, requests) if identical_layers else []
    layers = phase_layers(trace.phases)
    reference = (layers_checked or layers[1:2] or layers or [0])[0]
    # Level 1 has a quarter of the time, shared among the blocks to solve as they come (the
    # attention blocks' kinds first, then the other phases'); level 2 has the rest, and what
    # level 1 leaves.
    levels = _Levels(trace, requests, mip, alignment, time.perf_counter() + time_limit_s / 4)
    ordered = sorted(trace.phases, key=lambda p: not p.startswith(f"layer.{reference}."))
    levels.plan_attention_blocks(ordered)
    levels.plan_phases(ordered)
    iteration = levels.plan_iteration(deadline)
    meta = {**trace.meta, "format": PLAN_FORMAT, "alignment": alignment}
    flat = max_load([Buffer(str(r.id), r.lower, r.upper, r.size) for r in requests])
    return MemoryPlan(levels.blocks, levels.phase_blocks, iteration, flat, layers_checked, meta, levels.loops)


class _Levels:
    """The three levels of one bi-level plan (see :func:`plan_iteration`): the blocks of tiles'
    attention, then every phase's transient requests (level 1), then the iteration (level 2)."""

    def __init__(self, trace: Trace, requests, mip: str, alignment: int, level_one_end: float):
        self.trace, self.requests, self.mip, self.alignment = trace, requests, mip, alignment
        self.level_one_end = level_one_end
        self.rank = trace.malloc_ranks()
        self.by_id = {r.id: r for r in requests}
        self.blocks: dict[str, LevelPlan] = {}
        self.phase_blocks: dict[str, str] = {}
        self.loops: dict[str, int] = {}  # attention block phase -> which loop of its tile it is in
        self.spans: dict[str, list[int]] = {}  # a phase's first and past-last event, blocks folded in

    def plan_alike(self, signatures: dict[str, tuple]) -> None:
        """Name and plan the level-1 blocks of ``signatures`` (phase -> its transients' signature,
        ``(rank, lower, upper, bytes)`` each, in the order the phases are planned): phases of one
        kind alike share a block, named in the order their variants first occur, which no later
        layer or tile changes."""
        variants: dict[tuple, list[str]] = {}
        for phase, signature in signatures.items():
            variants.setdefault((phase_kind(phase), signature), []).append(phase)
        taken: dict[str, int] = {}
        for left, ((kind, signature), phases) in zip(range(len(variants), 0, -1), variants.items()):
            number = taken[kind] = taken.get(kind, -1) + 1
            name = kind if not number else f"{kind}#{number}"
            buffers = [Buffer(str(i), lower, upper, size) for i, (_, lower, upper, size) in enumerate(signature)]
            keys = [(name, r, size) for r, _, _, size in signature]
            share = (self.level_one_end - time.perf_counter()) / (left + 1)  # what is left over goes on
            self.blocks[name] = _solve(buffers, keys, max(share, 0.0), self.mip, self.alignment)
            self.phase_blocks.update(dict.fromkeys(phases, name))

    def transient_items(self, events: list, phase: str) -> tuple:
        """The signature of the requests made and freed within ``phase`` among ``events``
        ((position, event) pairs): ``(rank, lower, upper, bytes)`` each."""
        at: dict[int, list[int]] = {}
        for position, e in events:
            r = self.by_id[e.id]
            if r.malloc_phase == r.free_phase == phase:
                at.setdefault(e.id, []).append(position)
        ids = sorted(at, key=lambda i: at[i][0])
        return tuple((self.rank[i], at[i][0], at[i][1], self.by_id[i].size) for i in ids)

    def plan_attention_blocks(self, ordered: list[str]) -> None:
        """Level 0: each block of a tile's attention, all its requests (a block is closed)."""
        block_events: dict[str, list] = {}
        for event in self.trace.events:
            if attention_block(event.phase):
                block_events.setdefault(event.phase, []).append(event)
        self.block_events = block_events
        self.plan_alike({phase: self.transient_items(list(enumerate(block_events[phase])), phase)
                         for phase in ordered if phase in block_events})

    def plan_phases(self, ordered: list[str]) -> None:
        """Level 1: every other phase's transient requests, each loop of its attention blocks one
        pseudo request as large as the largest block of its kind anywhere."""
        loop_bytes: dict[str, int] = {}
        for phase, name in self.phase_blocks.items():
            kind = phase_kind(phase)
            loop_bytes[kind] = max(loop_bytes.get(kind, 0), self.blocks[name].peak)
        home = _folded(self.trace)
        own_events: dict[str, list] = {}
        for position, event in enumerate(self.trace.events):
            owner = home[event.phase]
            span = self.spans.setdefault(owner, [position, position + 1])
            span[1] = position + 1
            own_events.setdefault(owner, []).append(event)
        signatures = {}
        # (a tile whose events are all its blocks' has no phase of its own in the trace)
        for phase in [p for p in ordered if p not in self.block_events] + [p for p in self.spans if p not in home]:
            # the phase's own events and one place per loop of its attention blocks
            events, loop_kinds, previous = [], [], None
            for e in own_events.get(phase, []):
                if e.phase == phase:
                    events.append((len(events) + len(loop_kinds), e))
                    previous = None
                    continue
                kind = phase_kind(e.phase)
                if kind != previous:
                    loop_kinds.append((len(events) + len(loop_kinds), kind))
                    previous = kind
                if self.loops.setdefault(e.phase, len(loop_kinds) - 1) != len(loop_kinds) - 1:
                    raise ValueError(f"{e.phase} runs in two loops of attention blocks; name each loop's blocks apart")
            loops_of_phase = tuple((-1 - k, at, at + 1, loop_bytes[kind]) for k, (at, kind) in enumerate(loop_kinds))
            signatures[phase] = self.transient_items(events, phase) + loops_of_phase
        self.plan_alike(signatures)

    def plan_iteration(self, deadline: float) -> LevelPlan:
        """Level 2: the requests that cross phases, and a pseudo request per phase (a tile's
        blocks in it) of its level-1 block's peak."""
        buffers, keys = [], []
        for r in self.requests:
            if r.free_phase != r.malloc_phase:
                buffers.append(Buffer(str(r.id), r.lower, r.upper, r.size))
                keys.append((r.malloc_phase, self.rank[r.id], r.size))
        for phase, (lower, upper) in self.spans.items():
            peak = self.blocks[self.phase_blocks[phase]].peak
            if peak > 0:
                buffers.append(Buffer(f"pseudo:{phase}", lower, upper, peak))
                keys.append((phase, -1, peak))
        return _solve(buffers, keys, max(deadline - time.perf_counter(), 0.0), self.mip, self.alignment)


def planned_requests(memory_plan: MemoryPlan) -> dict[str, list[PlacedRequest]]:
    """Every phase's requests in malloc order, each with its arena offset (bytes): a crossing
    request's level-2 offset, or a transient one's level-1 offset above its phase's pseudo request
    (a tile's attention block: above its loop's pseudo request in the tile's block).

    Raises:
        ValueError: if a phase's ranks are not 0, 1, 2, ... (the plan is not of one trace).
    """
    crossing: dict[str, dict[int, PlacedRequest]] = {}
    pseudo: dict[str, int] = {}
    for p in memory_plan.iteration.placements:
        if p.rank < 0:
            pseudo[p.phase] = p.offset
        else:
            crossing.setdefault(p.phase, {})[p.rank] = p
    loop_offsets = {name: {p.rank: p.offset for p in level.placements if p.rank < 0}
                    for name, level in memory_plan.blocks.items()}
    planned = {}
    for phase, block in memory_plan.phase_blocks.items():
        ranks = dict(crossing.get(phase, {}))
        base = pseudo.get(phase, 0)
        if phase in memory_plan.loops:
            tile = attention_block(phase)[0]
            base = pseudo.get(tile, 0) + loop_offsets[memory_plan.phase_blocks[tile]][-1 - memory_plan.loops[phase]]
        for p in memory_plan.blocks[block].placements:
            if p.rank < 0:  # a loop of attention blocks, placed by its blocks
                continue
            if p.rank in ranks:
                raise ValueError(f"malloc number {p.rank} of phase {phase!r} is placed twice")
            ranks[p.rank] = PlacedRequest(phase, p.rank, p.size, base + p.offset)
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
    return LevelPlan([PlacedRequest(*row) for row in data["placements"]], data["peak"], data["lower_bound"],
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
        "loops": memory_plan.loops,
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
        if data.get("format") not in (1, PLAN_FORMAT):
            raise ValueError(f"format {data.get('format')!r}, expected {PLAN_FORMAT}")
        return MemoryPlan(
            blocks={name: _level(level) for name, level in data["blocks"].items()},
            phase_blocks=data["phase_blocks"],
            iteration=_level(data["iteration"]),
            flat_lower_bound=data["flat_lower_bound"],
            layers_checked=data["layers_checked"],
            meta=data["meta"],
            loops=data.get("loops", {}),
        )
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a memory plan ({error})") from None
