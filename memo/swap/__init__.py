"""MEMO's activation runtime: what a layer keeps for its backward pass, where, and how it comes back.

* :mod:`~memo.swap.prepare`: runtimes got ready for training (:func:`prepare_swapped_layers`,
  :func:`prepare_tiles`), with the rules for chunks, segments and the host budget;
* :mod:`~memo.swap.runtime`: units (whole layers, or sequence tiles of them) swapped token-wise
  (:class:`SwapRuntime`), the layout of their rounding buffers (:mod:`~memo.swap.layout`) and
  what happens while a unit runs (:mod:`~memo.swap.capture`), on the copy streams of
  :mod:`~memo.swap.streams`;
* :mod:`~memo.swap.alpha`: α, the fraction of tokens swapped; :mod:`~memo.swap.tile_alpha`: α
  of each tile and the checkpoint interval k of layers walked in tiles;
* :mod:`~memo.swap.tiled_layer`: layers walked in sequence tiles (:class:`TiledLayers`), their
  tiles units of a :class:`SwapRuntime` for memo.

Both runtimes are a :class:`memo.model.placement.Placement`, the contract the model's layers are
given, and a :class:`memo.model.placement.LayerRuntime`, the one the training loop drives. Which
one a run gets is its activation policy's choice (:mod:`memo.policy`).
"""

import dataclasses

from memo.swap.alpha import HostMemoryError
from memo.swap.prepare import (SwapReport, TileReport, host_budget, host_share, prepare_swapped_layers,
                               prepare_tiles)
from memo.swap.runtime import SwapRuntime
from memo.swap.tiled_layer import TiledLayers

__all__ = ["HostMemoryError", "SwapReport", "SwapRuntime", "TileReport", "TiledLayers", "host_budget",
           "host_share", "prepare_swapped_layers", "prepare_tiles", "report_columns"]


def report_columns() -> list[str]:
    """The result-row columns the runtimes' reports fill (``swap.*``, ``tiles.*``): every row of a
    training run carries them, None where the run's runtime has none."""
    return [*(f"swap.{f.name}" for f in dataclasses.fields(SwapReport)),
            *(f"tiles.{name}" for name in TileReport.row_fields())]
