"""MEMO in sequence tiles: each transformer layer walked in tiles of tokens, its device memory one
tile's work plus a few declared stores of the whole sequence.

Everything in a layer but core attention is token-local, so Megatron's own layer forward runs on
one tile of ``c`` tokens at a time (its norms, QKV, RoPE at the tile's positions, projection,
residuals and MLP, with their tensor-parallel collectives). Core attention is the one exception:
the tile's keys and values are written into the **key/value store** and its queries attend over
the store's blocks ``0 .. t`` (:mod:`memo.model.tiled_attention`).

Without swapping (``full_recompute``), the forward of a layer keeps no graph: for ``t = 0 .. T − 1``
run the layer on tile ``t``; the output rows go to the layer's output, the next layer's input. What
the layer keeps for its backward pass is its input (as the next layer's input, the residual
stream).

Backward of a layer, given the gradient of its output:

1. *Rebuild*: each tile runs up to core attention (norm, QKV, RoPE) without a graph, writing its
   keys and values into the store; the float32 **key/value gradient accumulators** are zeroed.
2. For ``t = T − 1 .. 0``: the tile is run again with a graph; core attention computes its output
   from the store, and its backward runs
   the blocks with the merged output and log-sum-exp, adding every block's key and value
   gradients into the accumulators. Only tiles ``≥ t`` see block ``t``, so after them block
   ``t``'s gradients are final and go back through RoPE and QKV with the rest of the tile: one
   ``torch.autograd.backward`` per tile gives the tile's input gradient and adds its share to
   every weight's gradient.

Under context parallelism (rank ``r`` of ``cp`` holds chunks ``r`` and ``2·cp − 1 − r`` of the
sequence, :mod:`memo.model.context_parallel`) the tiles are those of the rank's two chunks and the
store holds the whole sequence: a tile's keys and values cannot wait for the other ranks' tiles,
so each rank first makes its keys and values without a graph (the rebuild) and the store is
gathered over the ranks; the forward tiles then attend over it. In the backward pass, after the
rebuild and the gather, the reverse walk hands back only the query gradient, adding the key and
value gradients of every block into the accumulators, which are then summed over the ranks; a
second pass runs each tile up to its keys and values again and takes their summed gradients back
through RoPE, QKV and the norm. The two passes' input and weight gradients add up (backward is
linear), to what one pass gives without context parallelism.

The stores live as long as the walk: keys and values ``2·s·h_kv/tp`` elements in the activation
dtype, their gradient accumulators as many in float32, for the whole sequence whatever cp is.
Without swapping each layer keeps its input (the residual stream, ``s·h/tp``) until the layer's
backward; the gradient of a layer's input is a new ``s·h/tp`` tensor, the one of
its output freed when the layer's backward returns.

**Swapping** (``memo``, ``full_swap``; :class:`memo.swap.runtime.SwapRuntime` given as ``swap``):
every tile of every layer is a unit of the runtime (``u = i·T + t``). A tile's forward runs with a
graph, begun by :class:`memo.swap.tiled_forward._TileStart` (which holds nothing of the layer
input) and ended by :class:`memo.swap.tiled_forward._TileEnd` (an empty tensor, so the tile's
output is not held): its saved tensors live in the runtime's tile buffers and go to the host as its
α says, attention's output and log-sum-exp whole. The inputs of the checkpoint layers (every
``checkpoint_every``-th) go to the host (:class:`memo.swap.layer_inputs.LayerInputs`); a layer whose
every unit stays in the buffers keeps its input on the device.
A layer's backward brings its input back into the input store, or makes it there from the
checkpoint below (:meth:`TiledLayers._chain`: the layers between run tile by tile with their kept
attention outputs), makes the keys and values again, then for each tile from the last lets the
runtime bring the tile's buffer back and recompute its dropped tokens, and runs the tile's kept
graph backward.

The walk is split by pass: its forward (:mod:`memo.swap.tiled_forward`), its backward
(:mod:`memo.swap.tiled_backward`) and its core attention (:mod:`memo.swap.tile_attention`), over
what they share (:mod:`memo.swap.tile_state`); here are its set-up, its tiles and the contracts it
keeps with the layers and the training loop.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist

from memo.model.documents import Documents, documents_of
from memo.model.placement import Accounting, RuntimeReport, check_layer_arguments
from memo.model.tiles import batch_in_tile_order, rank_tile_blocks
from memo.swap.layer_inputs import LayerInputs
from memo.swap.runtime import SwapRuntime
from memo.swap.tile_attention import TileAttention
from memo.swap.tile_state import FORWARD, FORWARD_BLOCK, WHOLE_LAYER_MODES, Tile, TileStores
from memo.swap.tiled_backward import TileBackward
from memo.swap.tiled_forward import TileForward


def _unnamed(layer: int, part: str) -> None:
    """Where the walk's phases go when nobody names them."""


