"""Saved tensors made where MEMO keeps them: the contract between a layer and what runs it.

A :class:`Placement` takes over a layer's work: the layer's forward (a walk in tiles, or a
forward whose saved tensors are swapped), the memory of every tensor the layer's ops make and
save, and core attention. The modules that make such tensors are :class:`Placed`: the layer
itself, its norms, rotary embedding, FC1 and activation, and core attention. A placement is given
to them once the model is built (``place``); without one (``None``) every function here computes
exactly what the op it replaces computes (same kernels, same saved tensors, bit-identical
results), so the layout a swap placement discovers is the same either way. What drives such a
placement through a training run (attach, release, token order, accounting, report) is its
:class:`LayerRuntime` side; a method that places nothing has a :class:`NullRuntime`.

Under MEMO's swapping (:class:`memo.swap.runtime.SwapRuntime`) every tensor a layer saves for its
backward pass lives in a rounding buffer. An op asks the placement for its output's memory with
:func:`new_output`: the placement hands out the tensor's range of the buffer when the layer's
layout says the output is saved there, else new memory. The op then writes its rows straight
into the buffer, and nothing is copied.

Which tensors are born where (the README repeats it):

* written by their op into the buffer: the rotated q and k (:mod:`memo.model.rotary`), FC1's
  output (:mod:`memo.model.linear`) and the activation's (:func:`gelu`, :func:`swiglu`);
* written into the buffer a tile of tokens at a time: both norms' outputs and statistics
  (:func:`layer_norm`: means and reciprocal deviations; :func:`rms_norm`: reciprocal root mean
  squares; PyTorch's kernels make their own output, so one tile of it exists twice);
* copied into the buffer by the op that first makes them whole: v, cut from the fused QKV output
  (:func:`copy_into` instead of ``.contiguous()``);
* copied by the placement from the kernel's memory: attention's output and log-sum-exp (the fused
  attention kernels take no output tensor); the layer continues from the buffer's copy, so the
  kernel's output is freed at once;
* copied and kept alive by Megatron's layer as its residual stream: the layer input and the
  residual between attention and the MLP, which every method holds while the layer runs.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from memo.model.documents import DocumentParams
from memo.model.tiles import eighth_tile_tokens, spans


# layer arguments Megatron may pass that no placement handles (a layer refuses them in one line)
UNSUPPORTED_LAYER_ARGUMENTS = ("context", "packed_seq_params", "sequence_len_offset", "inference_context",
                               "attention_bias", "rotary_pos_cos", "rotary_pos_sin", "padding_mask")


def check_layer_arguments(kwargs: dict, placement: str) -> None:
    """Refuse, naming ``placement``, a layer argument of :data:`UNSUPPORTED_LAYER_ARGUMENTS`;
    documents kept apart (:class:`~memo.model.documents.DocumentParams`) are core attention's alone."""
    for key in UNSUPPORTED_LAYER_ARGUMENTS:
        if kwargs.get(key) is not None and not isinstance(kwargs[key], DocumentParams):
            raise ValueError(f"{placement} does not support the layer argument {key}")


class Placement(Protocol):
    """What runs a layer's work in place of the layer itself (swapping, a walk in tiles)."""

    def forward(self, layer, kwargs: dict) -> tuple:
        """``layer``'s forward pass on Megatron's keyword arguments: ``(hidden_states, context)``.
        ``layer.run(**kwargs)`` is Megatron's own."""
        ...

    def evaluate(self, layer, kwargs: dict) -> tuple:
        """``layer``'s forward pass without grad (validation), as :meth:`forward` returns it:
        nothing is kept for a backward pass."""
        ...

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a token-major tensor ``shape`` an op of the layer is about to make and
        save; its content is undefined."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute: Callable[[], torch.Tensor],
                  scale: Optional[float], backend: str) -> torch.Tensor:
        """Core attention on ``q, k, v`` (``[b, heads, s, dim]``, softmax ``scale``, kernels of
        ``backend``); ``compute()`` runs it as the layer would."""
        ...


