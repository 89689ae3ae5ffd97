"""Before training: the layers' runtime (swapping, or a walk in tiles), measured and allocated.

The activation policies (:mod:`memo.policy`) get their runtimes ready here, for training, the GPU
pack and the benchmarks alike. Whole layers that swap get a :class:`SwapRuntime`
(:func:`prepare_swapped_layers`):

1. Run layer 0 forward on a random input of the training shape: the tensors it saves give the
   layer layout and S_input, S_attn, S_other; two more forwards give T_layer.
2. Check the host constraint (``oohm`` if even α = 0 does not fit) and allocate the rounding
   buffers and the pinned slab for the largest α the host allows.
3. Measure B by copying a rounding buffer into that slab on the D2H stream.
4. ``alpha=auto``: solve α; if it is smaller, allocate the slab again at its exact size.

Layers walked in tiles get a :class:`TiledLayers` (:func:`prepare_tiles`), whose tiles are units
of a swap runtime where they swap, α solved per tile (:func:`ready_tiles`).

The processes of a tensor-parallel group must swap the same number of tokens (the
recomputation's collectives see their shapes), so the smallest k over the group is used. Other
processes solve α on their own: under context parallelism each rank swaps its own tokens and
recomputes them without exchanging any, and its host budget is its share of its node's.
"""

