"""Predicted time per iteration, and so MFU and TGS, from FLOPs, bandwidths and the efficiencies
of :class:`memo.config.FitConfig`.

Per micro-batch and pipeline stage, each layer costs:

* forward: the weight GEMMs ``2·b·t·W/tp`` FLOPs (``W`` the layer's four weights,
  :func:`memo.model.gpt.layer_matmul_weights`: ``4h² + 2h·f`` for the GPT, grouped keys and values
  and SwiGLU's 3h·f for Llama) at ``gemm_efficiency`` of the peak, and
  causal attention ``2·b·t·s·h/tp`` FLOPs (``t = s/cp`` tokens on this rank; within packed
  documents of ``n`` tokens, ``fit.document_tokens``, ``s`` becomes ``n``) at
  ``attention_forward_efficiency``; backward: twice the GEMMs, and 2.5 times the attention FLOPs
  (FlashAttention recomputes the scores) at ``attention_backward_efficiency``;
* tensor parallelism: with sequence parallelism two all-gathers and two reduce-scatters of the
  layer's ``b·t·h`` activations per pass, otherwise two all-reductions, over NVLink, a share
  ``tp_comm_overlap`` hidden;
* context parallelism, as the run's activation policy exchanges keys and values
  (:meth:`memo.policy.ActivationPolicy.cp_exchange`): with ``cp_comm_type=all_gather`` every rank
  gathers the ``cp − 1`` other ranks' key/value blocks (``groups·d`` wide) before its attention, and
  in the backward gathers them again and reduce-scatters their gradients, none of it overlapped; a
  walk in tiles (``stores``) gathers them into its stores likewise, and sums their float32
  gradients over the ranks; with ``p2p`` the same blocks pass
  around a ring, each step's transfer hidden behind the step's attention (exposed: what the
  attention of the pass does not cover), and in the backward their float32 gradients travel with
  them, one step more; with ``a2a`` (Ulysses) all-to-alls of the rank's q, k, v and output
  (``b·t·h/tp`` elements for q and the output, ``groups·d`` wide k and v) in the forward and twice
  that in the backward, not overlapped;
* recomputation and copies to the host not hidden behind compute, as the activation policy
  predicts them (:meth:`memo.policy.ActivationPolicy.recompute_seconds`,
  :meth:`memo.policy.ActivationPolicy.place`).

The head adds the logits GEMM (three times its forward FLOPs). The pipeline runs
``micro_batches + pp − 1`` stage slots; data parallelism then reduces the fp32 gradients in a ring
over ``dp·cp`` ranks (NVLink within a node, otherwise the node's network shared by its devices),
a share ``dp_comm_overlap`` hidden. The optimizer step is not counted.
"""

import math
from dataclasses import dataclass
from typing import Optional

from memo.config import ConfigError, FitConfig, Workload
from memo.hardware import Hardware
from memo.metrics import ATTENTION_BACKWARD_FLOPS, mfu, model_flops, tgs
from memo.model.gpt import attention_width, head_size, layer_matmul_weights, model_flops_parameters, padded_vocab_size
from memo.policy import LayerSeconds, Placed, policy_of

# Adam on the host reads a gradient (fp32), reads and writes a main weight and two moments (fp32)
HOST_ADAM_BYTES_PER_PARAM = 4 + 3 * 2 * 4


@dataclass(frozen=True)
class TimePrediction:
    """Seconds of one iteration and its parts (per micro-batch and layer where named so)."""

    layer_forward_s: float  # T_layer of MEMO's α problem: one layer's forward, communication included
    layer_backward_s: float
    layer_recompute_s: float
    layer_swap_exposed_s: float  # copies to or from the host not hidden behind compute
    layer_tp_comm_s: float  # forward and backward together
    layer_cp_comm_exposed_s: float
    head_s: float
    pipeline_p2p_s: float  # per micro-batch: a stage's sends and receives between pipeline stages
    bubble_fraction: float  # pipeline slots spent idle
    dp_comm_s: float  # per iteration
    optimizer_offload_s: float  # per iteration: Adam on the host and its copies (0 without)
    iteration_s: float
    flops_per_iteration: float
    mfu: float
    tgs: float


