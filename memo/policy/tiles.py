"""memo's layers walked in sequence tiles (``method.tile_tokens``): each layer runs one tile of
tokens at a time beside a few whole-sequence stores (:class:`memo.swap.TiledLayers`); for ``memo``
and ``full_swap`` every tile is a unit of a swap runtime, α solved per tile with a checkpoint
interval k (:mod:`memo.swap.tile_alpha`), for ``full_recompute`` a tile recomputes what it saves.

Predicted from a template of three layers of three tiles (:mod:`memo.profile.template`); under
context parallelism the stores of keys, values and their float32 accumulators hold the whole
sequence on every rank (:meth:`SequenceTiles.cp_buffers`).
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from memo.config import ConfigError, Method, ParallelConfig, Workload
from memo.hardware import Hardware
from memo.model import LayerBuild, head_size
from memo.model.placement import LayerRuntime
from memo.model.tiles import rank_tile_blocks, tiles_per_rank
from memo.policy.base import ActivationPolicy, LayerSeconds, OutOfHostMemory, Placed, Situation, _host_lines
from memo.policy.whole_layers import alpha_line, rounding_buffer_bytes
from memo.profile.template import MIN_TRACED_TILE, iteration_template
from memo.profile.trace import Trace
from memo.swap import HostMemoryError, host_budget, prepare_tiles
from memo.swap.alpha import SkeletalBytes
from memo.swap.streams import Streams
from memo.swap.tile_alpha import TileShape, TileSolution, solve_tiles

log = logging.getLogger("memo")


@dataclass(frozen=True)
class SequenceTiles(ActivationPolicy):
    """Layers walked in tiles of ``workload.layer_tile_tokens`` tokens, swapped (``memo``,
    ``full_swap``) or recomputed (``full_recompute``)."""

    has_runtime: ClassVar[bool] = True

    method: Method

    @property
    def swaps(self) -> bool:
        return self.method.swaps

    @property
    def layers(self) -> LayerBuild:
        return LayerBuild(activations="swap" if self.swaps else "recompute")

    @property
    def traced(self) -> ActivationPolicy:
        """The walk as it runs (its trace swaps nothing: α = 0, the most a tile recomputes)."""
        return SequenceTiles(dataclasses.replace(self.method, alpha=None))

    def trace_runtime(self, model, workload: Workload, device: torch.device) -> LayerRuntime:
        """The walk, its host memory outside the trace (which follows the device): the least of it
        (α = 0), and on a GPU none of it page-locked."""
        return prepare_tiles(model, workload, workload.layer_tile_tokens, device, self.swaps, host_budget=2**60,
                             alpha=0.0, pin=False)

    def planned_trace(self, workload: Workload) -> Optional[Trace]:
        """Three layers of three tiles, every request sized at the run's length and tile: one
        level-1 block serves every tile of a layer (:mod:`memo.plan.bilevel`)."""
        if workload.parallel.cp > 1:
            raise ConfigError(f"mode=plan plans one rank's layers walked in tiles without context parallelism, "
                              f"not parallel.cp={workload.parallel.cp}; set parallel.cp=1")
        layers, tile = workload.model.num_layers, workload.layer_tile_tokens
        log.info("planning %d layers of %d tiles as three layers of three tiles, each request sized at "
                 "seq=%d and tiles of %d tokens", layers, tiles_per_rank(workload.seq, 1, tile), workload.seq, tile)
        return iteration_template(workload, layers, self.traced).instance(
            workload.seq, layers, loss_tile_tokens=workload.loss_tile_tokens, layer_tile_tokens=tile)

    # ------------------------------------------------------------------ training

    @property
    def alpha(self) -> Optional[float]:
        return self.method.alpha

    def host_budget(self, hw: Hardware, device: torch.device, job_devices: int) -> float:
        return host_budget(hw, device, job_devices) if self.swaps else 0.0

    def prepare(self, model, workload: Workload, device: torch.device, host_budget: float,
                streams: Optional[Streams] = None, group=None) -> LayerRuntime:
        return prepare_tiles(model, workload, workload.layer_tile_tokens, device, self.swaps, host_budget,
                             self.alpha, streams, group)

    def share_in_flight(self, runtimes: list[LayerRuntime]) -> None:
        """The walks of one chunk's micro-batches in flight share the stores of keys, values and
        their gradients, which live within one layer's pass (their inputs' host memory, tile
        buffers and input store stay each walk's own)."""
        for walk in runtimes[1:]:
            walk.share_stores(runtimes[0])

    # ------------------------------------------------------------------ layouts a search tries

    def layer_tiles_tried(self, tried: tuple[Optional[int], ...], own: Optional[int]) -> tuple[Optional[int], ...]:
        return tuple(dict.fromkeys([*tried, own]))

    def candidate_layout(self, workload: Workload, parallel: ParallelConfig,
                         seq: Optional[int]) -> Optional[ParallelConfig]:
        """Under context parallelism tried without sequence parallelism (as training runs them)
        and with one exchange (the walk gathers into its stores whatever it is named); tiles below
        what the fit models (:data:`MIN_TRACED_TILE` tokens a sequence-parallel rank) or that do
        not split a fixed ``seq`` (each of the ``2·cp`` chunks) are not tried."""
        tile = workload.layer_tile_tokens
        layout = parallel if parallel.cp == 1 else dataclasses.replace(parallel, sequence_parallel=False)
        if layout.cp > 1 and layout.cp_comm_type != self.exchanges[0]:
            return None
        chunks = layout.tp if layout.sequence_parallel else 1
        if tile // chunks < MIN_TRACED_TILE:
            log.info("tiles of %d tokens under tp=%d cp=%d%s: not tried, the fit models tiles of at least %d tokens "
                     "a rank", tile, layout.tp, layout.cp, " with sequence parallelism" if layout.sequence_parallel
                     else "", MIN_TRACED_TILE)
            return None
        if seq is not None and seq % (tile * (2 * layout.cp if layout.cp > 1 else 1)):
            return None
        return layout

    # ------------------------------------------------------------------ prediction

    def cp_exchange(self, parallel: ParallelConfig) -> str:
        """"stores": the rank's keys and values gathered into the stores, their gradients summed."""
        return "stores"

    def cp_buffers(self, workload: Workload) -> int:
        """Bytes a context-parallel rank's walk holds beyond a rank alone with its tokens: the
        stores of keys, values and their float32 accumulators hold the whole sequence on every
        rank (``2·b·(s − s/cp)·g·(e + 4)`` more, ``g`` the key/value channels of a tensor-parallel
        rank), and one chunk of scratch (``b·s/(2·cp)·g·4``): the gather of keys and values
        stages one chunk of them (``e`` bytes an element), the reduce-scatter of their float32
        gradients one chunk of those, apart; 0 without context parallelism (gloo and NCCL may
        stage parts of the collectives, not counted)."""
        model, parallel, b, e = workload.model, workload.parallel, workload.micro_batch_size, workload.dtype_bytes
        cp, s = parallel.cp, workload.seq
        if cp == 1:
            return 0
        groups = model.num_query_groups or model.num_attention_heads
        g = head_size(model) * groups // parallel.tp
        wide = 8 if e == 8 else 4
        return 2 * b * (s - s // cp) * g * (e + wide) + b * s // (2 * cp) * g * wide

    def recompute_seconds(self, workload: Workload, seconds: LayerSeconds, alpha: float = 1.0,
                          checkpoint_every: int = 1) -> float:
        """The keys and values made again before the backward tiles (the norm and the QKV
        projection's keys and values of every tile; the last layer's, whose keys the store still
        holds, are counted too); recomputing, every tile's forward again with a graph; swapped, a layer between
        checkpoints made again from the one below, attention's output kept: (k − 1)/2 layers'
        token-wise work on average. (A tile's dropped tokens are not counted: every tile's α is
        taken as 1 here.)"""
        if not self.swaps:
            return seconds.forward + seconds.keys_values
        return seconds.keys_values + (checkpoint_every - 1) / 2 * (seconds.forward - seconds.attention)

    def place(self, situation: Situation) -> Placed:
        s, w = situation, situation.workload
        tile = w.layer_tile_tokens
        trace = s.template.instance(s.tokens, s.layers * s.in_flight, loss_tile_tokens=w.loss_tile_tokens,
                                    layer_tile_tokens=tile)
        if not self.swaps:
            return Placed(trace, recompute_s=self.recompute_seconds(w, s.seconds))
        blocks = tile_blocks(w)
        sizes = s.template.tile_skeletal(tile)
        try:  # each runtime of a pipeline stage's micro-batches in flight its share of the host budget
            plan = tile_host_plan(sizes, s.layers, tile_forward_times(s.seconds, blocks), self.alpha, s.host_link,
                                  s.host_budget / s.in_flight)
        except HostMemoryError as error:
            shape = TileShape(sizes, s.layers, len(blocks), 2)
            need = s.in_flight * math.ceil(shape.host_bytes([self.alpha or 0.0] * len(blocks), max(s.layers, 1)))
            raise OutOfHostMemory(str(error), need, alpha=self.alpha) from None
        alphas = plan.solution.alphas
        # the trace holds one walk's tile buffers and input store; the other runtimes of a pipeline
        # stage have theirs beside them (the stores of keys and values they share)
        others = (s.in_flight - 1) * (rounding_buffer_bytes(sizes) + input_store_bytes(w))
        return Placed(trace, host_bytes=plan.per_device * s.in_flight, rounding_buffers=others,
                      recompute_s=self.recompute_seconds(w, s.seconds, checkpoint_every=plan.solution.checkpoint_every),
                      swap_exposed_s=plan.exposed_copy_s, alpha=sum(alphas) / len(alphas),
                      alpha_binding=plan.solution.binding[alphas.index(min(alphas))],  # the smallest α's
                      alpha_bandwidth=min(plan.solution.alpha_bandwidth), tiles=plan)

    def report_lines(self, prediction) -> list[str]:
        if not self.swaps:
            return super().report_lines(prediction)
        return _host_lines(prediction) + [alpha_line(prediction)]


def input_store_bytes(workload: Workload) -> int:
    """The device store a swapping walk brings a layer's input back into: the layer input of one
    rank (``b·s/cp`` tokens, over tp under sequence parallelism, ``h`` wide)."""
    p = workload.parallel
    chunks = p.tp if p.sequence_parallel else 1
    return workload.micro_batch_size * workload.seq // p.cp // chunks * workload.model.hidden_size * workload.dtype_bytes


def tile_blocks(workload: Workload) -> list[int]:
    """Where rank 0's tiles are in the sequence, in tiles: all of them without context
    parallelism, else those of its two chunks (the first and the last of ``2·cp``)."""
    cp = workload.parallel.cp
    return rank_tile_blocks(tiles_per_rank(workload.seq, cp, workload.layer_tile_tokens), cp, 0)


def tile_forward_times(seconds: LayerSeconds, blocks: list[int]) -> list[float]:
    """``T_f(t)``, seconds, of each of a rank's tiles of a layer, the tiles at ``blocks`` (their
    places in the sequence, in tiles): the layer's token-wise work and collectives shared by its
    tiles, attention by its blocks (a tile at block ``j`` attends to ``j`` blocks in full and half
    of its own, so the rank's attention over its tiles is Σ_j (j + ½)·c² of 2·t·s, each tile its
    share)."""
    tiles = len(blocks)
    weights = [j + 0.5 for j in blocks]
    return [(seconds.forward - seconds.attention) / tiles + seconds.attention * w / sum(weights) for w in weights]


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
