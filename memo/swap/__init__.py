"""MEMO's activation runtime: what a layer keeps for its backward pass, where, and how it comes back.

* :mod:`~memo.swap.prepare`: :func:`prepare_swap`, the one way a model's layers get their
  placement (swapping or tiles), with the rules for chunks, segments and the host budget;
* :mod:`~memo.swap.runtime`: units (whole layers, or sequence tiles of them) swapped token-wise
  (:class:`SwapRuntime`), the layout of their rounding buffers (:mod:`~memo.swap.layout`) and
  what happens while a unit runs (:mod:`~memo.swap.capture`), on the copy streams of
  :mod:`~memo.swap.streams`;
* :mod:`~memo.swap.alpha`: α, the fraction of tokens swapped; :mod:`~memo.swap.tile_alpha`: α
  of each tile and the checkpoint interval k of layers walked in tiles;
* :mod:`~memo.swap.tiled_layer`: layers walked in sequence tiles (:class:`TiledLayers`), their
  tiles units of a :class:`SwapRuntime` for memo.

Both runtimes are a :class:`memo.model.placement.Placement`, the contract the model's layers are
given.
"""

from memo.swap.alpha import HostMemoryError
from memo.swap.prepare import LayerRuntime, SwapReport, TileReport, host_budget, host_share, prepare_swap
from memo.swap.runtime import SwapRuntime
from memo.swap.tiled_layer import TiledLayers

__all__ = ["HostMemoryError", "LayerRuntime", "SwapReport", "SwapRuntime", "TileReport", "TiledLayers",
           "host_budget", "host_share", "prepare_swap"]
