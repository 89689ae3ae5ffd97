"""MEMO in sequence tiles: each transformer layer walked in tiles of tokens, its device memory one
tile's work plus a few declared stores of the whole sequence.

Everything in a layer but core attention is token-local, so Megatron's own layer forward runs on
one tile of ``c`` tokens at a time (its norms, QKV, RoPE at the tile's positions, projection,
residuals and MLP, with their tensor-parallel collectives). Core attention is the one exception:
the tile's keys and values are written into the **key/value store** and its queries attend over
the store's blocks ``0 .. t`` (:mod:`memo.model.tiled_attention`).

Forward of a layer (no graph is kept): for ``t = 0 .. T − 1`` run the layer on tile ``t``; the
output rows go to the layer's output, the next layer's input. What the layer keeps for its
backward pass is its input (as the next layer's input, the residual stream) and, for ``memo``,
attention's output and log-sum-exp (MEMO's rule: attention is never recomputed); ``full_recompute``
keeps the input alone.

Backward of a layer, given the gradient of its output:

1. *Rebuild*: each tile runs up to core attention (norm, QKV, RoPE) without a graph, writing its
   keys and values into the store; the float32 **key/value gradient accumulators** are zeroed.
2. For ``t = T − 1 .. 0``: the tile is run again with a graph; core attention hands back the kept
   output (``memo``) or computes it from the store (``full_recompute``), and its backward runs
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
dtype, their gradient accumulators as many in float32, for the whole sequence whatever cp is. Per layer, the residual stream (input and
output, ``s·h/tp`` each) and ``memo``'s attention output and float32 log-sum-exp are kept until the
layer's backward; the gradient of a layer's input is a new ``s·h/tp`` tensor, the one of its output
freed when the layer's backward returns. Nothing is swapped (α = 0).
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from memo.model import attention_blocks as blocks
from memo.model.tiled_attention import block, tile_backward, tile_forward
from memo.model.placement import UNSUPPORTED_LAYER_ARGUMENTS
from memo.model.tiles import batch_in_tile_order

# the walk's modes, named as its phases are: a tile's forward, the keys and values made again
# before the backward tiles, a tile's forward again with a graph for its backward, and (context
# parallelism) a tile run again up to its keys and values, for their gradients
FORWARD, REBUILD, BACKWARD, KEYS = "fwd", "rebuild", "bwd", "bwd.kv"


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

    mode: str  # FORWARD, REBUILD, BACKWARD or KEYS
    layer: int
    index: int  # t, of this rank's tiles
    block: int  # where the tile's tokens are in the store (t without context parallelism)


@dataclass
class _Kept:
    """What ``memo`` keeps of one layer's attention: output ``[s, b, heads, d]`` (token-major, as
    the kernels' block outputs are merged into) and float32 log-sum-exp ``[b, heads, s]``."""

    out: torch.Tensor
    lse: torch.Tensor


class _Rebuilt(Exception):
    """Raised by core attention in a rebuild, once the tile's keys and values are in the store."""


