"""MEMO's token-wise swapping and recomputation: exact gradients, ordering, sizes, accounting."""

import sys

import pytest
import torch

from memo.config import ConfigError
from memo.data.batches import SyntheticTokens, micro_batches
from memo.swap import SwapRuntime, prepare_swapped_layers
from memo.swap.capture import Forward
from memo.swap.streams import CudaStreams, DeferredStreams, InlineStreams, OrderingError
from memo.policy import build_model, policy_of
from memo.swap.alpha import HostMemoryError
from memo.profile.layers import layer_bytes
from memo.profile.recorder import record
from memo.profile.trace import Trace

from conftest import resolve_config
from swap_training import train_gradients

# The layers' tensors are what is swapped and recomputed; a vocabulary of 1000 (padded to 1024)
# keeps the output layer, which took most of each step with GPT-2's 50304, small.
VOCAB = "model.vocab_size=1000"
SIX = ["model.num_layers=6", VOCAB]  # four swapped layers: both rounding buffers are reused


@pytest.fixture(scope="module")
def references(parallel_state):
    """``method=none``'s run with each loss, made when first asked for."""
    cache = {}

    def get(loss: str = "megatron"):
        if loss not in cache:
            cache[loss] = train_gradients("none", *SIX, f"train.loss={loss}")
        return cache[loss]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references("tiled")  # the loss memo uses by default


def _assert_same_gradients(got, expected):
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.keys() == e.keys()
        for name in e:
            torch.testing.assert_close(g[name], e[name], msg=f"step {step + 1}: {name}")


@pytest.mark.parametrize("loss", ["tiled", "megatron"])
@pytest.mark.parametrize(
    "method, alpha",
    [("memo", 0.0), ("memo", 0.125), ("memo", 0.5), ("memo", 1.0), ("full_swap", None),
     ("full_recompute", None)],
)
def test_gradients_of_two_steps_equal_keeping_everything(references, method, alpha, loss):
    reference = references(loss)
    losses, grads, runtime = train_gradients(method, *SIX, f"train.loss={loss}", alpha=alpha)
    assert losses == pytest.approx(reference[0], abs=1e-6)
    _assert_same_gradients(grads, reference[1])
    if runtime is not None:
        rows = runtime.take_accounting()
        recomputed = sum(r["recomputed"] for r in rows)
        assert (recomputed == 0) == (runtime.keep_tokens == runtime.layout.tokens)


