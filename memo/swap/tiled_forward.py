"""The forward pass of a walk in tiles (:class:`memo.swap.tiled_layer.TiledLayers`'): each layer's
output tile by tile, without a graph; or, swapped, each tile's graph kept with its saved tensors
in the tile buffers and the checkpoint layers' inputs sent to the host."""

import torch

from memo.swap.tile_state import FORWARD, Tile


class TileForward:
    """:class:`memo.swap.tiled_layer.TiledLayers`' forward pass (its state is the walk's)."""

    def run_forward(self, layer, index: int, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The layer's output, tile by tile, without a graph."""
        self._allocate(layer, x)
        if self.cp > 1:
            self._make_keys(layer, index, x, kwargs)
        out = torch.empty_like(x)
        for t, rows, j in self._tiles(x.shape[0]):
            out[rows] = self._run(layer, kwargs, x[rows], Tile(FORWARD, index, t, j))
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
                y = self._run(layer, kwargs, start, Tile(FORWARD, index, t, j), rows)
                ends.append(_TileEnd.apply(y, self))
            out[rows] = y.detach()
            del y, start
        self.inputs.sent(self.swap.streams)  # long done by now: the layer's compute outlasts it
        self.on_phase(index, FORWARD)
        return out, ends


class _TileStart(torch.autograd.Function):
    """A tile's rows of the layer input as the tile's graph begins: its backward writes the
    tile's input gradient where the walk says. The graph holds nothing of the layer input."""

    @staticmethod
    def forward(ctx, rows, anchor, walk):
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
    def forward(ctx, y, walk):
        ctx.walk = walk
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _nothing):
        return ctx.walk._output_grad, None
