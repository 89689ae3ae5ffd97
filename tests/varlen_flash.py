"""A float64 stand-in on the CPU for FlashAttention's variable-length entry points, for the
tests of the code that calls them on CUDA (``tests/model/test_attention_blocks.py``,
``tests/model/test_tiled_attention.py``)."""

import torch

from memo.model import attention_blocks


class VarlenFlash:
    """FlashAttention's variable-length entry points as PyTorch 2.11 declares them, computed in
    float64 on the CPU (softmax over each segment's earlier keys, grouped heads shared): what
    :func:`memo.model.attention_blocks.segments_forward` hands them and makes of their results
    is then checked against the block-per-segment path. Every other operator is ATen's own;
    ``calls`` counts the variable-length calls."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(torch.ops.aten, name)

    @staticmethod
    def _attend(q, k, v, scale):
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        scores = torch.einsum("ind,jnd->nij", q, k) * scale
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
        return torch.einsum("nij,jnd->ind", scores.softmax(-1), v), scores.logsumexp(-1)

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.dim() == 3 and is_causal and dropout_p == 0
        assert all(t.stride(-1) == 1 and t.dtype == q.dtype for t in (q, k, v))
        self.calls += 1
        bounds = cu_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])
        for a, b in zip(bounds, bounds[1:]):
            out[a:b], lse[:, a:b] = self._attend(q[a:b], k[a:b], v[a:b], scale)
        return out, lse, None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                                  rng_state, unused, *, scale):
        """Each segment's share of the gradients given the output and log-sum-exp of the whole
        attention it is part of (a tile's queries also see earlier blocks), as the kernels rebuild
        the softmax: ``exp(scores − lse)``."""
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        assert all(t.stride(-1) == 1 and t.dtype == q.dtype for t in (dout, q, k, v, out))
        self.calls += 1
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        bounds = cu_q.tolist()
        for a, b in zip(bounds, bounds[1:]):
            keys, values = (t[a:b].repeat_interleave(groups, dim=1) for t in (k, v))
            scores = torch.einsum("ind,jnd->nij", q[a:b], keys) * scale
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
            probs = torch.exp(scores - lse[:, a:b, None])
            d_probs = torch.einsum("ind,jnd->nij", dout[a:b], values)
            d_scores = probs * (d_probs - (dout[a:b] * out[a:b]).sum(-1).transpose(0, 1)[..., None]) * scale
            dq[a:b] = torch.einsum("nij,jnd->ind", d_scores, keys)
            dk[a:b] = torch.einsum("nij,ind->jnd", d_scores, q[a:b]).unflatten(1, (-1, groups)).sum(2)
            dv[a:b] = torch.einsum("nij,ind->jnd", probs, dout[a:b]).unflatten(1, (-1, groups)).sum(2)
        return dq, dk, dv


def use_varlen_flash(monkeypatch) -> VarlenFlash:
    """Have :mod:`memo.model.attention_blocks` take its CUDA branch for FlashAttention's segments
    on the CPU, into the :class:`VarlenFlash` returned, for the test ``monkeypatch`` belongs to."""
    fake = VarlenFlash()
    monkeypatch.setattr(attention_blocks, "_aten", fake)
    monkeypatch.setattr(attention_blocks, "_variable_length", lambda kernel, q: kernel == "flash" and q.shape[0] == 1)
    return fake
