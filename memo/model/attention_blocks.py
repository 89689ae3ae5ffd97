"""One block of attention at the kernel level: forward returning the log-sum-exp of every query's
scores, and backward given the output and log-sum-exp of the whole attention a block is part of.

Context parallelism splits one query's keys over several blocks (chunks of the sequence held by
different ranks). Each block's forward gives an output and a log-sum-exp; :func:`merge` combines
them into attention over all the blocks' keys. The backward of a block called with the merged
output and log-sum-exp (not the block's own) gives exactly that block's share of the gradients,
since the kernels rebuild the softmax as ``exp(scores − lse)``: this is how FlashAttention-based
ring attention works, and why it needs the kernels' own entry points rather than
``scaled_dot_product_attention``, which neither returns the log-sum-exp nor takes one.

Tensors are ``[b, heads, tokens, dim]``; the log-sum-exp is ``[b, heads, tokens]`` in float32.
A causal block is square and aligned at the top left (a chunk against itself); a full block has
no mask (a chunk against an earlier one).

Kernels, by the name :func:`memo.model.attention.select_backend` chose:

* ``flash`` on the CPU: ATen's fused CPU kernel; on CUDA: FlashAttention-2 as PyTorch ships it;
* ``efficient`` (CUDA): the memory-efficient kernel, whose log-sum-exp is padded to 32 tokens;
* ``math``: the scores materialized in float32, for dtypes and devices no fused kernel takes.

cuDNN's kernel is not offered here; a run that chose it uses ``flash`` for its blocks.
"""

import torch

BLOCK_KERNELS = ("flash", "efficient", "math")


def block_kernel(backend: str) -> str:
    """The block kernel for a run whose attention uses ``backend``."""
    return backend if backend in BLOCK_KERNELS else "flash"


def forward(kernel: str, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block: ``out`` in ``q``'s dtype, ``lse`` ``[b, heads, tokens]`` in
    float32 (float64 for float64 inputs)."""
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of one block, given ``out`` and ``lse`` of the attention it is part of."""
    if kernel == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    nothing = torch.empty(0, device=q.device)
    if kernel == "flash":
        # without dropout the kernel reads no random state: the seed and offset are placeholders
        seed = torch.zeros(2, dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), nothing, nothing, q.shape[2], k.shape[2], 0.0, causal,
            seed, nothing, scale=scale)
    padded = -(-q.shape[2] // 32) * 32
    lse = torch.nn.functional.pad(lse, (0, padded - q.shape[2])).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are merged and gradients summed in: float32, or the input's if wider."""
    return torch.promote_types(dtype, torch.float32)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Attention over the keys of two blocks from each one's ``(out, lse)``."""
    merged = torch.logaddexp(lse, block_lse)
    acc = wide(out.dtype)
    mixed = (out.to(acc) * torch.exp(lse - merged).unsqueeze(-1)
             + block_out.to(acc) * torch.exp(block_lse - merged).unsqueeze(-1))
    return mixed.to(out.dtype), merged


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.to(wide(q.dtype)), k.to(wide(q.dtype)).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, -torch.inf)
    return scores


def _math_forward(q, k, v, causal: bool, scale: float):
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(scores.dtype))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    acc = probs.dtype
    dout = dout.to(acc)
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    dscores = probs * (dprobs - (dout * out.to(acc)).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(dscores, k.to(acc))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
