"""What every pass of a walk in tiles (:mod:`memo.swap.tiled_layer`) shares: the mode a tile runs
in, the tile at hand, the stores of the whole sequence, and the ends a tile's attention may cut
its run short with."""

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from memo.model import attention_blocks as blocks
from memo.model.linear import GroupChannels

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


def keys_and_values_only(layer) -> ContextManager[None]:
    """``layer``'s QKV projection making the keys and values alone (their remaking before the
    backward tiles: the queries are made again with the tile's graph). Products of fewer columns
    may sum in another order than the forward's did: the keys made again equal the forward's up to
    rounding."""
    return _only(layer, keys_values=True)


def queries_only(layer) -> ContextManager[None]:
    """``layer``'s QKV projection making the queries alone (a tile's dropped tokens made again:
    their keys and values are in the store); the whole projection where keys have a norm
    (``qk_layernorm``): the key norm's backward reads what its forward saved for those tokens,
    which must then be their keys, not the channels a partial product leaves undefined."""
    if layer.config.qk_layernorm:
        return contextlib.nullcontext()
    return _only(layer, keys_values=False)


def _only(layer, keys_values: bool) -> ContextManager[None]:
    attention = layer.self_attention
    groups, d = attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head
    queries = attention.num_attention_heads_per_partition // groups * d
    channels = GroupChannels(groups, queries, queries + 2 * d) if keys_values else GroupChannels(groups, 0, queries)
    return attention.linear_qkv.only(channels)


@dataclass
class Tile:
    """The tile a layer's attention is run for, and how."""

    mode: str  # FORWARD, REBUILD, BACKWARD, KEYS or CHAIN
    layer: int
    index: int  # t, of this rank's tiles
    block: int  # where the tile's tokens are in the store (t without context parallelism)


class Rebuilt(Exception):
    """Raised by core attention in a rebuild, once the tile's keys and values are in the store."""


class KeysMade(Exception):
    """Raised by core attention in a KEYS pass with the tile's keys and values (in the graph)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