class _KeysMade(Exception):
    """Raised by core attention in a KEYS pass with the tile's keys and values (in the graph)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values


class TiledLayers:
    """The per-tile walk of every layer of one model replica (see the module docstring): the
    :class:`memo.model.placement.Placement` of its layers and their core attention.

    Args:
        tile_tokens: ``c``, tokens per tile as attention sees them: gathered over the
            ``sequence_chunks`` ranks of sequence parallelism, of which each holds ``c /
            sequence_chunks`` rows of the layer input (rows that must divide its own).
        keep_attention: keep attention's output and log-sum-exp (``memo``) rather than
            recompute it in the backward pass (``full_recompute``).
        sequence_chunks: tp under sequence parallelism, else 1. The tokens must be in tile order
            (:func:`memo.model.tiles.tile_order`), so that a tile gathered over the ranks is
            ``c`` consecutive tokens of the sequence.
    """

    def __init__(self, tile_tokens: int, keep_attention: bool, sequence_chunks: int = 1):
        if tile_tokens <= 0 or tile_tokens % sequence_chunks:
            raise ValueError(f"tile_tokens={tile_tokens} must be a positive multiple of {sequence_chunks}")
        self.tile_tokens = tile_tokens
        self.tile_rows = tile_tokens // sequence_chunks
        self.keep_attention = keep_attention
        self.stores: Optional[TileStores] = None
        self.cp_group = None  # the context-parallel group of the layers' attention, if any
        self.cp, self.cp_rank = 1, 0  # its size and this rank's place in it
        self.layers: list = []
        self._index: dict[int, int] = {}
        self._tile: Optional[_Tile] = None
        self._kept: Optional[_Kept] = None  # memo's kept attention of the layer being walked
        # called with (layer, part of its pass) as the walk goes: "fwd.t<t>", "rebuild" (before
        # the backward tiles, and under context parallelism before the forward ones too),
        # "bwd.t<t>", "bwd.kv.t<t>" (context parallelism), and the layer's own "fwd" or "bwd" when
        # its tiles are done (the profiler names its phases so)
        self.on_phase: Callable[[int, str], None] = lambda layer, part: None

    def token_order(self, micro_batch: dict) -> dict:
        """A micro-batch's tokens (``[b, s]`` tensors) in the order the walk needs them."""
        if self.tile_rows == self.tile_tokens:
            return micro_batch
        return batch_in_tile_order(micro_batch, self.tile_tokens, self.tile_tokens // self.tile_rows)

    def attach(self, layers: list) -> None:
        """Let ``layers`` (:class:`memo.model.layer.MemoTransformerLayer`, in order) run in tiles:
        the walk takes over each layer's forward and its core attention; the layer's other
        modules run as they are, one tile at a time."""
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
        for layer in self.layers:
            layer.place(None)
            layer.self_attention.core_attention.place(None)

    def release(self) -> None:
        """Give back the stores (idempotent)."""
        self.stores = None

    # ----------------------------------------------------------------- the walk

    def forward(self, layer, kwargs: dict):
        """``layer``'s forward pass over its tiles (keyword arguments as Megatron passes them):
        ``(output, None)``."""
        for key in UNSUPPORTED_LAYER_ARGUMENTS:
            if kwargs.get(key) is not None:
                raise ValueError(f"memo's tiles do not support the layer argument {key}")
        hidden = kwargs["hidden_states"]
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
        r, count = self.tile_rows, rows // self.tile_rows
        if self.cp == 1:
            return [(t, slice(t * r, (t + 1) * r), t) for t in range(count)]
        cp, rank, per_chunk = self.cp, self.cp_rank, count // 2
        starts = (rank * per_chunk, (2 * cp - 1 - rank) * per_chunk)
        return [(t, slice(t * r, (t + 1) * r), starts[t // per_chunk] + t % per_chunk) for t in range(count)]

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

    def _run(self, layer, kwargs: dict, hidden: torch.Tensor, tile: "_Tile"):
        rope, c = kwargs.get("rotary_pos_emb"), self.tile_tokens
        # the angles of the tile's gathered tokens, positions t·c .. (t + 1)·c
        tiled = dict(kwargs, hidden_states=hidden,
                     rotary_pos_emb=None if rope is None else rope[tile.index * c:(tile.index + 1) * c])
        self._tile = tile
        self.on_phase(tile.layer, REBUILD if tile.mode == REBUILD else f"{tile.mode}.t{tile.index}")
        try:
            return layer.run(**tiled)[0]
        finally:
            self._tile = None

    def _allocate(self, layer, x: torch.Tensor) -> Optional[_Kept]:
        """The stores (once, or again for another length) and ``memo``'s kept attention of the
        layer, before its tiles: ``[tokens, b, heads, dim]`` from the layer's attention."""
        attention = layer.self_attention
        tokens = x.shape[0] // self.tile_rows * self.tile_tokens  # this rank's
        d, b = attention.hidden_size_per_attention_head, x.shape[1]
        shape = (tokens * self.cp, b, attention.num_query_groups_per_partition, d)
        if self.stores is None or tuple(self.stores.keys.shape) != shape or self.stores.keys.dtype != x.dtype:
            self.stores = None  # the old ones go first
            self.stores = TileStores.empty(shape, x.dtype, x.device)
        if not self.keep_attention:
            return None
        heads = attention.num_attention_heads_per_partition
        return _Kept(torch.empty((tokens, b, heads, d), dtype=x.dtype, device=x.device),
                     torch.empty((b, heads, tokens), dtype=blocks.wide(x.dtype), device=x.device))

    def run_forward(self, layer, index: int, x: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, Optional[_Kept]]:
        """The layer's output, tile by tile, without a graph, and what ``memo`` keeps of its
        attention for its backward pass."""
        kept = self._kept = self._allocate(layer, x)
        try:
            if self.cp > 1:
                self._make_keys(layer, index, x, kwargs)
            out = torch.empty_like(x)
            for t, rows, j in self._tiles(x.shape[0]):
                out[rows] = self._run(layer, kwargs, x[rows], _Tile(FORWARD, index, t, j))
        finally:
            self._kept = None
        self.on_phase(index, FORWARD)
        return out, kept

    def run_backward(self, layer, index: int, x: torch.Tensor, kwargs: dict, grad: torch.Tensor,
                     kept: Optional[_Kept]) -> torch.Tensor:
        """The gradient of the layer's input from that of its output (and ``kept``, what its
        forward kept), adding the layer's weight gradients tile by tile."""
        tiles = self._tiles(x.shape[0])
        grad_x = torch.empty_like(x)  # the gradient stream below this layer
        self._make_keys(layer, index, x, kwargs)
        self.stores.key_grads.zero_()
        self.stores.value_grads.zero_()
        self._kept = kept
        try:
            for t, rows, j in reversed(tiles):
                tile_x = x[rows].detach().requires_grad_(True)
                with torch.enable_grad():
                    y = self._run(layer, kwargs, tile_x, _Tile(BACKWARD, index, t, j))
                torch.autograd.backward(y, grad[rows])
                grad_x[rows] = tile_x.grad
                del y, tile_x  # the tile's graph, before the next one's
        finally:
            self._kept = None
        if self.cp > 1:
            self._sum_gradients()
            for t, rows, j in tiles:
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
        self.on_phase(index, BACKWARD)
        return grad_x

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
        if q.shape[2] != self.tile_tokens:
            raise RuntimeError(f"a tile's attention got {q.shape[2]} tokens, not {self.tile_tokens}")
        kernel, c = blocks.kernel_for(backend, q), self.tile_tokens
        if tile.mode == KEYS:
            raise _KeysMade(k, v)
        if tile.mode == REBUILD or (tile.mode == FORWARD and self.cp == 1):
            block(self.stores.keys, tile.block, c).copy_(k)
            block(self.stores.values, tile.block, c).copy_(v)
        if tile.mode == REBUILD:
            raise _Rebuilt
        if tile.mode == FORWARD:
            out, lse = tile_forward(kernel, q, self.stores.keys, self.stores.values, tile.block, scale)
            if self.keep_attention:
                self._keep(tile, out, lse)
            return out
        return _TileAttention.apply(q, k, v, self, tile, kernel, scale)

    def _keep(self, tile: _Tile, out: torch.Tensor, lse: torch.Tensor) -> None:
        c, kept = out.shape[2], self._kept
        block(kept.out, tile.index, c).copy_(out)
        kept.lse[..., tile.index * c:(tile.index + 1) * c].copy_(lse)

    def _attention_of(self, tile: _Tile, q: torch.Tensor, kernel: str, scale: float):
        """The tile's merged output and log-sum-exp: kept (memo) or computed from the store."""
        if not self.keep_attention:
            return tile_forward(kernel, q, self.stores.keys, self.stores.values, tile.block, scale)
        kept, c = self._kept, q.shape[2]
        return block(kept.out, tile.index, c), kept.lse[..., tile.index * c:(tile.index + 1) * c]


class _TileAttention(torch.autograd.Function):
    """A tile's core attention in the backward walk: its output as :meth:`TiledLayers._attention_of`
    gives it; its backward runs the tile's blocks and returns the tile's query gradient and its
    own block's (then final) key and value gradients; under context parallelism the query
    gradient alone (the key and value gradients are final once summed over the ranks)."""

    @staticmethod
    def forward(ctx, q, k, v, walk: TiledLayers, tile: _Tile, kernel: str, scale: float):
        out, lse = walk._attention_of(tile, q, kernel, scale)
        ctx.walk, ctx.tile, ctx.kernel, ctx.scale = walk, tile, kernel, scale
        ctx.q, ctx.out, ctx.lse = q, out, lse
        ctx.kv_dtype = k.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        walk, j, c = ctx.walk, ctx.tile.block, ctx.q.shape[2]
        stores = walk.stores
        dq = tile_backward(ctx.kernel, dout, ctx.q, stores.keys, stores.values, ctx.out, ctx.lse, j, ctx.scale,
                           stores.key_grads, stores.value_grads)
        ctx.q = ctx.out = ctx.lse = None  # attributes, which autograd does not free with the node
        if walk.cp > 1:
            return dq, None, None, None, None, None, None
        dk, dv = (block(g, j, c).to(ctx.kv_dtype) for g in (stores.key_grads, stores.value_grads))
        return dq, dk, dv, None, None, None, None


class _TiledLayer(torch.autograd.Function):
    """One layer walked in tiles: the autograd node between its input and output."""

    @staticmethod
    def forward(ctx, hidden, walk: TiledLayers, layer, index: int, kwargs: dict):
        ctx.walk, ctx.layer, ctx.index, ctx.kwargs = walk, layer, index, kwargs
        ctx.save_for_backward(hidden)
        out, ctx.kept = walk.run_forward(layer, index, hidden, kwargs)
        return out

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # freed once the layer's backward is done
        grad_x = ctx.walk.run_backward(ctx.layer, ctx.index, hidden, ctx.kwargs, grad.contiguous(), kept)
        return grad_x, None, None, None, None


def _reverse_chunks(chunks: torch.Tensor) -> None:
    """Reverse the order of ``chunks`` (``[n, ...]``) in place, one chunk of scratch at a time."""
    n = chunks.shape[0]
    for i in range(n // 2):
        first = chunks[i].clone()
        chunks[i].copy_(chunks[n - 1 - i])
        chunks[n - 1 - i].copy_(first)