def test_a_context_parallel_rank_keeps_the_first_alpha_of_each_of_its_two_chunks(reference):
    """Two segments of S/2 tokens (a context-parallel rank's two chunks, here in one process):
    k = α·S/2 tokens of each swapped, the tails of both recomputed, the gradients unchanged."""
    losses, grads, runtime = train_gradients("memo", *SIX, alpha=0.25, segments=2)
    _assert_same_gradients(grads, reference[1])
    layout = runtime.layout
    assert (layout.tokens, layout.segment_tokens, runtime.keep_tokens) == (256, 128, 32)
    s_in, s_attn, s_other = (layout.bytes_of(kind) for kind in ("input", "attention", "tokens"))
    assert layout.host_bytes(32) == s_in + s_attn + s_other // 4
    rows = runtime.take_accounting()
    assert sum(r["recomputed"] for r in rows) == 2 * 4 * (s_other - s_other // 4)  # 2 steps, 4 layers
    slot = next(s for s in layout.slots if s.kind == "tokens" and s.chunks == 1)
    kept, dropped = runtime.split(torch.arange(256).view(256, *[1] * (len(slot.shape) - 1)), slot, 32)
    assert kept.flatten().tolist() == [*range(0, 32), *range(128, 160)]
    assert dropped.flatten().tolist() == [*range(32, 128), *range(160, 256)]


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_copies_done_as_late_as_the_events_allow_give_the_same_gradients(reference, alpha):
    streams = DeferredStreams()
    _, grads, _ = train_gradients("memo", *SIX, alpha=alpha, streams=streams)
    assert streams.copies_run > 0
    _assert_same_gradients(grads, reference[1])


class _MissingWait(DeferredStreams):
    """Deferred copies, and one wait of the runtime's left out: the waits of ``waiter`` on an event
    of ``producer`` made by the function ``site``."""

    def __init__(self, site: str, waiter: str, producer: str):
        super().__init__()
        self.skipped = (site, waiter, producer)
        self.skips = 0

    def wait(self, stream, event) -> None:
        if event is not None and (sys._getframe(1).f_code.co_name, stream, event[0]) == self.skipped:
            self.skips += 1
            return
        super().wait(stream, event)


# every wait of the swap runtime: (where, the stream that waits, the one it waits on)
RUNTIME_WAITS = [
    ("forward_unit", "compute", "d2h"),  # a buffer overwritten before its copy to the host ended
    ("backward_started", "compute", "h2d"),  # backward reading a buffer before its prefetch ended
    ("_offload", "d2h", "compute"),  # a copy to the host before the forward finished writing the buffer
    ("_prefetch", "h2d", "compute"),  # a prefetch into a buffer the previous unit's backward still reads
]


def missing_wait_shows(train, reference_grads, site: str, waiter: str, producer: str) -> bool:
    """Whether ``train(streams)`` (the gradients of its steps), with one wait of the runtime's
    left out, gives wrong gradients or fails the stand-in streams' ordering check."""
    streams = _MissingWait(site, waiter, producer)
    try:
        grads = train(streams)
    except OrderingError:
        return True
    assert streams.skips, f"{site} never waited for {producer} on {waiter}"
    return any(not torch.allclose(grads[0][name], reference_grads[0][name], rtol=1.3e-6, atol=1e-5)
               for name in grads[0])


@pytest.mark.parametrize("site, waiter, producer", RUNTIME_WAITS)
def test_each_missing_wait_would_corrupt_the_gradients_or_fail_the_ordering_check(reference, site, waiter,
                                                                                  producer):
    def train(streams):
        return train_gradients("memo", *SIX, alpha=0.5, streams=streams, steps=1)[1]

    assert missing_wait_shows(train, reference[1], site, waiter, producer), "nothing sees this missing wait"


def test_the_ordering_check_refuses_a_copy_not_ordered_after_compute():
    streams = DeferredStreams()
    a, b = torch.zeros(4), torch.ones(4)
    with pytest.raises(OrderingError, match="d2h"):
        streams.copy(streams.d2h, a, b)  # nothing recorded on compute yet
    streams.wait(streams.d2h, streams.record(streams.compute))
    streams.copy(streams.d2h, a, b)
    streams.record(streams.compute)  # compute work after the wait
    with pytest.raises(OrderingError):
        streams.copy(streams.d2h, a, b)
    # waiting for a d2h event passes on what d2h had waited for
    done = streams.record(streams.d2h)
    with pytest.raises(OrderingError):
        streams.wait(streams.h2d, done)
        streams.copy(streams.h2d, b, a)
    streams.wait(streams.d2h, streams.record(streams.compute))
    streams.wait(streams.h2d, streams.record(streams.d2h))
    streams.copy(streams.h2d, b, a)
    streams.synchronize()
    assert a.tolist() == b.tolist() == [1.0] * 4


def test_skeletal_sizes_of_a_layer_match_a_hand_count(parallel_state):
    # tiny: h = 256, 4 heads of 64, ffn 1024; one sequence of S = 256 tokens in fp32.
    workload = resolve_config("method=memo", *SIX, "seq=256", "train.loss=megatron").workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    runtime = prepare_swapped_layers(model, workload, torch.device("cpu"), 2**40, 0.25, DeferredStreams())
    report = runtime.swap_report
    S, h, f, heads = 256, 256, 1024, 4
    assert report.skeletal_input_bytes == 4 * S * h
    assert report.skeletal_attention_bytes == 4 * S * (h + heads)  # output and log-sum-exp
    # norm1 out, q, k, v, attention residual, norm2 out: 6h; fc1 and GeLU outputs: 2f; mean and
    # rstd of both norms: 4. RoPE's cos and sin are one table of the model, saved by no layer:
    # with input and attention output, 16·S·h (f = 4h) plus statistics.
    assert report.skeletal_other_bytes == 4 * S * (6 * h + 2 * f + 4)
    assert (report.skeletal_input_bytes + report.skeletal_attention_bytes + report.skeletal_other_bytes
            == 4 * S * (16 * h + heads + 4))
    assert (report.keep_tokens, report.alpha, report.alpha_binding) == (64, 0.25, "fixed")
    swapped = 4 * S * h + 4 * S * (h + heads) + 0.25 * report.skeletal_other_bytes
    assert report.host_bytes == runtime.slab.numel() == 4 * swapped


def test_skeletal_sizes_of_a_llama_layer_match_a_hand_count(parallel_state):
    # tiny_llama: h = 256, 8 query heads over 2 key/value heads of 32, SwiGLU of ffn 768, RMSNorm;
    # one sequence of S = 256 tokens in fp32.
    workload = resolve_config("method=memo", "model=tiny_llama", "model.num_layers=6", VOCAB, "seq=256",
                              "train.loss=megatron").workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    runtime = prepare_swapped_layers(model, workload, torch.device("cpu"), 2**40, 0.25, DeferredStreams())
    report = runtime.swap_report
    S, h, f, heads, kv = 256, 256, 768, 8, 2 * 32
    assert report.skeletal_input_bytes == 4 * S * h
    assert report.skeletal_attention_bytes == 4 * S * (h + heads)  # output and log-sum-exp
    # norm1 out, q, the attention residual, norm2 out: 4h; k and v: 2·kv; FC1's [gate, up] 2f and
    # SwiGLU's output f (no silu(gate) is kept); each RMSNorm's reciprocal root mean square: 2
    assert report.skeletal_other_bytes == 4 * S * (4 * h + 2 * kv + 3 * f + 2)
    born = [s for s in runtime.layout.slots if s.born is not None]
    # made in place: both norms' output and statistic, q, k, v, FC1's and SwiGLU's outputs
    assert sorted(s.shape for s in born) == sorted(
        [(S, 1, h), (S, 1, 1)] * 2 + [(S, 1, 8, 32), (S, 1, 2, 32), (S, 1, 2, 32), (S, 1, 2 * f), (S, 1, f)])
    assert (report.keep_tokens, report.alpha) == (64, 0.25)


@pytest.mark.parametrize("loss", ["tiled", "megatron"])
def test_llama_shaped_gradients_of_every_method_equal_keeping_everything(parallel_state, loss):
    shape = ("model=tiny_llama", "model.num_layers=6", VOCAB, f"train.loss={loss}")
    _, expected, _ = train_gradients("none", *shape)
    for method, alpha in [("memo", 0.0), ("memo", 0.5), ("full_swap", None), ("full_recompute", None),
                          ("megatron_selective", None), ("megatron_full_recompute", None)]:
        _, grads, _ = train_gradients(method, *shape, alpha=alpha)
        _assert_same_gradients(grads, expected)


def test_swapping_refuses_the_math_kernel_in_one_line(parallel_state):
    # SDPA's math kernel saves its s×s probabilities for the backward: no token-wise slot holds
    # them, so the swap runtime would stop at its first layer (as it did on a GPU).
    workload = resolve_config("method=memo", *SIX, "seq=256").workload
    with pytest.raises(ConfigError, match="method=memo swaps .* math kernel.*train.attention_backend=auto"):
        build_model(workload, "cpu", "math")
    keeping = resolve_config("method=full_recompute", *SIX, "seq=256").workload
    assert build_model(keeping, "cpu", "math").attention_backend == "math"


def _one_step_accounting(layers: int, alpha: float):
    _, _, runtime = train_gradients("memo", f"model.num_layers={layers}", VOCAB, alpha=alpha, steps=1)
    return runtime, runtime.take_accounting(), runtime.rounding_buffer_bytes


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_device_bytes_do_not_grow_with_layers_and_host_bytes_follow_the_formula(parallel_state, alpha):
    results = {n: _one_step_accounting(n, alpha) for n in (4, 8)}
    (_, _, device4), (runtime8, rows8, device8) = results[4], results[8]
    assert device4 == device8 > 0
    layout = runtime8.layout
    assert runtime8.rounding_buffer_bytes == 2 * layout.buffer_bytes
    s_in, s_attn, s_other = (layout.bytes_of(kind) for kind in ("input", "attention", "tokens"))
    assert sum(r["host"] for r in rows8) == 6 * (s_in + s_attn + alpha * s_other)
    assert all(r["device"] == 0 for r in rows8 if r["layer"] < 6)
    assert sum(r["recomputed"] for r in rows8) == 6 * (1 - alpha) * s_other


def _recorded_memo_step(layers: int, seq: int, model: str = "tiny"):
    """The allocation trace of one real CPU step of ``method=memo`` (α = 0.5) and its runtime."""
    workload = resolve_config("method=memo", f"model={model}", f"model.num_layers={layers}", f"seq={seq}",
                              VOCAB).workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    runtime = prepare_swapped_layers(model, workload, torch.device("cpu"), 2**40, 0.5, InlineStreams())
    (batch,) = next(micro_batches(SyntheticTokens(workload.model.vocab_size, 0), seq, 1, 1, 0, 1,
                                  torch.device("cpu")))

    def step(marker):
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        marker.backward()
        loss.backward()

    return Trace(record(model, step).events), runtime


@pytest.mark.parametrize("model", ["tiny", "tiny_llama"])
@pytest.mark.parametrize("layers", [4, 8])
def test_the_device_holds_exactly_two_layers_of_skeletal_bytes(parallel_state, layers, model):
    trace, runtime = _recorded_memo_step(layers, 1024, model)
    requests = trace.requests()
    # No layer keeps a request of its own for its backward: the last two included, everything
    # it saves is in a rounding buffer (allocated before the step, so not a request).
    assert [layer_bytes(trace, i, requests).skeletal for i in range(layers)] == [0] * layers
    assert runtime.rounding_buffer_bytes == 2 * runtime.layout.bytes_kept
    rows = runtime.take_accounting()
    assert [r["device"] > 0 for r in rows] == [i >= layers - 2 for i in range(layers)]
    assert all(r["host"] == r["recomputed"] == 0 for r in rows if r["layer"] >= layers - 2)


def test_the_slab_is_allocated_once_before_training(parallel_state, monkeypatch):
    calls = []
    original = SwapRuntime.allocate
    monkeypatch.setattr(SwapRuntime, "allocate", lambda self, *a: calls.append(a) or original(self, *a))
    _, _, runtime = train_gradients("memo", *SIX, alpha=0.5, steps=2)
    assert len(calls) == 1  # in prepare_swapped_layers, none during the two steps
    assert runtime.slab.numel() == 4 * runtime.layout.host_bytes(runtime.keep_tokens)


def test_cuda_waits_land_on_the_named_stream_whatever_stream_is_current(monkeypatch):
    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_event(self, event):
            log.append((self.name, event))

    current = [Stream("compute")]

    class Switch:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", Switch)
    streams = CudaStreams(torch.device("cuda", 0))
    with torch.cuda.stream(streams.d2h):  # a caller inside another stream's context
        streams.wait(streams.compute, "offloaded")
    assert log == [("compute", "offloaded")]


def test_host_memory_error_names_what_to_change():
    from memo.swap.alpha import SkeletalBytes, check_host

    with pytest.raises(HostMemoryError, match="lower alpha, shorten seq"):
        check_host(SkeletalBytes(100, 100, 1000), 10, 8 * 700, 0.6)


class _RecordingStreams(DeferredStreams):
    """Deferred copies that also remember the shape and contiguity of every side-stream copy."""

    def __init__(self):
        super().__init__()
        self.side_copies = []

    def copy(self, stream, dst, src):
        if stream != self.compute:
            self.side_copies.append((dst.is_contiguous(), src.is_contiguous()))
        super().copy(stream, dst, src)


def test_copies_to_and_from_the_host_are_contiguous_blocks():
    from memo.swap.streams import copy_blocks as _copy_blocks

    streams = _RecordingStreams()
    buffer = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)  # two chunks of 8 tokens
    host = torch.zeros(2, 5, 3)
    streams.wait(streams.d2h, streams.record(streams.compute))  # the buffer is made
    _copy_blocks(streams, streams.d2h, host, buffer[:, :5])  # each chunk's first 5 tokens
    streams.synchronize()
    assert streams.side_copies == [(True, True), (True, True)]
    torch.testing.assert_close(host, buffer[:, :5])


