"""Bi-level planning: level-1 blocks per layer pass, level 2 for the iteration, plan files."""

import pytest

from memo.config import Method, ModelConfig, ParallelConfig, Workload
from memo.plan.bilevel import addresses, plan_iteration, read_plan, write_plan
from memo.dsa.buffers import PlanError, max_load, validate
from memo.profile.layers import LayerMismatchError
from memo.profile.trace import Event, Trace

from conftest import trace_of

TINY = ModelConfig(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
NONE = Method(name="none")


def _layered_trace(layers: int = 4) -> Trace:
    """A hand-made iteration: each layer keeps one 100-byte tensor for its backward and makes two
    transient ones per pass (64 bytes, then 32 bytes while the first is alive)."""
    events, ids = [], iter(range(10**6))

    def transient(phase, sizes):
        made = [(next(ids), size) for size in sizes]
        events.extend(Event("malloc", i, s, phase) for i, s in made)
        events.extend(Event("free", i, s, phase) for i, s in reversed(made))

    kept = []
    for layer in range(layers):
        phase = f"layer.{layer}.fwd"
        kept.append(next(ids))
        events.append(Event("malloc", kept[-1], 100, phase))
        transient(phase, [64, 32])
    for layer in reversed(range(layers)):
        phase = f"layer.{layer}.bwd"
        transient(phase, [48, 16])
        events.append(Event("free", kept[layer], 100, phase))
    return Trace(events)


def test_a_hand_made_iteration_gets_the_offsets_worked_out_by_hand():
    trace = _layered_trace()
    memory_plan = plan_iteration(trace, time_limit_s=5)
    assert memory_plan.blocks["layer.fwd"].peak == 96 and memory_plan.blocks["layer.bwd"].peak == 64
    assert set(memory_plan.phase_blocks.values()) == {"layer.fwd", "layer.bwd"}
    # Level 2: four kept tensors stack to 400 bytes; the last forward's block sits on top of them.
    assert memory_plan.iteration.peak == memory_plan.iteration.lower_bound == 496
    assert memory_plan.flat_lower_bound == 496
    offsets = addresses(memory_plan, trace)
    buffers = trace.buffers()
    assert validate(buffers, [offsets[int(b.id)] for b in buffers]) == 496


def test_every_request_of_a_real_trace_gets_an_address_and_none_overlap():
    trace = trace_of(Workload(TINY, NONE, ParallelConfig(), 512, dtype="fp32"))
    memory_plan = plan_iteration(trace, time_limit_s=20)
    offsets = addresses(memory_plan, trace)
    buffers = trace.buffers()
    peak = validate(buffers, [offsets[int(b.id)] for b in buffers])
    assert peak <= memory_plan.arena_bytes
    assert memory_plan.flat_lower_bound == max_load(buffers) <= memory_plan.arena_bytes


def test_moving_one_transient_request_breaks_validation():
    trace = _layered_trace()
    memory_plan = plan_iteration(trace, time_limit_s=5)
    offsets = addresses(memory_plan, trace)
    buffers = trace.buffers()
    first = buffers[1]  # layer 0 forward: its 64-byte transient, alive with the kept tensor
    kept = buffers[0]
    offsets[int(first.id)] = offsets[int(kept.id)]
    with pytest.raises(PlanError):
        validate(buffers, [offsets[int(b.id)] for b in buffers])


@pytest.mark.parametrize("model,seq,tp", [
    (TINY, 4096, 1),
    (ModelConfig(name="1.3b", num_layers=4, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16),
     64 * 1024, 1),
    (ModelConfig(name="7b", num_layers=4, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32),
     4096, 1),
    (ModelConfig(name="7b", num_layers=4, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32),
     1 << 20, 8),
], ids=["tiny-4k", "1.3b-64k", "7b-4k", "7b-1m-tp8"])
def test_level_one_plans_of_our_traces_are_proven_optimal(model, seq, tp):
    trace = trace_of(Workload(model, NONE, ParallelConfig(tp=tp), seq, dtype="bf16"))
    memory_plan = plan_iteration(trace, time_limit_s=20)
    for name in ("layer.fwd", "layer.bwd"):
        block = memory_plan.blocks[name]
        assert block.peak == block.lower_bound > 0, name


def test_plans_round_trip_and_are_never_overwritten(tmp_path):
    memory_plan = plan_iteration(_layered_trace(), time_limit_s=5)
    path = tmp_path / "plan.json"
    write_plan(path, memory_plan)
    assert read_plan(path) == memory_plan
    with pytest.raises(FileExistsError, match="exists and is kept"):
        write_plan(path, memory_plan)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "blocks": {}}')
    with pytest.raises(ValueError, match=r"bad.json: not a memory plan"):
        read_plan(bad)


def test_layers_that_differ_are_not_planned_as_one():
    events = list(_layered_trace().events)
    at = next(i for i, e in enumerate(events) if e.phase == "layer.2.fwd")
    events.insert(at, Event("malloc", 999, 8, "layer.2.fwd"))
    events.insert(at + 1, Event("free", 999, 8, "layer.2.fwd"))
    with pytest.raises(LayerMismatchError, match="layer.2.fwd differs"):
        plan_iteration(Trace(events), time_limit_s=5)
