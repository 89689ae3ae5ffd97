"""The profiler: allocation traces of one iteration, their phases, layers and skeletal bytes."""

import dataclasses

import pytest
import torch

from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, Workload
from memo.dsa.buffers import read_buffers
from memo.profile.layers import LayerMismatchError, check_identical_layers, layer_bytes
from memo.profile.recorder import AllocationRecorder
from memo.profile.trace import Event, Trace, read_trace, write_trace

from conftest import trace_of

TINY = ModelConfig(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
SEVEN_B = ModelConfig(name="7b", num_layers=4, hidden_size=4096, ffn_hidden_size=16384,
                      num_attention_heads=32)
NONE = Method(name="none")
METHODS = [
    NONE,
    Method(name="full_recompute", layer_activations="recompute"),
    Method(name="megatron_full_recompute", recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1),
]


def test_recorder_sees_storages_not_views_and_frees_when_the_last_user_goes():
    recorder = AllocationRecorder(lambda: "p")
    with recorder:
        a = torch.empty(10)  # 40 bytes
        view = a[2:5]
        del a
        alive = list(recorder.events)
        del view
        x = torch.ones(4, requires_grad=True)
        y = x.exp()  # saved for backward: freed only when the graph goes
        loss = y.sum()
        del y
        saved = list(recorder.events)
        loss.backward()
        del loss
    recorder.stop()
    assert alive == [Event("malloc", 0, 40, "p")]
    ids = {e.id for e in saved if e.op == "free"}
    assert 0 in ids and 2 not in ids  # a freed with its view; exp's output kept by autograd
    assert any(e.op == "free" and e.id == 2 for e in recorder.events)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_fake_and_real_cpu_traces_are_the_same_requests_in_the_same_order(method):
    fake = trace_of(Workload(TINY, method, ParallelConfig(), 512, dtype="fp32"), "fake")
    real = trace_of(Workload(TINY, method, ParallelConfig(), 512, dtype="fp32"), "cpu")
    assert len(fake.events) > 500
    assert [(e.op, e.size, e.phase) for e in fake.events] == [(e.op, e.size, e.phase) for e in real.events]


def test_phases_follow_the_iteration():
    trace = trace_of(Workload(TINY, NONE, ParallelConfig(), 256, dtype="bf16"))
    layers = range(TINY.num_layers)
    assert trace.phases == [
        "embedding.fwd.lookup", "embedding.fwd", *(f"layer.{i}.fwd" for i in layers), "head.fwd", "loss.fwd", "loss.bwd",
        "head.bwd", *(f"layer.{i}.bwd" for i in reversed(layers)), "embedding.bwd", "optimizer",
    ]
    assert check_identical_layers(trace) == [1, 2]


def _expected_skeletal(model: ModelConfig, seq: int, tp: int, sp: bool, element: int) -> int:
    """Bytes a GPT layer of our local spec keeps for backward, per rank (b = 1).

    The spec's table: 16·s·h elements. RoPE rotates q and k with one table of the model, saved
    by no layer, and v has storage of its own, so the fused QKV output is not kept. Small
    statistics: LayerNorm mean and rstd (2 norms × 2 per token) and attention's log-sum-exp (fp32,
    per head and token). Without sequence parallelism the norms and the residual (input, two norm
    outputs, attention residual: 4·s·h) are replicated over tensor parallelism.
    """
    s, h, heads = seq, model.hidden_size, model.num_attention_heads
    main = 16 * s * h // tp if sp else 4 * s * h + 12 * s * h // tp
    norm_tokens = s // tp if sp else s
    small = 4 * norm_tokens * element + (heads // tp) * s * 4
    return main * element + small


@pytest.mark.parametrize("model,seq,tp,sp", [
    (TINY, 1024, 1, False),
    (SEVEN_B, 4096, 1, False),
    (SEVEN_B, 1 << 20, 1, False),
    (SEVEN_B, 1 << 20, 8, False),
    (SEVEN_B, 1 << 20, 8, True),
], ids=["tiny", "7b-4k", "7b-1m", "7b-1m-tp8", "7b-1m-tp8-sp"])
def test_skeletal_bytes_are_the_specs_sixteen_bsh(model, seq, tp, sp):
    layout = ParallelConfig(tp=tp, sequence_parallel=sp)
    trace = trace_of(Workload(model, NONE, layout, seq, dtype="bf16"))
    got = layer_bytes(trace, 1)
    assert got.skeletal == _expected_skeletal(model, seq, tp, sp, element=2)
    # input, two norm outputs and their mean and rstd, q, k, v, attention's output and
    # log-sum-exp, the attention residual, FC1's and GeLU's outputs: 15 storages
    assert got.skeletal_requests == 15
    assert 0 < got.transient_forward_peak <= got.transient_forward


def test_a_layer_that_allocates_differently_is_named():
    trace = trace_of(Workload(TINY, NONE, ParallelConfig(), 256, dtype="fp32"))
    events = list(trace.events)
    at = next(i for i, e in enumerate(events) if e.phase == "layer.2.bwd")
    events[at:at] = [Event("malloc", 10**6, 512, "layer.2.bwd"), Event("free", 10**6, 512, "layer.2.bwd")]
    with pytest.raises(LayerMismatchError, match=r"layer\.2\.bwd differs from layer\.1\.bwd at event 0"):
        check_identical_layers(Trace(events, trace.meta))


def test_traces_round_trip_are_dsa_instances_and_are_never_overwritten(tmp_path):
    trace = trace_of(Workload(TINY, NONE, ParallelConfig(), 256, dtype="fp32"))
    path = tmp_path / "trace.csv"
    write_trace(path, trace)
    back = read_trace(path)
    assert back.events == trace.events
    assert back.meta["model"] == dataclasses.asdict(TINY) and back.meta["backend"] == "fake"
    assert read_buffers(path) == trace.buffers()  # MiniMalloc's columns come first
    with pytest.raises(FileExistsError, match="exists and is kept"):
        write_trace(path, trace)


def test_a_corrupt_trace_is_refused_with_its_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,lower,upper,size,malloc_phase,free_phase\n0,0,3,64,a,a\n1,1,x,64,a,a\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: not a request"):
        read_trace(path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="cpu", parallel=ParallelConfig(tp=2)), "traces one process"),
    (dict(method=Method(name="memo", layer_activations="swap")), "rounding buffers"),
    (dict(backend="gpu"), "profile.backend=gpu"),
])
def test_what_cannot_be_traced_is_refused_in_one_line(kwargs, message):
    backend = kwargs.pop("backend", "fake")
    workload = Workload(**(dict(model=TINY, method=NONE, parallel=ParallelConfig(), seq=256) | kwargs))
    with pytest.raises(ConfigError, match=message) as error:
        trace_of(workload, backend)
    assert "\n" not in str(error.value)
