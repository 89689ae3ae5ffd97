"""Planning layers walked in tiles: one level-1 block for every tile of a layer and one for every
block of a tile's attention, whatever the number of tiles; ``mode=plan`` from three layers of three
tiles; ``plan=true`` serving a tiled run's steps."""

import dataclasses

import pytest
import yaml
from conftest import REPO, run_in_process, trace_of

from memo.config import Method, ModelConfig, ParallelConfig, Workload
from memo.dsa.buffers import read_buffers, validate
from memo.plan.runtime import CPU_SERVING
from memo.plan.bilevel import addresses, phase_kind, plan_iteration, read_plan
from memo.policy import policy_of
from memo.profile.template import iteration_template
from memo.profile.trace import Event, Trace, read_trace

TINY_LLAMA = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / "tiny_llama.yaml").read_text()))
MEMO = Method(name="memo", layer_activations="swap")
TILE = 512


def tiled(layers: int, tiles: int) -> Workload:
    return Workload(dataclasses.replace(TINY_LLAMA, num_layers=layers), MEMO, ParallelConfig(), tiles * TILE,
                    dtype="bf16", loss="tiled", layer_tile_tokens=TILE)


def without_gradients(trace: Trace) -> Trace:
    gradients = set(trace.meta["gradient_requests"])
    return Trace([e for e in trace.events if e.id not in gradients], trace.meta)


def placed_validly(memory_plan, trace: Trace) -> int:
    """The peak of ``trace``'s requests at the plan's addresses; raises if two overlap."""
    offsets = addresses(memory_plan, trace)
    buffers = trace.buffers()
    return validate(buffers, [offsets[int(b.id)] for b in buffers])


@pytest.fixture(scope="module")
def three_and_six_tiles():
    traces = {tiles: trace_of(tiled(3, tiles)) for tiles in (3, 6)}
    return {tiles: (trace, plan_iteration(trace, 20, identical_layers=False)) for tiles, trace in traces.items()}


def test_a_three_tile_plan_is_the_six_tile_plans_tile_phases(three_and_six_tiles):
    """Every tile of six and every block of its attention is served by a level-1 block the
    three-tile plan has, placed alike; both plans place every request of their trace."""
    (three_trace, three), (six_trace, six) = three_and_six_tiles[3], three_and_six_tiles[6]
    tile_blocks = {name for name in six.blocks if ".t" in name}
    assert tile_blocks == {name for name in three.blocks if ".t" in name}
    assert {"layer.fwd.t", "layer.bwd.t", "layer.fwd.t.b", "layer.bwd.t.db"} <= tile_blocks
    for name in tile_blocks:
        assert six.blocks[name].placements == three.blocks[name].placements, name
        assert six.blocks[name].peak == three.blocks[name].peak > 0, name
    # the tiles (and blocks) beyond the third use blocks the three-tile plan has
    later = {phase: block for phase, block in six.phase_blocks.items() if ".t3" in phase or ".t5" in phase}
    assert later and set(later.values()) <= set(three.blocks)
    for trace, memory_plan in ((three_trace, three), (six_trace, six)):
        assert memory_plan.flat_lower_bound <= placed_validly(memory_plan, trace) <= memory_plan.arena_bytes


def test_the_tiles_of_the_middle_layer_share_one_block_and_its_loops_are_pseudo_requests(three_and_six_tiles):
    """Every forward tile of the middle layer shares one block; so do its backward tiles but the
    first the backward pass runs (its last, which finds the gradient of the layer above new)."""
    _, six = three_and_six_tiles[6]
    tiles = {phase: block for phase, block in six.phase_blocks.items()
             if phase.startswith("layer.1.") and phase_kind(phase) in ("layer.fwd.t", "layer.bwd.t")}
    assert {tiles[f"layer.1.fwd.t{t}"] for t in range(6)} == {"layer.fwd.t"}
    assert len({tiles[f"layer.1.bwd.t{t}"] for t in range(5)}) == 1
    assert tiles["layer.1.bwd.t5"] != tiles["layer.1.bwd.t0"]
    # a tile's loop of attention blocks is one request of its level-1 block, as large as the
    # largest block of its kind (the first block of a forward loop merges nothing, so is smaller)
    forward_blocks = [six.blocks[name].peak for name in six.blocks if phase_kind(name.split("#")[0]) == "layer.fwd.t.b"]
    assert len(forward_blocks) == 2 and min(forward_blocks) < max(forward_blocks)
    loop = [p for p in six.blocks["layer.fwd.t"].placements if p.rank < 0]
    assert [p.size for p in loop] == [max(forward_blocks)]
    assert all(six.loops[phase] == 0 for phase in six.loops)


