"""Core attention of a walk in tiles (:class:`memo.swap.tiled_layer.TiledLayers`'): a tile's keys
and values into the store, its queries over the store's blocks (:mod:`memo.model.tiled_attention`),
as the tile's mode asks."""

import torch

from memo.model.documents import block_kernel
from memo.model.tiled_attention import block, tile_backward, tile_forward
from memo.swap.tile_state import BACKWARD, BACKWARD_BLOCK, CHAIN, FORWARD, KEYS, REBUILD, KeysMade, Rebuilt, Tile


class TileAttention:
    """:class:`memo.swap.tiled_layer.TiledLayers`' core attention (its state is the walk's)."""

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
            raise KeysMade(k, v)
        if tile.mode == REBUILD or (tile.mode == FORWARD and self.cp == 1):
            block(self.stores.keys, tile.block, c).copy_(k)
            block(self.stores.values, tile.block, c).copy_(v)
        if tile.mode == REBUILD:
            raise Rebuilt
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
    def forward(ctx, q, k, v, walk, tile: Tile, kernel: str, scale: float):
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
    def forward(ctx, q, k, v, walk, tile: Tile, kernel: str, scale: float):
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
