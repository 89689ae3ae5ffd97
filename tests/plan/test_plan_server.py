"""The plan-serving core on real traces of the tiny GPT and of 7B-shaped layers (fake tensors):
every planned request at its planned offset, never two live requests on the same bytes, and
every departure from the plan sent to the ordinary allocator and counted."""

import functools
import random

import pytest

from memo.config import Method, ModelConfig, ParallelConfig, Workload
from memo.plan.server import PlanServer, is_layer_region, serve_events
from memo.plan.bilevel import addresses, plan_iteration
from memo.dsa.buffers import Buffer, validate
from memo.profile.trace import Event, Trace

from conftest import trace_of

TINY = ModelConfig(name="tiny", num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                   vocab_size=512)
SEVEN_B = ModelConfig(name="7b", num_layers=4, hidden_size=4096, ffn_hidden_size=16384,
                      num_attention_heads=32)
ALIGN = 512


@functools.lru_cache
def traced(model_name: str, method: str) -> tuple[Trace, object]:
    tiny = model_name == "tiny"
    model, seq, dtype = (TINY, 256, "fp32") if tiny else (SEVEN_B, 8192, "bf16")
    trace = trace_of(Workload(model, Method(name=method, layer_activations=(
        "recompute" if method == "full_recompute" else "megatron")), ParallelConfig(), seq, dtype=dtype),
        "fake")
    return trace, plan_iteration(trace, time_limit_s=10, mip="none", alignment=ALIGN)


def in_layers(trace: Trace) -> list[Event]:
    return [e for e in trace.events if e.op == "malloc" and e.phase.startswith("layer.") and e.size > 0]


