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


def test_a_grouped_model_probes_with_fewer_key_value_heads(monkeypatch):
    import memo.model.attention as attention

    # the CUDA memory-efficient kernel takes no grouped keys and values: a kernel that refuses them
    # must not be chosen for a grouped model (a stand-in here, on the CPU)
    seen, real = [], attention.causal_attention

    def refusing_grouped(q, k, v, backend, **kwargs):
        seen.append((backend, q.shape[2], k.shape[2], kwargs.get("grouped")))
        if backend == "flash" and q.shape[2] != k.shape[2]:
            raise RuntimeError("both fused kernels require query, key and value to have the same num_heads")
        return real(q, k, v, backend, **kwargs)

    monkeypatch.setattr(attention, "causal_attention", refusing_grouped)
    select_backend.cache_clear()
    assert select_backend("cpu", torch.float32, 32, "auto", True) == "math"
    assert [b for b, *_ in seen] == ["cudnn", "flash", "efficient", "math"]  # each tried, grouped
    assert {tuple(shape) for _, *shape in seen} == {(4, 2, True)}
    with pytest.raises(ConfigError, match="with fewer key/value heads than query heads"):
        select_backend("cpu", torch.float32, 32, "flash", True)
    assert select_backend("cpu", torch.float32, 32, "auto", False) == "flash"
    select_backend.cache_clear()


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
