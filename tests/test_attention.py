"""SdpaAttention computes causal attention exactly, in Megatron's [s, b, heads, dim] layout."""

import math

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from memo.config import ConfigError
from memo.model.attention import SdpaAttention, select_backend


def attention_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.0,
        use_cpu_initialization=True,
    )


def reference_attention(q, k, v):
    """Textbook causal softmax attention; [s, b, n, d] in, [s, b, n·d] out."""
    s, b, n, d = q.shape
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
    return out.reshape(s, b, n * d)


@pytest.mark.parametrize("backend, dtype", [("flash", torch.float32), ("math", torch.float64)])
def test_matches_reference_forward_and_backward(backend, dtype):
    config = attention_config()
    attention = SdpaAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, backend=backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(37, 2, 4, 16, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, None)
    expected = reference_attention(q, k, v)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_backend_selection_on_cpu():
    assert select_backend("cpu", torch.float32, 64) == "flash"  # PyTorch's fused CPU kernel
    assert select_backend("cpu", torch.float32, 64, "math") == "math"
    with pytest.raises(ConfigError, match="train.attention_backend=cudnn"):
        select_backend("cpu", torch.float32, 64, "cudnn")


def test_refuses_non_causal_masks():
    config = attention_config()
    with pytest.raises(ValueError, match="causal"):
        SdpaAttention(config, layer_number=1, attn_mask_type=AttnMaskType.padding)


def test_backend_probe_leaves_the_global_rng_alone():
    select_backend.cache_clear()
    torch.manual_seed(5)
    select_backend("cpu", torch.float32, 32)
    after_probe = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_probe, torch.rand(3))
