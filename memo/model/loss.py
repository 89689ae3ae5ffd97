"""A vocab-parallel output layer and cross entropy that never holds the logits of the sequence.

Megatron's ``output_layer`` plus ``vocab_parallel_cross_entropy`` makes the logits of every token
at once: ``[s, b, v/tp]`` in the activation dtype plus an fp32 copy that the backward pass keeps
(at 1M tokens, v = 50304, tp = 8: 12.3 GiB + 24.6 GiB). :func:`tiled_cross_entropy` runs the same
arithmetic over tiles of ``tile_tokens`` tokens of this rank's hidden states: per tile it gathers
the tile over sequence parallelism, makes its logits, reduces max and sum over the tensor-parallel
ranks and keeps only the per-token log-sum-exp (fp32, 4 bytes a token). The backward pass makes
each tile's logits again, turns them into ``softmax − one_hot`` scaled by the loss gradient, and
from that the tile's input gradient (reduce-scattered back under sequence parallelism) and its
share of the weight gradient, accumulated in fp32 over tiles.

The device holds one tile's logits (and their fp32 form) at a time, besides the hidden states the
layer below hands over, their gradient, and the fp32 weight-gradient accumulator
``[v/tp, h]``. :class:`TiledLossGPTModel` is Megatron's ``GPTModel`` with this loss in place of
its output layer and cross entropy when labels are given; without labels (evaluation, logits
wanted) it is Megatron's own path. Its word embedding, the other end of the tied weight, runs its
backward pass in tiles too (:class:`~memo.model.embedding.TiledVocabEmbedding`).
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.utils import VocabUtility

from memo.model.embedding import TiledVocabEmbedding
from memo.model.norm import LayerNorm, RMSNorm
from memo.model.tiles import (
    accumulate_product, auto_tile_tokens, gather, read_tile, reduce_scatter, spans, write_tile,
)

class _Tiles:
    """The tiles of one call: which rows of this rank's hidden states, their labels, and the
    tensor-parallel group over which logits are split."""

    def __init__(self, weight, labels, tile, sequence_parallel, group):
        self.size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.group, self.tile = group, tile
        self.chunks = self.size if sequence_parallel else 1
        self.vocab = weight.shape[0]
        self.first, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(self.vocab, rank, self.size)
        self.labels = labels

    def spans(self, tokens: int):
        return spans(tokens, self.tile)

    def logits(self, rows, weight):
        """The tile's gathered input ``[T, b, h]`` (from this rank's ``rows``) and its fp32 logits
        ``[T, b, v/tp]``."""
        x = gather(rows, self.group, self.chunks)
        return x, torch.nn.functional.linear(x, weight).float()

    def targets(self, start: int, end: int):
        """The tile's targets in this rank's vocabulary rows (0 where outside) and that mask."""
        target = read_tile(self.labels, start, end, self.chunks)
        inside = (target >= self.first) & (target < self.first + self.vocab)
        return (target - self.first).masked_fill_(~inside, 0), inside

    def forward(self, rows, weight, start, end, loss, lse) -> None:
        """Write the losses and log-sum-exp of the tile of this rank's rows ``start:end`` (their
        hidden states ``rows``) into ``loss`` and ``lse`` (``[s, b]``)."""
        _, logits = self.logits(rows, weight)
        peak = logits.amax(dim=-1)
        if self.size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        logits.sub_(peak.unsqueeze(-1))
        local, inside = self.targets(start, end)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0.0)
        sums = torch.stack((logits.exp_().sum(dim=-1), picked))
        del logits
        if self.size > 1:
            dist.all_reduce(sums, group=self.group)
        log_sum = sums[0].log_()
        write_tile(loss, start, end, self.chunks, log_sum - sums[1])
        write_tile(lse, start, end, self.chunks, log_sum.add_(peak))

    def backward(self, rows, weight, start, end, lse, grad_loss, grad_weight) -> torch.Tensor:
        """The input gradient of the tile of this rank's rows ``start:end`` (their hidden states
        ``rows``); adds its share to ``grad_weight``."""
        x, probs = self.logits(rows, weight)
        # softmax from the kept log-sum-exp, minus the one-hot of the target, times dloss
        probs.sub_(read_tile(lse, start, end, self.chunks).unsqueeze(-1)).exp_()
        local, inside = self.targets(start, end)
        probs.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(probs.dtype))
        probs.mul_(read_tile(grad_loss, start, end, self.chunks).unsqueeze(-1))
        grad_logits = probs.to(rows.dtype)
        del probs
        accumulate_product(grad_weight, grad_logits.flatten(0, 1).t(), x.flatten(0, 1))
        return reduce_scatter(grad_logits @ weight, self.group, self.chunks)


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tile, sequence_parallel, group, norm):
        tiles = _Tiles(weight, labels, tile, sequence_parallel, group)
        lse = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        loss = torch.empty_like(lse)
        for start, end in tiles.spans(hidden.shape[0]):
            tiles.forward(_normed(hidden[start:end], norm), weight, start, end, loss, lse)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.tile, ctx.sequence_parallel, ctx.group, ctx.norm = tile, sequence_parallel, group, norm
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        tiles, norm = _Tiles(weight, labels, ctx.tile, ctx.sequence_parallel, ctx.group), ctx.norm
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start, end in tiles.spans(hidden.shape[0]):
            rows = hidden[start:end].detach().requires_grad_(norm is not None)
            with torch.enable_grad():
                x = _normed(rows, norm)
            grad_x = tiles.backward(x.detach(), weight, start, end, lse, grad_loss, grad_weight)
            if tiles.size > 1 and tiles.chunks == 1:
                # Without sequence parallelism every rank holds every token: its input gradient is
                # the sum of all ranks' vocabulary shares (Megatron's copy-to-tensor-parallel
                # region), summed before the norm's backward so that its weight's is whole too.
                dist.all_reduce(grad_x, group=tiles.group)
            if norm is None:
                grad_hidden[start:end] = grad_x
            else:  # the tile's norm again, and its backward: its weight's gradient adds up
                torch.autograd.backward(x, grad_x)
                grad_hidden[start:end] = rows.grad
            del rows, x, grad_x  # one tile's tensors at a time, as the fit's template counts them
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def _normed(rows: torch.Tensor, norm) -> torch.Tensor:
    return rows if norm is None else norm(rows)


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_tile_tokens: int,
    sequence_parallel: bool = False,
    group=None,
    norm=None,
) -> torch.Tensor:
    """Per-token cross entropy ``[s, b]`` (fp32) of the vocab-parallel logits ``hidden @ weightᵀ``.

    Args:
        hidden: ``[s / tp, b, h]`` under sequence parallelism, else ``[s, b, h]``: the final norm's
            output on this rank.
        weight: ``[v / tp, h]``: this rank's rows of the output (tied embedding) weight.
        labels: ``[s, b]`` target token ids (every tensor-parallel rank holds all of them).
        loss_tile_tokens: tokens of ``hidden`` per tile (under sequence parallelism, per rank).
        group: the tensor-parallel group (``None``: no tensor parallelism).
        norm: the final norm, applied to each tile of ``hidden`` (then ``hidden`` is its input):
            its output never exists for the whole sequence. Its weight's gradient is added by
            autograd, one tile at a time.
    """
    if loss_tile_tokens < 1:
        raise ValueError(f"loss_tile_tokens={loss_tile_tokens} must be at least 1")
    return _TiledCrossEntropy.apply(hidden, weight, labels, loss_tile_tokens, sequence_parallel, group, norm)


class TiledLossGPTModel(GPTModel):
    """Megatron's ``GPTModel`` whose loss is :func:`tiled_cross_entropy` (see the module docstring).

    Args:
        loss_tile_tokens: tokens per tile of the loss and of the embedding's backward pass, or
            ``None`` for each one's own default (:func:`~memo.model.tiles.auto_tile_tokens`,
            :func:`~memo.model.tiles.eighth_tile_tokens`).
    """

    def __init__(self, *args, loss_tile_tokens: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        # A module of its own so that profiling hooks can see the loss start and end.
        config = self.config
        self.tiled_loss = TiledLossHead(loss_tile_tokens, config.sequence_parallel,
                                        config.ffn_hidden_size // config.tensor_model_parallel_size)
        if self.pre_process:  # the other end of the tied weight
            TiledVocabEmbedding.adopt(self.embedding.word_embeddings, loss_tile_tokens)
        # our final norm runs inside the loss's tiles, so its output never exists whole
        final = self.decoder.final_layernorm if self.post_process else None
        self._final_norm = final if isinstance(final, (LayerNorm, RMSNorm)) else None
        if self._final_norm is not None:
            self._final_norm.in_loss = True

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        usable = (
            labels is not None and self.post_process and self.config.mtp_num_layers is None
            and kwargs.get("inference_context") is None
        )
        norm = self._final_norm
        if not usable:
            if norm is not None:
                hidden_states = norm.normalize(hidden_states)
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        return self.tiled_loss(hidden_states, labels, weight, None if norm is None else norm.normalize)


class TiledLossHead(torch.nn.Module):
    """The output layer and the loss as one step: ``[s, b, h]`` hidden states, ``[b, s]`` labels
    and the ``[v/tp, h]`` output weight in, ``[b, s]`` fp32 losses out. Holds no parameters.

    Args:
        loss_tile_tokens: tokens per tile, or ``None`` for :func:`auto_tile_tokens`.
        ffn_per_rank: the MLP's FC1 width on this rank, which bounds the automatic tile.
    """

    def __init__(self, loss_tile_tokens: Optional[int], sequence_parallel: bool, ffn_per_rank: int):
        super().__init__()
        self.loss_tile_tokens, self.sequence_parallel = loss_tile_tokens, sequence_parallel
        self.ffn_per_rank = ffn_per_rank

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, norm=None) -> torch.Tensor:
        """Per-token losses ``[b, s]``; ``norm``: the final norm, applied per tile (``hidden`` is
        then its input)."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        tile = self.loss_tile_tokens or auto_tile_tokens(
            hidden.shape[0], tp if self.sequence_parallel else 1, hidden.shape[1], weight.shape[0],
            self.ffn_per_rank, hidden.element_size())
        loss = tiled_cross_entropy(
            hidden, weight, labels.t().contiguous(), tile, self.sequence_parallel, group, norm
        )
        return loss.t().contiguous()