def test_a_swapped_layer_does_not_run_fc2_again_when_recomputing(parallel_state):
    workload = resolve_config("method=memo", *SIX, "seq=256").workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    streams = _RecordingStreams()
    runtime = prepare_swapped_layers(model, workload, torch.device("cpu"), 2**40, 0.5, streams)
    calls = [0] * 6
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.linear_fc2.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        layer.mlp.linear_fc1.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 100))
    tokens = SyntheticTokens(workload.model.vocab_size, 0)
    (batch,) = next(micro_batches(tokens, 256, 1, 1, 0, 1, torch.device("cpu")))
    model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean().backward()
    # FC1 twice (forward, then the dropped tokens again), FC2 once, in every swapped layer
    assert calls == [201] * 4 + [101] * 2
    assert all(dst and src for dst, src in streams.side_copies)
    recomputed = sum(r["recomputed"] for r in runtime.take_accounting())
    assert recomputed == 4 * runtime.layout.bytes_of("tokens") // 2


class _ComputeCopies(DeferredStreams):
    """Deferred copies that add up the bytes copied on the compute stream (into the buffers)."""

    def __init__(self):
        super().__init__()
        self.compute_bytes = 0

    def copy(self, stream, dst, src):
        if stream == self.compute:
            self.compute_bytes += dst.numel() * dst.element_size()
        super().copy(stream, dst, src)


