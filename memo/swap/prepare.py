"""Before training: the layers' placement (swapping or tiles), measured and allocated.

:func:`prepare_swap` is the one way a model's layers get their placement, for training, the GPU
pack and the benchmarks alike. A method that swaps whole layers gets a :class:`SwapRuntime`:

1. Run layer 0 forward on a random input of the training shape: the tensors it saves give the
   layer layout and S_input, S_attn, S_other; two more forwards give T_layer.
2. Check the host constraint (``oohm`` if even α = 0 does not fit) and allocate the rounding
   buffers and the pinned slab for the largest α the host allows.
3. Measure B by copying a rounding buffer into that slab on the D2H stream.
4. ``alpha=auto``: solve α; if it is smaller, allocate the slab again at its exact size.

The processes of a tensor-parallel group must swap the same number of tokens (the
recomputation's collectives see their shapes), so the smallest k over the group is used. Other
processes solve α on their own: under context parallelism each rank swaps its own tokens and
recomputes them without exchanging any, and its host budget is its share of its node's.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from memo import hardware
from memo.config import ParallelConfig, Workload
from memo.hardware import Hardware
from memo.model import torch_dtype
from memo.swap.alpha import SkeletalBytes, check_host, choose_alpha, host_bound
from memo.swap.layout import ATTENTION, INPUT, TOKENS
from memo.swap.runtime import SwapRuntime
from memo.swap.streams import Streams, streams_for
from memo.swap.tiled_layer import TiledLayers


@dataclass(frozen=True)
class SwapReport:
    """What a run with swapping decided and measured; every field goes into its result row."""

    alpha: float  # swapped fraction actually used: keep_tokens / tokens
    alpha_binding: str  # "bandwidth", "host", "none" (α = 1) or "fixed" (given)
    alpha_bandwidth: float  # the bandwidth constraint's bound on α
    alpha_host: float  # the host constraint's bound on α
    keep_tokens: int  # k: tokens per segment swapped
    tokens: int  # S: tokens of a layer input on this device
    segment_tokens: int  # S, or S/2 when the input holds two context-parallel chunks
    swapped_layers: int
    layer_time_s: float  # T_layer: one layer's forward
    host_bandwidth_bytes_per_s: float  # B: device-to-host copies into the slab
    host_budget_bytes: int  # M_host
    host_bytes: int  # the slab: what all swapped layers keep on the host
    rounding_buffer_bytes: int  # both buffers
    skeletal_input_bytes: int  # S_input of one layer
    skeletal_attention_bytes: int  # S_attn
    skeletal_other_bytes: int  # S_other


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_time(layer, kwargs: dict, device: torch.device, repeats: int = 2) -> float:
    """Seconds of one forward of ``layer`` with autograd recording, best of ``repeats``."""
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        layer.run(**kwargs)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _bandwidth(runtime: SwapRuntime, device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of a copy from a rounding buffer into the host slab on the D2H stream."""
    n = min(runtime.buffers[0].numel(), runtime.slab.numel())
    if n == 0:
        return math.inf
    src, dst, s = runtime.buffers[0][:n], runtime.slab[:n], runtime.streams
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        s.copy(s.d2h, dst, src)
        s.synchronize()
        best = min(best, time.perf_counter() - start)
    return n / best


def _min_over(value: int, device: torch.device, group) -> int:
    if group is None or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


log = logging.getLogger("memo")

LayerRuntime = Union[SwapRuntime, TiledLayers]


def sequence_chunks(parallel: ParallelConfig) -> int:
    """Chunks of ``S`` tokens in the tensors between sequence parallelism's gather and
    reduce-scatter: tp under sequence parallelism, else 1."""
    return parallel.tp if parallel.sequence_parallel else 1


def segments(parallel: ParallelConfig) -> int:
    """Runs of a layer input that each keep their own first ``k`` tokens: 2 where the input holds
    both of a context-parallel rank's chunks (one from each end of the sequence), else 1."""
    return 2 if parallel.cp > 1 and sequence_chunks(parallel) == 1 else 1


def host_share(node_host_bytes: float, devices_per_node: Optional[int]) -> float:
    """Bytes of host memory one process may fill with swapped activations: its GPU's share of
    its node's ``node_host_bytes``. The fit predicts with the same share."""
    return node_host_bytes / (devices_per_node or 1)


def host_budget(hw: Hardware, device: torch.device) -> float:
    """M_host of a process training on ``device`` of ``hw``: its share of the node's host memory
    (``hardware.host_memory_gib``, or what this machine has), and on a GPU no more than its share
    of what can be page-locked here now."""
    budget = host_share(hw.host_memory_bytes or hardware.host_memory_bytes(), hw.devices_per_node)
    if device.type != "cuda":
        return budget
    # Swapped activations live in page-locked memory: what can be pinned here now bounds them,
    # shared by the GPUs this node's processes see (a one-GPU box: all of it).
    budget = min(budget, hardware.pinnable_memory_bytes() / max(torch.cuda.device_count(), 1))
    memlock = hardware.memlock_limit_bytes()
    if memlock is not None and memlock < budget:
        log.warning("ulimit -l is %.2f GiB, below the %.2f GiB of swapped activations this GPU may "
                    "pin; where the container enforces it, raise it (ulimit -l unlimited)",
                    memlock / 2**30, budget / 2**30)
    return budget