import contextlib
import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo import hardware
from memo.config import ParallelConfig, Workload
from memo.hardware import Hardware
from memo.model import torch_dtype
from memo.model.context_parallel import batch_for_rank
from memo.model.documents import DocumentParams, Documents
from memo.model.placement import RuntimeReport
from memo.model.tiles import tiles_per_rank
from memo.results import finite
from memo.swap.alpha import SkeletalBytes, check_host, choose_alpha, host_bound
from memo.swap.layout import ATTENTION, EXTERNAL, INPUT, TOKENS
from memo.swap.runtime import SwapRuntime
from memo.swap.streams import Streams, streams_for
from memo.swap.tile_alpha import TileShape, solve_tiles
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

    def runtime_report(self) -> RuntimeReport:
        """The run's records of it: ``swap.*`` columns and a log line."""
        return RuntimeReport(
            row={f"swap.{k}": finite(v) for k, v in dataclasses.asdict(self).items()},
            summary=(f"swapping: alpha {self.alpha:.4f} ({self.alpha_binding}), {self.keep_tokens} of {self.tokens} "
                     f"tokens per chunk, T_layer {self.layer_time_s:.4f} s, B "
                     f"{self.host_bandwidth_bytes_per_s / 1e9:.2f} GB/s, host {self.host_bytes / 2**30:.2f} GiB"),
            skeletal_bytes=(self.skeletal_input_bytes, self.skeletal_attention_bytes, self.skeletal_other_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(run, device: torch.device, repeats: int = 2) -> float:
    """Seconds of ``run()`` (a forward with autograd recording), best of ``repeats``."""
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _bandwidth(runtime: SwapRuntime, device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of a copy from a rounding buffer into the host slab on the D2H stream."""
    runtime.ready_buffers()
    n = min(runtime.buffers[0].numel(), runtime.slab.numel())
    if n == 0:
        return math.inf
    src, dst, s = runtime.buffers[0][:n], runtime.slab[:n], runtime.streams
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        s.wait(s.d2h, s.record(s.compute))
        s.copy(s.d2h, dst, src)
        s.synchronize()
        best = min(best, time.perf_counter() - start)
    return n / best


def _min_over(value: Union[int, list[int]], device: torch.device, group) -> Union[int, list[int]]:
    """The smallest ``value`` (each, of a list: one collective) over the processes of ``group``."""
    values = value if isinstance(value, list) else [value]
    if group is not None and dist.get_world_size(group) > 1:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        values = [int(v) for v in t.tolist()]
    return values if isinstance(value, list) else values[0]


log = logging.getLogger("memo")


def sequence_chunks(parallel: ParallelConfig) -> int:
    """Chunks of ``S`` tokens in the tensors between sequence parallelism's gather and
    reduce-scatter: tp under sequence parallelism, else 1."""
    return parallel.tp if parallel.sequence_parallel else 1


def segments(parallel: ParallelConfig) -> int:
    """Runs of a layer input that each keep their own first ``k`` tokens: 2 where the input holds
    both of a context-parallel rank's chunks (one from each end of the sequence), else 1."""
    return 2 if parallel.cp > 1 and sequence_chunks(parallel) == 1 else 1


def host_share(node_host_bytes: float, devices_on_node: Optional[int]) -> float:
    """Bytes of host memory one process may fill with swapped activations: its GPU's share of
    its node's ``node_host_bytes``, shared by the ``devices_on_node`` GPUs the job holds there (a
    job on fewer GPUs than the node has has the whole node's for them). The fit predicts with the
    same share."""
    return node_host_bytes / (devices_on_node or 1)


def host_budget(hw: Hardware, device: torch.device, job_devices: int = 1) -> float:
    """M_host of a process training on ``device`` of ``hw`` in a job of ``job_devices`` processes:
    its share of the node's host memory (``hardware.host_memory_gib``, or what this machine has)
    among the job's processes on the node, and on a GPU no more than its share of what can be
    page-locked here now."""
    on_node = min(job_devices, hw.devices_per_node or 1)
    budget = host_share(hw.host_memory_bytes or hardware.host_memory_bytes(), on_node)
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


def prepare_swapped_layers(model, workload: Workload, device: torch.device, host_budget: float,
                           alpha: Optional[float] = None, streams: Optional[Streams] = None,
                           group=None) -> SwapRuntime:
    """A :class:`SwapRuntime` for ``model``'s layers (``workload``'s Megatron ``GPTModel``), ready
    to train ``workload.micro_batch_size`` sequences of ``workload.seq`` tokens (all
    tensor-parallel ranks together) per micro-batch: attached, measured, α solved (or ``alpha``,
    fixed) and its memory allocated (steps 1–4 above); its :meth:`SwapRuntime.report` says what
    was decided.

    Args:
        device: where the model lives (the rounding buffers go there).
        host_budget: bytes of host memory this process may fill with activations (M_host).
        streams: the copy streams; by default CUDA streams on a GPU, inline copies on the CPU.
        group: the processes whose recomputations exchange tokens (the tensor-parallel group),
            which must keep the same ``k``; ``None`` for a process alone.

    Raises:
        HostMemoryError: if the swapped activations cannot fit in ``host_budget``.
    """
    parallel = workload.parallel
    runtime = SwapRuntime(len(model.decoder.layers), streams or streams_for(device), device,
                          sequence_chunks(parallel), segments(parallel))
    ready_runtime(runtime, model, workload, alpha, host_budget, group)
    return runtime


def prepare_tiles(model, workload: Workload, tile_tokens: int, device: torch.device, swap: bool,
                  host_budget: float = 0.0, alpha: Union[None, float, Sequence[float]] = None,
                  streams: Optional[Streams] = None, group=None, pin: bool = True) -> TiledLayers:
    """A walk of ``model``'s layers in tiles of ``tile_tokens`` tokens, attached; with ``swap``
    its tiles are units of a swap runtime, measured, α solved per tile (or ``alpha``, fixed) and
    the host memory allocated (:func:`ready_tiles`; ``pin``: page-locked, on a GPU), else they
    recompute what they save.

    Raises:
        HostMemoryError: if the swapped activations cannot fit in ``host_budget``.
    """
    layers = list(model.decoder.layers)
    if not swap:
        walk = TiledLayers(tile_tokens, sequence_chunks=sequence_chunks(workload.parallel))
        walk.attach(layers)
        return walk
    walk = swapping_walk(workload, tile_tokens, len(layers), streams or streams_for(device), device)
    ready_tiles(walk, model, workload, alpha, host_budget, group, pin=pin)
    return walk


def _layer_arguments(model, workload: Workload, runtime: SwapRuntime) -> dict:
    """A layer's keyword arguments at the training shape, its input random (requiring grad), for
    finding its layout and timing it."""
    seq, device = workload.seq, runtime.device
    tokens = seq // (workload.parallel.cp * runtime.sequence_chunks)
    # A generator of its own: measuring must not move the RNG that training draws from.
    generator = torch.Generator(device.type).manual_seed(0)
    hidden = torch.randn(tokens, workload.micro_batch_size, model.config.hidden_size, dtype=torch_dtype(workload),
                         device=device, generator=generator, requires_grad=True)
    arguments = {"hidden_states": hidden, "attention_mask": None, "rotary_pos_emb": model.rotary_pos_emb(seq)}
    if workload.document_mask:  # attention within documents saves its own tensors, in its own order
        documents = {"documents": DocumentParams.of(Documents((0,), seq), device)}
        if workload.parallel.cp > 1:  # (this rank's tokens, as the rotary angles are)
            documents = batch_for_rank(documents, parallel_state.get_context_parallel_rank(), workload.parallel.cp)
        arguments["packed_seq_params"] = documents["documents"]
    return arguments


def swapping_walk(workload: Workload, tile_tokens: int, num_layers: int, streams: Streams, device: torch.device,
                  buffers: int = 2) -> TiledLayers:
    """A walk in tiles of ``tile_tokens`` tokens whose tiles are units of a swap runtime with
    ``buffers`` tile buffers (:func:`ready_tiles` gets it ready)."""
    chunks = sequence_chunks(workload.parallel)
    tiles = tiles_per_rank(workload.seq, workload.parallel.cp, tile_tokens)
    runtime = SwapRuntime(num_layers * tiles, streams, device, chunks, buffers=buffers, units_per_layer=tiles)
    return TiledLayers(tile_tokens, sequence_chunks=chunks, swap=runtime)


def tile_alphas(alpha: Union[None, float, Sequence[float]], tiles: int) -> list[float]:
    """α of each of ``tiles`` tiles: one for all, or one per tile."""
    if alpha is None:
        return [0.0] * tiles
    alphas = [float(alpha)] * tiles if isinstance(alpha, (int, float)) else [float(a) for a in alpha]
    if len(alphas) != tiles:
        raise ValueError(f"{len(alphas)} values of alpha for {tiles} tiles")
    for a in alphas:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha={a} is outside [0, 1]")
    return alphas


@dataclass(frozen=True)
class TileReport:
    """What a walk in tiles that swaps decided and measured: :meth:`row` goes into the result row
    (``tiles.*``), :meth:`tile_records` into ``layers.jsonl``."""

    tiles: int  # T: tiles of a layer on this device
    tile_tokens: int  # c, gathered over sequence parallelism
    buffers: int  # R
    checkpoint_every: int  # k
    alphas: tuple[float, ...]  # α of each tile actually used: keep_tokens / tokens of a tile
    keep_tokens: tuple[int, ...]
    binding: tuple[str, ...]  # per tile: "bandwidth", "host", "none" (α = 1) or "fixed"
    alpha_bandwidth: tuple[float, ...]  # per tile: the bandwidth constraint's bound alone
    tile_time_s: tuple[float, ...]  # T_f(t): forward seconds of each tile (first and last measured)
    host_bandwidth_bytes_per_s: float
    host_budget_bytes: int
    host_bytes: int  # the slab of every tile's swapped part and the checkpoint layers' inputs
    tile_buffer_bytes: int  # all R
    store_bytes: int  # the device's whole-sequence stores: keys, values, their accumulators, the input store
    skeletal_input_bytes: int  # of one tile
    skeletal_attention_bytes: int
    skeletal_other_bytes: int

    @classmethod
    def row_fields(cls) -> list[str]:
        """The keys of :meth:`row`."""
        scalars = [f.name for f in dataclasses.fields(cls) if not str(f.type).startswith("tuple")]
        return [*scalars, "alpha_min", "alpha_mean", "alpha_max", "first_tile_time_s", "last_tile_time_s"]

    def row(self) -> dict:
        """The scalar figures, α summarised (each tile's is in ``layers.jsonl``)."""
        scalars = {k: v for k, v in dataclasses.asdict(self).items() if not isinstance(v, tuple)}
        return {**scalars, "alpha_min": min(self.alphas), "alpha_mean": sum(self.alphas) / self.tiles,
                "alpha_max": max(self.alphas), "first_tile_time_s": self.tile_time_s[0],
                "last_tile_time_s": self.tile_time_s[-1]}

    def runtime_report(self) -> RuntimeReport:
        """The run's records of it: ``tiles.*`` columns, a line per tile, and a log line."""
        return RuntimeReport(
            row={f"tiles.{k}": finite(v) for k, v in self.row().items()},
            layer_records=tuple({"step": 0, **record} for record in self.tile_records()),
            summary=(f"tiles of {self.tile_tokens} tokens swapped: alpha {min(self.alphas):.3f} to "
                     f"{max(self.alphas):.3f} over {self.tiles} tiles, a checkpoint layer every "
                     f"{self.checkpoint_every}, host {self.host_bytes / 2**30:.2f} GiB"),
            skeletal_bytes=(self.skeletal_input_bytes, self.skeletal_attention_bytes, self.skeletal_other_bytes))

    def tile_records(self) -> list[dict]:
        """One record per tile: its α, tokens kept, what bound it, its bandwidth bound and time."""
        return [{"tile": t, "alpha": a, "keep_tokens": k, "binding": b,
                 "alpha_bandwidth": bw if math.isfinite(bw) else None, "tile_time_s": s}
                for t, (a, k, b, bw, s) in enumerate(zip(self.alphas, self.keep_tokens, self.binding,
                                                         self.alpha_bandwidth, self.tile_time_s, strict=True))]


def _tile_times(walk: TiledLayers, layer, kwargs: dict, tiles: int) -> list[float]:
    """T_f(t) of every tile: the first and the last timed (a forward with autograd recording,
    as training runs it), the others on the line between by the position of their block in the
    sequence (attention grows linearly with it; under context parallelism a rank's tiles are two
    runs of blocks, one from each end)."""
    device = walk.swap.device
    first, last = (_best_seconds(functools.partial(walk.time_tile, layer, kwargs, t), device)
                   for t in (0, tiles - 1))
    if tiles == 1:
        return [first]
    blocks = walk.blocks(kwargs["hidden_states"].shape[0])
    return [first + (last - first) * (j - blocks[0]) / (blocks[-1] - blocks[0]) for j in blocks]


def ready_tiles(walk: TiledLayers, model, workload: Workload, alpha: Union[None, float, Sequence[float]],
                host_budget: float, group=None, checkpoint_every: Optional[int] = None,
                pin: bool = True) -> TileReport:
    """Attach ``walk`` (made by :func:`swapping_walk`) to ``model``'s layers, find a tile's layout,
    solve α per tile and k (:mod:`memo.swap.tile_alpha`; ``alpha`` fixes α, one for all tiles or
    one per tile; ``checkpoint_every`` fixes k) and allocate the host slab of every tile's swapped
    part and the host memory of the checkpoint layers' inputs; the device's stores and tile
    buffers follow in the first step. The walk keeps the report (:meth:`TiledLayers.report`).
    The tensor-parallel ranks of ``group`` keep the smallest ``k`` of each tile and the largest
    checkpoint interval, so that their recomputations' collectives match.

    Raises:
        HostMemoryError: if even α = 0 fits the host with no checkpoint interval.
    """
    with _released_on_failure(walk):
        walk.tile_report = _ready_tiles(walk, model, workload, alpha, host_budget, group, checkpoint_every, pin)
        return walk.tile_report


@contextlib.contextmanager
def _released_on_failure(placement: Union[SwapRuntime, TiledLayers]):
    """Give ``placement``'s memory back if getting it ready fails: a registered slab must not
    outlive the failure."""
    try:
        yield
    except BaseException:
        placement.release()
        raise


def _ready_tiles(walk: TiledLayers, model, workload: Workload, alpha, host_budget: float, group,
                 checkpoint_every: Optional[int], pin: bool) -> TileReport:
    runtime = walk.swap
    device = runtime.device
    # the ranks that must agree solve with the same budget, so that none refuses alone
    host_budget = _min_over(int(min(host_budget, 2**62)), device, group)
    layers = list(model.decoder.layers)
    walk.attach(layers)
    kwargs = _layer_arguments(model, workload, runtime)
    hidden = kwargs["hidden_states"]
    layout = walk.discover(layers[0], kwargs)
    tiles, segment = runtime.units_per_layer, layout.segment_tokens
    tile_input = next(s.nbytes for s in layout.slots if s.kind == EXTERNAL)
    sizes = SkeletalBytes(tile_input, layout.bytes_of(ATTENTION), layout.bytes_of(TOKENS))
    shape = TileShape(sizes, len(layers), tiles, runtime.buffer_count)
    times = _tile_times(walk, layers[0], kwargs, tiles)
    fixed = None if alpha is None else tile_alphas(alpha, tiles)
    pin = pin and device.type == "cuda"

    def allocate(solution) -> tuple[list[int], int]:
        *keeps, k = _min_over([math.floor(a * segment + 1e-9) for a in solution.alphas]
                              + [-solution.checkpoint_every], device, group)
        k = -k
        if keeps * len(layers) != list(runtime.keeps):
            runtime.allocate(layout, keeps * len(layers), pin)
        return keeps, k

    # the largest α the host allows first (bandwidth unbounded), to measure B into that slab
    keeps, _ = allocate(solve_tiles(shape, [math.inf] * tiles, math.inf, host_budget, fixed, checkpoint_every))
    bandwidth = _bandwidth(runtime, device) if runtime.swapped_units else math.inf
    solution = solve_tiles(shape, times, bandwidth, host_budget, fixed, checkpoint_every)
    keeps, k = allocate(solution)
    walk.checkpoint_every = k
    walk.allocate_inputs(len(layers), hidden.detach(), pin)
    stores = sum(t.numel() * t.element_size() for t in vars(walk.stores).values()) + \
        hidden.numel() * hidden.element_size()
    walk.stores = None  # the device's memory is requested in the first step, as a trace sees it
    runtime.buffers = []
    inputs = walk.inputs.host
    return TileReport(
        tiles=tiles, tile_tokens=walk.tile_tokens, buffers=runtime.buffer_count, checkpoint_every=k,
        alphas=tuple(kt / segment for kt in keeps), keep_tokens=tuple(keeps), binding=solution.binding,
        alpha_bandwidth=solution.alpha_bandwidth, tile_time_s=tuple(times),
        host_bandwidth_bytes_per_s=bandwidth, host_budget_bytes=int(host_budget),
        host_bytes=runtime.slab.numel() + inputs.numel() * inputs.element_size(),
        tile_buffer_bytes=runtime.rounding_buffer_bytes, store_bytes=stores, skeletal_input_bytes=sizes.input,
        skeletal_attention_bytes=sizes.attention, skeletal_other_bytes=sizes.other)


def ready_runtime(runtime: SwapRuntime, model, workload: Workload, alpha: Optional[float],
                  host_budget: float, group=None) -> SwapReport:
    """Attach ``runtime`` to ``model``'s layers, measure a layer, solve α and allocate the
    buffers and the slab (steps 1–4 above): :func:`prepare_swapped_layers`'s work on a runtime it
    did not make (one with another segment count, in the tests). The runtime keeps the report
    (:meth:`SwapRuntime.report`)."""
    with _released_on_failure(runtime):
        runtime.swap_report = _ready_runtime(runtime, model, workload, alpha, host_budget, group)
        return runtime.swap_report


def _ready_runtime(runtime: SwapRuntime, model, workload: Workload, alpha: Optional[float],
                   host_budget: float, group) -> SwapReport:
    device = runtime.device
    layers = list(model.decoder.layers)
    runtime.attach(layers)
    kwargs = _layer_arguments(model, workload, runtime)
    layout = runtime.discover(layers[0], kwargs)
    layer_time = _best_seconds(functools.partial(layers[0].run, **kwargs), device)
    del kwargs
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
        tokens=layout.tokens,
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
