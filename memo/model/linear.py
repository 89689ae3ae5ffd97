"""Column- and row-parallel linear layers that, under sequence parallelism, run in tiles of tokens.

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

Under a swap placement (``placement``), the output is written where the placement puts it
(FC1's output is saved by GeLU, so it is made in its rounding buffer), with or without sequence
parallelism.

Megatron's ``RowParallelLinear`` (attention's projection, FC2) with sequence parallelism makes the
whole ``[s, b, h]`` partial product before its reduce-scatter, and in the backward pass
all-gathers the whole ``[s, b, h]`` output gradient: ``s·h`` elements where a rank's share is
``s·h/tp`` (8 GiB against 1 GiB at 1M tokens, tp = 8, bf16), the largest tensors of a MEMO layer's
backward. :class:`TiledRowParallelLinear` reduce-scatters the partial product a tile at a time
into the tile's output rows, and in the backward pass gathers one tile of the output gradient,
writes its rows of the input gradient and adds its share of the weight gradient (fp32).
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from memo.model.placement import Placed, Placement, new_output
from memo.model.tiles import accumulate_product, eighth_tile_tokens, gather, spans, tile_rows, write_tile


class _SequenceTiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, tile, placement, channels):
        size = dist.get_world_size(group)
        tokens = x.shape[0]
        out = new_output(placement, (size * tokens, *x.shape[1:-1], weight.shape[0]), x.dtype, x.device)
        rows = tile_rows(out, 0, tokens, size)  # [size, tokens, ...]: each rank's rows of out
        for start, end in spans(tokens, tile):
            gathered = gather(x[start:end], group, size).unflatten(0, (size, -1))
            for rank in range(size):
                _linear_into(rows[rank, start:end], gathered[rank], weight, bias, channels)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tile, ctx.has_bias, ctx.partial = group, tile, bias is not None, channels is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _no_partial_backward(ctx)
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
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None, None, None, None


class _SequenceTiledRowLinear(torch.autograd.Function):
    """``reduce_scatter(x @ weightᵀ)`` over ``group``, a tile of output rows at a time: ``x`` is
    ``[tp·S, b, k/tp]`` (every token), the output ``[S, b, h]`` (this rank's tokens)."""

    @staticmethod
    def forward(ctx, x, weight, group, tile):
        size = dist.get_world_size(group)
        tokens = x.shape[0] // size
        out = x.new_empty((tokens, *x.shape[1:-1], weight.shape[0]))
        for start, end in spans(tokens, tile):
            # every rank's rows of the tile as one strided batch: no gathered copy of the input
            rows = tile_rows(x, start, end, size).flatten(1, -2)  # [tp, T·b, k/tp], a view
            partial = torch.bmm(rows, weight.t().expand(size, -1, -1))
            dist.reduce_scatter_tensor(out[start:end], partial.view(-1, *out.shape[1:]), group=group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tile = group, tile
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, size = ctx.group, dist.get_world_size(ctx.group)
        tokens = grad_out.shape[0]
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start, end in spans(tokens, ctx.tile):
            g = gather(grad_out[start:end].contiguous(), group, size)  # [tp·T, b, h]
            write_tile(grad_x, start, end, size, torch.matmul(g, weight))
            rows = tile_rows(x, start, end, size)
            for rank, g_rank in enumerate(g.unflatten(0, (size, -1))):
                accumulate_product(grad_weight, g_rank.flatten(0, -2).t(), rows[rank].flatten(0, -2))
        return grad_x, grad_weight.to(weight.dtype), None, None


class _PlacedLinear(torch.autograd.Function):
    """Megatron's column-parallel product without sequence parallelism, its output written where
    a swap placement puts it; the input gradient all-reduced over ``group`` when asked
    (Megatron's ``allreduce_dgrad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, allreduce_dgrad, placement, channels):
        out = new_output(placement, (*x.shape[:-1], weight.shape[0]), x.dtype, x.device)
        _linear_into(out, x, weight, bias, channels)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.allreduce_dgrad, ctx.has_bias = group, allreduce_dgrad, bias is not None
        ctx.partial = channels is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _no_partial_backward(ctx)
        x, weight = ctx.saved_tensors
        g = grad_out.flatten(0, -2)
        grad_x = (g @ weight).view(x.shape)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_x, group=ctx.group)
        grad_weight = g.t() @ x.flatten(0, -2)
        grad_bias = g.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None


def column_parallel_tiled(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                          tile: int, placement: Optional[Placement] = None,
                          channels: Optional["GroupChannels"] = None) -> torch.Tensor:
    """``x`` (``[S, b, h]``, this rank's tokens) gathered over ``group`` and multiplied by
    ``weightᵀ`` (plus ``bias``), ``tile`` tokens of each rank at a time: ``[tp·S, b, o/tp]``
    (``channels``: those output channels only, the others left undefined)."""
    return _SequenceTiledLinear.apply(x, weight, bias, group, tile, placement, channels)


def row_parallel_tiled(x: torch.Tensor, weight: torch.Tensor, group, tile: int) -> torch.Tensor:
    """``x @ weightᵀ`` (``x``: ``[tp·S, b, k/tp]``, every token) reduce-scattered over ``group``,
    ``tile`` output tokens at a time: ``[S, b, h]``, this rank's tokens."""
    return _SequenceTiledRowLinear.apply(x, weight, group, tile)


@dataclass(frozen=True)
class GroupChannels:
    """Output channels ``start .. stop`` of each of ``groups`` equal blocks of a column-parallel
    product's channels: the queries, or the keys and values, of Megatron's fused QKV projection,
    whose channels are ``[groups, (heads/groups + 2)·d]`` (each group's query heads, its key, its
    value)."""

    groups: int
    start: int
    stop: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """These channels of ``t`` (``[..., channels]``) as ``[..., groups, stop − start]`` (a view)."""
        return t.unflatten(-1, (self.groups, -1))[..., self.start:self.stop]


def _no_partial_backward(ctx) -> None:
    if ctx.partial:
        raise RuntimeError("a product of some of its output channels only (the keys and values made again, or "
                           "a recomputation's queries) has no backward pass")


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias,
                 channels: Optional[GroupChannels] = None) -> None:
    """``out = x @ weightᵀ (+ bias)``, written into ``out`` (contiguous rows); with ``channels``,
    those channels of ``out`` only, one product per group on the weight's own rows (no copy of
    them). The bias is added after the product, rounded as Megatron's ``output + bias`` is, not
    inside the GEMM."""
    x = x.flatten(0, -2)
    if channels is None:
        torch.matmul(x, weight.t(), out=out.view(-1, weight.shape[0]))
        if bias is not None:
            out.add_(bias)
        return
    target, rows = channels.of(out.view(x.shape[0], -1)), channels.of(weight.t())  # [tokens | in, groups, part]
    for group in range(channels.groups):
        part = torch.matmul(x, rows[:, group])
        if bias is not None:
            part.add_(channels.of(bias)[group])
        target[:, group].copy_(part)


class TiledColumnParallelLinear(Placed, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` whose sequence-parallel product runs in tiles (see the
    module docstring) and whose output, under swapping, is made where the placement puts it; every
    other case (a frozen weight, Megatron's fused or deferred weight gradients) is Megatron's own.
    The bias is always added in the product: it is never returned apart.

    Args:
        matmul_tile_tokens: tokens of this rank's input per tile of the product (``None``:
            :func:`~memo.model.tiles.eighth_tile_tokens`).
    """

    def __init__(self, *args, matmul_tile_tokens: Optional[int] = None, **kwargs):
        # The bias is added in place to the product, never returned for the caller to add:
        # Megatron's MLP would otherwise make FC1's output a second time, as output + bias.
        kwargs["skip_bias_add"] = False
        super().__init__(*args, **kwargs)
        if matmul_tile_tokens is not None and matmul_tile_tokens < 1:
            raise ValueError(f"matmul_tile_tokens={matmul_tile_tokens} must be at least 1")
        self.matmul_tile_tokens = matmul_tile_tokens
        # set by a walk in tiles around a pass that needs some of the channels only (:meth:`only`)
        self.channels: Optional[GroupChannels] = None

    @contextlib.contextmanager
    def only(self, channels: GroupChannels) -> Iterator[None]:
        """Compute ``channels`` of the output only, the others left undefined, while inside: the
        tensors saved for the backward pass are the whole product's, and a backward pass through
        such a product is refused."""
        self.channels = channels
        try:
            yield
        finally:
            self.channels = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        ours = (
            weight.requires_grad and not kwargs.get("gradient_accumulation_fusion")
            and kwargs.get("grad_output_buffer") is None and not args
        )
        bias, group = kwargs.get("bias"), kwargs.get("tp_group")
        if ours and kwargs.get("sequence_parallel"):
            tile = self.matmul_tile_tokens or eighth_tile_tokens(input.shape[0])
            return column_parallel_tiled(input, weight, bias, group, tile, self.placement, self.channels)
        if ours and (self.placement is not None or self.channels is not None):
            return _PlacedLinear.apply(input, weight, bias, group, bool(kwargs.get("allreduce_dgrad")),
                                       self.placement, self.channels)
        if self.channels is not None:
            raise RuntimeError("some output channels only were asked of a product Megatron runs itself "
                               "(a frozen weight, or fused or deferred weight gradients)")
        return super()._forward_impl(input, weight, *args, **kwargs)


class TiledRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` whose sequence-parallel product and reduce-scatter run in
    tiles (see the module docstring); every other case (no sequence parallelism, a frozen weight,
    Megatron's fused weight gradients, expert communication) is Megatron's own.

    Args:
        matmul_tile_tokens: tokens of this rank's output per tile of the product (``None``:
            :func:`~memo.model.tiles.eighth_tile_tokens`).
    """

    def __init__(self, *args, matmul_tile_tokens: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if matmul_tile_tokens is not None and matmul_tile_tokens < 1:
            raise ValueError(f"matmul_tile_tokens={matmul_tile_tokens} must be at least 1")
        self.matmul_tile_tokens = matmul_tile_tokens

    def forward(self, input_):
        ours = (
            self.sequence_parallel and self.input_is_parallel and self.weight.requires_grad
            and not self.gradient_accumulation_fusion and not self.explicit_expert_comm
            and not self.config.cpu_offloading
        )
        if not ours:
            return super().forward(input_)
        size = dist.get_world_size(self.tp_group)
        tile = self.matmul_tile_tokens or eighth_tile_tokens(input_.shape[0] // size)
        output = row_parallel_tiled(input_, self.weight, self.tp_group, tile)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
