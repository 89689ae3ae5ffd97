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
  output (:mod:`memo.model.linear`) and the activation's (:func:`gelu`, :func:`swiglu`);
* written into the buffer a tile of tokens at a time: both norms' outputs and statistics
  (:func:`layer_norm`: means and reciprocal deviations; :func:`rms_norm`: reciprocal root mean
  squares; PyTorch's kernels make their own output, so one tile of it exists twice);
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


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runtime):
        gate, up = torch.chunk(x, 2, dim=-1)
        out = new_output(runtime, up.shape, x.dtype, x.device)
        torch.mul(torch.nn.functional.silu(gate), up, out=out)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = torch.chunk(grad_x, 2, dim=-1)
        # autograd's ops for silu(gate) * up, so gradients are bit-identical to it; each half
        # written into its place (no concatenated copy)
        grad_gate.copy_(torch.ops.aten.silu_backward(grad * up, gate))
        torch.mul(grad, torch.nn.functional.silu(gate), out=grad_up)
        return grad_x, None


def swiglu(x: torch.Tensor, runtime) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate, up]`` (last dimension, halves), written where
    ``runtime`` places it. Saves ``x`` only and makes SiLU again in the backward pass: autograd's
    composition would also keep ``silu(gate)`` (half of ``x`` again)."""
    if not torch.is_grad_enabled():
        gate, up = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return _SwiGLU.apply(x, runtime)


def _tiled_into(runtime, x: torch.Tensor, kernel) -> tuple[torch.Tensor, ...]:
    """``kernel``'s token-major outputs on all of ``x``, made by running it on an eighth of the
    tokens at a time and copying each tile into memory ``runtime`` places: PyTorch's norm kernels
    make their own output (their out= variants copy from it), so only one tile exists twice. The
    outputs take the dtypes the kernel gives them (a norm's statistics: the input's on the CPU,
    float32 for 16-bit input on CUDA, as its backward reads them)."""
    tiles = spans(x.shape[0], eighth_tile_tokens(x.shape[0]))
    start, end = next(tiles)
    first = kernel(x[start:end])
    outs = tuple(new_output(runtime, (x.shape[0], *t.shape[1:]), t.dtype, x.device) for t in first)
    for target, value in zip(outs, first, strict=True):
        target[start:end].copy_(value)
    for start, end in tiles:
        for target, value in zip(outs, kernel(x[start:end]), strict=True):
            target[start:end].copy_(value)
    return outs


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, runtime):
        shape = x.shape[-1:]
        out, mean, rstd = _tiled_into(runtime, x, lambda t: torch.native_layer_norm(t, shape, weight, bias, eps))
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


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, runtime):
        shape = x.shape[-1:]
        if runtime is None:
            out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        else:
            out, rstd = _tiled_into(runtime, x, lambda t: torch.ops.aten._fused_rms_norm(t, shape, weight, eps))
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if x.is_cuda:
            grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(
                grad, x, x.shape[-1:], rstd, weight, [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
        else:  # PyTorch has no CPU kernel for it
            grad_x, grad_w = _rms_norm_backward_host(grad, x, rstd, weight)
        return grad_x, grad_w, None, None


def _rms_norm_backward_host(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor):
    """RMSNorm's input and weight gradients in float32 (float64 for float64 input), an eighth of
    the tokens at a time: with ``x̂ = x·rstd``, ``dx = rstd·(g·w − x̂·mean(g·w·x̂))`` and
    ``dw = Σ g·x̂``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    w = weight.to(acc)
    for start, end in spans(x.shape[0], eighth_tile_tokens(x.shape[0])):
        normed = x[start:end].to(acc) * rstd[start:end]
        g = grad[start:end].to(acc)
        grad_w += (g * normed).flatten(0, -2).sum(dim=0)
        gw = g * w
        grad_x[start:end] = rstd[start:end] * (gw - normed * (gw * normed).mean(dim=-1, keepdim=True))
    return grad_x, grad_w.to(weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, runtime) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (tokens first) with PyTorch's fused kernel, its
    output and reciprocal root mean square written where ``runtime`` places them, an eighth of
    the tokens at a time. Saves ``x``, the weight and that statistic (``[tokens, ..., 1]``, float32):
    autograd's ``rms_norm`` on the CPU is a composition that would keep four tensors of ``x``'s size."""
    if not torch.is_grad_enabled():
        return torch.ops.aten._fused_rms_norm(x, x.shape[-1:], weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps, runtime)
