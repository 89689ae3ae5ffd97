"""A vocab-parallel word embedding that never holds the whole sequence's lookup or its gradient.

Megatron's ``VocabParallelEmbedding`` under tensor parallelism zeroes the rows of tokens outside
this rank's vocabulary with an in-place masked assignment, then (under sequence parallelism)
reduce-scatters the ``[s, b, h]`` result. Its backward pass all-gathers the gradient of every
token (``[s, b, h]``: 8 GiB at 1M tokens and h = 4096 in bf16), makes a masked copy of it for the
assignment (8 GiB more) and hands that to ``embedding_dense_backward``.

:class:`TiledVocabEmbedding` computes the same passes in tiles of tokens. Its forward under
sequence parallelism looks up one tile of every rank's shard at a time and reduce-scatters it
into this rank's ``[s/tp, b, h]`` output (Megatron's whole ``[s, b, h]`` lookup is the peak of a
long sequence's forward there: 58 GB for Llama-3.1-8B at 6.5M tokens). Its backward, per tile,
all-gathers the tile's gradient over sequence parallelism, picks the rows of tokens in this
rank's vocabulary, and adds them into an fp32 weight gradient. The device holds one tile's lookup
or gradient at a time, besides the output or the fp32 ``[v/tp, h]`` accumulator, and each token's
local id (8 bytes a token) and whether it is another rank's (1 byte). With ``train.loss=tiled`` it is the word embedding of
:class:`~memo.model.loss.TiledLossGPTModel`, with the loss's ``train.loss_tile_tokens`` if set.
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import VocabParallelEmbedding

from memo.model.tiles import eighth_tile_tokens, gather, read_tile, spans, tile_rows


class _VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, first, tile, scatter, group):
        size = dist.get_world_size(group) if group is not None else 1
        rows = weight.shape[0]
        # [s, b]: the token-major order of the [s, b, h] output; -1 marks another rank's token
        local = (ids.t() - first).contiguous()
        if scatter and size > 1:  # (local's other ranks' tokens are marked -1 tile by tile)
            out = _scattered_lookup(local, weight, tile, group, size)
        else:
            outside = (local < 0) | (local >= rows)
            out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
            if size > 1:
                out.masked_fill_(outside.unsqueeze(-1), 0.0)
                dist.all_reduce(out, group=group)
            local.masked_fill_(outside, -1)
            del outside
        ctx.save_for_backward(local)
        ctx.rows, ctx.dtype, ctx.tile, ctx.group = rows, weight.dtype, tile, group
        ctx.chunks = size if scatter else 1
        return out if scatter else out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        if ctx.chunks == 1:
            grad = grad.transpose(0, 1)  # [s, b, h], as the ids
        grad_weight = torch.zeros((ctx.rows, grad.shape[-1]), dtype=torch.float32, device=grad.device)
        for start, end in spans(grad.shape[0], ctx.tile):
            rows = gather(grad[start:end], ctx.group, ctx.chunks).flatten(0, 1)
            ids = read_tile(local, start, end, ctx.chunks).flatten()
            # another rank's tokens add zeros to row 0: no data-dependent shapes (fake tensors)
            mine = (ids >= 0).unsqueeze(-1)
            grad_weight.index_add_(0, ids.clamp(min=0), torch.where(mine, rows, 0.0).float())
        return None, grad_weight.to(ctx.dtype), None, None, None, None


def _scattered_lookup(local: torch.Tensor, weight: torch.Tensor, tile: int, group, size: int) -> torch.Tensor:
    """This rank's ``[s/size, b, h]`` shard of the lookup of ``local`` (``[s, b]`` ids less this
    rank's first row of ``weight``), summed over the ``size`` ranks of ``group``, made ``tile`` rows
    of the shard at a time: each tile's rows of every shard are looked up (``[size·tile, b, h]``)
    and reduce-scattered into the shard, so that the whole sequence's lookup (``s·b·h`` elements,
    the peak of a long sequence's forward under sequence parallelism) never exists. Marks
    ``local``'s tokens of other ranks' rows -1 in place, for the backward pass."""
    shard, rows = local.shape[0] // size, weight.shape[0]
    out = torch.empty((shard, local.shape[1], weight.shape[1]), dtype=weight.dtype, device=weight.device)
    for start, end in spans(shard, tile):
        ids = tile_rows(local, start, end, size)  # a view: the -1 marks go into local
        away = (ids < 0) | (ids >= rows)
        part = torch.nn.functional.embedding(ids.masked_fill(away, 0).flatten(0, 1), weight)
        part.masked_fill_(away.flatten(0, 1).unsqueeze(-1), 0.0)
        dist.reduce_scatter_tensor(out[start:end], part, group=group)
        ids.masked_fill_(away, -1)
        del part, away, ids
    return out


class TiledVocabEmbedding(VocabParallelEmbedding):
    """Megatron's ``VocabParallelEmbedding`` with the backward pass described above.

    Made from Megatron's module in place (:meth:`adopt`), so that its weight, its name in the
    state dict and its tying to the output layer stay as they are.
    """

    embedding_tile_tokens: Optional[int]

    @classmethod
    def adopt(cls, embedding: VocabParallelEmbedding, embedding_tile_tokens: Optional[int]) -> "TiledVocabEmbedding":
        """Turn ``embedding`` into this class. ``embedding_tile_tokens``: tokens of this rank's
        output per tile of the backward pass (``None``: :func:`~memo.model.tiles.eighth_tile_tokens`)."""
        if embedding_tile_tokens is not None and embedding_tile_tokens < 1:
            raise ValueError(f"embedding_tile_tokens={embedding_tile_tokens} must be at least 1")
        embedding.__class__ = cls
        embedding.embedding_tile_tokens = embedding_tile_tokens
        return embedding

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` token ids in; ``[s/tp, b, h]`` out under sequence parallelism, else
        ``[b, s, h]`` (Megatron's layouts)."""
        size = self.tp_group.size()
        group: Optional[dist.ProcessGroup] = self.tp_group if size > 1 else None
        chunks = size if self.reduce_scatter_embeddings else 1
        tile = self.embedding_tile_tokens or eighth_tile_tokens(input_.shape[1] // chunks)
        return _VocabEmbedding.apply(input_, self.weight, self.vocab_start_index, tile,
                                     self.reduce_scatter_embeddings, group)
