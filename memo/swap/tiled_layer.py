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
graph, begun by :class:`_TileStart` (which holds nothing of the layer input) and ended by
:class:`_TileEnd` (an empty tensor, so the tile's output is not held): its saved tensors live in
the runtime's tile buffers and go to the host as its α says, attention's output and log-sum-exp
whole. The inputs of the checkpoint layers (every ``checkpoint_every``-th) go to the host
(:class:`LayerInputs`); a layer whose every unit stays in the buffers keeps its input on the device.
A layer's backward brings its input back into the input store, or makes it there from the
checkpoint below (:meth:`TiledLayers._chain`: the layers between run tile by tile with their kept
attention outputs), makes the keys and values again, then for each tile from the last lets the
runtime bring the tile's buffer back and recompute its dropped tokens, and runs the tile's kept
graph backward.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from memo.model import attention_blocks as blocks
from memo.model.tiled_attention import block, tile_backward, tile_forward
from memo.model.documents import Documents, block_kernel, documents_of
from memo.model.placement import Accounting, RuntimeReport, check_layer_arguments
from memo.model.tiles import batch_in_tile_order, rank_tile_blocks
from memo.swap.runtime import SwapRuntime, host_memory, register, unregister
from memo.swap.streams import Streams

# the walk's modes, named as its phases are: a tile's forward, the keys and values made again
# before the backward tiles, a tile's forward again with a graph for its backward, and (context
# parallelism) a tile run again up to its keys and values, for their gradients
FORWARD, REBUILD, BACKWARD, KEYS = "fwd", "rebuild", "bwd", "bwd.kv"
# under swapping with checkpoint layers: a layer's input made again from the checkpoint below,
# through the layers between, each tile's attention output taken from what its forward kept
CHAIN = "chain"
WHOLE_LAYER_MODES = (REBUILD, CHAIN)  # named once per layer, not per tile
# a tile's attention blocks, named within the tile's phase: those of its forward kernels and of
# its backward kernels (a tile's backward phase runs both: its forward again, then its gradients)
FORWARD_BLOCK, BACKWARD_BLOCK = "b", "db"


@dataclass
class TileStores:
    """The layer-wide stores every layer's walk shares: ``[tokens, b, groups, dim]`` each."""

    keys: torch.Tensor
    values: torch.Tensor
    key_grads: torch.Tensor  # float32 (or wider)
    value_grads: torch.Tensor

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> "TileStores":
        """Stores of keys and values ``shape`` (``[tokens, b, groups, dim]``) in ``dtype``."""
        wide = blocks.wide(dtype)
        return cls(*(torch.empty(shape, dtype=dtype, device=device) for _ in range(2)),
                   *(torch.empty(shape, dtype=wide, device=device) for _ in range(2)))



@dataclass
class _Tile:
    """The tile a layer's attention is run for, and how."""

    mode: str  # FORWARD, REBUILD, BACKWARD, KEYS or CHAIN
    layer: int
    index: int  # t, of this rank's tiles
    block: int  # where the tile's tokens are in the store (t without context parallelism)


def _unnamed(layer: int, part: str) -> None:
    """Where the walk's phases go when nobody names them."""


class _Rebuilt(Exception):
    """Raised by core attention in a rebuild, once the tile's keys and values are in the store."""


class _KeysMade(Exception):
    """Raised by core attention in a KEYS pass with the tile's keys and values (in the graph)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values


class TiledLayers:
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
        self.stores: Optional[TileStores] = None
        self.cp_group = None  # the context-parallel group of the layers' attention, if any
        self.cp, self.cp_rank = 1, 0  # its size and this rank's place in it
        self.layers: list = []
        self._index: dict[int, int] = {}
        self._tile: Optional[_Tile] = None
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

    def name_phases(self, on_phase: Optional[Callable[[int, str], None]]) -> None:
        """Tell ``on_phase`` of the walk's parts as they begin (see :attr:`on_phase`); None: stop."""
        self.on_phase = on_phase or _unnamed

    def accounting(self) -> Optional[Accounting]:
        """Under swapping, the tiles' skeletal bytes by layer since the last call."""
        return self.swap.accounting() if self.swap is not None else None

    def device_buffers(self) -> list[torch.Tensor]:
        """Under swapping, the tile buffers, once the first forward pass made them."""
        return self.swap.device_buffers() if self.swap is not None else []

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
        self._tile, self.documents = _Tile(FORWARD, 0, 0, 0), documents_of(kwargs)
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
        self._tile, self.documents = _Tile(FORWARD, 0, t, j), documents_of(kwargs)
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
        check_layer_arguments(kwargs, "memo's tiles")
        self.documents = documents_of(kwargs)
        hidden = kwargs["hidden_states"]
        if self.documents is not None and (self.cp > 1 or self.documents.tokens != hidden.shape[0] // self.tile_rows
                                           * self.tile_tokens):
            raise ValueError(f"memo's tiles keep the documents of a whole sequence apart, without context "
                             f"parallelism: documents of {self.documents.tokens} tokens, a layer input of "
                             f"{hidden.shape[0]} rows")
        if not hidden.requires_grad:
            # the weights are not the walk's inputs: without a graph to the input no backward
            # would run, and their gradients would be lost silently
            raise ValueError("a layer walked in tiles needs an input that requires grad")
        if hidden.shape[0] % (self.tile_rows * self._chunks):
            raise ValueError(f"{hidden.shape[0]} rows cannot be cut into {self._chunks} chunk(s) of tiles of "
                             f"{self.tile_rows}")
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return _TiledLayer.apply(hidden, self, layer, self._index[id(layer)], rest), None

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

    def _make_keys(self, layer, index: int, x: torch.Tensor, kwargs: dict) -> None:
        """Every tile's keys and values into the store, without a graph, then (under context
        parallelism) the other ranks' from them."""
        with torch.no_grad():
            for t, rows, j in self._tiles(x.shape[0]):
                try:
                    self._run(layer, kwargs, x[rows], _Tile(REBUILD, index, t, j))
                except _Rebuilt:
                    pass
        if self.cp > 1:
            for store in (self.stores.keys, self.stores.values):
                self._gather(store)

    def _halves(self, store: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``store``'s first and second halves as ``[cp, chunk, ...]``: rank ``r``'s chunks are the
        first's ``r`` and the second's ``cp − 1 − r``."""
        front, back = store.unflatten(0, (2, self.cp, -1)).unbind(0)
        return front, back

    def _gather(self, store: torch.Tensor) -> None:
        """The other ranks' chunks of ``store`` (``[s, ...]``, sequence order) from them: each
        half in place, in rank order; the second half's chunks then put back in sequence order.
        Besides the store, one chunk exists at a time."""
        cp, rank = self.cp, self.cp_rank
        front, back = self._halves(store)
        for half, own in ((front, rank), (back, cp - 1 - rank)):
            mine = half[own].clone()
            dist.all_gather_into_tensor(half.flatten(0, 1), mine, group=self.cp_group)
            del mine
        _reverse_chunks(back)

    def _sum_gradients(self) -> None:
        """The key and value gradients of every rank's queries, summed over the ranks."""
        for grads in (self.stores.key_grads, self.stores.value_grads):
            dist.all_reduce(grads, group=self.cp_group)

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

    def _run(self, layer, kwargs: dict, hidden: torch.Tensor, tile: "_Tile", rows: Optional[slice] = None):
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

    def run_forward(self, layer, index: int, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The layer's output, tile by tile, without a graph."""
        self._allocate(layer, x)
        if self.cp > 1:
            self._make_keys(layer, index, x, kwargs)
        out = torch.empty_like(x)
        for t, rows, j in self._tiles(x.shape[0]):
            out[rows] = self._run(layer, kwargs, x[rows], _Tile(FORWARD, index, t, j))
        self.on_phase(index, FORWARD)
        return out

    def run_forward_swapped(self, layer, index: int, x: torch.Tensor, kwargs: dict
                            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer's output, tile by tile, each tile's graph kept with its saved tensors in the
        tile buffers (the swap runtime sends their host part out); the layer input goes to the
        host. Returns the output and each tile's end of graph, for the backward pass."""
        self._allocate(layer, x)
        self.inputs.ready_store(x)
        self.swap.ready_buffers()
        if self.cp > 1:  # every rank's keys and values, before any tile attends over them
            self._make_keys(layer, index, x, kwargs)
        if self._resident_layer(index):
            self.inputs.kept[index] = x
        elif index % self.checkpoint_every == 0:
            self.inputs.offload(index // self.checkpoint_every, x, self.swap.streams)
            self.swap.account(index * self._count, "host", x.numel() * x.element_size())
        out = torch.empty_like(x)
        ends = []
        for t, rows, j in self._tiles(x.shape[0]):
            with torch.enable_grad():
                start = _TileStart.apply(x[rows].detach(), self._anchor, self)  # not x's graph
                y = self._run(layer, kwargs, start, _Tile(FORWARD, index, t, j), rows)
                ends.append(_TileEnd.apply(y, self))
            out[rows] = y.detach()
            del y, start
        self.inputs.sent(self.swap.streams)  # long done by now: the layer's compute outlasts it
        self.on_phase(index, FORWARD)
        return out, ends

    def run_backward_swapped(self, layer, index: int, kwargs: dict, grad: torch.Tensor,
                             ends: list[torch.Tensor]) -> torch.Tensor:
        """The gradient of the layer's input from that of its output: the input back from the
        host, the keys and values made again, then the tiles in reverse, each brought back (its
        dropped tokens recomputed) by the swap runtime and taken back through its kept graph."""
        grad_x = torch.empty_like(grad)  # the gradient stream below this layer
        if index in self.inputs.kept:
            x = self.inputs.current = self.inputs.kept.pop(index)
        else:
            x = self.inputs.reload(index // self.checkpoint_every, self.swap.streams)
            self._chain(index, x, kwargs)
        self._make_keys(layer, index, x, kwargs)
        self.stores.key_grads.zero_()
        self.stores.value_grads.zero_()
        try:
            for t, rows, j in reversed(self._tiles(x.shape[0])):
                self.on_phase(index, f"{BACKWARD}.t{t}")
                self._tile = _Tile(BACKWARD, index, t, j)
                self.swap.backward_started(index * self._count + t)
                self._input_grad, self._output_grad = grad_x[rows], grad[rows]
                ends[t].backward(torch.empty(0, dtype=x.dtype, device=x.device))
                ends[t] = None  # the tile's graph, before the next one's
        finally:
            self._tile = self._input_grad = self._output_grad = None
        if self.cp > 1:
            self._key_gradients(layer, index, x, kwargs, grad_x)
        self.on_phase(index, BACKWARD)
        return grad_x

    def _chain(self, index: int, x: torch.Tensor, kwargs: dict) -> None:
        """Layer ``index``'s input made in ``x`` (the input store, holding the input of the
        checkpoint layer below) by running the layers between on it, tile by tile, in place,
        without a graph: with attention's output known (kept by each tile's forward), a layer
        is token-local."""
        first = index - index % self.checkpoint_every
        if first == index:
            return
        staging = self.inputs.ready_staging(self.swap)
        with torch.no_grad():
            for j in range(first, index):
                for t, rows, block_index in self._tiles(x.shape[0]):
                    kept = self.swap.kept_output(j * self._count + t, staging)
                    self._chain_output = kept.movedim(0, 2)  # [b, heads, c, d], as attention returns it
                    try:
                        x[rows] = self._run(self.layers[j], kwargs, x[rows], _Tile(CHAIN, index, t, block_index))
                    finally:
                        self._chain_output = None

    @property
    def _count(self) -> int:
        """``T``: tiles of one layer on this rank."""
        return self.swap.units_per_layer

    def run_backward(self, layer, index: int, x: torch.Tensor, kwargs: dict, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of the layer's input ``x`` from that of its output, adding the layer's
        weight gradients tile by tile."""
        grad_x = torch.empty_like(x)  # the gradient stream below this layer
        self._make_keys(layer, index, x, kwargs)
        self.stores.key_grads.zero_()
        self.stores.value_grads.zero_()
        for t, rows, j in reversed(self._tiles(x.shape[0])):
            tile_x = x[rows].detach().requires_grad_(True)
            with torch.enable_grad():
                y = self._run(layer, kwargs, tile_x, _Tile(BACKWARD, index, t, j))
            torch.autograd.backward(y, grad[rows])
            grad_x[rows] = tile_x.grad
            del y, tile_x  # the tile's graph, before the next one's
        if self.cp > 1:
            self._key_gradients(layer, index, x, kwargs, grad_x)
        self.on_phase(index, BACKWARD)
        return grad_x

    def _key_gradients(self, layer, index: int, x: torch.Tensor, kwargs: dict, grad_x: torch.Tensor) -> None:
        """Under context parallelism, once every tile's queries have added their key and value
        gradients: those summed over the ranks, each tile run again from its input ``x[rows]``
        up to its keys and values, and their gradients taken back into ``grad_x``."""
        self._sum_gradients()
        for t, rows, j in self._tiles(x.shape[0]):
            tile_x = x[rows].detach().requires_grad_(True)
            try:
                with torch.enable_grad():
                    self._run(layer, kwargs, tile_x, _Tile(KEYS, index, t, j))
            except _KeysMade as made:
                c = self.tile_tokens
                grads = [block(g, j, c).to(made.keys.dtype) for g in (self.stores.key_grads,
                                                                        self.stores.value_grads)]
                torch.autograd.backward([made.keys, made.values], grads)
                del made, grads
            grad_x[rows] += tile_x.grad
            del tile_x

    # ---------------------------------------------------------- core attention

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """New memory: a tile's tensors are the tile's own (the walk places none of them)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute, scale: float, backend: str):
        """Core attention of the tile being walked: ``q, k, v`` as the kernels take them
        (``[b, heads, c, dim]``); ``compute`` (whole attention of the tile alone) is not used."""
        tile = self._tile
        if tile is None:  # the layer run whole, without a graph (evaluation)
            return compute()
        if tile.mode == CHAIN:
            return self._chain_output
        if self.swap is not None and self.swap.capturing:
            # a tile's forward, discovery or recomputation under the swap runtime: its capture
            # keeps (or, recomputing, gives back) the output and log-sum-exp in the tile's buffer
            kernel = block_kernel(backend, q, self.documents)
            return self.swap.attention(q, k, v, lambda: _SwappedTileAttention.apply(q, k, v, self, tile, kernel,
                                                                                      scale))
        if q.shape[2] != self.tile_tokens:
            raise RuntimeError(f"a tile's attention got {q.shape[2]} tokens, not {self.tile_tokens}")
        kernel, c = block_kernel(backend, q, self.documents), self.tile_tokens
        if tile.mode == KEYS:
            raise _KeysMade(k, v)
        if tile.mode == REBUILD or (tile.mode == FORWARD and self.cp == 1):
            block(self.stores.keys, tile.block, c).copy_(k)
            block(self.stores.values, tile.block, c).copy_(v)
        if tile.mode == REBUILD:
            raise _Rebuilt
        if tile.mode == FORWARD:
            return tile_forward(kernel, q, self.stores.keys, self.stores.values, tile.block, scale,
                                self.block_phases(tile.layer, f"{tile.mode}.t{tile.index}"), self.documents)[0]
        return _TileAttention.apply(q, k, v, self, tile, kernel, scale)


class _TileAttention(torch.autograd.Function):
    """A tile's core attention in the backward walk without swapping: its output from the store;
    its backward runs the tile's blocks and returns the tile's query gradient and its
    own block's (then final) key and value gradients; under context parallelism the query
    gradient alone (the key and value gradients are final once summed over the ranks)."""

    @staticmethod
    def forward(ctx, q, k, v, walk: TiledLayers, tile: _Tile, kernel: str, scale: float):
        out, lse = tile_forward(kernel, q, walk.stores.keys, walk.stores.values, tile.block, scale,
                                walk.block_phases(tile.layer, f"{tile.mode}.t{tile.index}"), walk.documents)
        ctx.walk, ctx.tile, ctx.kernel, ctx.scale, ctx.documents = walk, tile, kernel, scale, walk.documents
        ctx.q, ctx.out, ctx.lse = q, out, lse
        ctx.kv_dtype = k.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        walk, j, c = ctx.walk, ctx.tile.block, ctx.q.shape[2]
        stores = walk.stores
        dq = tile_backward(ctx.kernel, dout, ctx.q, stores.keys, stores.values, ctx.out, ctx.lse, j, ctx.scale,
                           stores.key_grads, stores.value_grads,
                           walk.block_phases(ctx.tile.layer, f"{BACKWARD}.t{ctx.tile.index}", BACKWARD_BLOCK),
                           ctx.documents)
        ctx.q = ctx.out = ctx.lse = None  # attributes, which autograd does not free with the node
        if walk.cp > 1:
            return dq, None, None, None, None, None, None
        dk, dv = (block(g, j, c).to(ctx.kv_dtype) for g in (stores.key_grads, stores.value_grads))
        return dq, dk, dv, None, None, None, None


class _SwappedTileAttention(torch.autograd.Function):
    """A tile's core attention in its forward under swapping: the tile's keys and values into the
    store, its queries over the store's blocks; saves the queries, output and log-sum-exp (into
    the tile's buffer, through the swap runtime's hooks). Its backward runs the tile's blocks
    against the store as it is then (made again), like :class:`_TileAttention`'s."""

    @staticmethod
    def forward(ctx, q, k, v, walk: TiledLayers, tile: _Tile, kernel: str, scale: float):
        c, stores = q.shape[2], walk.stores
        if walk.cp == 1:  # (under context parallelism the store was made, and gathered, first)
            block(stores.keys, tile.block, c).copy_(k)
            block(stores.values, tile.block, c).copy_(v)
        out, lse = tile_forward(kernel, q, stores.keys, stores.values, tile.block, scale,
                                walk.block_phases(tile.layer, f"{tile.mode}.t{tile.index}"), walk.documents)
        ctx.save_for_backward(q, out, lse)
        ctx.walk, ctx.block, ctx.kernel, ctx.scale, ctx.kv_dtype = walk, tile.block, kernel, scale, k.dtype
        ctx.documents = walk.documents
        ctx.layer, ctx.index = tile.layer, tile.index
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        stores, j, c = ctx.walk.stores, ctx.block, q.shape[2]
        dq = tile_backward(ctx.kernel, dout, q, stores.keys, stores.values, out, lse, j, ctx.scale,
                           stores.key_grads, stores.value_grads,
                           ctx.walk.block_phases(ctx.layer, f"{BACKWARD}.t{ctx.index}", BACKWARD_BLOCK),
                           ctx.documents)
        if ctx.walk.cp > 1:  # final once summed over the ranks (:meth:`TiledLayers._key_gradients`)
            return dq, None, None, None, None, None, None
        dk, dv = (block(g, j, c).to(ctx.kv_dtype) for g in (stores.key_grads, stores.value_grads))
        return dq, dk, dv, None, None, None, None


class _TileStart(torch.autograd.Function):
    """A tile's rows of the layer input as the tile's graph begins: its backward writes the
    tile's input gradient where the walk says. The graph holds nothing of the layer input."""

    @staticmethod
    def forward(ctx, rows, anchor, walk: TiledLayers):
        ctx.walk = walk
        return rows.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.walk._input_grad.copy_(grad)
        return None, None, None


class _TileEnd(torch.autograd.Function):
    """The end of a tile's graph, kept from its forward to its backward without the tile's
    output (an empty tensor): its backward hands the graph the gradient the walk gives it."""

    @staticmethod
    def forward(ctx, y, walk: TiledLayers):
        ctx.walk = walk
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _nothing):
        return ctx.walk._output_grad, None


class _TiledLayer(torch.autograd.Function):
    """One layer walked in tiles: the autograd node between its input and output."""

    @staticmethod
    def forward(ctx, hidden, walk: TiledLayers, layer, index: int, kwargs: dict):
        ctx.walk, ctx.layer, ctx.index, ctx.kwargs = walk, layer, index, kwargs
        if walk.swap is not None:  # the input goes to the host
            out, ctx.ends = walk.run_forward_swapped(layer, index, hidden, kwargs)
            return out
        ctx.save_for_backward(hidden)
        return walk.run_forward(layer, index, hidden, kwargs)

    @staticmethod
    def backward(ctx, grad):
        ctx.walk.documents = documents_of(ctx.kwargs)  # (the tiles' recomputations attend with them)
        if ctx.walk.swap is not None:
            ends, ctx.ends = ctx.ends, None  # the tiles' graphs, freed as the layer's backward goes
            grad_x = ctx.walk.run_backward_swapped(ctx.layer, ctx.index, ctx.kwargs, grad.contiguous(), ends)
            return grad_x, None, None, None, None
        (hidden,) = ctx.saved_tensors
        return ctx.walk.run_backward(ctx.layer, ctx.index, hidden, ctx.kwargs, grad.contiguous()), None, None, None, None


@dataclass
class LayerInputs:
    """Under swapping, the checkpoint layers' inputs on the host (``[layers, rows, b, hidden]``,
    pinned on a GPU) and one device store into which a layer's input comes back for its backward
    pass."""

    host: torch.Tensor
    pinned: bool = False
    store: Optional[torch.Tensor] = None  # made at the first forward pass (:meth:`ready_store`)
    kept: dict = dataclasses.field(default_factory=dict)  # inputs of the resident layers, on the device
    current: Optional[torch.Tensor] = None  # the input of the layer whose backward runs
    staging: Optional[torch.Tensor] = None  # a tile's kept attention output on its way to a chain
    # the input being sent to the host, and the end of its copy: held until compute has waited for
    # that end (at the end of the layer's forward), since an allocator that ignores record_stream
    # (the plan's arena) would hand its memory to compute as soon as the caller frees it
    sending: Optional[tuple[torch.Tensor, object]] = None

    @classmethod
    def empty(cls, layers: int, x: torch.Tensor, pin: bool) -> "LayerInputs":
        host = host_memory(layers * x.numel(), x.dtype, pin).view(layers, *x.shape)
        if pin and host.numel():
            register(host)
        return cls(host, pin and bool(host.numel()))

    def ready_store(self, x: torch.Tensor) -> None:
        """The device's input store, shaped as layer input ``x``, unless it is (idempotent)."""
        if self.store is None:
            self.store = torch.empty_like(x)

    def ready_staging(self, runtime: SwapRuntime) -> torch.Tensor:
        """Device memory for one tile's kept attention output, made at the first chain."""
        if self.staging is None:
            self.staging = runtime.empty_like_slot("out")
        return self.staging

    def offload(self, index: int, x: torch.Tensor, streams: Streams) -> None:
        """Send checkpoint ``index``'s input ``x`` to the host once compute has made it; ``x`` is
        held until :meth:`sent`, which the layer's forward calls at its end."""
        streams.wait(streams.d2h, streams.record(streams.compute))
        streams.copy(streams.d2h, self.host[index], x)
        self.sending = (x, streams.record(streams.d2h))

    def sent(self, streams: Streams) -> None:
        """Let compute wait for the last input sent to the host, then let that input go."""
        if self.sending is not None:
            streams.wait(streams.compute, self.sending[1])
            self.sending = None

    def reload(self, index: int, streams: Streams) -> torch.Tensor:
        """Checkpoint ``index``'s input in the store, for compute, once the store's previous
        layer's backward is done. Its copy to the host needs no wait: the layer's first tile
        swaps (else the input would have stayed on the device), and the tile that reused that
        tile's buffer waited for its copy out, which the D2H stream ran after the input's."""
        streams.wait(streams.h2d, streams.record(streams.compute))
        streams.copy(streams.h2d, self.store, self.host[index])
        streams.wait(streams.compute, streams.record(streams.h2d))
        self.current = self.store
        return self.store

    def release(self) -> None:
        self.kept.clear()
        self.current = self.sending = None
        if self.pinned:
            unregister(self.host)
            self.pinned = False


def _reverse_chunks(chunks: torch.Tensor) -> None:
    """Reverse the order of ``chunks`` (``[n, ...]``) in place, one chunk of scratch at a time."""
    n = chunks.shape[0]
    for i in range(n // 2):
        first = chunks[i].clone()
        chunks[i].copy_(chunks[n - 1 - i])
        chunks[n - 1 - i].copy_(first)
