"""Before training with swapping: measure one layer, solve α, allocate buffers and the host slab.

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

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from memo.config import Workload
from memo.execute.swap import ATTENTION, INPUT, TOKENS, SwapRuntime
from memo.model import torch_dtype
from memo.plan.alpha import SkeletalBytes, check_host, choose_alpha, host_bound


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


def prepare_swap(
    runtime: SwapRuntime, model, workload: Workload, alpha: Optional[float], host_budget: float,
    group=None,
) -> SwapReport:
    """Attach ``runtime`` to ``model`` (``workload``'s Megatron ``GPTModel``) and get it ready to
    train ``workload.micro_batch_size`` sequences of ``workload.seq`` tokens (all tensor-parallel
    ranks together) per micro-batch.

    Args:
        alpha: a fixed swap ratio, or ``None`` to solve for it.
        host_budget: bytes of host memory this process may fill with activations (M_host).
        group: the processes whose recomputations exchange tokens (the tensor-parallel group),
            which must keep the same ``k``; ``None`` for a process alone.

    Raises:
        HostMemoryError: if the swapped activations cannot fit in ``host_budget``.
    """
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
