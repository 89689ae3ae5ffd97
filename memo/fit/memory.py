"""Per-device and per-node memory of one training configuration, term by term, without running it.

* Model states (Megatron mixed precision): 16-bit weights, fp32 gradient buffer, and Adam's fp32
  main weights, first and second moments (sharded over data and context parallelism by the
  distributed optimizer). In fp32 there is no separate main copy.
* Activations: the iteration's requests from the fake-tensor trace of the real model
  (:mod:`memo.fit.template`), replayed through the caching-allocator simulator (``plan=false``),
  or placed by the bi-level planner (``plan=true``). At the instant of most bytes in use they
  split into skeletal tensors (kept for a layer's backward), transient tensors (made and freed
  within one phase), embedding/logits/loss buffers, persistent buffers (alive from one iteration to
  the next) and others (gradients handed between layers).
* MEMO and full swapping: two rounding buffers of one layer's skeletal tensors each, which hold
  every skeletal tensor on the device (the last two layers keep all of theirs there); every other
  layer's input, attention output and first α of its other skeletal tensors go to the host, so
  host memory per node is ``(n − 2)·(S_input + S_attn + α·S_other)`` per device times the
  devices of a node.
* Context parallelism adds the buffers of its exchange at their backward peak
  (:func:`context_parallel_buffers`); the trace itself is of one context-parallel rank's tokens.

Pipeline parallelism is predicted for its first stage holding ``pp`` micro-batches in flight
(1F1B), with the embedding, the head and the loss on the same stage: an upper bound.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from memo.config import Workload, shards_optimizer
from memo.fit.megatron_offload import offloaded_bytes, offloaded_layers
from memo.fit.template import INNER_LAYERS, IterationTemplate
from memo.execute.optimizer_offload import NO_OFFLOAD, OffloadBytes, offload_bytes
from memo.model.gpt import parameter_count, parameter_numels
from memo.model.tiles import rank_tile_blocks
from memo.swap.alpha import AlphaSolution, SkeletalBytes, choose_alpha
from memo.swap.tile_alpha import TileShape, TileSolution, solve_tiles
from memo.plan.bilevel import RUNTIME_ALIGNMENT, plan_iteration
from memo.dsa.caching_allocator import OutOfMemoryError, simulate
from memo.profile.trace import Trace

_ALIGN = 256  # bytes: each tensor in a rounding buffer starts at a multiple


@dataclass(frozen=True)
class ModelStates:
    """Bytes per device of what lives for the whole run; ``offload`` is what Adam keeps on the
    host for it (``train.optimizer_offload=host``)."""

    params: int  # parameters on this device (count)
    weights: int
    gradients: int
    optimizer: int  # on the device
    offload: OffloadBytes = NO_OFFLOAD

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def model_states(workload: Workload, distributed_optimizer: Optional[bool],
                 offload_fraction: float = 0.0) -> ModelStates:
    """Weights, gradients and Adam states of one device, bytes; the states sharded over dp·cp
    where ``distributed_optimizer`` is true, or is None and dp·cp > 1.

    ``offload_fraction`` > 0: that share of the parameters' Adam states and fp32 main weights live
    on the host (Megatron's ``HybridDeviceOptimizer``, which needs the distributed optimizer and
    turns it on), counted as :func:`memo.execute.optimizer_offload.offload_bytes` counts what a run
    allocates: for dp·cp = 1 exactly, tensor by tensor in the model's order; sharded over dp·cp
    ranks, each tensor's share taken as its own.
    """
    parallel = workload.parallel
    params = parameter_count(workload.model, parallel.tp, parallel.pp)
    element = workload.dtype_bytes
    # 16-bit training keeps fp32 main weights next to Adam's two fp32 moments.
    optimizer_per_param = 12 if element < 4 else 8
    sharded = offload_fraction > 0 or shards_optimizer(distributed_optimizer, parallel)
    shards = parallel.dp * parallel.cp if sharded else 1
    optimizer = math.ceil(params * optimizer_per_param / shards)
    offload = NO_OFFLOAD
    if offload_fraction > 0:
        pieces = [-(-n // shards) for n in parameter_numels(workload.model, parallel.tp, parallel.pp)]
        offload = offload_bytes(pieces, element, offload_fraction)
    return ModelStates(params, params * element, params * 4, max(optimizer - offload.device_bytes_removed, 0),
                       offload)


@dataclass(frozen=True)
class Activations:
    """Bytes per device of the activations at their peak, and the allocator's view of them.

    The five kinds are taken at one instant, the peak, and add up to ``allocated_peak``.
    """

    skeletal: int  # made in a forward pass, kept for a backward one, at the peak (rounding buffers not included)
    transient: int  # made and freed within one phase, at the peak
    head: int  # embedding, logits and loss buffers, at the peak
    persistent: int  # kept from one iteration to the next: all-gather buffer, RoPE tables
    other: int  # the rest at the peak: gradients (and, walked in tiles, outputs) handed between layers
    allocated_peak: int  # the sum of the five
    peak_phase: str  # the phase of the iteration in which the peak falls
    held: int  # what the allocator holds for them: caching reserved, or the planned arena
    alloc_retries: int  # caching allocator: cache flushes to serve a request within capacity
    # caching allocator, when it cannot serve a request within the capacity: that request's size;
    # ``held`` is then what it would reserve with no limit (what the run would need)
    refused_bytes: Optional[int] = None

    @property
    def overhead(self) -> int:
        """Bytes the allocator holds beyond the peak of live bytes (never negative)."""
        return self.held - self.allocated_peak


def _phase_kind(phase: Optional[str]) -> str:
    return "head" if phase is not None and phase.split(".")[0] in ("embedding", "head", "loss") else "layer"


def _forward(phase: str) -> bool:
    """Whether ``phase`` is part of a forward pass (a layer's, or one of its tiles')."""
    return ".fwd" in phase and ".bwd" not in phase


def split_peak(trace: Trace) -> tuple[int, str, dict[str, int]]:
    """The most bytes in use at one instant, the phase of that instant, and those bytes by kind
    (see :class:`Activations`)."""
    live, best, at = 0, -1, 0
    for position, event in enumerate(trace.events):
        live += event.size if event.op == "malloc" else -event.size
        if live > best:
            best, at = live, position
    kinds = dict.fromkeys(("skeletal", "transient", "head", "persistent", "other"), 0)
    for r in trace.requests():
        if not r.lower <= at < r.upper:
            continue
        if r.free_phase is None:
            kind = "persistent"
        elif r.malloc_phase == r.free_phase:
            kind = "transient"
        elif _forward(r.malloc_phase) and r.free_phase.split(".")[0] in ("layer", INNER_LAYERS) \
                and not _forward(r.free_phase):
            kind = "skeletal"
        elif "head" in (_phase_kind(r.malloc_phase), _phase_kind(r.free_phase)):
            kind = "head"
        else:
            kind = "other"
        kinds[kind] += r.size
    phase = trace.events[at].phase if trace.events else ""
    return max(best, 0), phase, kinds


def activations(trace: Trace, capacity: Optional[int], plan: bool, time_limit_s: float = 10.0) -> Activations:
    """The activation memory of ``trace`` within ``capacity`` bytes (None: no limit).

    With ``capacity`` at most 0 no allocator is asked (``held`` is the peak). The caching
    allocator (``plan=false``) may refuse a request within ``capacity``: ``refused_bytes`` then
    says which size and ``held`` is what it would reserve without a limit; a plan
    (``plan=true``) is never refused, the caller compares ``held`` with ``capacity``.
    """
    peak, phase, kinds = split_peak(trace)
    at_peak = dict(**kinds, allocated_peak=peak, peak_phase=phase)
    if capacity is not None and capacity <= 0:
        return Activations(**at_peak, held=peak, alloc_retries=0)
    if plan:
        # planned as training plans its recorded step: on the allocator's grid, with the layers
        # that differ (MEMO's last two, the first) given blocks of their own
        held = plan_iteration(trace, time_limit_s, mip="none", alignment=RUNTIME_ALIGNMENT,
                              identical_layers=False).arena_bytes
        return Activations(**at_peak, held=held, alloc_retries=0)
    try:
        stats = simulate(trace.events, capacity_bytes=capacity)
    except OutOfMemoryError as error:
        unlimited = simulate(trace.events)
        return Activations(**at_peak, held=unlimited.peak_reserved, alloc_retries=unlimited.num_alloc_retries,
                           refused_bytes=error.size)
    return Activations(**at_peak, held=stats.peak_reserved, alloc_retries=stats.num_alloc_retries)


def swapped_sizes(template: IterationTemplate, workload: Workload) -> SkeletalBytes:
    """One layer's skeletal bytes on one device as MEMO's runtime keeps them, split as its α
    problem needs them: the layer input (as traced), what attention produced (its output,
    ``b·s·h/tp`` elements, and its fp32 log-sum-exp per head and token), and the rest."""
    model, parallel, b = workload.model, workload.parallel, workload.micro_batch_size
    tokens = workload.seq // parallel.cp
    layer = min(2, template.layers - 1)
    total = template.kept_bytes(layer, tokens)
    layer_input = template.input_bytes(tokens)
    heads = model.num_attention_heads // parallel.tp
    attention = b * tokens * (model.hidden_size // parallel.tp * workload.dtype_bytes + heads * 4)
    return SkeletalBytes(layer_input, attention, total - layer_input - attention)


def rounding_buffer_bytes(sizes: SkeletalBytes) -> int:
    """Two rounding buffers, each one layer's skeletal tensors (``sizes``), 256-byte aligned."""
    return 2 * -(-(sizes.input + sizes.attention + sizes.other) // _ALIGN) * _ALIGN


def context_parallel_buffers(workload: Workload) -> int:
    """Bytes one layer's context-parallel attention holds beyond attention without it, at its peak
    (the backward pass), counted as held although they live only while that layer's attention
    runs; 0 without context parallelism. With ``t = s/cp`` tokens per rank, ``h = hidden/tp``
    channels and ``e``-byte elements:

    * ``all_gather``: all ``s`` tokens' keys and values and their gradients, ``4·b·s·h·e``, and
      ``b·t·h·(e + 4)`` for the query's gradient, summed in float32, and the kernels' gradients of
      one block;
    * ``p2p``: the held and the incoming keys and values, the gradient of the held ones and the one
      received (both float32), the query's gradient in float32 and the kernels' block gradients:
      ``b·t·h·(5·e + 28)``;
    * ``a2a``: q, k, v, the output and the incoming gradient re-sharded by heads, the gradients
      by heads and the all-to-alls' staging copies: at most ``7.5·b·t·h·e``.

    These are the peaks :mod:`memo.model.context_parallel` reaches, beyond the dq, dk, dv that
    attention without context parallelism allocates too (the incoming gradient arrives laid out
    as the output and is not copied), as the allocation recorder measures them in
    ``tests/context_parallel_worker.py`` (exactly for the first two; the third is a bound within
    20% at cp = 2 and 4: gloo's all-to-all stages what it sends in copies of varying size).
    """
    parallel = workload.parallel
    return exchange_bytes(parallel.cp_comm_type, parallel.cp, workload.micro_batch_size, workload.seq,
                          workload.model.hidden_size // parallel.tp, workload.dtype_bytes)


def exchange_bytes(comm_type: str, cp: int, b: int, s: int, h: int, e: int) -> int:
    """:func:`context_parallel_buffers` of ``b`` sequences of ``s`` tokens, ``h`` channels per
    rank, ``e``-byte elements."""
    if cp == 1:
        return 0
    t = s // cp
    if comm_type == "a2a":
        return 15 * b * t * h * e // 2
    if comm_type == "p2p":
        return b * t * h * (5 * e + 28)
    return 4 * b * s * h * e + b * t * h * (e + 4)


@dataclass(frozen=True)
class HostPlan:
    """MEMO's swap on one device: α, why, and the host bytes it needs."""

    solution: AlphaSolution
    per_device: int  # bytes


def host_plan(
    sizes: SkeletalBytes,
    layers: int,
    alpha: Optional[float],
    layer_time_s: float,
    bandwidth: float,
    budget: float,
) -> HostPlan:
    """α (given, or solved from the layer's predicted forward time) and the host bytes per device.

    Raises:
        HostMemoryError: if even α = 0 does not fit ``budget`` (status ``oohm``).
    """
    solution = choose_alpha(sizes, layers, layer_time_s, bandwidth, budget, alpha)
    per_device = max(layers - 2, 0) * math.ceil(sizes.swapped(solution.alpha))
    return HostPlan(solution, per_device)


def tiled_context_parallel_stores(workload: Workload) -> int:
    """Bytes a context-parallel rank's walk in tiles holds beyond a rank alone with its tokens:
    the stores of keys, values and their float32 accumulators hold the whole sequence on every
    rank (``2·b·(s − s/cp)·g·(e + 4)`` more, ``g`` the key/value channels of a tensor-parallel
    rank), and the gather of keys and values stages one chunk (``b·s/(2·cp)·g·e``); 0 without
    context parallelism. The all-reduce of the accumulators runs in place (gloo and NCCL may
    stage parts of it, not counted)."""
    model, parallel, b, e = workload.model, workload.parallel, workload.micro_batch_size, workload.dtype_bytes
    cp, s = parallel.cp, workload.seq
    if cp == 1:
        return 0
    groups = model.num_query_groups or model.num_attention_heads
    g = model.hidden_size // model.num_attention_heads * groups // parallel.tp
    wide = 8 if e == 8 else 4
    return 2 * b * (s - s // cp) * g * (e + wide) + b * s // (2 * cp) * g * e


def tile_blocks(workload: Workload) -> list[int]:
    """Where rank 0's tiles are in the sequence, in tiles: all of them without context
    parallelism, else those of its two chunks (the first and the last of ``2·cp``)."""
    cp = workload.parallel.cp
    return rank_tile_blocks(workload.seq // (cp * workload.tile_tokens), cp, 0)


@dataclass(frozen=True)
class TileHostPlan:
    """MEMO in tiles on one device: α per tile and k, the host bytes, the copies' exposed time."""

    solution: TileSolution
    shape: TileShape
    per_device: int  # bytes on the host
    exposed_copy_s: float  # a layer's copies not hidden behind the next tiles' forward, seconds


def tile_host_plan(sizes: SkeletalBytes, layers: int, tile_times_s: list[float], alpha: Optional[float],
                   bandwidth: float, budget: float, buffers: int = 2) -> TileHostPlan:
    """α per tile (given for all, or solved) and k as :mod:`memo.swap.tile_alpha` solves them for
    training, with ``sizes`` one tile's skeletal bytes, ``tile_times_s`` each tile's forward,
    ``bandwidth`` the device-to-host bytes/s and ``budget`` the host bytes of this device.

    Raises:
        HostMemoryError: if α = 0 does not fit with any checkpoint interval (naming the host term).
    """
    tiles = len(tile_times_s)
    shape = TileShape(sizes, layers, tiles, buffers)
    solution = solve_tiles(shape, tile_times_s, bandwidth, budget, None if alpha is None else [alpha] * tiles)
    exposed = sum(max(0.0, (sizes.attention + sizes.input + a * sizes.other) / bandwidth
                      - tile_times_s[(t + 1) % tiles]) for t, a in enumerate(solution.alphas))
    return TileHostPlan(solution, shape, math.ceil(solution.host_bytes), exposed)


@dataclass(frozen=True)
class MegatronOffload:
    """Megatron's fine-grained activation offloading on one device: bytes and the copies' time."""

    host_bytes: int  # every offloading layer's copies, at once (the peak of the forward's end)
    device_freed: int  # the offloaded layers' tensors off the device at the activations' peak
    exposed_copy_s: float  # a layer's copies not hidden behind its forward and backward, a mean


def megatron_offload(workload: Workload, layers: int, bandwidth: float, forward_s: float,
                     backward_s: float) -> MegatronOffload:
    """``method=megatron_offload`` on ``layers`` layers of one device (:mod:`memo.fit.megatron_offload`).

    The activations peak as the backward pass begins, every layer's tensors made: every
    offloading layer (all but the last, :func:`offloaded_layers`) then has its copies on the host,
    and the one whose backward comes next is brought back one group ahead, so ``layers − 2``
    layers' freed bytes are off the device at the peak. A layer's copies to the host run beside
    its forward, and back beside the backward of the layer after it: what takes longer than those
    is exposed (``bandwidth`` bytes/s; ``forward_s``, ``backward_s`` one layer's passes).
    """
    per_layer = offloaded_bytes(workload)
    offloading = offloaded_layers(layers)
    copy = per_layer.per_layer_host / bandwidth
    exposed = (max(0.0, copy - forward_s) + max(0.0, copy - backward_s)) * offloading / max(layers, 1)
    return MegatronOffload(offloading * per_layer.per_layer_host,
                           max(offloading - 1, 0) * per_layer.per_layer_device_freed, exposed)


def less_offloaded(acts: Activations, freed: int) -> Activations:
    """``acts`` (of the iteration without offloading) with ``freed`` bytes of its skeletal tensors
    off the device at the peak, which falls where it did (the start of the backward pass)."""
    return dataclasses.replace(acts, skeletal=acts.skeletal - freed, allocated_peak=acts.allocated_peak - freed,
                               held=acts.held - freed)