def test_a_hand_made_tile_gets_the_offsets_worked_out_by_hand():
    """A tile keeps 100 bytes over its loop of three blocks of 40 (then 10 over it) bytes each:
    its level-1 block is 140 bytes, the blocks all at offset 100 however many there are."""
    events, ids = [], iter(range(1000))

    def block(phase, sizes):
        made = [(next(ids), size) for size in sizes]
        events.extend(Event("malloc", i, s, phase) for i, s in made)
        events.extend(Event("free", i, s, phase) for i, s in reversed(made))

    for tiles in (1, 3):
        layer = f"layer.{tiles}.fwd.t0"
        kept = next(ids)
        events.append(Event("malloc", kept, 100, layer))
        for j in range(tiles):
            block(f"{layer}.b{j}", [40, 10] if j else [40])
        events.append(Event("free", kept, 100, layer))
    trace = Trace(events)
    memory_plan = plan_iteration(trace, 5, identical_layers=False)
    assert memory_plan.blocks["layer.fwd.t.b"].peak == 40 and memory_plan.blocks["layer.fwd.t.b#1"].peak == 50
    assert set(memory_plan.phase_blocks[f"layer.{t}.fwd.t0"] for t in (1, 3)) == {"layer.fwd.t"}
    assert memory_plan.blocks["layer.fwd.t"].peak == 150 and memory_plan.arena_bytes == 150
    offsets = addresses(memory_plan, trace)
    for size in (40, 10):  # every block's request at one address, in both tiles
        assert len({offsets[e.id] for e in events if e.op == "malloc" and e.size == size}) == 1, size
    assert placed_validly(memory_plan, trace) == 150


def test_a_tile_made_of_its_blocks_alone_is_planned():
    """A tile phase with no request of its own outside its blocks still has its level-1 block:
    its loop's pseudo request."""
    events = [Event("malloc", 1, 64, "layer.0.fwd.t0.b0"), Event("free", 1, 64, "layer.0.fwd.t0.b0"),
              Event("malloc", 2, 64, "layer.0.fwd.t1.b0"), Event("free", 2, 64, "layer.0.fwd.t1.b0"),
              Event("malloc", 3, 32, "layer.0.fwd.t1.b1"), Event("free", 3, 32, "layer.0.fwd.t1.b1")]
    trace = Trace(events)
    memory_plan = plan_iteration(trace, 5, identical_layers=False)
    assert memory_plan.phase_blocks["layer.0.fwd.t1"] == memory_plan.phase_blocks["layer.0.fwd.t0"] == "layer.fwd.t"
    assert memory_plan.arena_bytes == 64 and placed_validly(memory_plan, trace) == 64


def test_a_block_that_keeps_a_request_past_itself_is_refused():
    events = [Event("malloc", 1, 8, "layer.0.fwd.t1.b0"), Event("malloc", 2, 8, "layer.0.fwd.t1.b1"),
              Event("free", 1, 8, "layer.0.fwd.t1.b1"), Event("free", 2, 8, "layer.0.fwd.t1.b1")]
    with pytest.raises(ValueError, match="made in layer.0.fwd.t1.b0 is freed in layer.0.fwd.t1.b1: each block"):
        plan_iteration(Trace(events), 5, identical_layers=False)


def test_three_layers_of_three_tiles_plan_the_runs_own_tiles_and_arena():
    """The template's iteration at the run's length and tile has the level-1 blocks of a direct
    trace of four layers of five tiles, and its arena but the loss's per-token fp32 gradient,
    which it sizes at one loss tile (as :mod:`memo.profile.template` states)."""
    work = tiled(4, 5)
    real = plan_iteration(without_gradients(trace_of(work)), 20, identical_layers=False)
    template = iteration_template(work, 4, policy_of(work).traced)
    instance = template.instance(work.seq, 4, layer_tile_tokens=TILE)
    planned = plan_iteration(instance, 20, identical_layers=False)
    for name in real.blocks:
        if ".t" in name:
            assert planned.blocks[name].placements == real.blocks[name].placements, name
    assert planned.arena_bytes == real.arena_bytes - 4 * (work.seq - template.loss_tile(work.seq))


def test_plan_mode_plans_a_walk_in_tiles_and_its_files_place_every_request(tmp_path):
    out = tmp_path / "plan"
    row = run_in_process(out, "mode=plan", "model=tiny_llama", "model.num_layers=4", "method=memo",
                         f"method.tile_tokens={TILE}", f"seq={8 * TILE}")
    assert row["status"] == "ok", row["error"]
    assert row["profile.template"] is True and row["profile.layers_identical"] is None
    for level in ("tile_forward", "tile_backward", "attention_block_forward", "attention_block_backward"):
        assert row[f"plan.{level}_peak_bytes"] >= row[f"plan.{level}_lower_bound_bytes"] > 0, level
    memory_plan = read_plan(out / "plan.json")
    assert memory_plan.loops and all(".b" in phase or ".db" in phase for phase in memory_plan.loops)
    trace = read_trace(out / "trace.csv")
    buffers = read_buffers(out / "trace.csv")
    offsets = addresses(memory_plan, trace)
    assert validate(buffers, [offsets[int(b.id)] for b in buffers]) <= row["plan.arena_bytes"]


@pytest.mark.slow
def test_a_planned_tiled_cpu_run_matches_every_request_of_its_steps(tmp_path):
    row = run_in_process(tmp_path / "memo", "method=memo", "method.tile_tokens=128", "plan=true", "model=tiny",
                         "seq=512", "train.steps=4", "train.warmup_steps=2")
    assert row["status"] == "ok", row["error"]
    assert row["plan.serving"] == CPU_SERVING and row["plan.iterations"] == 2
    assert (row["plan.divergences"], row["plan.fallback"], row["plan.missing"]) == (0, 0, 0)
    assert row["plan.served"] == 2 * row["plan.recorded_requests"] > 0
    assert 0 < row["plan.peak_live_bytes"] <= row["plan.arena_bytes"] == row["plan.planned_peak_bytes"]