def check_no_live_overlap(events: list[Event], offsets: dict) -> None:
    """Independently of the server: served requests alive at once share no byte."""
    served = [r for r in Trace(events).requests() if offsets.get(r.id) is not None]
    buffers = [Buffer(str(r.id), r.lower, r.upper, -(-r.size // ALIGN) * ALIGN) for r in served]
    validate(buffers, [offsets[r.id] for r in served])


@pytest.mark.parametrize("model_name,method", [("tiny", "none"), ("tiny", "full_recompute"),
                                               ("7b", "none"), ("7b", "full_recompute")])
def test_the_traced_iteration_is_served_entirely_at_its_planned_offsets(model_name, method):
    trace, memory_plan = traced(model_name, method)
    server = PlanServer(memory_plan)
    offsets = serve_events(server, trace.events)
    planned = addresses(memory_plan, trace)
    made = [e for e in trace.events if e.op == "malloc" and e.size > 0]
    assert all(offsets[e.id] == planned[e.id] for e in made)
    assert all(o % ALIGN == 0 for o in offsets.values() if o is not None)
    check_no_live_overlap(trace.events, offsets)
    stats = server.finish()
    assert (stats.served, stats.fallback, stats.missing, stats.divergences) == (len(made), 0, 0, 0)
    assert stats.served_bytes == sum(e.size for e in made)
    assert stats.peak_live_bytes <= stats.arena_bytes == stats.planned_peak_bytes

    # Scoped to the layer regions, the rest is the ordinary allocator's.
    server = PlanServer(memory_plan, is_layer_region)
    offsets = serve_events(server, trace.events)
    layer_requests = in_layers(trace)
    assert layer_requests and all(offsets[e.id] == planned[e.id] for e in layer_requests)
    assert all(offsets[e.id] is None for e in made if not e.phase.startswith("layer."))
    stats = server.finish()
    assert (stats.served, stats.fallback, stats.missing, stats.divergences) == (len(layer_requests), 0, 0, 0)
    assert 0 < stats.peak_live_bytes <= stats.arena_bytes <= stats.planned_peak_bytes
    assert stats.first_divergence == ""


def test_iterations_after_the_first_are_served_alike():
    trace, memory_plan = traced("tiny", "none")
    server = PlanServer(memory_plan)
    # Gradients made in the layers outlive their iteration: the next step frees them first.
    kept = [r for r in trace.requests() if r.free_phase is None]
    assert any(r.malloc_phase.startswith("layer.") for r in kept)
    live = {}
    for step in range(3):
        events = [Event("free", r.id, r.size, "optimizer") for r in kept] if step else []
        serve_events(server, events + trace.events, live)
    stats = server.finish()
    assert stats.iterations == 3 and stats.served == 3 * sum(e.op == "malloc" and e.size > 0
                                                             for e in trace.events)
    assert stats.fallback == stats.divergences == stats.missing == 0

    # Had the run kept them, the next iteration would find their bytes taken, and fall back there.
    server, live = PlanServer(memory_plan), {}
    serve_events(server, trace.events, live)
    serve_events(server, trace.events, live)
    stats = server.finish()
    assert stats.divergences > 0 and "overlap" in stats.first_divergence


def _phase_mallocs(events: list[Event], phase: str) -> list[int]:
    return [i for i, e in enumerate(events) if e.op == "malloc" and e.phase == phase and e.size > 0]


def _check_one_divergence(trace, memory_plan, events, phase, reason, caplog):
    server = PlanServer(memory_plan)
    with caplog.at_level("WARNING", logger="memo"):
        offsets = serve_events(server, events)
    check_no_live_overlap(events, offsets)
    stats = server.finish()
    assert stats.divergences == 1 and stats.fallback >= 1
    assert stats.first_divergence.startswith(phase) and reason in stats.first_divergence
    assert sum("departs from the memory plan" in r.message for r in caplog.records) == 1
    # Every other layer phase is still served as planned.
    planned = addresses(memory_plan, trace)
    others = [e for e in in_layers(trace) if e.phase != phase]
    assert all(offsets[e.id] == planned[e.id] for e in others)
    return offsets, stats


def test_a_resized_request_falls_back_with_the_rest_of_its_phase(caplog):
    trace, memory_plan = traced("tiny", "none")
    phase = "layer.2.fwd"
    events = list(trace.events)
    i = _phase_mallocs(events, phase)[3]
    grown = events[i].size + ALIGN + 1
    events = [Event(e.op, e.id, grown, e.phase) if e.id == events[i].id else e for e in events]
    offsets, stats = _check_one_divergence(trace, memory_plan, events, phase, "asks for", caplog)
    later = [events[j].id for j in _phase_mallocs(events, phase)[3:]]
    assert all(offsets[k] is None for k in later) and stats.fallback == len(later)
    earlier = [events[j].id for j in _phase_mallocs(events, phase)[:3]]
    assert all(offsets[k] is not None for k in earlier)


def test_a_size_within_the_planned_block_is_still_served():
    trace, memory_plan = traced("tiny", "none")
    events = list(trace.events)
    i = _phase_mallocs(events, "layer.1.bwd")[0]
    planned = -(-events[i].size // ALIGN) * ALIGN
    events[i] = Event("malloc", events[i].id, planned - (events[i].size % ALIGN == 0), events[i].phase)
    server = PlanServer(memory_plan)
    offsets = serve_events(server, events)
    assert offsets[events[i].id] == addresses(memory_plan, trace)[events[i].id]
    assert server.finish().divergences == 0


def test_reordered_requests_diverge_at_the_first_difference(caplog):
    trace, memory_plan = traced("tiny", "none")
    phase = "layer.1.fwd"
    events = list(trace.events)
    mallocs = _phase_mallocs(events, phase)
    a, b = next((x, y) for x, y in zip(mallocs, mallocs[1:])
                if -(-events[x].size // ALIGN) != -(-events[y].size // ALIGN))
    events[a], events[b] = events[b], events[a]
    offsets, _ = _check_one_divergence(trace, memory_plan, events, phase, "asks for", caplog)
    assert offsets[events[a].id] is None


def test_an_extra_request_falls_back_and_a_missing_one_is_counted(caplog):
    trace, memory_plan = traced("tiny", "none")
    phase = "layer.2.bwd"
    events = list(trace.events)
    first = _phase_mallocs(events, phase)[0]
    extra = [Event("malloc", 10**6, 4096, phase), Event("free", 10**6, 4096, phase)]
    events[first:first] = extra
    offsets, stats = _check_one_divergence(trace, memory_plan, events, phase, "", caplog)
    assert all(offsets[e.id] is None for e in events if e.op == "malloc" and e.phase == phase)
    planned_in_phase = len(_phase_mallocs(list(trace.events), phase))
    assert stats.missing == planned_in_phase  # none of that phase's planned requests came as planned

    # The last request of a phase never made: nothing else changes, one request is missing.
    events = list(trace.events)
    gone = events[_phase_mallocs(events, phase)[-1]].id
    events = [e for e in events if e.id != gone]
    server = PlanServer(memory_plan)
    offsets = serve_events(server, events)
    stats = server.finish()
    assert (stats.divergences, stats.fallback, stats.missing) == (0, 0, 1)


def test_a_request_whose_planned_bytes_are_still_live_falls_back(caplog):
    trace, memory_plan = traced("tiny", "none")
    planned = addresses(memory_plan, trace)
    requests = {r.id: r for r in trace.requests()}
    size_of = {r.id: -(-r.size // ALIGN) * ALIGN for r in requests.values()}
    # A transient request freed late, past a later request of its phase planned on its bytes.
    events = list(trace.events)
    for r in sorted(requests.values(), key=lambda r: r.lower):
        if r.malloc_phase != r.free_phase or not r.malloc_phase.startswith("layer.") or r.size == 0:
            continue
        later = [q for q in requests.values() if q.malloc_phase == r.malloc_phase and q.lower > r.upper
                 and q.size and planned[q.id] < planned[r.id] + size_of[r.id]
                 and planned[r.id] < planned[q.id] + size_of[q.id]]
        if later:
            break
    free = next(i for i, e in enumerate(events) if e.op == "free" and e.id == r.id)
    reuse = min(later, key=lambda q: q.lower)
    moved = events.pop(free)
    events.insert(reuse.lower, moved)  # after the pop, reuse's malloc sits at reuse.lower - 1
    offsets, _ = _check_one_divergence(trace, memory_plan, events, r.malloc_phase, "overlap", caplog)
    assert offsets[reuse.id] is None


def well_formed(events: list[Event]) -> list[Event]:
    """``events`` less the frees of requests not live and the mallocs of requests already live."""
    live, kept = set(), []
    for e in events:
        if (e.op == "malloc") != (e.id in live):
            (live.add if e.op == "malloc" else live.discard)(e.id)
            kept.append(e)
    return kept


def test_random_departures_never_overlap_and_are_all_counted():
    trace, memory_plan = traced("tiny", "full_recompute")
    rng = random.Random(7)
    for trial in range(40):
        events = list(trace.events)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(events))
            e = events[i]
            kind = rng.choice(("resize", "swap", "extra", "drop", "late-free"))
            if kind == "resize" and e.op == "malloc":
                size = rng.choice((0, 1, e.size * 2, e.size + 7, max(e.size - 4096, 0)))
                events = [Event(x.op, x.id, size if x.op == "malloc" else x.size, x.phase) if x.id == e.id
                          else x for x in events]
            elif kind == "swap" and i + 1 < len(events):
                a, b = events[i], events[i + 1]
                if a.id != b.id:  # each keeps its position's phase
                    events[i] = Event(b.op, b.id, b.size, a.phase)
                    events[i + 1] = Event(a.op, a.id, a.size, b.phase)
            elif kind == "extra":
                new = 10**6 + trial * 100 + i
                events[i:i] = [Event("malloc", new, rng.randint(1, 1 << 16), e.phase)]
                j = rng.randint(i + 1, len(events))
                events.insert(j, Event("free", new, 0, events[j - 1].phase))
            elif kind == "drop" and e.op == "malloc":
                events = [x for x in events if x.id != e.id]
            elif kind == "late-free" and e.op == "free":
                events.insert(rng.randint(i, len(events)), events.pop(i))
        events = well_formed(events)
        server = PlanServer(memory_plan)
        offsets = serve_events(server, events)
        check_no_live_overlap(events, offsets)
        stats = server.finish()
        made = [e for e in events if e.op == "malloc" and e.size > 0]
        assert stats.served + stats.fallback == len(made), trial
        assert stats.served == sum(offsets[e.id] is not None for e in made)
        assert (stats.fallback > 0) == (stats.divergences > 0)


def test_a_plan_off_the_alignment_grid_is_refused():
    trace, _ = traced("tiny", "none")
    unaligned = plan_iteration(trace, time_limit_s=5, mip="none")  # byte-exact sizes and offsets
    if all(p.offset % ALIGN == 0 and p.size % ALIGN == 0 for b in unaligned.blocks.values()
           for p in b.placements):
        pytest.fail("the tiny trace should have sizes off a 512-byte grid")
    unaligned.meta["alignment"] = ALIGN
    with pytest.raises(ValueError, match="not on the plan's 512-byte grid"):
        PlanServer(unaligned)
