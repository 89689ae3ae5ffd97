"""Tiles of a sequence that tensor parallelism may split: the collectives that join and split a
tile over the tensor-parallel ranks, and a tile's rows in a tensor of every token.

Under sequence parallelism rank ``r`` holds tokens ``r·S .. (r + 1)·S`` of an ``[s, ...]``
tensor. A tile of this rank's rows ``start:end`` gathered over the ``chunks = tp`` ranks holds
rows ``start:end`` of each rank's shard, in rank order; without sequence parallelism
``chunks = 1`` and a tile is plain rows.
"""

import torch
import torch.distributed as dist

# the loss's tile: at most this many bytes of fp32 logits; no tile has fewer tokens than the
# floor (a thinner GEMM wastes the tensor cores more than it saves)
_TILE_LOGITS_BYTES = 256 * 2**20
_MIN_TILE_TOKENS = 64


def auto_tile_tokens(tokens: int, chunks: int, micro_batch_size: int, vocab_per_rank: int,
                     ffn_per_rank: int, element_size: int) -> int:
    """Tokens per tile (of this rank's ``tokens`` hidden states) when none is configured.

    The largest power of two whose fp32 logits ``[tile·chunks, b, v/tp]`` take at most 256 MiB and
    at most the bytes of one FC1 output of the sequence (``[tokens·chunks, b, ffn/tp]`` in the
    training dtype, ``element_size`` bytes an element), but at least 64 tokens. A layer's backward
    holds several FC1-sized tensors at once, so the loss's own transients (a tile's logits and
    their gradient) stay below a layer's and the loss does not set the step's peak.
    """
    row = 4 * vocab_per_rank * micro_batch_size * chunks  # fp32 logits of one token of the tile
    fc1 = tokens * chunks * micro_batch_size * ffn_per_rank * element_size
    fit = int(max(min(_TILE_LOGITS_BYTES, fc1) // row, _MIN_TILE_TOKENS))
    return 1 << (fit.bit_length() - 1)


def eighth_tile_tokens(tokens: int) -> int:
    """Tokens per tile for a layer whose tiles hold only ``[tile, b, h]``-sized tensors (the
    embedding's backward pass, a column-parallel linear layer): the largest power of two at
    most an eighth of this rank's ``tokens``, but at least 64."""
    fit = max(int(tokens) // 8, _MIN_TILE_TOKENS)
    return 1 << (fit.bit_length() - 1)


def tiles_per_rank(seq: int, cp: int, layer_tile_tokens: int) -> int:
    """``T``: the tiles of ``layer_tile_tokens`` tokens (gathered over sequence parallelism) that a
    context-parallel rank's share of a ``seq``-token sequence is walked in."""
    return seq // (cp * layer_tile_tokens)


def rank_tile_blocks(tiles: int, cp: int, rank: int) -> list[int]:
    """Where each of context-parallel rank ``rank``'s ``tiles`` tiles of a layer lies in the
    sequence, in tiles: in order without context parallelism; under it, the first half in chunk
    ``rank`` of the ``2·cp`` chunks and the second half in chunk ``2·cp − 1 − rank``, as
    Megatron's load-balanced split gives a rank its tokens."""
    if cp == 1:
        return list(range(tiles))
    per_chunk = tiles // 2
    starts = (rank * per_chunk, (2 * cp - 1 - rank) * per_chunk)
    return [starts[t // per_chunk] + t % per_chunk for t in range(tiles)]


def spans(tokens: int, tile: int):
    """``(start, end)`` of each tile of ``tile`` rows over ``tokens`` rows (the last may be short)."""
    return ((start, min(start + tile, tokens)) for start in range(0, tokens, tile))


def accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` into an fp32 ``total``: in place for fp32 operands, else the product in
    their dtype (as Megatron's one GEMM over all tiles makes it) summed in fp32."""
    if a.dtype == torch.float32:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


def gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``x`` of every one of the ``size`` ranks of ``group``, joined along the first dimension
    into a new tensor (``x`` itself when ``size`` is 1)."""
    if size == 1:
        return x
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """This rank's ``1/size`` of the first dimension of ``x`` summed over the ranks of ``group``,
    in a new tensor (``x`` itself when ``size`` is 1)."""
    if size == 1:
        return x
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def tile_rows(t: torch.Tensor, start: int, end: int, chunks: int) -> torch.Tensor:
    """The rows of ``t`` (``[s, ...]``, every token) that a gathered tile holds: rows ``start:end``
    of each of the ``chunks`` sequence-parallel shards, as a ``[chunks, end − start, ...]`` view."""
    return t.unflatten(0, (chunks, -1))[:, start:end]


def read_tile(t: torch.Tensor, start: int, end: int, chunks: int) -> torch.Tensor:
    """:func:`tile_rows` in the gathered tile's token order, ``[chunks·(end − start), ...]``."""
    return tile_rows(t, start, end, chunks).flatten(0, 1)


def write_tile(t: torch.Tensor, start: int, end: int, chunks: int, value: torch.Tensor) -> None:
    """Write a gathered tile's ``value`` into its rows of ``t`` (a flattened view would copy)."""
    tile_rows(t, start, end, chunks).copy_(value.unflatten(0, (chunks, -1)))


def tile_order(t: torch.Tensor, dim: int, tile_tokens: int, chunks: int) -> torch.Tensor:
    """The tokens of ``t`` (a sequence along ``dim``) reordered so that sequence parallelism's
    split into ``chunks`` equal shards gives rank ``r``, for every tile ``τ``, the tokens
    ``τ·c + r·c/chunks .. τ·c + (r + 1)·c/chunks`` (``c = tile_tokens``): gathering rows
    ``τ·c/chunks ..`` of every shard then yields the tile's ``c`` consecutive tokens, in order.
    Every token-local computation, and a loss summed over tokens, is unchanged by the order."""
    s = t.shape[dim]
    if s % tile_tokens or tile_tokens % chunks:
        raise ValueError(f"{s} tokens cannot be cut into tiles of {tile_tokens} split over {chunks} ranks")
    tiles = t.unflatten(dim, (s // tile_tokens, chunks, tile_tokens // chunks))
    return tiles.transpose(dim, dim + 1).flatten(dim, dim + 2)


def batch_in_tile_order(batch: dict, tile_tokens: int, chunks: int) -> dict:
    """:func:`tile_order` of every ``[b, s]`` tensor of a micro-batch (tokens, labels, positions)."""
    return {key: tile_order(value, 1, tile_tokens, chunks) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()}