@dataclass(frozen=True)
class RuntimeReport:
    """What getting a :class:`LayerRuntime` ready decided and measured, for the run's records."""

    row: dict = field(default_factory=dict)  # result-row columns (``swap.*``, ``tiles.*``)
    layer_records: tuple[dict, ...] = ()  # lines of ``layers.jsonl`` at step 0 (each tile's α, say)
    summary: Optional[str] = None  # one line for the log; None: nothing to say
    # one swapped unit's (a layer's, a tile's) skeletal bytes: its input's, attention's output and
    # log-sum-exp, the rest; None where nothing is swapped
    skeletal_bytes: Optional[tuple[int, int, int]] = None


@dataclass(frozen=True)
class Accounting:
    """The skeletal activations of the steps since the last look, bytes: each layer's
    (``{"layer", "device", "host", "recomputed"}``, lines of ``layers.jsonl``) and the step's."""

    layers: tuple[dict, ...]
    device_bytes: int  # what the device holds of them: the rounding buffers, nothing beside them

    def totals(self) -> dict:
        """The step record's columns."""
        return {"skeletal_device_bytes": self.device_bytes,
                "skeletal_host_bytes": sum(r["host"] for r in self.layers),
                "recomputed_bytes": sum(r["recomputed"] for r in self.layers)}


class LayerRuntime(Protocol):
    """What runs a model's layers through training as its activation policy (:mod:`memo.policy`)
    got it ready: MEMO's swap runtime, a walk in sequence tiles, or :class:`NullRuntime`. The
    training loop and the memory plan see this, never which one it is."""

    def attach(self, layers: list) -> None:
        """Take over ``layers`` (the model's decoder layers, in order)."""
        ...

    def release(self) -> None:
        """Give back the memory it holds, once the copies in flight are done (idempotent)."""
        ...

    def token_order(self, micro_batch: dict) -> dict:
        """A micro-batch (``[b, s]`` tensors) in the token order the layers take."""
        ...

    def use(self, chunk: int, micro_batch: int) -> None:
        """Run the layers of model chunk ``chunk`` for ``micro_batch`` (0-based, of the step) next,
        its forward or its backward pass (a pipeline stage's micro-batches in flight,
        :mod:`memo.swap.in_flight`)."""
        ...

    def accounting(self) -> Optional[Accounting]:
        """The skeletal activations of the steps since the last call; None where it keeps them
        nowhere but where autograd does."""
        ...

    def report(self) -> RuntimeReport:
        """What getting it ready decided and measured."""
        ...

    def device_buffers(self) -> list[torch.Tensor]:
        """The device buffers it keeps activations in (MEMO's rounding or tile buffers), once made:
        a trace names their requests."""
        ...

    def device_stores(self) -> list[torch.Tensor]:
        """What else it keeps on the device from step to step, once made (a walk's whole-sequence
        stores): resident at a step's start, as the weights are."""
        ...

    def name_phases(self, on_phase: Optional[Callable[[int, str], None]]) -> None:
        """Tell ``on_phase(layer, part)`` of the parts of a layer's pass as they begin (a walk's
        tiles, rebuilds and attention blocks), until called with None."""
        ...


class NullRuntime:
    """The :class:`LayerRuntime` of a policy that places nothing: the layers run as they are built
    (Megatron's, or memo's keeping or recomputing whole layers)."""

    def attach(self, layers: list) -> None:
        pass

    def release(self) -> None:
        pass

    def token_order(self, micro_batch: dict) -> dict:
        return micro_batch

    def use(self, chunk: int, micro_batch: int) -> None:
        pass

    def accounting(self) -> Optional[Accounting]:
        return None

    def report(self) -> RuntimeReport:
        return RuntimeReport()

    def device_buffers(self) -> list[torch.Tensor]:
        return []

    def device_stores(self) -> list[torch.Tensor]:
        return []

    def name_phases(self, on_phase: Optional[Callable[[int, str], None]]) -> None:
        pass


class Placed:
    """A module whose work a :class:`Placement` may take over (see the module docstring)."""

    placement: Optional[Placement] = None

    def place(self, placement: Optional[Placement]) -> None:
        """Run under ``placement`` from now on (``None``: as Megatron's module would)."""
        self.placement = placement


