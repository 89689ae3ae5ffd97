"""Validation: the loss on held-out sequences, whole and by position in the sequence.

Every ``train.eval_interval`` steps (and after the last) the model runs forward, without
gradients, on the same ``train.eval_iters`` global batches of validation samples: Megatron's
valid split for ``train.data=megatron:...``, other samples of the source otherwise
(:meth:`memo.data.batches.SyntheticTokens.valid_sample`). Each token's loss is counted in the
bucket of its position, ``train.eval_buckets`` equal spans of the sequence, so that a long
context's use shows: a model that uses it predicts late tokens better than early ones.

Without gradients the layers run Megatron's own forward (no swapping, nothing saved), so a
validation pass holds one layer's transient tensors at a time, as inference does; layers walked in
tiles are walked tile by tile into their key/value stores
(:meth:`memo.swap.tiled_layer.TiledLayers.evaluate`), so that no whole-sequence attention is made.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo.data.batches import micro_batches
from memo.execute.pipeline import PipelineSchedule, loss_result
from memo.execute.train import token_losses


class ValidationSamples:
    """A source's validation samples, as :func:`memo.data.batches.micro_batches` draws samples."""

    def __init__(self, source):
        self.source = source

    def sample(self, index: int, length: int) -> torch.Tensor:
        return self.source.valid_sample(index, length)


def bucket_bounds(seq: int, buckets: int) -> list[tuple[int, int]]:
    """The token positions ``[start, end)`` of each position bucket of a ``seq``-token sequence."""
    return [(b * seq // buckets, (b + 1) * seq // buckets) for b in range(buckets)]


def validation_loss(
    chunks: list[torch.nn.Module],
    source,
    seq: int,
    micro_batch_size: int,
    micro_batches_per_pass: int,
    buckets: int,
    device: torch.device,
    layers_view: Callable[[dict], dict],
    eod: Optional[int] = None,
    pipeline: Optional[PipelineSchedule] = None,
) -> dict:
    """The mean loss (nats per token) over one pass of validation samples, and per position bucket.

    Args:
        chunks: this rank's model chunks (its pipeline stage's).
        micro_batches_per_pass: micro-batches of each data-parallel rank (eval_iters · micro_batches).
        layers_view: a micro-batch as this rank's layers take it: its tokens of the sequence
            (context parallelism), in the layers' order (a walk in tiles under sequence
            parallelism), as training takes it.
        eod: the end-of-document id where documents are kept apart (positions then count within
            each document).
        pipeline: the schedule over the pipeline stages (forward only), where there are several.

    Returns:
        ``valid_loss`` and ``valid_loss_by_position`` (a list, bucket by bucket), the same on
        every rank.
    """
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    batch = next(micro_batches(ValidationSamples(source), seq, micro_batch_size, micro_batches_per_pass,
                               parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size(), device, eod=eod))
    sums = torch.zeros(buckets, dtype=torch.float64, device=device)
    counts = torch.zeros(buckets, dtype=torch.float64, device=device)

    def add(per_token: torch.Tensor, counted: Optional[torch.Tensor], position_ids: torch.Tensor) -> None:
        # the bucket whose span (bucket_bounds) holds each position (within its document, where
        # documents are kept apart: the context the token had)
        bucket = (((position_ids + 1) * buckets - 1) // seq).reshape(-1)
        weight = torch.ones_like(per_token, dtype=torch.float64) if counted is None else counted.double()
        sums.index_add_(0, bucket, (per_token.double() * weight).reshape(-1))
        counts.index_add_(0, bucket, weight.reshape(-1))

    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            if pipeline is None:
                for micro_batch in batch:
                    mb = layers_view(micro_batch)
                    per_token, counted = token_losses(chunks[0], mb)
                    add(per_token, counted, mb["position_ids"])
                    del per_token
            else:
                def forward(chunk, _index, micro_batch):
                    mb = layers_view(micro_batch)
                    output, counted = token_losses(chunk, mb)

                    def loss(per_token):  # (the last stage's: its sums, nothing to reduce)
                        add(per_token, counted, mb["position_ids"])
                        return loss_result(per_token.new_zeros(()), {})
                    return output, loss
                pipeline.run(batch, forward, forward_only=True)
                # the last stage's sums, on every stage
                group = parallel_state.get_pipeline_model_parallel_group()
                dist.all_reduce(sums, group=group)
                dist.all_reduce(counts, group=group)
    finally:
        for chunk in chunks:
            chunk.train()
    dist.all_reduce(sums, group=dp_group)
    dist.all_reduce(counts, group=dp_group)
    # (a bucket no token counted in, past every document's length, has no loss: None)
    return {"valid_loss": (sums.sum() / counts.sum()).item(),
            "valid_loss_by_position": [None if n == 0 else total / n for total, n in zip(sums.tolist(), counts.tolist())]}
