"""The backward pass of a walk in tiles (:class:`memo.swap.tiled_layer.TiledLayers`'): the layer's
input back (from the host, or made from the checkpoint below), every tile's keys and values made
again into the store, then the tiles in reverse, each taking its gradient back through its graph
(made again, or kept and brought back by the swap runtime); under context parallelism the key and
value gradients summed over the ranks and taken back through each tile's keys and values."""

from typing import Optional

import torch
import torch.distributed as dist

from memo.model.tiled_attention import block
from memo.swap.tile_state import (BACKWARD, CHAIN, KEYS, REBUILD, KeysMade, Rebuilt, Tile, keys_and_values_only,
                                  queries_only)


class TileBackward:
    """:class:`memo.swap.tiled_layer.TiledLayers`' backward pass (its state is the walk's)."""

    def run_backward(self, layer, index: int, x: torch.Tensor, kwargs: dict, grad: torch.Tensor,
                     keys_held: bool = False) -> torch.Tensor:
        """The gradient of the layer's input ``x`` from that of its output, adding the layer's
        weight gradients tile by tile; ``keys_held``: the store holds the layer's keys and values
        still (nothing wrote it since the layer's forward)."""
        grad_x = torch.empty_like(x)  # the gradient stream below this layer
        if not keys_held:
            self._make_keys(layer, index, x, kwargs)
        self.stores.key_grads.zero_()
        self.stores.value_grads.zero_()
        for t, rows, j in reversed(self._tiles(x.shape[0])):
            tile_x = x[rows].detach().requires_grad_(True)
            with torch.enable_grad():
                y = self._run(layer, kwargs, tile_x, Tile(BACKWARD, index, t, j))
            torch.autograd.backward(y, grad[rows])
            grad_x[rows] = tile_x.grad
            del y, tile_x  # the tile's graph, before the next one's
        if self.cp > 1:
            self._key_gradients(layer, index, x, kwargs, grad_x)
        self.on_phase(index, BACKWARD)
        return grad_x

    def run_backward_swapped(self, layer, index: int, kwargs: dict, grad: torch.Tensor,
                             ends: list[torch.Tensor], keys_held: bool = False) -> torch.Tensor:
        """The gradient of the layer's input from that of its output: the input back from the
        host, the keys and values made again (unless ``keys_held``: as :meth:`run_backward`),
        then the tiles in reverse, each brought back (its dropped tokens recomputed, their
        queries alone) by the swap runtime and taken back through its kept graph."""
        grad_x = torch.empty_like(grad)  # the gradient stream below this layer
        if index in self.inputs.kept:
            x = self.inputs.current = self.inputs.kept.pop(index)
        else:
            x = self.inputs.reload(index // self.checkpoint_every, self.swap.streams)
            self._chain(index, x, kwargs)
        if not keys_held:
            self._make_keys(layer, index, x, kwargs)
        self.stores.key_grads.zero_()
        self.stores.value_grads.zero_()
        below = self._reloaded_below(index, x)
        try:
            for t, rows, j in reversed(self._tiles(x.shape[0])):
                self.on_phase(index, f"{BACKWARD}.t{t}")
                self._tile = Tile(BACKWARD, index, t, j)
                with queries_only(layer):
                    self.swap.backward_started(index * self._count + t)
                self._input_grad, self._output_grad = grad_x[rows], grad[rows]
                ends[t].backward(torch.empty(0, dtype=x.dtype, device=x.device))
                ends[t] = None  # the tile's graph, before the next one's
                if below is not None:  # the tile's rows of the store are free: the input below comes in
                    self.inputs.prefetch_rows(below, rows, self.swap.streams)
        finally:
            self._tile = self._input_grad = self._output_grad = None
        if self.cp > 1:
            self._key_gradients(layer, index, x, kwargs, grad_x)
        self.on_phase(index, BACKWARD)
        return grad_x

    def _reloaded_below(self, index: int, x: torch.Tensor) -> Optional[int]:
        """The checkpoint whose input the layer below reloads into the store for its backward,
        where the store's rows may take it as this layer's tiles finish (this layer's input ``x``
        is the store, or one kept on the device): None where no layer is below, its input is kept
        on the device, or (context parallelism) ``x``, the store, is read again after the tiles,
        for the key and value gradients."""
        below = index - 1
        if below < 0 or below in self.inputs.kept or (self.cp > 1 and x is self.inputs.store):
            return None
        return below // self.checkpoint_every

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
                        x[rows] = self._run(self.layers[j], kwargs, x[rows], Tile(CHAIN, index, t, block_index))
                    finally:
                        self._chain_output = None

    def _make_keys(self, layer, index: int, x: torch.Tensor, kwargs: dict) -> None:
        """Every tile's keys and values into the store, without a graph (the projection's queries
        not made), then (under context parallelism) the other ranks' from them."""
        self.store_writes += 1
        with torch.no_grad(), keys_and_values_only(layer):
            for t, rows, j in self._tiles(x.shape[0]):
                try:
                    self._run(layer, kwargs, x[rows], Tile(REBUILD, index, t, j))
                except Rebuilt:
                    pass
        if self.cp > 1:
            for store in (self.stores.keys, self.stores.values):
                self._gather(store)

    def _key_gradients(self, layer, index: int, x: torch.Tensor, kwargs: dict, grad_x: torch.Tensor) -> None:
        """Under context parallelism, once every tile's queries have added their key and value
        gradients: those summed over the ranks, each tile run again from its input ``x[rows]``
        up to its keys and values, and their gradients taken back into ``grad_x``."""
        self._sum_gradients()
        for t, rows, j in self._tiles(x.shape[0]):
            tile_x = x[rows].detach().requires_grad_(True)
            try:
                with torch.enable_grad():
                    self._run(layer, kwargs, tile_x, Tile(KEYS, index, t, j))
            except KeysMade as made:
                c = self.tile_tokens
                grads = [block(g, j, c).to(made.keys.dtype) for g in (self.stores.key_grads,
                                                                        self.stores.value_grads)]
                torch.autograd.backward([made.keys, made.values], grads)
                del made, grads
            grad_x[rows] += tile_x.grad
            del tile_x

    # ---------------------------------------------------------- core attention

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
        """The key and value gradients of every rank's queries summed over the ranks into this
        rank's two chunks of the accumulators, the only ones its tiles take back (the others' are
        left as they are): a reduce-scatter of each half, half the bytes an all-reduce moves. The
        second half's chunks are put in rank order first (rank ``r``'s, ``cp − 1 − r``, at ``r``);
        besides the accumulators, one chunk exists at a time."""
        cp, rank = self.cp, self.cp_rank
        for grads in (self.stores.key_grads, self.stores.value_grads):
            front, back = self._halves(grads)
            _reverse_chunks(back)
            for half, own in ((front, rank), (back, cp - 1 - rank)):
                mine = torch.empty_like(half[rank])
                dist.reduce_scatter_tensor(mine, half.flatten(0, 1), group=self.cp_group)
                half[own].copy_(mine)  # (the second half's own chunk back at its place in the sequence)
                del mine


def _reverse_chunks(chunks: torch.Tensor) -> None:
    """Reverse the order of ``chunks`` (``[n, ...]``) in place, one chunk of scratch at a time."""
    n = chunks.shape[0]
    for i in range(n // 2):
        first = chunks[i].clone()
        chunks[i].copy_(chunks[n - 1 - i])
        chunks[n - 1 - i].copy_(first)
