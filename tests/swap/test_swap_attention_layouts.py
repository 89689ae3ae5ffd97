"""MEMO's swapping with an attention kernel that lays its tensors out as CUDA's memory-efficient
kernel does: its output batch-major (``[b, s, heads, dim]`` memory) and its log-sum-exp padded to a
multiple of 32 tokens. The CPU kernel does neither, so a stand-in with those layouts shows that the
runtime places both and continues from the buffer's copy of the output, with the gradients of
keeping everything."""

import pytest
import torch

from memo.swap import capture as swap_capture, layout as swap_layout
from memo.model import attention_blocks
from memo.model.attention import select_backend

from swap_training import train_gradients


class _EfficientLike(torch.autograd.Function):
    """Causal attention (float32 arithmetic of :mod:`memo.model.attention_blocks`' math kernel)
    whose output and saved log-sum-exp have the memory-efficient kernel's layouts."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, n, s, d = q.shape
        out, lse = attention_blocks.forward("math", q, k, v, True, scale)
        batch_major = q.new_empty(b, s, n, d).transpose(1, 2)
        batch_major.copy_(out)
        padded = lse.new_zeros(b, n, -(-s // 32) * 32)
        padded[..., :s] = lse
        ctx.save_for_backward(q, k, v, batch_major, padded)
        ctx.scale = scale
        return batch_major

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, padded = ctx.saved_tensors
        lse = padded[..., : q.shape[2]]
        return (*attention_blocks.backward("math", dout, q, k, v, out, lse, True, ctx.scale), None)


def _efficient_like(q, k, v, dropout_p=0.0, is_causal=True, scale=None, enable_gqa=False):
    return _EfficientLike.apply(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)


@pytest.fixture
def efficient_like_kernel(monkeypatch, single_process):
    # the kernel choice probes SDPA and is cached per process: probed on the stand-in, it would
    # pick kernels this CPU lacks for every later test of the process
    select_backend.cache_clear()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _efficient_like)
    relocated = []
    apply = swap_capture._Relocated.apply
    monkeypatch.setattr(swap_capture._Relocated, "apply", lambda *a: relocated.append(a) or apply(*a))
    yield relocated
    select_backend.cache_clear()


def test_a_padded_log_sum_exp_and_a_batch_major_output_are_placed_and_gradients_kept(efficient_like_kernel):
    seq = 200  # the log-sum-exp is padded to 224 tokens
    small = ("model.num_layers=4", "model.vocab_size=1000")  # (GPT-2's output layer: most of a step)
    _, expected, _ = train_gradients("none", *small, seq=seq, steps=2)
    _, got, runtime = train_gradients("memo", *small, seq=seq, steps=2, alpha=0.5)
    products = [s for s in runtime.layout.slots if s.kind == swap_layout.ATTENTION]
    assert sorted(s.shape[0] for s in products) == [seq, 224]  # the output, the log-sum-exp
    # the layer goes on from the buffer's copy of the output (batch-major, one sequence): 4 layers
    # in the forward of 2 steps, and the recomputations of the swapped layers' dropped rows
    assert len(efficient_like_kernel) == 2 * 4
    for step_got, step_expected in zip(got, expected, strict=True):
        for name, grad in step_expected.items():
            torch.testing.assert_close(step_got[name], grad)
