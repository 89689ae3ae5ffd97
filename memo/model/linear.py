"""A column-parallel linear layer that, under sequence parallelism, gathers its input in tiles.

Megatron's ``ColumnParallelLinear`` with sequence parallelism all-gathers its ``[s/tp, b, h]``
input into one ``[s, b, h]`` buffer (``get_global_memory_buffer``: allocated once and kept for the
whole run, 8 GiB at 1M tokens and h = 4096 in bf16), multiplies, and in the backward pass gathers
it again there for the weight gradient while the input gradient ``[s, b, h]`` is made whole
before its reduce-scatter.

:class:`TiledColumnParallelLinear` runs the same products over tiles of tokens: per tile it
all-gathers the tile's input (``[tp·T, b, h]``), writes the tile's output rows in place, and in the
backward pass adds the tile's share of the weight gradient (fp32) and reduce-scatters the tile's
input gradient into its rows. Nothing is kept between iterations, and the device holds one tile's
gathered input and input gradient at a time besides the layer's output (or its gradient) and
the fp32 ``[o/tp, h]`` weight-gradient accumulator. What the backward pass saves is Megatron's:
the input shard and the weight.
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear

from memo.model.tiles import accumulate_product, eighth_tile_tokens, gather, spans, tile_rows


class _SequenceTiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, tile):
        size = dist.get_world_size(group)
        tokens = x.shape[0]
        out = x.new_empty((size * tokens, *x.shape[1:-1], weight.shape[0]))
        rows = tile_rows(out, 0, tokens, size)  # [size, tokens, ...]: each rank's rows of out
        for start, end in spans(tokens, tile):
            gathered = gather(x[start:end], group, size).unflatten(0, (size, -1))
            for rank in range(size):
                _linear_into(rows[rank, start:end], gathered[rank], weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tile, ctx.has_bias = group, tile, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, size, tokens = ctx.group, dist.get_world_size(ctx.group), x.shape[0]
        grad_rows = tile_rows(grad_out, 0, tokens, size)
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start, end in spans(tokens, ctx.tile):
            gathered = gather(x[start:end], group, size).unflatten(0, (size, -1))
            partial = x.new_empty((size, end - start, *x.shape[1:]))
            for rank in range(size):
                g = grad_rows[rank, start:end].flatten(0, -2)
                accumulate_product(grad_weight, g.t(), gathered[rank].flatten(0, -2))
                torch.matmul(g, weight, out=partial[rank].view(-1, x.shape[-1]))
            del gathered
            dist.reduce_scatter_tensor(grad_x[start:end], partial.flatten(0, 1), group=group)
        grad_bias = grad_out.flatten(0, -2).sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None, None


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """``out = x @ weightᵀ (+ bias)``, written into ``out`` (contiguous rows)."""
    flat_out, flat_x = out.view(-1, weight.shape[0]), x.flatten(0, -2)
    if bias is None:
        torch.matmul(flat_x, weight.t(), out=flat_out)
    else:
        torch.addmm(bias, flat_x, weight.t(), out=flat_out)


class TiledColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` whose sequence-parallel product runs in tiles (see the
    module docstring); every other case (no sequence parallelism, a frozen weight, Megatron's
    fused or deferred weight gradients) is Megatron's own.

    Args:
        tile_tokens: tokens of this rank's input per tile (``None``:
            :func:`~memo.model.tiles.eighth_tile_tokens`).
    """

    def __init__(self, *args, tile_tokens: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tile_tokens={tile_tokens} must be at least 1")
        self.tile_tokens = tile_tokens

    def _forward_impl(self, input, weight, *args, **kwargs):
        tiled = (
            kwargs.get("sequence_parallel") and weight.requires_grad
            and not kwargs.get("gradient_accumulation_fusion") and kwargs.get("grad_output_buffer") is None
            and not args
        )
        if not tiled:
            return super()._forward_impl(input, weight, *args, **kwargs)
        tile = self.tile_tokens or eighth_tile_tokens(input.shape[0])
        return _SequenceTiledLinear.apply(input, weight, kwargs.get("bias"), kwargs["tp_group"], tile)
