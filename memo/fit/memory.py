"""Per-device and per-node memory of one training configuration, term by term, without running it.

* Model states (Megatron mixed precision): 16-bit weights, fp32 gradient buffer, and Adam's fp32
  main weights, first and second moments (sharded over data and context parallelism by the
  distributed optimizer). In fp32 there is no separate main copy.
* Activations: the iteration's requests from the fake-tensor trace of the real model
  (:mod:`memo.profile.template`), as the run's activation policy places them
  (:meth:`memo.policy.ActivationPolicy.place`: MEMO's rounding buffers and host memory, Megatron's
  offloading), replayed through the caching-allocator simulator (``plan=false``), or placed by the
  bi-level planner (``plan=true``). At the instant of most bytes in use they split into skeletal
  tensors (kept for a layer's backward), transient tensors (made and freed within one phase),
  embedding/logits/loss buffers, persistent buffers (alive from one iteration to the next) and
  others (gradients handed between layers).
* Context parallelism adds the buffers of its exchange at their backward peak
  (:meth:`memo.policy.ActivationPolicy.cp_buffers`); the trace itself is of one context-parallel
  rank's tokens.

* NCCL's buffers (:func:`nccl_buffers`): per communicator a layout uses, its channels' connections
  at NCCL's default sizes, outside PyTorch's allocator; one GPU cannot measure eight ranks' worth.

Pipeline parallelism is predicted for its first stage holding ``pp`` micro-batches in flight
(1F1B), with the embedding, the head and the loss on the same stage: an upper bound.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from memo.config import ParallelConfig, Workload, shards_optimizer
from memo.dsa.caching_allocator import OutOfMemoryError, simulate
from memo.execute.optimizer_offload import NO_OFFLOAD, OffloadBytes, offload_bytes
from memo.model.gpt import parameter_count, parameter_numels
from memo.plan.bilevel import RUNTIME_ALIGNMENT, plan_iteration
from memo.profile.template import INNER_LAYERS
from memo.profile.trace import Trace


# NCCL's buffer per connection and protocol at its defaults (src/init.cc: DEFAULT_BUFFSIZE,
# DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE; NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE and
# NCCL_LL128_BUFFSIZE override them), bytes.
NCCL_SIMPLE_BYTES = 1 << 22
NCCL_LL_BYTES = 8 * 512 * 8 * 16  # lines per thread × threads × steps × 16-byte FIFO line
NCCL_LL128_BYTES = 120 * 640 * 8 * 8  # elements per thread × threads × steps × 8 bytes
NCCL_CONNECTION_BYTES = NCCL_SIMPLE_BYTES + NCCL_LL_BYTES + NCCL_LL128_BYTES
# Connections a rank holds per channel: the ring's and the tree's (allreduce takes either).
NCCL_CONNECTIONS_PER_CHANNEL = 2


@dataclass(frozen=True)
class NcclBuffers:
    """Device bytes NCCL allocates for one rank's communicators (outside PyTorch's allocator), and
    the assumption they rest on, as a row records it."""

    bytes: int
    assumption: str


NO_NCCL = NcclBuffers(0, "")  # one device, or a CPU's gloo


def nccl_buffers(parallel: ParallelConfig, sharded_optimizer: bool, channels: int) -> NcclBuffers:
    """NCCL's buffers on one rank of ``parallel``: each communicator of more than one rank that a
    step uses holds ``channels`` × :data:`NCCL_CONNECTIONS_PER_CHANNEL` connections of the three
    protocols' default buffers. PyTorch makes one communicator per process group, even where two
    groups hold the same ranks; a step uses tensor parallelism's, context parallelism's exchange,
    pipeline parallelism's sends, the gradients' and the loss's reduction over data × context
    parallelism, the gradient norm's group (every rank of the distributed optimizer's instance where
    ``sharded_optimizer``, else tensor × pipeline parallelism's) and the world's (the run's own
    agreements). NVLink SHARP's (NVLS) buffers are not counted: where it is on (NCCL_NVLS_ENABLE,
    the default on NVSwitch systems) NCCL allocates more."""
    world = parallel.tp * parallel.cp * parallel.pp * parallel.dp
    groups = {"tp": parallel.tp, "cp": parallel.cp, "pp": parallel.pp, "dp×cp": parallel.dp * parallel.cp,
              "norm": world if sharded_optimizer else parallel.tp * parallel.pp, "world": world}
    used = {name: ranks for name, ranks in groups.items() if ranks > 1}
    if not used:
        return NO_NCCL
    per_communicator = channels * NCCL_CONNECTIONS_PER_CHANNEL * NCCL_CONNECTION_BYTES
    named = ", ".join(f"{name} {ranks}" for name, ranks in used.items())
    return NcclBuffers(len(used) * per_communicator, (
        f"NCCL: {len(used)} communicator(s) ({named}) × {channels} channels × "
        f"{NCCL_CONNECTIONS_PER_CHANNEL} connections × {NCCL_CONNECTION_BYTES / 2**20:.2f} MiB "
        "(Simple, LL, LL128 at NCCL's default sizes); NVLS buffers not counted"))


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


def optimizer_step_bytes(workload: Workload, distributed_optimizer: Optional[bool], offload_fraction: float,
                         pytorch_adam: bool) -> int:
    """Bytes one device's optimizer step makes and frees, on a GPU: where Megatron's Adam is
    PyTorch's ``AdamW`` (``pytorch_adam``: neither Transformer Engine's nor Apex's fused Adam is
    installed), its multi-tensor step makes the square roots of a parameter group's second moments
    at once, an fp32 element per parameter of the group, which is nearly every parameter (the
    other group holds the norms); fused Adams make none. Sharded as the states are; the share of
    the parameters whose states are on the host steps there."""
    if not pytorch_adam:
        return 0
    parallel = workload.parallel
    params = parameter_count(workload.model, parallel.tp, parallel.pp)
    sharded = offload_fraction > 0 or shards_optimizer(distributed_optimizer, parallel)
    shards = parallel.dp * parallel.cp if sharded else 1
    return math.ceil(4 * params * (1 - offload_fraction) / shards)


def persistent_bytes(trace: Trace) -> int:
    """Bytes of the requests ``trace`` makes and keeps into the next iteration (RoPE's tables,
    Megatron's all-gather buffer, the tiles' stores): what the optimizer step finds on the device
    beside the model states and buffers."""
    return sum(r.size for r in trace.requests() if r.free_phase is None)


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


def less_offloaded(acts: Activations, freed: int) -> Activations:
    """``acts`` (of the iteration without offloading) with ``freed`` bytes of its skeletal tensors
    off the device at the peak, which falls where it did (the start of the backward pass)."""
    return dataclasses.replace(acts, skeletal=acts.skeletal - freed, allocated_peak=acts.allocated_peak - freed,
                               held=acts.held - freed)
