"""The ops that write a layer's saved tensors where the swap runtime keeps them: the memory they
are handed, and results and gradients bit-identical to the ops they stand for."""

import pytest
import torch

from memo.model.placement import copy_into, gelu, layer_norm
from memo.model.rotary import RotaryTable, rotate


class _Arena:
    """A stand-in runtime: hands out consecutive ranges of one tensor and remembers them."""

    def __init__(self):
        self.memory = torch.empty(1 << 16)
        self.given = []
        self._next = 0

    def output(self, shape, dtype, device):
        n = torch.Size(shape).numel()
        out = self.memory[self._next:self._next + n].view(shape)
        self._next += n
        self.given.append(out.data_ptr())
        return out


def _inputs(*shapes):
    torch.manual_seed(0)
    return [torch.randn(*s, dtype=torch.float32, requires_grad=True) for s in shapes]


def _run_both(placed, reference, inputs):
    """Outputs and input gradients of ``placed`` and ``reference`` on copies of ``inputs``."""
    results = []
    for fn in (placed, reference):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        out = fn(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, [x.grad for x in leaves]))
    return results


@pytest.mark.parametrize("tokens", [7, 512])  # one tile; tiles of 64 tokens
def test_layer_norm_writes_its_output_and_statistics_into_the_memory_it_is_given(tokens):
    arena = _Arena()
    inputs = _inputs((tokens, 2, 16), (16,), (16,))
    (out, grads), (ref, ref_grads) = _run_both(
        lambda x, w, b: layer_norm(x, w, b, 1e-5, arena),
        lambda x, w, b: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5), inputs)
    assert out.data_ptr() == arena.given[0] and len(arena.given) == 3  # output, mean, rstd
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)


def test_gelu_and_the_copy_of_v_write_into_the_memory_they_are_given():
    arena = _Arena()
    (x,) = _inputs((64, 1, 32))
    (out, (grad,)), (ref, (ref_grad,)) = _run_both(lambda t: gelu(t, arena), torch.nn.functional.gelu, [x])
    assert out.data_ptr() == arena.given[0]
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    fused = torch.randn(64, 1, 3, 32, requires_grad=True)
    v = copy_into(fused[:, :, 2], arena)  # v cut from a fused QKV output, as Megatron hands it
    assert v.data_ptr() == arena.given[1] and v.is_contiguous()
    v.sum().backward()
    assert torch.equal(fused.grad[:, :, 2], torch.ones(64, 1, 32)) and not fused.grad[:, :, :2].any()


def test_rotary_writes_q_into_the_memory_it_is_given_with_megatrons_arithmetic():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    arena, table = _Arena(), RotaryTable()
    q, freqs = _inputs((32, 1, 2, 16), (32, 1, 1, 16))
    freqs = freqs.detach()
    (out, (grad,)), (ref, (ref_grad,)) = _run_both(
        lambda t: rotate(t, freqs, table, arena), lambda t: _apply_rotary_pos_emb_bshd(t, freqs), [q])
    assert out.data_ptr() == arena.given[0]
    assert torch.equal(out, ref)
    torch.testing.assert_close(grad, ref_grad)  # the backward rotates by the table, not autograd's graph


class _TypedArena:
    """A stand-in runtime that hands out new memory of the dtype asked for, and notes it."""

    def __init__(self):
        self.dtypes = []

    def output(self, shape, dtype, device):
        self.dtypes.append(dtype)
        return torch.empty(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("device, statistics", [("cpu", torch.bfloat16), ("meta", torch.float32)])
def test_layer_norm_keeps_its_statistics_in_the_dtype_its_kernels_backward_reads(device, statistics):
    """In bf16 the CPU kernel keeps the mean and reciprocal deviation in bf16 and CUDA's in float32,
    which CUDA's backward reads as float32; the meta device follows CUDA's rule."""
    arena = _TypedArena()
    x, w, b = (torch.randn(*s, dtype=torch.bfloat16, device=device, requires_grad=True)
               for s in ((512, 2, 16), (16,), (16,)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer_norm(x, w, b, 1e-5, arena)
    _, mean, rstd = torch.native_layer_norm(x.detach(), (16,), w.detach(), b.detach(), 1e-5)
    assert (mean.dtype, rstd.dtype) == (statistics, statistics)
    assert arena.dtypes == [torch.bfloat16, statistics, statistics]  # output, mean, rstd
    assert [(t.dtype, tuple(t.shape)) for t in saved[3:]] == [(statistics, (512, 2, 1))] * 2
