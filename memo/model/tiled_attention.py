"""Causal attention of one tile of queries over a store of the whole sequence's keys and values.

A layer walked in tiles of ``c`` tokens makes tile ``t``'s keys and values after those of every
earlier tile and writes them into a *store* (``[tokens, b, groups, dim]``, token-major, as the
QKV projection lays them out). Tile ``t``'s queries attend to the store's blocks ``0 .. t``: the
earlier ones in full, their own causally (a square block, so every kernel puts its diagonal in
the same place), merged by log-sum-exp (:mod:`memo.model.attention_blocks`, the block entry
points context parallelism uses). No ``[tokens, tokens]`` and no whole-sequence query or output
exists: a tile's work holds its queries, one block's output and the running merge in float32 (and
a copy of the block's keys and values per query head where they are grouped and the kernel takes
them only so, :func:`memo.model.attention_blocks.takes_grouped`).

The backward pass of tile ``t`` is given the tile's merged output and log-sum-exp; every block's
key and value gradients are added into float32 accumulators of the store's shape. Tiles taken in
descending order finish block ``t``'s gradients with tile ``t`` (only tiles ``≥ t`` see it).
"""

from typing import Callable, Optional

import torch

from memo.model import attention_blocks as blocks
from memo.model.documents import Documents, chunk_blocks


def block(store: torch.Tensor, index: int, tokens: int) -> torch.Tensor:
    """Rows ``index·tokens .. (index + 1)·tokens`` of ``store`` (``[s, b, n, d]``) as the kernels
    take them, ``[b, n, tokens, d]`` (a view)."""
    return store[index * tokens:(index + 1) * tokens].permute(1, 2, 0, 3)


def tile_forward(kernel: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile: int,
                 scale: float, on_block: Optional[Callable[[Optional[int]], None]] = None,
                 documents: Optional[Documents] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of tile ``tile``'s queries ``q`` (``[b, heads, c, d]``) over the store's first
    ``tile + 1`` blocks of ``c`` tokens.

    The blocks are merged in place into one float32 output and log-sum-exp made before the first,
    and each block's tensors are freed before the next begins: the requests of a block are made
    and freed within it, so that every block of every tile allocates alike (the planner plans
    one). ``on_block`` is told the block about to run, and ``None`` once the last is done. With
    ``documents`` (of the whole sequence) each query attends within its document only: a block
    runs its documents' parts (the tile's own block all of them at once,
    :func:`memo.model.attention_blocks.segments_forward`), and one wholly of other documents
    runs none.

    Returns:
        ``(out, lse)``: ``out`` ``[b, heads, c, d]`` in ``q``'s dtype, laid out ``[c, b, heads, d]``
        in memory as Megatron's attention output is, rounded once from the float32 merge;
        ``lse`` ``[b, heads, c]`` in float32 (float64 for float64 input).
    """
    c, acc = q.shape[2], blocks.wide(q.dtype)
    on_block = on_block or _no_blocks
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    if documents is not None:  # a query's first block of its document is merged into nothing
        out.zero_()
        lse.fill_(-torch.inf)
    for j in range(tile + 1):
        on_block(j)
        parts = chunk_blocks(documents, tile, j, c)
        if not parts:  # keys wholly of other documents: nothing to attend
            continue
        if documents is not None and j == tile:  # the tile's own documents, causal segments of it
            part = blocks.segments_forward(kernel, q, block(keys, j, c), block(values, j, c), _segments(parts, c),
                                           scale)
            blocks.merge_into(out, lse, *part)
            del part
            continue
        k, v = block(keys, j, c), block(values, j, c)
        for rows, cols, causal in parts:
            part = blocks.forward(kernel, blocks.rows(q, rows), blocks.rows(k, cols), blocks.rows(v, cols), causal, scale)
            if j == 0 and documents is None:
                out.copy_(part[0])
                lse.copy_(part[1])
            else:
                blocks.merge_into(blocks.rows(out, rows), lse[..., rows], *part)
            del part
    on_block(None)
    token_major = torch.empty((c, q.shape[0], q.shape[1], q.shape[3]), dtype=q.dtype, device=q.device)
    token_major.permute(1, 2, 0, 3).copy_(out)
    return token_major.permute(1, 2, 0, 3), lse


def tile_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, tile: int, scale: float, key_grads: torch.Tensor,
                  value_grads: torch.Tensor, on_block: Optional[Callable[[Optional[int]], None]] = None,
                  documents: Optional[Documents] = None) -> torch.Tensor:
    """The backward pass of :func:`tile_forward`: returns ``dq`` (``q``'s dtype) and adds every
    block's key and value gradients into ``key_grads`` and ``value_grads`` (float32 or wider,
    the store's shape). Each block's tensors are freed before the next begins; ``on_block`` is
    told as in :func:`tile_forward`; ``documents`` as there."""
    c = q.shape[2]
    on_block = on_block or _no_blocks
    # in the layouts the kernels take, once for all the tile's blocks rather than per block
    dout, out = blocks.token_major(dout), blocks.token_major(out)
    lse = lse.to(blocks.wide(q.dtype)).contiguous()
    dq = torch.zeros(q.shape, dtype=blocks.wide(q.dtype), device=q.device)
    for j in range(tile + 1):
        on_block(j)
        parts = chunk_blocks(documents, tile, j, c)
        if not parts:
            continue
        if documents is not None and j == tile:  # (on CUDA grouped heads' key and value gradients are
            # rounded per query head, then summed: blocks.segments_backward)
            dqb, dkb, dvb = blocks.segments_backward(kernel, dout, q, block(keys, j, c), block(values, j, c), out, lse,
                                                     _segments(parts, c), scale, key_grads.dtype)
            dq.add_(dqb)
            block(key_grads, j, c).add_(dkb)
            block(value_grads, j, c).add_(dvb)
            del dqb, dkb, dvb
            continue
        k, v = block(keys, j, c), block(values, j, c)
        for rows, cols, causal in parts:
            dqb, dkb, dvb = blocks.backward(kernel, blocks.rows(dout, rows), blocks.rows(q, rows), blocks.rows(k, cols),
                                            blocks.rows(v, cols), blocks.rows(out, rows), lse[..., rows], causal, scale)
            blocks.rows(dq, rows).add_(dqb)
            blocks.rows(block(key_grads, j, c), cols).add_(dkb)
            blocks.rows(block(value_grads, j, c), cols).add_(dvb)
            del dqb, dkb, dvb
    on_block(None)
    return dq.to(q.dtype)


def _segments(parts: list[tuple[slice, slice, bool]], c: int) -> tuple[int, ...]:
    """The bounds of the causal parts of a tile's block of its own keys (its documents' parts,
    which cut its ``c`` tokens into segments) for :func:`memo.model.attention_blocks.segments_forward`:
    on CUDA one variable-length kernel call for all of them."""
    return (*(rows.start for rows, _, _ in parts), c)


def _no_blocks(_block: Optional[int]) -> None:
    pass