def test_saved_tensors_are_made_in_the_buffers_but_the_residual_stream_and_attentions(parallel_state):
    S, h, heads, k = 256, 256, 4, 128  # tiny in fp32, α = 0.5
    streams = _ComputeCopies()
    _, _, runtime = train_gradients("memo", *SIX, alpha=0.5, steps=1, streams=streams)
    slots = runtime.layout.slots
    copied = [s for s in slots if s.kind != "alias" and s.born is None]
    # the layer input, the residual after attention, attention's output and log-sum-exp
    assert sorted((s.kind, s.shape) for s in copied) == [
        ("attention", (S, 1, heads)), ("attention", (S, 1, heads, h // heads)), ("input", (S, 1, h)),
        ("tokens", (S, 1, h))]
    # everything else is made in place: both norms (output, mean, rstd), q, k, v, FC1 and GeLU
    assert sum(s.born is not None for s in slots) == 3 + 3 + 3 + 2
    # only those four are copied: whole in the last two layers, the residual's first k tokens in
    # the four swapped layers
    whole = 4 * S * (3 * h + heads)
    assert streams.compute_bytes == 2 * whole + 4 * (whole - 4 * (S - k) * h)


def test_a_layers_forward_makes_none_of_its_saved_tensors_outside_the_buffers(parallel_state):
    S, h, f = 1024, 256, 1024
    trace, _ = _recorded_memo_step(4, S)
    forward = [r for r in trace.requests()
               if r.malloc_phase.startswith("layer.") and r.malloc_phase.endswith(".fwd")]
    # the largest request a layer's forward makes is the fused QKV output (q, k and v are then
    # made in the buffer from it); no FC1- or GeLU-sized output is ever a request
    assert max(r.size for r in forward) == 4 * S * 3 * h
    assert not [r for r in forward if r.size == 4 * S * f]


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_saved_tensors_come_back_in_the_layout_they_were_saved_in(parallel_state, monkeypatch,
                                                                   micro_batch_size):
    # CUDA's fused attention backward kernels take their forward's layouts for granted (the CPU
    # kernel honours any strides, so only the strides themselves can show it here)
    saved, handed = {}, []
    pack, unpack = Forward.pack, SwapRuntime.saved

    def spy_pack(self, t):
        handle = pack(self, t)
        if isinstance(handle, tuple):
            saved[id(handle[0]), handle[1]] = (tuple(t.shape), t.stride())
        return handle

    def spy_unpack(self, handle):
        t = unpack(self, handle)
        if isinstance(handle, tuple):
            handed.append((saved[id(handle[0]), handle[1]], (tuple(t.shape), t.stride())))
        return t

    monkeypatch.setattr(Forward, "pack", spy_pack)
    monkeypatch.setattr(SwapRuntime, "saved", spy_unpack)
    batch = f"train.micro_batch_size={micro_batch_size}"
    workload = resolve_config("method=memo", *SIX, "seq=256", batch).workload
    torch.manual_seed(0)
    model = build_model(workload, "cpu").module
    runtime = prepare_swapped_layers(model, workload, torch.device("cpu"), 2**40, 0.5, InlineStreams())
    tokens = SyntheticTokens(workload.model.vocab_size, 0)
    batches = micro_batches(tokens, 256, micro_batch_size, 1, 0, 1, torch.device("cpu"))
    (batch,) = next(batches)
    model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean().backward()
    assert len(handed) == 6 * sum(s.kind != "alias" for s in runtime.layout.slots) + 6  # + aliases
    for (shape, stride), (got_shape, got_stride) in handed:
        assert got_shape == shape
        wide = [d for d, n in enumerate(shape) if n > 1]
        assert [got_stride[d] for d in wide] == [stride[d] for d in wide]


class _FakeCudart:
    def __init__(self, register_error: int = 0):
        self.register_error, self.calls = register_error, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):
        self.calls.append(("get_last_error",))
        return 0


def test_a_pinned_slab_is_unregistered_once_when_released(parallel_state, monkeypatch):
    _, _, runtime = train_gradients("memo", *SIX, alpha=0.5, steps=1)
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    runtime.allocate(runtime.layout, runtime.keep_tokens, pin=True)
    slab = (runtime.slab.data_ptr(), runtime.slab.numel())
    runtime.release()
    runtime.release()  # idempotent: a job's cleanup after an earlier release
    assert cudart.calls == [("register", *slab), ("unregister", slab[0])]


def test_a_refused_registration_is_out_of_host_memory_and_clears_cudas_error(parallel_state, monkeypatch):
    _, _, runtime = train_gradients("memo", *SIX, alpha=0.5, steps=1)
    cudart = _FakeCudart(register_error=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(HostMemoryError, match="ulimit -l"):
        runtime.allocate(runtime.layout, runtime.keep_tokens, pin=True)
    assert [c[0] for c in cudart.calls] == ["register", "get_last_error"]
    runtime.release()
    assert [c[0] for c in cudart.calls] == ["register", "get_last_error"]  # nothing to unregister


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_a_registration_page_locks_every_byte_of_the_slab(monkeypatch, dtype):
    """A layer-input slab is bf16: registering its element count would lock half of it."""
    from memo.swap.host_memory import host_memory, register

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slab = host_memory(3 * 1000, dtype, pin=True)
    register(slab)
    assert cudart.calls == [("register", slab.data_ptr(), 3 * 1000 * dtype.itemsize)]
    assert slab.data_ptr() % 4096 == 0


@pytest.mark.parametrize("tiles", [[], ["method.tile_tokens=64"]])
def test_a_released_placement_and_its_model_are_freed(parallel_state, tiles):
    """A sweep runs its jobs in one process: nothing of a job's layers may outlive it (the pass
    that finds the layout keeps no graph, whose hooks would hold the runtime and its layers)."""
    import gc
    import weakref

    workload = resolve_config("method=memo", "alpha=0.5", "model=tiny_llama", "seq=256", *tiles).workload
    model = build_model(workload, "cpu").module
    placement = policy_of(workload).prepare(model, workload, torch.device("cpu"), 2**40, InlineStreams())
    alive = [weakref.ref(placement), weakref.ref(model.decoder.layers[0])]
    placement.release()
    del placement, model
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]