class TiledLayers(TileForward, TileBackward, TileAttention):
    """The per-tile walk of every layer of one model replica (see the module docstring): the
    :class:`memo.model.placement.Placement` of its layers and their core attention, and their
    :class:`memo.model.placement.LayerRuntime`.

    Args:
        tile_tokens: ``c``, tokens per tile as attention sees them: gathered over the
            ``sequence_chunks`` ranks of sequence parallelism, of which each holds ``c /
            sequence_chunks`` rows of the layer input (rows that must divide its own).
        sequence_chunks: tp under sequence parallelism, else 1. The tokens must be in tile order
            (:func:`memo.model.tiles.tile_order`), so that a tile gathered over the ranks is
            ``c`` consecutive tokens of the sequence.
    """

    def __init__(self, tile_tokens: int, sequence_chunks: int = 1, swap: Optional[SwapRuntime] = None,
                 checkpoint_every: int = 1):
        if tile_tokens <= 0 or tile_tokens % sequence_chunks:
            raise ValueError(f"tile_tokens={tile_tokens} must be a positive multiple of {sequence_chunks}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every}: every k-th layer keeps its input, k >= 1")
        self.checkpoint_every = checkpoint_every  # k: layers 0, k, 2k, ... send their input to the host
        self.tile_tokens = tile_tokens
        self.tile_rows = tile_tokens // sequence_chunks
        self.swap = swap
        self.inputs: Optional[LayerInputs] = None  # under swapping: the layer inputs, on the host
        self._anchor = torch.empty(0, requires_grad=True)  # makes a tile's input require grad
        self._input_grad: Optional[torch.Tensor] = None  # rows of the layer input's gradient being made
        self._output_grad: Optional[torch.Tensor] = None  # rows of the layer output's gradient
        self._chain_output: Optional[torch.Tensor] = None  # attention's kept output, in a CHAIN tile
        self._held = _HeldStores()
        self.cp_group = None  # the context-parallel group of the layers' attention, if any
        self.cp, self.cp_rank = 1, 0  # its size and this rank's place in it
        self.layers: list = []
        self._index: dict[int, int] = {}
        self._tile: Optional[Tile] = None
        # the documents kept apart of the micro-batch being walked (its DocumentParams'), if any
        self.documents: Optional[Documents] = None
        # called with (layer, part of its pass) as the walk goes: "fwd.t<t>", "rebuild" (before
        # the backward tiles, and under context parallelism before the forward ones too),
        # "bwd.t<t>", "bwd.kv.t<t>" (context parallelism), and the layer's own "fwd" or "bwd" when
        # its tiles are done (the profiler names its phases so); within a tile, each block of its
        # attention as "<part>.b<j>" (forward kernels) or "<part>.db<j>" (backward kernels)
        self.on_phase: Callable[[int, str], None] = _unnamed
        # under swapping, what getting it ready decided (memo.swap.prepare.ready_tiles)
        self.tile_report = None

    @property
    def stores(self) -> Optional[TileStores]:
        """The stores of keys, values and their gradient accumulators (made by the first pass)."""
        return self._held.stores

    @stores.setter
    def stores(self, stores: Optional[TileStores]) -> None:
        self._held.stores = stores

    @property
    def store_writes(self) -> int:
        """Passes that wrote the stores' keys and values so far: a layer's backward finds the
        count its forward left when nothing wrote them since (the last layer's, as a rule)."""
        return self._held.writes

    @store_writes.setter
    def store_writes(self, writes: int) -> None:
        self._held.writes = writes

    def share_stores(self, other: "TiledLayers") -> None:
        """Use ``other``'s stores from now on, this walk's own given back: walks of one model
        chunk's micro-batches in flight (:mod:`memo.swap.in_flight`), whose passes never overlap,
        so that the stores exist once. A pass of either counts as a write of both's keys."""
        self._held = other._held

    def name_phases(self, on_phase: Optional[Callable[[int, str], None]]) -> None:
        """Tell ``on_phase`` of the walk's parts as they begin (see :attr:`on_phase`); None: stop."""
        self.on_phase = on_phase or _unnamed

    def accounting(self) -> Optional[Accounting]:
        """Under swapping, the tiles' skeletal bytes by layer since the last call."""
        return self.swap.accounting() if self.swap is not None else None

    def device_buffers(self) -> list[torch.Tensor]:
        """Under swapping, the tile buffers, once the first forward pass made them."""
        return self.swap.device_buffers() if self.swap is not None else []

    def device_stores(self) -> list[torch.Tensor]:
        """The stores of keys, values and their accumulators, and under swapping the layer input's,
        once the first forward pass made them."""
        stores = [] if self.stores is None else [self.stores.keys, self.stores.values, self.stores.key_grads,
                                                 self.stores.value_grads]
        if self.inputs is not None and self.inputs.store is not None:
            stores.append(self.inputs.store)
        return stores

    def report(self) -> RuntimeReport:
        """What getting the walk ready decided and measured."""
        if self.tile_report is not None:
            return self.tile_report.runtime_report()
        return RuntimeReport(summary=f"layers walked in tiles of {self.tile_tokens} tokens")

    def token_order(self, micro_batch: dict) -> dict:
        """A micro-batch's tokens (``[b, s]`` tensors) in the order the walk needs them."""
        if self.tile_rows == self.tile_tokens:
            return micro_batch
        return batch_in_tile_order(micro_batch, self.tile_tokens, self.tile_tokens // self.tile_rows)

    def attach(self, layers: list) -> None:
        """Let ``layers`` (:class:`memo.model.layer.MemoTransformerLayer`, in order) run in tiles:
        the walk takes over each layer's forward and its core attention; the layer's other
        modules run as they are, one tile at a time (under swapping, with their saved tensors in
        the tile buffers)."""
        if self.swap is not None:
            self.swap.attach(layers)
        self.layers = list(layers)
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        groups = {layer.self_attention.core_attention.cp_group for layer in layers}
        if len(groups) > 1:
            raise ValueError("the layers walked in tiles must share one context-parallel group")
        self.cp_group = next(iter(groups), None)
        if self.cp_group is not None:
            self.cp, self.cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        for layer in layers:
            layer.place(self)
            layer.self_attention.core_attention.place(self)

    def detach(self) -> None:
        """Give the layers back to their own forward."""
        if self.swap is not None:
            self.swap.detach()
        for layer in self.layers:
            layer.place(None)
            layer.self_attention.core_attention.place(None)

    def release(self) -> None:
        """Give back the stores, and under swapping the tile buffers and the host memory, once
        the copies in flight are done (idempotent)."""
        if self.swap is not None:
            self.swap.release()
        if self.inputs is not None:
            self.inputs.release()
            self.inputs = None
        self.stores = None

    # -------------------------------------------------------------- swapping

    def discover(self, layer, kwargs: dict):
        """The layout of what one tile of ``layer`` saves (Megatron's keyword arguments of a whole
        layer input, which must require grad): tile 0 run once under the swap runtime's
        discovery, its input left to the walk (EXTERNAL)."""
        x = kwargs["hidden_states"]
        self._allocate(layer, x)
        rows = slice(0, self.tile_rows)
        tile_x = x[rows].detach().requires_grad_(True)
        tiled = self._tile_kwargs(kwargs, tile_x, 0)
        self._tile, self.documents = Tile(FORWARD, 0, 0, 0), documents_of(kwargs)
        try:
            with torch.enable_grad():
                return self.swap.discover(layer, tiled, external_input=True)
        finally:
            self._tile, self.documents = None, None

    def time_tile(self, layer, kwargs: dict, t: int) -> None:
        """Run tile ``t`` of ``layer`` forward once, with autograd recording, as training does
        but for the swap runtime's copies (the stores as they are): for timing it."""
        x = kwargs["hidden_states"]
        _, rows, j = self._tiles(x.shape[0])[t]
        self._allocate(layer, x)
        self._tile, self.documents = Tile(FORWARD, 0, t, j), documents_of(kwargs)
        try:
            with torch.enable_grad():
                layer.run(**self._tile_kwargs(kwargs, x[rows].detach().requires_grad_(True), t))
        finally:
            self._tile, self.documents = None, None

    def allocate_inputs(self, layers: int, x: torch.Tensor, pin: bool) -> None:
        """Host memory for the inputs of the checkpoint layers among ``layers`` (every k-th) but
        those whose every tile stays in the buffers, shaped as ``x``; the device's one input
        store, into which a layer's input comes back for its backward pass, is made at the first
        forward pass."""
        if self.inputs is not None:
            self.inputs.release()
        host = sum(1 for i in range(0, layers, self.checkpoint_every) if not self._resident_layer(i))
        self.inputs = LayerInputs.empty(host, x, pin)

    def _resident_layer(self, index: int) -> bool:
        """Whether every tile of layer ``index`` stays in the buffers: its input stays on the
        device too (the last layers when a layer has fewer tiles than there are buffers)."""
        return self.swap.resident(index * self._count)

    # ----------------------------------------------------------------- the walk

    def forward(self, layer, kwargs: dict):
        """``layer``'s forward pass over its tiles (keyword arguments as Megatron passes them):
        ``(output, None)``."""
        hidden = self._walked(kwargs)
        if not hidden.requires_grad:
            # the weights are not the walk's inputs: without a graph to the input no backward
            # would run, and their gradients would be lost silently
            raise ValueError("a layer walked in tiles needs an input that requires grad")
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return _TiledLayer.apply(hidden, self, layer, self._index[id(layer)], rest), None

    def evaluate(self, layer, kwargs: dict):
        """``layer``'s forward pass over its tiles without grad (validation): ``(output, None)``.
        Nothing is kept or swapped; the keys and values go into the walk's stores, so that it
        holds what its forward holds, less the graph (no whole-sequence attention is made)."""
        hidden = self._walked(kwargs)
        try:
            return self.run_forward(layer, self._index[id(layer)], hidden, kwargs), None
        finally:
            self.documents = None

    def _walked(self, kwargs: dict) -> torch.Tensor:
        """The layer input of Megatron's keyword arguments ``kwargs``, once they are checked to be
        what the walk takes; the walk's documents are theirs from then on."""
        check_layer_arguments(kwargs, "memo's tiles")
        self.documents = documents_of(kwargs)
        hidden = kwargs["hidden_states"]
        if self.documents is not None and (self.cp > 1 or self.documents.tokens != hidden.shape[0] // self.tile_rows
                                           * self.tile_tokens):
            raise ValueError(f"memo's tiles keep the documents of a whole sequence apart, without context "
                             f"parallelism: documents of {self.documents.tokens} tokens, a layer input of "
                             f"{hidden.shape[0]} rows")
        if hidden.shape[0] % (self.tile_rows * self._chunks):
            raise ValueError(f"{hidden.shape[0]} rows cannot be cut into {self._chunks} chunk(s) of tiles of "
                             f"{self.tile_rows}")
        return hidden

    @property
    def _chunks(self) -> int:
        """Chunks of the sequence a rank's layer input holds: two under context parallelism."""
        return 1 if self.cp == 1 else 2

    def _tiles(self, rows: int) -> list[tuple[int, slice, int]]:
        """``(t, this rank's rows of tile t, its block of the store)`` for a layer input of ``rows``
        rows: under context parallelism the first half of the tiles are chunk ``r``'s, the second
        chunk ``2·cp − 1 − r``'s."""
        r = self.tile_rows
        blocks = rank_tile_blocks(rows // r, self.cp, self.cp_rank)
        return [(t, slice(t * r, (t + 1) * r), j) for t, j in enumerate(blocks)]

    def blocks(self, rows: int) -> list[int]:
        """Where each of this rank's tiles is in the sequence, in blocks of ``c`` tokens, for a
        layer input of ``rows`` rows."""
        return [j for _, _, j in self._tiles(rows)]

    def block_phases(self, layer: int, part: str, kind: str = FORWARD_BLOCK) -> Callable[[Optional[int]], None]:
        """What tells :attr:`on_phase` of the attention blocks of ``layer``'s ``part`` (a tile's
        phase, ``fwd.t<t>`` or ``bwd.t<t>``): block ``j``'s phase is ``<part>.<kind><j>``, and
        ``part`` again once the blocks are done."""
        return lambda j: self.on_phase(layer, part if j is None else f"{part}.{kind}{j}")

    def _tile_kwargs(self, kwargs: dict, hidden: torch.Tensor, index: int) -> dict:
        rope, c = kwargs.get("rotary_pos_emb"), self.tile_tokens
        # the angles of the tile's gathered tokens: rows t·c .. (t + 1)·c of this rank's table (under
        # context parallelism Megatron's table holds the rank's two chunks, in its rows' order)
        return dict(kwargs, hidden_states=hidden,
                    rotary_pos_emb=None if rope is None else rope[index * c:(index + 1) * c])

    def _run(self, layer, kwargs: dict, hidden: torch.Tensor, tile: "Tile", rows: Optional[slice] = None):
        """The layer on one tile; with ``rows`` (the tile's rows of the layer input), as a unit of
        the swap runtime, whose backward reads those rows of the input store."""
        tiled = self._tile_kwargs(kwargs, hidden, tile.index)
        self._tile = tile
        self.on_phase(tile.layer, tile.mode if tile.mode in WHOLE_LAYER_MODES else f"{tile.mode}.t{tile.index}")
        try:
            if rows is None:
                return layer.run(**tiled)[0]
            unit = tile.layer * self._count + tile.index
            return self.swap.forward_unit(unit, layer, tiled, lambda: self.inputs.current[rows])[0]
        finally:
            self._tile = None

    def _allocate(self, layer, x: torch.Tensor) -> None:
        """The stores (once, or again for another length), before the layer's tiles:
        ``[tokens, b, groups, dim]`` from the layer's attention."""
        attention = layer.self_attention
        tokens = x.shape[0] // self.tile_rows * self.tile_tokens  # this rank's
        d, b = attention.hidden_size_per_attention_head, x.shape[1]
        shape = (tokens * self.cp, b, attention.num_query_groups_per_partition, d)
        if self.stores is None or tuple(self.stores.keys.shape) != shape or self.stores.keys.dtype != x.dtype:
            self.stores = None  # the old ones go first
            self.stores = TileStores.empty(shape, x.dtype, x.device)
        self.store_writes += 1  # (every pass that writes keys and values into the stores begins here)

    @property
    def _count(self) -> int:
        """``T``: tiles of one layer on this rank."""
        return self.swap.units_per_layer


class _HeldStores:
    """A walk's stores and the count of passes that wrote them (shared by the walks of one model
    chunk's micro-batches in flight, :meth:`TiledLayers.share_stores`)."""

    def __init__(self):
        self.stores: Optional[TileStores] = None
        self.writes = 0


class _TiledLayer(torch.autograd.Function):
    """One layer walked in tiles: the autograd node between its input and output."""

    @staticmethod
    def forward(ctx, hidden, walk: TiledLayers, layer, index: int, kwargs: dict):
        ctx.walk, ctx.layer, ctx.index, ctx.kwargs = walk, layer, index, kwargs
        if walk.swap is not None:  # the input goes to the host
            out, ctx.ends = walk.run_forward_swapped(layer, index, hidden, kwargs)
        else:
            ctx.save_for_backward(hidden)
            out = walk.run_forward(layer, index, hidden, kwargs)
        ctx.store_writes = walk.store_writes
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.walk.documents = documents_of(ctx.kwargs)  # (the tiles' recomputations attend with them)
        keys_held = ctx.walk.store_writes == ctx.store_writes
        if ctx.walk.swap is not None:
            ends, ctx.ends = ctx.ends, None  # the tiles' graphs, freed as the layer's backward goes
            grad_x = ctx.walk.run_backward_swapped(ctx.layer, ctx.index, ctx.kwargs, grad.contiguous(), ends, keys_held)
            return grad_x, None, None, None, None
        (hidden,) = ctx.saved_tensors
        grad_x = ctx.walk.run_backward(ctx.layer, ctx.index, hidden, ctx.kwargs, grad.contiguous(), keys_held)
        return grad_x, None, None, None, None