def prepare_swap(model, workload: Workload, device: torch.device, host_budget: float,
                 alpha: Optional[float] = None, streams: Optional[Streams] = None,
                 group=None) -> tuple[Optional[LayerRuntime], Optional["SwapReport"]]:
    """Give ``model``'s layers (``workload``'s Megatron ``GPTModel``) their placement and get it
    ready to train ``workload.micro_batch_size`` sequences of ``workload.seq`` tokens (all
    tensor-parallel ranks together) per micro-batch.

    Returns ``(None, None)`` for a method that leaves its layers to Megatron (or to our layer's
    own recomputation), ``(TiledLayers, None)`` for layers walked in tiles, and a
    :class:`SwapRuntime` with its :class:`SwapReport` for swapping. A training step's micro-batch
    goes through the placement's ``token_order``; ``release`` gives its memory back.

    Args:
        device: where the model lives (the rounding buffers go there).
        host_budget: bytes of host memory this process may fill with activations (M_host).
        alpha: a fixed swap ratio, or ``None`` to solve for it.
        streams: the copy streams; by default CUDA streams on a GPU, inline copies on the CPU.
        group: the processes whose recomputations exchange tokens (the tensor-parallel group),
            which must keep the same ``k``; ``None`` for a process alone.

    Raises:
        HostMemoryError: if the swapped activations cannot fit in ``host_budget``.
    """
    layers = list(model.decoder.layers)
    if workload.tiled:
        walk = TiledLayers(workload.tile_tokens, keep_attention=workload.method.swaps,
                           sequence_chunks=sequence_chunks(workload.parallel))
        walk.attach(layers)
        return walk, None
    if not workload.swaps:
        return None, None
    parallel = workload.parallel
    runtime = SwapRuntime(len(layers), streams or streams_for(device), device, sequence_chunks(parallel), segments(parallel))
    return runtime, ready_runtime(runtime, model, workload, alpha, host_budget, group)


def ready_runtime(runtime: SwapRuntime, model, workload: Workload, alpha: Optional[float],
                  host_budget: float, group=None) -> SwapReport:
    """Attach ``runtime`` to ``model``'s layers, measure a layer, solve α and allocate the
    buffers and the slab (steps 1–4 above): :func:`prepare_swap`'s work on a runtime it did not
    make (one with another segment count, in the tests)."""
    device = runtime.device
    layers = list(model.decoder.layers)
    runtime.attach(layers)
    config = model.config
    seq = workload.seq
    tokens = seq // (workload.parallel.cp * runtime.sequence_chunks)
    # A generator of its own: measuring must not move the RNG that training draws from.
    generator = torch.Generator(device.type).manual_seed(0)
    hidden = torch.randn(tokens, workload.micro_batch_size, config.hidden_size, dtype=torch_dtype(workload),
                         device=device, generator=generator, requires_grad=True)
    kwargs = {"hidden_states": hidden, "attention_mask": None, "rotary_pos_emb": model.rotary_pos_emb(seq)}
    layout = runtime.discover(layers[0], kwargs)
    layer_time = _layer_time(layers[0], kwargs, device)
    del hidden, kwargs
    sizes = SkeletalBytes(layout.bytes_of(INPUT), layout.bytes_of(ATTENTION), layout.bytes_of(TOKENS))
    n = len(layers)
    by_host = host_bound(sizes, n, host_budget)
    check_host(sizes, n, host_budget, 0.0 if alpha is None else alpha)
    cap = min(1.0, by_host) if alpha is None else alpha
    pin = device.type == "cuda"
    segment = layout.segment_tokens
    keep = _min_over(math.floor(cap * segment + 1e-9), device, group)
    runtime.allocate(layout, keep, pin)
    bandwidth = _bandwidth(runtime, device) if runtime.swapped_layers else math.inf
    solution = choose_alpha(sizes, n, layer_time, bandwidth, host_budget, alpha)
    solved = _min_over(math.floor(solution.alpha * segment + 1e-9), device, group)
    if solved != keep:  # the bandwidth bound the cap
        keep = solved
        runtime.allocate(layout, keep, pin)
    return SwapReport(
        alpha=keep / segment,
        alpha_binding=solution.binding,
        alpha_bandwidth=solution.alpha_bandwidth,
        alpha_host=solution.alpha_host,
        keep_tokens=keep,
        tokens=tokens,
        segment_tokens=segment,
        swapped_layers=runtime.swapped_layers,
        layer_time_s=layer_time,
        host_bandwidth_bytes_per_s=bandwidth,
        host_budget_bytes=int(host_budget),
        host_bytes=runtime.slab.numel(),
        rounding_buffer_bytes=runtime.rounding_buffer_bytes,
        skeletal_input_bytes=sizes.input,
        skeletal_attention_bytes=sizes.attention,
        skeletal_other_bytes=sizes.other,
    )
