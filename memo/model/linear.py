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

With a swap runtime attached (``runtime``), the output is written where the runtime places it
(FC1's output is saved by GeLU, so it is made in its rounding buffer), with or without sequence
parallelism.
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear

from memo.model.placement import new_output
from memo.model.tiles import accumulate_product, eighth_tile_tokens, gather, spans, tile_rows


class _SequenceTiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, tile, runtime):
        size = dist.get_world_size(group)
        tokens = x.shape[0]
        out = new_output(runtime, (size * tokens, *x.shape[1:-1], weight.shape[0]), x.dtype, x.device)
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
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None, None, None


class _PlacedLinear(torch.autograd.Function):
    """Megatron's column-parallel product without sequence parallelism, its output written where
    a swap runtime places it; the input gradient all-reduced over ``group`` when asked
    (Megatron's ``allreduce_dgrad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, allreduce_dgrad, runtime):
        out = new_output(runtime, (*x.shape[:-1], weight.shape[0]), x.dtype, x.device)
        _linear_into(out, x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.allreduce_dgrad, ctx.has_bias = group, allreduce_dgrad, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.flatten(0, -2)
        grad_x = (g @ weight).view(x.shape)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_x, group=ctx.group)
        grad_weight = g.t() @ x.flatten(0, -2)
        grad_bias = g.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """``out = x @ weightᵀ (+ bias)``, written into ``out`` (contiguous rows). The bias is added
    after the product, rounded as Megatron's ``output + bias`` is, not inside the GEMM."""
    torch.matmul(x.flatten(0, -2), weight.t(), out=out.view(-1, weight.shape[0]))
    if bias is not None:
        out.add_(bias)


class TiledColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` whose sequence-parallel product runs in tiles (see the
    module docstring) and whose output, under swapping, is made where the runtime places it; every
    other case (a frozen weight, Megatron's fused or deferred weight gradients) is Megatron's own.
    The bias is always added in the product: it is never returned apart.

    Args:
        tile_tokens: tokens of this rank's input per tile (``None``:
            :func:`~memo.model.tiles.eighth_tile_tokens`).
    """

    def __init__(self, *args, tile_tokens: Optional[int] = None, **kwargs):
        # The bias is added in place to the product, never returned for the caller to add:
        # Megatron's MLP would otherwise make FC1's output a second time, as output + bias.
        kwargs["skip_bias_add"] = False
        super().__init__(*args, **kwargs)
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tile_tokens={tile_tokens} must be at least 1")
        self.tile_tokens = tile_tokens
        self.runtime = None  # a SwapRuntime, attached after the model is built

    def _forward_impl(self, input, weight, *args, **kwargs):
        ours = (
            weight.requires_grad and not kwargs.get("gradient_accumulation_fusion")
            and kwargs.get("grad_output_buffer") is None and not args
        )
        bias, group = kwargs.get("bias"), kwargs.get("tp_group")
        if ours and kwargs.get("sequence_parallel"):
            tile = self.tile_tokens or eighth_tile_tokens(input.shape[0])
            return _SequenceTiledLinear.apply(input, weight, bias, group, tile, self.runtime)
        if ours and self.runtime is not None:
            return _PlacedLinear.apply(input, weight, bias, group, bool(kwargs.get("allreduce_dgrad")),
                                       self.runtime)
        return super()._forward_impl(input, weight, *args, **kwargs)
