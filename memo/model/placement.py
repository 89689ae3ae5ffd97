"""Saved tensors made where MEMO keeps them: the layer's ops that write their output in place.

Under MEMO's swapping (:class:`memo.execute.swap.SwapRuntime`) every tensor a layer saves for its
backward pass lives in a rounding buffer. A module that makes such a tensor asks the runtime
attached to it (its ``runtime`` attribute, ``None`` without swapping) for its output's memory with
:func:`new_output`: the runtime hands out the tensor's range of the buffer when the layer's layout
says the output is saved there, else new memory. The op then writes its rows straight into the
buffer, and the runtime has nothing to copy. Without a runtime every function here computes
exactly what the op it replaces computes (same kernels, same saved tensors, bit-identical
results), so the layout the runtime discovers is the same either way.

Which tensors are born where (the README repeats it):

* written by their op into the buffer: the rotated q and k (:mod:`memo.model.rotary`), FC1's
  output (:mod:`memo.model.linear`) and GeLU's (:func:`gelu`);
* written into the buffer a tile of tokens at a time: both norms' outputs, means and reciprocal
  deviations (:func:`layer_norm`; PyTorch's kernel makes its own output, so one tile of it
  exists twice);
* copied into the buffer by the op that first makes them whole: v, cut from the fused QKV output
  (:func:`copy_into` instead of ``.contiguous()``);
* copied by the runtime from the kernel's memory: attention's output and log-sum-exp (the fused
  attention kernels take no output tensor); the layer continues from the buffer's copy, so the
  kernel's output is freed at once;
* copied and kept alive by Megatron's layer as its residual stream: the layer input and the
  residual between attention and the MLP, which every method holds while the layer runs.
"""

from typing import Optional

import torch

from memo.model.tiles import eighth_tile_tokens, spans


def new_output(runtime, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Memory for an op's token-major output of ``shape``: ``runtime``'s (a rounding-buffer range
    or new memory) while it runs a layer, else new memory. Its content is undefined."""
    if runtime is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return runtime.output(tuple(shape), dtype, device)


class _CopyInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runtime):
        out = new_output(runtime, x.shape, x.dtype, x.device)
        out.copy_(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_into(x: torch.Tensor, runtime) -> torch.Tensor:
    """A contiguous copy of ``x`` (as ``x.contiguous()`` makes) in memory ``runtime`` places."""
    if runtime is None:
        return x.contiguous()
    return _CopyInto.apply(x, runtime)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runtime):
        out = new_output(runtime, x.shape, x.dtype, x.device)
        torch.ops.aten.gelu.out(x, approximate="none", out=out)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="none"), None


def gelu(x: torch.Tensor, runtime) -> torch.Tensor:
    """``torch.nn.functional.gelu(x)`` written where ``runtime`` places it; saves its input, as
    autograd's GeLU does."""
    if runtime is None or not torch.is_grad_enabled():
        return torch.nn.functional.gelu(x)
    return _Gelu.apply(x, runtime)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, runtime):
        shape = x.shape[-1:]
        # PyTorch's layer-norm kernel makes its own output (its out= variant copies from it), so
        # it runs on a tile of tokens at a time: only one tile's output exists twice
        tiles = spans(x.shape[0], eighth_tile_tokens(x.shape[0]))
        start, end = next(tiles)
        first = torch.native_layer_norm(x[start:end], shape, weight, bias, eps)
        # the statistics in the dtype the kernel keeps them in, which its backward reads: the
        # input's on the CPU, float32 for 16-bit input on CUDA
        out, mean, rstd = (new_output(runtime, (x.shape[0], *t.shape[1:]), t.dtype, x.device) for t in first)
        for target, value in zip((out, mean, rstd), first, strict=True):
            target[start:end].copy_(value)
        for start, end in tiles:
            tile = torch.native_layer_norm(x[start:end], shape, weight, bias, eps)
            for target, value in zip((out, mean, rstd), tile, strict=True):
                target[start:end].copy_(value)
        # autograd's native_layer_norm saves these, in this order
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad, x, x.shape[-1:], mean, rstd, weight, bias, mask
        )
        return grad_x, grad_w, grad_b, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               runtime) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (tokens first), its output and statistics written
    where ``runtime`` places them, an eighth of the tokens at a time."""
    if runtime is None or not torch.is_grad_enabled():
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps, runtime)