def new_output(placement: Optional[Placement], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Memory for an op's token-major output of ``shape``: ``placement``'s (a rounding-buffer range
    or new memory) while it runs a layer, else new memory. Its content is undefined."""
    if placement is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return placement.output(tuple(shape), dtype, device)


class _CopyInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, placement):
        out = new_output(placement, x.shape, x.dtype, x.device)
        out.copy_(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_into(x: torch.Tensor, placement: Optional[Placement]) -> torch.Tensor:
    """A contiguous copy of ``x`` (as ``x.contiguous()`` makes) in memory ``placement`` places."""
    if placement is None:
        return x.contiguous()
    return _CopyInto.apply(x, placement)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, placement):
        out = new_output(placement, x.shape, x.dtype, x.device)
        torch.ops.aten.gelu.out(x, approximate="none", out=out)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="none"), None


def gelu(x: torch.Tensor, placement: Optional[Placement]) -> torch.Tensor:
    """``torch.nn.functional.gelu(x)`` written where ``placement`` places it; saves its input, as
    autograd's GeLU does."""
    if placement is None or not torch.is_grad_enabled():
        return torch.nn.functional.gelu(x)
    return _Gelu.apply(x, placement)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, placement):
        gate, up = torch.chunk(x, 2, dim=-1)
        out = new_output(placement, up.shape, x.dtype, x.device)
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


def swiglu(x: torch.Tensor, placement: Optional[Placement]) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate, up]`` (last dimension, halves), written where
    ``placement`` places it. Saves ``x`` only and makes SiLU again in the backward pass: autograd's
    composition would also keep ``silu(gate)`` (half of ``x`` again)."""
    if not torch.is_grad_enabled():
        gate, up = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return _SwiGLU.apply(x, placement)


def _tiled_into(placement: Optional[Placement], x: torch.Tensor, kernel) -> tuple[torch.Tensor, ...]:
    """``kernel``'s token-major outputs on all of ``x``, made by running it on an eighth of the
    tokens at a time and copying each tile into memory ``placement`` places: PyTorch's norm kernels
    make their own output (their out= variants copy from it), so only one tile exists twice. The
    outputs take the dtypes the kernel gives them (a norm's statistics: the input's on the CPU,
    float32 for 16-bit input on CUDA, as its backward reads them)."""
    tiles = spans(x.shape[0], eighth_tile_tokens(x.shape[0]))
    start, end = next(tiles)
    first = kernel(x[start:end])
    outs = tuple(new_output(placement, (x.shape[0], *t.shape[1:]), t.dtype, x.device) for t in first)
    for target, value in zip(outs, first, strict=True):
        target[start:end].copy_(value)
    for start, end in tiles:
        for target, value in zip(outs, kernel(x[start:end]), strict=True):
            target[start:end].copy_(value)
    return outs


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, placement):
        shape = x.shape[-1:]
        out, mean, rstd = _tiled_into(placement, x, lambda t: torch.native_layer_norm(t, shape, weight, bias, eps))
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
               placement: Optional[Placement]) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (tokens first), its output and statistics written
    where ``placement`` places them, an eighth of the tokens at a time."""
    if placement is None or not torch.is_grad_enabled():
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps, placement)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, placement):
        shape = x.shape[-1:]
        if placement is None:
            out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        else:
            out, rstd = _tiled_into(placement, x, lambda t: torch.ops.aten._fused_rms_norm(t, shape, weight, eps))
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             placement: Optional[Placement]) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (tokens first) with PyTorch's fused kernel, its
    output and reciprocal root mean square written where ``placement`` places them, an eighth of
    the tokens at a time. Saves ``x``, the weight and that statistic (``[tokens, ..., 1]``, float32):
    autograd's ``rms_norm`` on the CPU is a composition that would keep four tensors of ``x``'s size."""
    if not torch.is_grad_enabled():
        return torch.ops.aten._fused_rms_norm(x, x.shape[-1:], weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps, placement)