def _ring_seconds(bytes_: float, ranks: int, bandwidth: float) -> float:
    """A ring all-gather or reduce-scatter of ``bytes_`` (the full tensor) over ``ranks``."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * bytes_ / bandwidth


def _link(ranks_spanned: int, hw: Hardware, efficiency: float) -> float:
    """Bytes/s per device of a collective over ``ranks_spanned`` consecutive devices."""
    if ranks_spanned == 1:
        return math.inf  # nothing to send
    per_node = hw.devices_per_node or 1
    within = ranks_spanned <= per_node
    bandwidth = hw.intra_node_bytes_per_s if within else hw.inter_node_bytes_per_s
    if bandwidth is None:
        key = "intra_node_gbps" if within else "inter_node_gbps"
        raise ConfigError(
            f"hardware={hw.name} has no hardware.{key}, which a layout over "
            f"{ranks_spanned} devices needs; set it (GB/s)"
        )
    return bandwidth * efficiency / (1 if within else per_node)


def layer_seconds(workload: Workload, hw: Hardware, fit: FitConfig, exchange: str) -> LayerSeconds:
    """One layer's seconds on one device per micro-batch (see the module docstring), its keys and
    values crossing context-parallel ranks by ``exchange``."""
    model, parallel, seq = workload.model, workload.parallel, workload.seq
    micro_batch_size, element_bytes = workload.micro_batch_size, workload.dtype_bytes
    h, width, d = model.hidden_size, attention_width(model), head_size(model)
    tp, cp = parallel.tp, parallel.cp
    b, t = micro_batch_size, seq / cp
    peak = hw.peak_flops

    weights = layer_matmul_weights(model)
    gemm_rate = peak * fit.gemm_efficiency
    gemm = 2 * b * t * weights / tp / gemm_rate
    # QKᵀ and PV, 4·b·t·s·w/tp (w = heads·d, the hidden size unless the heads are narrower or wider),
    # halved by the causal mask; within documents of n tokens s becomes n
    attention_flops = 2 * b * t * workload.attended_tokens * width / tp
    attention = attention_flops / (peak * fit.attention_forward_efficiency)
    attention_bwd = ATTENTION_BACKWARD_FLOPS * attention_flops / (peak * fit.attention_backward_efficiency)

    activation = b * t * h * element_bytes
    tp_link = _link(tp, hw, fit.link_efficiency)
    # Two all-gathers and two reduce-scatters, or two all-reductions (each is both): four rings.
    tp_pass = 4 * _ring_seconds(activation, tp, tp_link) * (1 - fit.tp_comm_overlap)

    groups = model.num_query_groups or model.num_attention_heads
    kv = b * t * (d * groups) / tp * element_bytes  # this rank's keys, or values
    qo = b * t * width / tp * element_bytes  # this rank's queries, or attention's output
    block = 2 * kv  # one key and one value block
    cp_link = _link(tp * cp, hw, fit.link_efficiency)
    if cp == 1:
        cp_fwd = cp_bwd = 0.0
    elif exchange == "stores":  # the rank's keys and values gathered into the store; their gradients reduce-scattered
        cp_fwd = (cp - 1) * block / cp_link
        cp_bwd = cp_fwd + (cp - 1) / cp * (cp * block * 4 / element_bytes) / cp_link
    elif exchange == "a2a":  # q, k, v to heads, the output back
        cp_fwd = (cp - 1) / cp * (2 * qo + 2 * kv) / cp_link
        cp_bwd = 2 * cp_fwd
    elif exchange == "p2p":
        cp_fwd = max(0.0, (cp - 1) * block / cp_link - attention)
        gradients = cp * block * 4 / element_bytes  # float32
        cp_bwd = max(0.0, ((cp - 1) * block + gradients) / cp_link - attention_bwd)
    else:
        cp_fwd = (cp - 1) * block / cp_link
        cp_bwd = 2 * cp_fwd
    # the token-wise GEMMs up to FC2's input (QKV, projection, FC1); the QKV GEMM's keys and values
    f = model.ffn_hidden_size
    token_wise = 2 * b * t * (weights - f * h) / tp / gemm_rate
    keys_values = 2 * b * t * h * 2 * (d * groups) / tp / gemm_rate
    return LayerSeconds(gemm, attention, attention_bwd, tp_pass, cp_fwd, cp_bwd, token_wise, keys_values)


def predict_time(
    workload: Workload,
    micro_batches: int,
    hw: Hardware,
    fit: FitConfig,
    local_params: int = 0,
    placed: Optional[Placed] = None,
    offloaded_params: int = 0,
) -> TimePrediction:
    """Predict one iteration of ``workload`` (see the module docstring).

    Args:
        micro_batches: micro-batches per data-parallel rank and iteration.
        local_params: parameters on one device (for the gradient reduction).
        placed: where the activation policy keeps the activations (its recomputation and exposed
            copies); None: as it would before any is placed (α = 1, no checkpoint layers).
        offloaded_params: parameters of this device whose Adam step runs on the host: their fp32
            gradients go to the host and their fp32 main weights come back over the host link
            while the CPU streams :data:`HOST_ADAM_BYTES_PER_PARAM` bytes each at this device's
            ``fit.host_adam_gbps``, one tensor's copies behind another's step (Megatron's
            ``overlap_cpu_optimizer_d2h_h2d``): the slower of the two, after the backward pass.
    """
    model, parallel, seq = workload.model, workload.parallel, workload.seq
    micro_batch_size = workload.micro_batch_size
    h, n = model.hidden_size, model.num_layers
    tp, cp, pp, dp = parallel.tp, parallel.cp, parallel.pp, parallel.dp
    b, t = micro_batch_size, seq / cp
    peak = hw.peak_flops
    policy = policy_of(workload)
    parts = layer_seconds(workload, hw, fit, policy.cp_exchange(parallel))
    forward, backward = parts.forward, parts.backward
    recompute = placed.recompute_s if placed is not None else policy.recompute_seconds(workload, parts)
    swap = placed.swap_exposed_s if placed is not None else 0.0

    vocab = padded_vocab_size(model, tp)
    head = 3 * 2 * b * t * h * vocab / tp / (peak * fit.gemm_efficiency)
    # a stage's micro-batch: its layers, the head (the last stage's, which binds), and the layer
    # outputs sent on and their gradients sent back at each of its chunks' ends (Megatron's
    # schedules wait for them), between neighbours tp·cp·dp ranks apart
    vpp = parallel.vpp
    sent = b * t / (tp if parallel.sequence_parallel else 1) * h * workload.dtype_bytes
    p2p = 0.0 if pp == 1 else 2 * vpp * sent / _link(2 * tp * cp * dp, hw, fit.link_efficiency)
    stage = n // pp * (forward + backward + recompute + swap) + head + p2p
    # 1F1B fills and drains the pipeline once: pp − 1 idle slots of a micro-batch; the interleaved
    # schedule's are a chunk's, 1/vpp of one
    slots = micro_batches + (pp - 1) / vpp
    grad_ranks = dp * cp
    dp_link = _link(tp * cp * pp * dp, hw, fit.link_efficiency)
    dp_comm = 2 * _ring_seconds(local_params * 4, grad_ranks, dp_link) * (1 - fit.dp_comm_overlap)
    # fp32 gradients go out, fp32 main weights come back (converted on the device)
    copies = offloaded_params * (4 + 4) / hw.host_link_bytes_per_s
    optimizer_offload = max(copies, offloaded_params * HOST_ADAM_BYTES_PER_PARAM / (fit.host_adam_gbps * 1e9))
    iteration = slots * stage + dp_comm + optimizer_offload

    devices = tp * cp * pp * dp
    global_batch = micro_batch_size * micro_batches * dp
    # (within documents, the attention computed: as a run's mfu_documents, not the paper's s²)
    flops = global_batch * model_flops(seq, seq * workload.attended_tokens, model_flops_parameters(model), n,
                                       attention_width(model))
    return TimePrediction(
        layer_forward_s=forward,
        layer_backward_s=backward,
        layer_recompute_s=recompute,
        layer_swap_exposed_s=swap,
        layer_tp_comm_s=2 * parts.tp_pass,
        layer_cp_comm_exposed_s=parts.cp_forward + parts.cp_backward,
        head_s=head,
        pipeline_p2p_s=p2p,
        bubble_fraction=(pp - 1) / vpp / slots,
        dp_comm_s=dp_comm,
        optimizer_offload_s=optimizer_offload,
        iteration_s=iteration,
        flops_per_iteration=flops,
        mfu=mfu(flops, iteration, devices, peak),
        tgs=tgs(global_batch * seq, iteration, devices),
    )
