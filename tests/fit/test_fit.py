"""``mode=fit``: each memory term against hand-computed formulas, the scaled trace against a direct
one, predictions for ``model=tiny`` against what a CPU run allocates, the searches, the rows."""

import dataclasses
import json
import logging
import math
import subprocess

import pandas as pd
import pytest
from conftest import PYTHON, REPO, resolve_config, run_in_process

from analysis import tables
from analysis.rows import load_results
from memo.config import FitConfig, Method, ModelConfig, ParallelConfig, Workload
from memo.fit import memory
from analysis.calibration import compare
from memo.fit.calibration import problem_of_row
from memo.fit.predict import Problem, predict
from memo.fit.search import layouts, longest
from memo.fit.timing import predict_time
from memo.policy import policy_of
from memo.policy.whole_layers import host_plan
from memo.profile.template import iteration_template
from memo.hardware import HARDWARE, GiB
from memo.model.gpt import layer_matmul_weights, model_flops_parameters, padded_vocab_size, parameter_count
from memo.swap.alpha import HostMemoryError, SkeletalBytes
from memo.dsa.buffers import max_load
from memo.profile.iteration import trace_iteration
from memo.profile.trace import Trace

SEVEN_B = ModelConfig(
    name="7b", num_layers=32, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32
)
TINY = ModelConfig(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
NONE = Method(name="none")
MEMO = Method(name="memo", layer_activations="swap")
FULL_RECOMPUTE = Method(name="full_recompute", layer_activations="recompute")
MEGATRON_FULL = Method(
    name="megatron_full_recompute",
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
)
A800 = HARDWARE["a800"]
S = 1 << 20  # 1M tokens
LAYOUT = ParallelConfig(tp=4, cp=2, sequence_parallel=True)  # the paper's 7B layout


def work(model=SEVEN_B, method=NONE, parallel=ParallelConfig(), seq=S, dtype="bf16", **kwargs) -> Workload:
    return Workload(model, method, parallel, seq, dtype=dtype, **kwargs)


def problem(method=NONE, model=SEVEN_B, hw=A800, alpha=None, **kwargs) -> Problem:
    """The problem of ``method`` (swapping ``alpha`` of the tokens where given) on ``model``."""
    if alpha is not None:
        method = dataclasses.replace(method, alpha=alpha)
    return Problem(work(model, method), hardware=hw, fit=FitConfig(), **kwargs)


def template_of(workload: Workload, layers: int):
    """The iteration template of ``workload`` as a prediction traces it (its policy's ``traced``)."""
    return iteration_template(workload, layers, policy_of(workload).traced)


def without_gradients(trace: Trace) -> Trace:
    """``trace`` without its gradients; the other requests alive at its end persist and stay."""
    gradients = set(trace.meta["gradient_requests"])
    return Trace([e for e in trace.events if e.id not in gradients], trace.meta)


# ---------------------------------------------------------------- the scaled, synthesized trace


@pytest.mark.parametrize("method", [NONE, MEGATRON_FULL, FULL_RECOMPUTE], ids=lambda m: m.name)
def test_a_template_instance_has_the_peak_of_the_real_iteration(method):
    """Five traced layers at 2k and 4k tokens stand for seven layers at 6k: the same bytes in use at
    every instant's maximum as a direct trace of the seven-layer model at 6k tokens."""
    model = dataclasses.replace(
        TINY, num_layers=7, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8
    )
    layout = ParallelConfig(tp=2, sequence_parallel=True)
    template = template_of(work(model, method, layout), 7)
    assert template.layers == 5
    direct = work(model, method, layout, 6144)
    real = without_gradients(trace_iteration(direct, policy_of(direct)))
    instance = template.instance(6144, 7)
    assert max_load(instance.buffers()) == max_load(real.buffers())
    assert memory.split_peak(instance) == memory.split_peak(real)


@pytest.mark.parametrize("tile", [512, None], ids=["tile512", "auto"])
@pytest.mark.parametrize("tp, sp", [(2, True), (1, False)], ids=["tp2-sp", "tp1"])
def test_a_tiled_loss_template_stands_for_many_tiles(tp, sp, tile):
    """Traced with one tile per pass, the template stands for 6 (tp2+sp) or 12 tiles of 512 tokens
    a rank, or the default tiles of the loss (64 tokens) and of the embedding's backward pass
    (512 tokens, all ranks together): every request but one is sized as a direct trace sizes it.
    The loss's fp32 gradient per token is made and freed in loss.bwd like a tile's requests and
    is sized at one tile, 4 bytes a token short."""
    model = dataclasses.replace(
        TINY, num_layers=9, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8
    )
    layout = ParallelConfig(tp=tp, sequence_parallel=sp)
    template = template_of(work(model, NONE, layout, loss="tiled"), 9)
    direct = work(model, NONE, layout, 6144, loss="tiled", loss_tile_tokens=tile)
    real = without_gradients(trace_iteration(direct, policy_of(direct)))
    instance = template.instance(6144, 9, loss_tile_tokens=tile)
    short = 4 * (6144 - template.loss_tile(6144, tile))
    chunks = tp if sp else 1
    assert template.loss_tile(6144, tile) == (tile or 64) * chunks
    # by default a power of two at most an eighth of a rank's tokens: 256 of 3072, 512 of 6144
    assert template.embedding_tile(6144, tile) == (tile * chunks if tile else 512)
    assert max_load(real.buffers()) - max_load(instance.buffers()) == short
    (peak, phase, kinds), (real_peak, real_phase, real_kinds) = (
        memory.split_peak(instance), memory.split_peak(real))
    assert (peak, phase) == (real_peak - short, real_phase) and phase == "loss.bwd"
    assert kinds == {**real_kinds, "transient": real_kinds["transient"] - short}


# ---------------------------------------------------------------- hand formulas, 7b at 1M tokens


def per_layer_kept_bytes(s: int, tp: int, cp: int) -> int:
    """One 7B layer's skeletal bytes per device at s tokens, by hand: the spec's 16·b·s·h
    elements divided by tp·cp, in bf16; plus LayerNorm mean and rstd (2 norms × 2 per token of
    this rank, in bf16 as the CPU kernels keep them) and attention's fp32 log-sum-exp per head of
    this rank and token."""
    h, heads = 4096, 32
    t = s // cp
    return 16 * t * h // tp * 2 + 4 * (t // tp) * 2 + heads // tp * t * 4


def test_model_states_are_megatrons_mixed_precision_bytes():
    h, f, tp = 4096, 16384, 4
    params = 32 * ((4 * h * h + 2 * h * f + 3 * h + f) // tp + 6 * h) + 50304 * h // tp + 2 * h
    states = memory.model_states(work(parallel=LAYOUT), distributed_optimizer=False)
    assert (states.params, states.weights, states.gradients, states.optimizer) == (
        params,
        2 * params,
        4 * params,
        12 * params,
    )
    # The distributed optimizer shards main weights and moments over dp·cp = 2 ranks.
    sharded = memory.model_states(work(parallel=LAYOUT), distributed_optimizer=True)
    assert sharded.optimizer == 6 * params and sharded.weights == 2 * params
    # unset, it is on wherever there are dp·cp ranks to shard over
    assert memory.model_states(work(parallel=LAYOUT), distributed_optimizer=None) == sharded
    alone = dataclasses.replace(LAYOUT, dp=1, cp=1)
    assert memory.model_states(work(parallel=alone), None) == memory.model_states(work(parallel=alone), False)
    # All devices together hold the model once per dp·cp replica.
    whole = parameter_count(SEVEN_B)
    assert whole == 32 * (4 * h * h + 2 * h * f + 9 * h + f) + padded_vocab_size(SEVEN_B, 1) * h + 2 * h


def test_llama_and_qwen_parameter_counts_are_their_published_ones():
    # Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B and Qwen2.5-32B as their model cards count them
    # (8.03B, 70.6B, 7.61B, 32.5B), to the parameter: every tensor of their checkpoints
    counts = {name: parameter_count(resolve_config(f"model={name}").workload.model)
              for name in ("llama3_8b", "llama3_70b", "qwen2.5_7b", "qwen2.5_32b")}
    assert counts == {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496,
                      "qwen2.5_7b": 7_615_616_512, "qwen2.5_32b": 32_763_876_352}
    h, f, q, kv, vocab = 4096, 14336, 4096, 2 * 8 * 128, 128256  # llama3_8b, by hand
    assert counts["llama3_8b"] == 32 * (h * (q + kv) + q * h + 3 * h * f + 2 * h) + 2 * vocab * h + h
    llama = resolve_config("model=llama3_8b").workload.model
    assert layer_matmul_weights(llama) == h * (q + kv) + q * h + 3 * h * f  # 218,103,808
    # MFU's P leaves out the untied input embedding (a lookup); a tied one is the output layer
    assert model_flops_parameters(llama) == counts["llama3_8b"] - vocab * h
    assert model_flops_parameters(SEVEN_B) == parameter_count(SEVEN_B)


def test_skeletal_activations_of_every_layer_at_one_million_tokens():
    prediction = predict(problem(NONE), LAYOUT, S)
    kept = per_layer_kept_bytes(S, 4, 2)
    assert kept == pytest.approx(16 * S * 4096 / (4 * 2) * 2, rel=0.03)  # statistics are small
    # At the peak (the loss) every one of the 32 layers still keeps its tensors.
    assert prediction.acts.skeletal == 32 * kept
    assert prediction.status == "oom"  # 32 × 16.4 GiB on an 80 GiB device


def test_recomputation_keeps_each_layers_input_only():
    for method in (FULL_RECOMPUTE, MEGATRON_FULL):
        prediction = predict(problem(method), LAYOUT, S)
        layer_input = (S // 2) * 4096 // 4 * 2  # b·s·h/(tp·cp) elements, bf16
        assert prediction.acts.skeletal == 32 * layer_input, method.name


def test_memo_buffers_host_bytes_and_alpha_at_one_million_tokens():
    prediction = predict(problem(MEMO, alpha=0.25), LAYOUT, S)
    t, h, tp = S // 2, 4096, 4
    runtime_kept = per_layer_kept_bytes(S, 4, 2)
    layer_input = t * h // tp * 2
    attention = t * h // tp * 2 + 32 // tp * t * 4  # output and fp32 log-sum-exp
    other = runtime_kept - layer_input - attention
    assert prediction.rounding_buffers == 2 * runtime_kept
    # The buffers hold every skeletal tensor on the device, the last two layers' whole: the
    # allocator holds none. The other 30 layers swap input, attention and α·other.
    assert prediction.acts.skeletal == 0
    assert prediction.row()["predicted_skeletal_device_bytes"] == 2 * runtime_kept
    assert prediction.host_per_device == 30 * math.ceil(layer_input + attention + 0.25 * other)
    assert prediction.host_per_node == 8 * prediction.host_per_device
    assert prediction.alpha == 0.25 and prediction.alpha_binding == "fixed"
    # Half the tokens would need more than the node's 2 TiB × 0.9: out of host memory.
    oohm = predict(problem(MEMO, alpha=0.5), LAYOUT, S)
    assert oohm.status == "oohm" and oohm.host_per_node == 8 * 30 * math.ceil(
        layer_input + attention + other / 2
    )
    assert oohm.host_per_node > oohm.host_capacity_per_node == int(2048 * GiB * 0.9)
    # all S tokens' keys and values and their gradients, bf16, and the query's gradient (t tokens)
    assert prediction.cp_buffers == 4 * S * h // tp * 2 + (S // 2) * h // tp * (2 + 4)


def test_the_first_layers_input_made_by_the_embeddings_lookup_is_its_skeletal_input():
    from memo.policy.whole_layers import swapped_sizes

    one_layer = work(dataclasses.replace(TINY, num_layers=1), MEMO, seq=2048, dtype="fp32")
    sizes = swapped_sizes(template_of(one_layer, 1), one_layer)
    assert sizes.input == 2048 * TINY.hidden_size * 4  # [s, b, h] fp32, made in embedding.fwd.lookup


def test_memo_alpha_is_solved_against_bandwidth_and_host_memory():
    sizes = SkeletalBytes(input=100, attention=100, other=1000)
    # The copy of one layer (200 + α·1000 bytes at 1000 B/s) must hide behind 0.7 s: α = 0.5.
    plan = host_plan(sizes, 12, None, 0.7, 1000.0, budget=1e9)
    assert plan.solution.alpha == pytest.approx(0.5) and plan.solution.binding == "bandwidth"
    assert plan.per_device == 10 * 700
    # Ten swapped layers in 4000 bytes: 400 per layer, α = 0.2.
    plan = host_plan(sizes, 12, None, 0.7, 1000.0, budget=4000)
    assert plan.solution.alpha == pytest.approx(0.2) and plan.solution.binding == "host"
    with pytest.raises(HostMemoryError, match="out of host memory"):
        host_plan(sizes, 12, None, 0.7, 1000.0, budget=1000)
    # A given α keeps both bounds, as the training run's report does (one choose_alpha for both).
    plan = host_plan(sizes, 12, 0.1, 0.7, 1000.0, budget=4000)
    assert (plan.solution.alpha, plan.solution.binding) == (0.1, "fixed")
    bounds = (plan.solution.alpha_bandwidth, plan.solution.alpha_host)
    assert bounds == (pytest.approx(0.5), pytest.approx(0.2))
    assert plan.per_device == 10 * 300
    with pytest.raises(HostMemoryError, match="alpha=0.3 swaps"):
        host_plan(sizes, 12, 0.3, 0.7, 1000.0, budget=4000)


def test_a_planned_prediction_places_every_request_of_the_scaled_iteration():
    """plan=true plans the synthesized 32-layer iteration (its extra layers' requests apart from the
    traced layers, which still allocate alike): no less than the most bytes in use at once, no
    more than the caching allocator holds."""
    planned = predict(problem(MEGATRON_FULL, plan=True), LAYOUT, 256 * 1024)
    cached = predict(problem(MEGATRON_FULL), LAYOUT, 256 * 1024)
    assert planned.status == cached.status == "ok"
    assert planned.acts.allocated_peak == cached.acts.allocated_peak
    assert planned.acts.allocated_peak <= planned.acts.held <= cached.acts.held


def test_an_oom_breakdown_is_taken_at_one_instant_and_adds_up_to_what_is_needed():
    p = predict(problem(NONE), LAYOUT, S)
    a = p.acts
    terms = (a.skeletal, a.transient, a.head, a.persistent, a.other)
    assert min(terms) >= 0 and sum(terms) == a.allocated_peak and a.overhead >= 0
    workspaces = 64 * 2**20  # fit.device_workspace_mib's default: cuBLAS's workspaces among them
    fixed = p.reserved + workspaces + p.states.total + p.rounding_buffers + p.cp_buffers
    assert p.device_total == fixed + a.allocated_peak + a.overhead > p.device_capacity - p.margin
    assert p.margin == math.ceil(0.03 * p.device_capacity)  # fit.memory_margin's default
    assert p.status == "oom" and p.reason.startswith(
        f"needs {p.device_total / GiB:.2f} GiB of 80.00 GiB less a margin of {p.margin / GiB:.2f} GiB")
    assert f"at their peak in {a.peak_phase}" in p.reason and a.peak_phase.startswith(("loss", "head"))


def test_persistent_buffers_are_counted_not_taken_for_gradients():
    # Megatron's sequence-parallel all-gather buffer ([s/cp, b, h] bf16), RoPE's angles
    # (fp32, t × 128) and memo's cos/sin table (bf16, 2 × t × 128)
    t = S // 2
    a = predict(problem(NONE), LAYOUT, S).acts
    assert a.persistent == t * 4096 * 2 + t * 128 * 4 + 2 * t * 128 * 2


def test_memo_with_the_memory_plan_is_predicted():
    planned = predict(problem(MEMO, plan=True, alpha=0.25), LAYOUT, 256 * 1024)
    cached = predict(problem(MEMO, alpha=0.25), LAYOUT, 256 * 1024)
    assert planned.status == cached.status == "ok"
    assert cached.acts.allocated_peak == planned.acts.allocated_peak <= planned.acts.held


def test_verdicts_ok_oom_and_oohm():
    small_host = dataclasses.replace(A800, host_memory_bytes=64 * GiB)
    assert predict(problem(MEMO), LAYOUT, 128 * 1024).status == "ok"
    assert predict(problem(NONE), LAYOUT, S).status == "oom"
    oohm = predict(problem(MEMO, hw=small_host), LAYOUT, S)
    assert oohm.status == "oohm" and "out of host memory" in oohm.reason


def test_predicted_time_is_the_flop_count_over_the_assumed_rates():
    fit = FitConfig()
    h, f, n, s, peak = 4096, 16384, 32, 64 * 1024, A800.peak_flops
    t = predict_time(work(seq=s), 1, A800, fit, local_params=0)
    gemm = 2 * s * (4 * h * h + 2 * h * f) / (peak * fit.gemm_efficiency)
    attention_flops = 2 * s * s * h
    forward = gemm + attention_flops / (peak * fit.attention_forward_efficiency)
    backward = 2 * gemm + 2.5 * attention_flops / (peak * fit.attention_backward_efficiency)
    head = 3 * 2 * s * h * 50304 / (peak * fit.gemm_efficiency)
    assert t.layer_forward_s == pytest.approx(forward)
    assert t.iteration_s == pytest.approx(n * (forward + backward) + head)
    params = n * (4 * h * h + 2 * h * f + 9 * h + f) + 50304 * h + 2 * h
    flops = 6 * s * params + 6 * n * h * s * s  # the paper's model FLOPs
    assert t.mfu == pytest.approx(flops / (t.iteration_s * peak))
    # Full recomputation runs every layer's forward once more; the model FLOPs stay the same.
    again = predict_time(work(method=FULL_RECOMPUTE, seq=s), 1, A800, fit)
    assert again.iteration_s == pytest.approx(t.iteration_s + n * forward)
    assert again.mfu < t.mfu
    # Within packed documents of 8K tokens (fit.document_tokens) attention computes s·8K of s², and
    # MFU counts what it computes (as a run's mfu_documents)
    d = 8 * 1024
    documents = predict_time(work(seq=s, document_mask=True, document_tokens=d), 1, A800, fit, local_params=0)
    attention_d = 2 * s * d * h
    forward_d = gemm + attention_d / (peak * fit.attention_forward_efficiency)
    backward_d = 2 * gemm + 2.5 * attention_d / (peak * fit.attention_backward_efficiency)
    assert documents.iteration_s == pytest.approx(n * (forward_d + backward_d) + head)
    assert documents.mfu == pytest.approx((6 * s * params + 6 * n * h * s * d) / (documents.iteration_s * peak))


def test_context_parallel_time_is_the_exchange_of_keys_and_values():
    """cp = 2 within one A800 node: the other rank's key and value block (b·t·h/tp elements each,
    bf16) over NVLink at 80% of 400 GB/s, once in the forward, twice in the backward."""
    s, h, tp = 64 * 1024, 4096, 4
    t = predict_time(work(seq=s, parallel=LAYOUT), 1, A800, FitConfig())
    block = 2 * (s // 2) * h // tp * 2
    assert t.layer_cp_comm_exposed_s == pytest.approx(3 * block / (400e9 * 0.8))
    without = predict_time(work(seq=s, parallel=ParallelConfig(tp=4)), 1, A800, FitConfig())
    assert without.layer_cp_comm_exposed_s == 0
    # Ulysses: all-to-alls of the rank's b·t·h/tp elements, half of them leaving it: four in the
    # forward, eight in the backward
    ulysses = dataclasses.replace(LAYOUT, cp_comm_type="a2a")
    t = predict_time(work(seq=s, parallel=ulysses), 1, A800, FitConfig())
    assert t.layer_cp_comm_exposed_s == pytest.approx(12 * (1 / 2) * (block / 2) / (400e9 * 0.8))
    assert predict(problem(NONE), ulysses, s).cp_buffers == 15 * (s // 2) * h // tp * 2 // 2
    # the ring: the same block, hidden behind attention's compute (64k tokens on an A800: wholly)
    ring = dataclasses.replace(LAYOUT, cp_comm_type="p2p")
    t = predict_time(work(seq=s, parallel=ring), 1, A800, FitConfig())
    assert t.layer_cp_comm_exposed_s == 0
    assert predict(problem(NONE), ring, s).cp_buffers == (s // 2) * h // tp * (5 * 2 + 28)
    slow = dataclasses.replace(A800, intra_node_bytes_per_s=1e9)  # a link so slow that nothing hides it
    exposed = predict_time(work(seq=s, parallel=ring), 1, slow, FitConfig())
    naked = predict_time(work(seq=s, parallel=LAYOUT), 1, slow, FitConfig())
    assert exposed.layer_cp_comm_exposed_s > 0
    assert exposed.layer_forward_s < naked.layer_forward_s  # attention hides part of the transfer
    # grouped keys and values (8 groups of 32 heads) are a quarter as wide: so is their exchange;
    # Ulysses moves q and the output whole, k and v a quarter
    grouped = dataclasses.replace(SEVEN_B, num_query_groups=8)
    t = predict_time(work(grouped, seq=s, parallel=LAYOUT), 1, A800, FitConfig())
    assert t.layer_cp_comm_exposed_s == pytest.approx(3 * block / 4 / (400e9 * 0.8))
    t = predict_time(work(grouped, seq=s, parallel=ulysses), 1, A800, FitConfig())
    assert t.layer_cp_comm_exposed_s == pytest.approx(3 * (1 / 2) * (2 + 2 / 4) * (block / 2) / (400e9 * 0.8))


# ---------------------------------------------------------------- tiny: predicted against a CPU run


# the CPU as the tiny models' predictions take it: a fixed peak, 16 GiB of each memory
_CPU_BOX = dataclasses.replace(HARDWARE["cpu"], peak_flops=1e11, device_memory_bytes=16 * GiB,
                               host_memory_bytes=16 * GiB, host_link_bytes_per_s=1e10)


def test_tiny_activation_peak_matches_a_real_cpu_iteration():
    """The prediction (five traced layers scaled to eight layers at 4k tokens) against one real
    iteration of the eight-layer model on the CPU, every tensor allocated: within 10%."""
    model = dataclasses.replace(TINY, num_layers=8)
    cpu = _CPU_BOX
    tiny = work(model, NONE, seq=4096, dtype="fp32")
    fit = FitConfig(device_reserved_gib=0)
    prediction = predict(Problem(tiny, hardware=cpu, fit=fit), ParallelConfig(), 4096)
    real = without_gradients(trace_iteration(tiny, policy_of(tiny), "cpu"))
    measured = max_load(real.buffers())
    assert prediction.acts.allocated_peak == pytest.approx(measured, rel=0.10)
    assert prediction.states.weights == 4 * prediction.states.params  # fp32, no main copy
    assert prediction.states.optimizer == 8 * prediction.states.params


@pytest.mark.parametrize("name", ["tiny", "tiny_llama"])
def test_tiny_memo_prediction_matches_a_cpu_training_run(tmp_path, name):
    """MEMO's buffers, host slab and resident layers as ``python run.py method=memo alpha=0.5``
    allocates them on the CPU, against the prediction: within 10%. (The layers' tensors are
    compared: a vocabulary of 1000 keeps the output layer, which they do not depend on, small.)"""
    out = tmp_path / "train"
    row = run_in_process(out, "method=memo", "alpha=0.5", "seq=2k", "train.steps=2", "train.warmup_steps=1",
                         f"model={name}", "model.vocab_size=1000")
    assert row["status"] == "ok", row["error"]
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    cpu = _CPU_BOX
    model = resolve_config(f"model={name}", "model.vocab_size=1000").workload.model
    tiny = Problem(work(model, dataclasses.replace(MEMO, alpha=0.5), dtype="fp32"), hardware=cpu, fit=FitConfig())
    prediction = predict(tiny, ParallelConfig(), 2048)
    assert prediction.rounding_buffers == pytest.approx(row["swap.rounding_buffer_bytes"], rel=0.10)
    assert prediction.host_per_device == pytest.approx(row["swap.host_bytes"], rel=0.10)
    predicted_device = prediction.rounding_buffers + prediction.acts.skeletal
    assert predicted_device == pytest.approx(step["skeletal_device_bytes"], rel=0.10)


# ---------------------------------------------------------------- searches


def test_layouts_of_eight_devices_keep_tensor_parallelism_in_a_node():
    found = layouts(SEVEN_B, 16, 8)
    assert all(p.tp * p.cp * p.pp * p.dp == 16 and p.tp <= 8 and 32 % p.pp == 0 for p in found)
    assert not any(p.tp == 16 for p in found)
    # By hand: tp ∈ {1, 2, 4, 8}; for each, ordered (cp, pp, dp) with product 16/tp: 15 + 10 + 6 + 3,
    # of which 10 + 6 + 3 + 1 have cp > 1 and are tried with each of the three exchanges
    assert len(found) == 15 + 10 + 6 + 3 + 2 * (10 + 6 + 3 + 1)
    assert all(p.sequence_parallel == (p.tp > 1) for p in found)
    assert {p.cp_comm_type for p in found if p.cp > 1} == {"all_gather", "p2p", "a2a"}
    # Ulysses splits the heads over tp·cp: with 12 heads, only layouts whose tp·cp divides 12
    ulysses = layouts(dataclasses.replace(SEVEN_B, num_attention_heads=12, hidden_size=4608), 16, 8,
                      cp_comm_types=("a2a",))
    assert ulysses and all(12 % (p.tp * p.cp) == 0 and p.cp_comm_type == "a2a" for p in ulysses)
    assert {(p.tp, p.cp) for p in ulysses} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    # and its key/value groups too: Llama-3-8B's 8 leave tp·cp ≤ 8; tp also divides them
    llama = dataclasses.replace(SEVEN_B, num_query_groups=8, ffn_hidden_size=14336)
    grouped = layouts(llama, 64, 8, cp_comm_types=("a2a",))
    assert grouped and max(p.tp * p.cp for p in grouped) == 8
    assert not [p for p in layouts(dataclasses.replace(llama, num_query_groups=2), 16, 8) if p.tp > 2]


def test_binary_search_finds_the_longest_length_that_fits():
    calls = []

    @dataclasses.dataclass
    class Fake:
        seq: int

        @property
        def fits(self):
            return self.seq <= 700

    def fake(seq):
        calls.append(seq)
        return Fake(seq)

    best, stop = longest(fake, 64, 64 * 100)
    assert best.seq == 640 and stop.seq == 704 and len(calls) <= 8
    none, first = longest(lambda seq: Fake(seq + 10_000), 64, 640)
    assert none is None and first.seq == 64 + 10_000


def test_seq_max_agrees_with_predictions_around_it():
    p = problem(MEMO)
    best, stop = longest(lambda seq: predict(p, LAYOUT, seq), 64 * 1024, 2048 * 1024)
    assert best.fits and predict(p, LAYOUT, best.seq + 64 * 1024).status != "ok"


# ---------------------------------------------------------------- as a user runs it

# The jobs below run in this process, as run.py runs them (conftest.run_in_process picks
# memo.modes.fit.fit_job for mode=fit); what run.py adds (the one-line errors) is tested by
# test_mistakes_get_one_line, through run.py. In one process the templates of the searches are
# traced once (memo.fit.template caches them per process, as a sweep's jobs share them).


def run(*args, cwd):
    return subprocess.run(
        [PYTHON, str(REPO / "run.py"), *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def fit(out, *overrides) -> dict:
    """The row (``out/result.json``) of ``python run.py OVERRIDES`` (mode=fit) run in this process
    into ``out``."""
    row = run_in_process(out, *overrides)
    assert row["status"] in ("ok", "oom", "oohm"), row["error"]
    return json.loads((out / "result.json").read_text())


def test_fit_mode_prints_every_term_and_writes_a_training_row(tmp_path, caplog):
    out = tmp_path / "fit"
    with caplog.at_level(logging.INFO, logger="memo"):
        row = fit(out, "mode=fit", "model=7b", "seq=1024k", "method=memo", "hardware=a800", "cluster.gpus=8",
                  "parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true",
                  "train.distributed_optimizer=true")
    log = caplog.text  # what run.py writes to run.log
    for term in (
        "weights",
        "gradients",
        "optimizer states",
        "skeletal activations",
        "rounding buffers",
        "transient activations",
        "embedding/logits/loss",
        "swapped activations",
        "alpha",
        "bound by",
        "time per iteration",
        "NCCL buffers",
    ):
        assert term in log, term
    assert row["mode"] == "fit" and row["seq"] == S and row["world_size"] == 8
    # NCCL's buffers, counted by hand: the tp, cp, dp×cp, the distributed optimizer's norm (all 8) and the
    # world's communicators, 32 channels of two connections, each 4 MiB (Simple) + 8·512·8·16 B (LL)
    # + 120·640·8·8 B (LL128)
    nccl = 5 * 32 * 2 * (4 * 2**20 + 524_288 + 4_915_200)
    assert row["predicted_nccl_bytes"] == nccl == 3_082_813_440
    assert row["predicted_reserved_bytes"] == 2 * GiB + nccl
    assert row["predicted_nccl_assumption"].startswith("NCCL: 5 communicator(s) (tp 4, cp 2, dp×cp 2, norm 8, world 8)")
    assert row["status"] in ("ok", "oom", "oohm")
    assert row["predicted_rounding_buffer_bytes"] == 2 * per_layer_kept_bytes(S, 4, 2)
    assert row["predicted_mfu"] > 0 and row["mfu"] is None  # nothing was measured
    assert (out / "layouts.csv").read_text().count("\n") == 2


def test_layout_and_length_search_rows_feed_the_longest_sequence_table(tmp_path):
    # the jobs of ``run.py -m ... method=memo,full_recompute hydra.sweep.dir=SWEEP``
    sweep = tmp_path / "sweep"
    for job, method in enumerate(("memo", "full_recompute")):
        fit(sweep / str(job), "mode=fit", "model=tiny", "seq=max", "parallel=search", "cluster.gpus=2",
            "hardware=a800", "hardware.device_memory_gib=8", "fit.device_reserved_gib=0", "fit.seq_step=16k",
            "fit.seq_limit=1024k", f"method={method}", "fit.tile_tokens=[whole]")
    results = load_results(sweep)
    assert set(results["status"]) == {"ok"} and (results["seq"] % (16 * 1024) == 0).all()
    for job in ("0", "1"):
        tried = pd.read_csv(sweep / job / "layouts.csv")
        assert len(tried) == len(layouts(TINY, 2, 8)) == 6  # tp1 cp2 (each exchange), pp2, dp2; tp2 (+sp)
        row = results[results["output_dir"].str.endswith(f"/{job}")].iloc[0]
        # The row is the layout that fits the longest sequence, listed first.
        assert row["seq"] == tried.loc[tried["status"] == "ok", "seq"].max() == tried["seq"].iloc[0]
        assert tried["layout"].iloc[0].startswith(f"tp{row['parallel.tp']} cp{row['parallel.cp']}")
        # training runs every layout, context and pipeline parallelism included
        assert "unrunnable" not in set(tried["status"]) and (tried["pp"] > 1).sum() == 1
    assert results["fit.runners_up"].str.count(";").min() == 2  # three runners-up of six
    table = tables.longest_sequence(results)
    assert sorted(table.index.get_level_values("variant")) == [
        "full_recompute (predicted)",
        "memo (predicted)",
    ]
    assert sorted(table["seq"]) == sorted(results["seq"])
    assert table["layout"].str.startswith("tp").all()


@pytest.mark.parametrize(
    "args,message",
    [
        (["seq=max"], "seq=max is searched by mode=fit only"),
        (["mode=fit", "parallel=search"], "parallel=search needs the number of devices"),
        (["mode=fit", "cluster.gpus=8"], "cluster.gpus=8 but parallel.tp·cp·pp·dp = 1"),
        (["plan=true", "train.warmup_steps=0"], "plan=true records and plans the last warm-up step"),
        (["mode=fit", "fit.gemm_efficiency=0"], "fit.gemm_efficiency=0.0 must be a fraction"),
        (["mode=profile", "parallel=search"], "a layout search is done by mode=fit (parallel=search) or mode=train"),
    ],
)
def test_mistakes_get_one_line(tmp_path, args, message):
    done = run(*args, f"hydra.run.dir={tmp_path / 'x'}", cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_calibration_predicts_measured_rows_again_and_gives_the_errors(tmp_path):
    """A real CPU training row, predicted again from its own columns; a device row (its peak
    reserved given) gets a memory error too. Errors are predicted / measured − 1."""
    out = tmp_path / "runs" / "train"
    # a vocabulary of 1000: the row records it and the prediction follows it
    row = run_in_process(out, "seq=1k", "train.steps=3", "train.warmup_steps=1", "model.vocab_size=1000")
    assert row["status"] == "ok", row["error"]
    measured = json.loads((out / "result.json").read_text())
    device_row = dict(measured, peak_reserved_bytes=2 * GiB, result_path="device")
    rows = pd.concat([load_results(tmp_path / "runs"), pd.DataFrame([device_row])], ignore_index=True)
    table = compare(rows)
    assert len(table) == 2
    problem_, parallel, seq = problem_of_row(rows.iloc[0])
    w = problem_.workload
    assert (w.model.name, w.method.name, seq, parallel.tp, w.dtype) == ("tiny", "none", 1024, 1, "fp32")
    assert w.model.vocab_size == 1000
    assert w.loss == measured["train.loss"]  # the loss the run used
    assert problem_.hardware.peak_flops == measured["hardware.peak_flops"]  # the run's own denominator
    expected = predict(problem_, parallel, seq)
    cpu, device = table.iloc[0], table.iloc[1]
    assert cpu["time_error"] == pytest.approx(expected.time.iteration_s / measured["iter_time_s"] - 1)
    assert pd.isna(cpu["memory_error"])  # a CPU run measures no device
    held = expected.device_total - expected.reserved
    assert device["memory_error"] == pytest.approx(held / (2 * GiB) - 1)


def test_when_no_layout_fits_the_row_shows_the_one_closest_to_fitting(tmp_path):
    out = tmp_path / "fit"
    row = fit(out, "mode=fit", "model=65b", "seq=64k", "method=megatron_full_recompute", "hardware=a800",
              "parallel=search", "cluster.gpus=8")
    tried = pd.read_csv(out / "layouts.csv")
    tried = tried[tried["status"] != "unrunnable"]
    assert row["status"] == "oom" and (tried["status"] == "oom").all()
    assert row["predicted_device_bytes"] == tried["device_bytes"].min() == tried["device_bytes"].iloc[0]


def test_all_layouts_are_tried_with_the_switch_and_the_row_says_why_one_cannot_run(tmp_path):
    # Adam on the host needs 16-bit weights: each layout with it is one training cannot run
    out = tmp_path / "fit"
    row = fit(out, "mode=fit", "model=tiny", "seq=64k", "method=memo", "hardware=a800", "parallel=search",
              "cluster.gpus=2", "fit.layouts=all", "fit.tile_tokens=[whole]", "fit.optimizer_offload=[none,host]",
              "train.dtype=fp32")
    tried = pd.read_csv(out / "layouts.csv")  # each layout with Adam on the device and on the host
    assert len(tried) == 2 * len(layouts(TINY, 2, 8)) and "unrunnable" not in set(tried["status"])
    marked = tried["unrunnable"].notna()
    assert (marked == (tried["optimizer_offload"] > 0)).all() and marked.any()
    chosen = tried.iloc[0]
    assert (row["fit.unrunnable"] is None) == (not marked.iloc[0]) and row["parallel.cp"] == chosen["cp"]