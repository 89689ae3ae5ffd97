"""One block of attention at the kernel level: forward returning the log-sum-exp of every query's
scores, and backward given the output and log-sum-exp of the whole attention a block is part of.

Context parallelism splits one query's keys over several blocks (chunks of the sequence held by
different ranks). Each block's forward gives an output and a log-sum-exp; :func:`merge` combines
them into attention over all the blocks' keys. The backward of a block called with the merged
output and log-sum-exp (not the block's own) gives exactly that block's share of the gradients,
since the kernels rebuild the softmax as ``exp(scores − lse)``: this is how FlashAttention-based
ring attention works, and why it needs the kernels' own entry points rather than
``scaled_dot_product_attention``, which neither returns the log-sum-exp nor takes one.

Tensors are ``[b, heads, tokens, dim]``; the log-sum-exp is ``[b, heads, tokens]`` in float32
(float64 for float64 input on the CPU). A causal block is square and aligned at the top left (a
chunk against itself); a full block has no mask (a chunk against an earlier one). The kernels
disagree on the causal diagonal of a block that is not square (FlashAttention-2's is at the bottom
right, cuDNN's and the memory-efficient kernel's at the top left), so such a block is refused.

Kernels (:func:`choose`), and what their entry points need in PyTorch 2.11 (the schemas are
``tests/data/torch-2.11-aten-schemas.txt``):

* ``cudnn`` (CUDA, sm80 and newer, fp16/bf16, head size a multiple of 8 up to 128): cuDNN's fused
  attention, the fastest on Hopper (a block of one key, which it does not take, runs ``flash``).
  Its log-sum-exp is ``[b, heads, tokens, 1]``. Its backward
  graphs are cached by the layouts of q, k and v only, so the output and its gradient are always
  handed over token-major within the block (:func:`token_major`) and the log-sum-exp packed;
  undefined (``None``) sequence offsets select its dense path.
* ``flash`` on the CPU: ATen's fused CPU kernel; on CUDA (sm80 and newer, fp16/bf16, head size a
  multiple of 8 up to 256): FlashAttention-2 as PyTorch ships it. Its backward takes the dense
  path only when the cumulative sequence lengths are undefined (``None``; a defined tensor, even
  an empty one, selects the variable-length path), and reads the log-sum-exp through a bare
  pointer, so it must be contiguous.
* ``efficient`` (CUDA, sm50 and newer; fp32, fp16, bf16 on sm80): the memory-efficient kernel,
  whose log-sum-exp is padded to 32 tokens. Its backward reads the output with the row stride of
  a token-major block whatever the tensor's strides say, so the output is handed over token-major.
* ``math``: the scores materialized in float32 (or wider), for dtypes and devices no fused kernel
  takes.

Without dropout none of the backward kernels reads its random state: seeds and offsets are
``None``.

Keys and values may have fewer heads than queries (grouped-query attention: each of ``g`` heads
serves ``heads/g`` query heads). cuDNN's, FlashAttention's (its variable-length entry point
too) and ATen's CPU kernel take them as they are and give their gradients with ``g`` heads, each
summed over its query heads inside the kernel (PyTorch 2.11: ``cudnn/MHA.cpp``,
``flash_attn/flash_api.cpp``'s ``mha_fwd``/``mha_bwd``, ``cpu/FlashAttentionKernel.cpp``): no copy
of a block's keys and values per query head is made for them. For the memory-efficient kernel
and ``math`` each block's keys and values are repeated per query head (:func:`expand_kv`) and
their gradients summed back in float32 (:func:`fold_kv`).
"""

import functools
from typing import Optional, Sequence

import torch

BLOCK_KERNELS = ("cudnn", "flash", "efficient", "math")
_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten


def supports(kernel: str, device_type: str, capability: Optional[tuple[int, int]], dtype: torch.dtype,
             head_dim: int) -> bool:
    """Whether ``kernel`` runs blocks of ``head_dim``-wide heads in ``dtype`` on a device of
    ``device_type`` (``capability``: CUDA's compute capability, ``None`` on the CPU), as PyTorch
    2.11's checks and kernels allow (:mod:`torch.nn.attention`'s selection applies the same)."""
    if kernel == "math":
        return True
    if device_type == "cpu":
        return kernel == "flash" and dtype in (torch.float32, torch.float64, *_HALF)
    if device_type != "cuda" or capability is None:
        return False
    aligned = head_dim % 8 == 0
    if kernel == "cudnn":
        return (8, 0) <= capability <= (12, 1) and dtype in _HALF and aligned and head_dim <= 128
    if kernel == "flash":
        return capability >= (8, 0) and dtype in _HALF and aligned and head_dim <= 256
    if kernel == "efficient":
        if dtype == torch.float32:
            return capability >= (5, 0) and head_dim % 4 == 0
        return dtype in _HALF and aligned and capability >= ((8, 0) if dtype == torch.bfloat16 else (5, 0))
    raise ValueError(f"{kernel} is not a block kernel; choose one of {', '.join(BLOCK_KERNELS)}")


def choose(whole: str, device_type: str, capability: Optional[tuple[int, int]], dtype: torch.dtype,
           head_dim: int) -> str:
    """The kernel for the blocks of a run whose whole-sequence attention runs ``whole`` (a name
    :func:`memo.model.attention.select_backend` gave): that kernel where it runs blocks here,
    else the first of cuDNN, flash, efficient that does, else ``math``."""
    if whole == "math":
        return "math"
    for kernel in dict.fromkeys((whole, "cudnn", "flash", "efficient")):
        if kernel in BLOCK_KERNELS and supports(kernel, device_type, capability, dtype, head_dim):
            return kernel
    return "math"


def kernel_for(whole: str, q: torch.Tensor) -> str:
    """:func:`choose` for blocks of ``q``'s device, dtype and head size."""
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return choose(whole, q.device.type, capability, q.dtype, q.shape[-1])


def _check_block(kernel: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block must be square, not {q.shape[2]} queries by {k.shape[2]} keys: "
                         "the kernels align its diagonal differently")
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"{kernel} is not a block kernel; choose one of {', '.join(BLOCK_KERNELS)}")
    if q.device.type == "cpu" and kernel not in ("flash", "math"):
        raise ValueError(f"the {kernel} kernel does not run on the CPU")


def rows(t: torch.Tensor, tokens: slice) -> torch.Tensor:
    """Tokens ``tokens`` of a ``[b, heads, tokens, ...]`` tensor (a view)."""
    return t[:, :, tokens]


def token_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[b, heads, tokens, dim]``) with its tokens outermost but for the batch, as the
    CUDA kernels write their outputs: itself if so already, else a copy."""
    if t.transpose(1, 2).is_contiguous():
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def takes_grouped(kernel: str) -> bool:
    """Whether ``kernel`` takes keys and values with fewer heads than the queries as they are (see
    the module docstring)."""
    return kernel in ("cudnn", "flash")


def _heads_for(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``k`` and ``v`` as ``kernel`` takes them beside ``q``, and the query heads per key head
    they were repeated for (1: as they are)."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or takes_grouped(kernel):
        return k, v, 1
    return expand_kv(k, groups), expand_kv(v, groups), groups


def forward(kernel: str, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block: ``out`` in ``q``'s dtype, ``lse`` ``[b, heads, tokens]``;
    ``k`` and ``v`` with as many heads as ``q`` or fewer (grouped)."""
    _check_block(kernel, q, k, causal)
    k, v, _ = _heads_for(kernel, q, k, v)
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale)
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=causal, scale=scale)
        return out, lse
    if kernel == "cudnn" and k.shape[2] > 1:  # cuDNN takes no block of one key: flash does
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal,
            return_debug_mask=False, scale=scale)
        return out, lse.squeeze(-1)
    if kernel in ("cudnn", "flash"):
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale)
        return out, lse
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float,
             grad_dtype: Optional[torch.dtype] = None):
    """``(dq, dk, dv)`` of one block, given ``out`` and ``lse`` of the attention it is part of:
    ``dk`` and ``dv`` with ``k``'s heads, in ``grad_dtype`` where given, else as made: in ``k``'s
    dtype by a kernel that takes grouped heads, in :func:`wide` precision where a group's query
    heads' gradients are summed here (:func:`fold_kv`), so that a caller adding them into wider
    accumulators rounds them nowhere."""
    _check_block(kernel, q, k, causal)
    expanded_k, expanded_v, groups = _heads_for(kernel, q, k, v)
    dq, dk, dv = _block_backward(kernel, dout, q, expanded_k, expanded_v, out, lse, causal, scale)
    if groups > 1:
        dk, dv = (fold_kv(d.to(wide(d.dtype)), groups) for d in (dk, dv))
    if grad_dtype is not None:
        dk, dv = dk.to(grad_dtype), dv.to(grad_dtype)
    return dq, dk, dv


def _block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    if kernel == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, dropout_p=0.0, is_causal=causal, scale=scale)
    s_q, s_k = q.shape[2], k.shape[2]
    if kernel == "cudnn" and s_k > 1:
        return _aten._scaled_dot_product_cudnn_attention_backward(
            token_major(dout), q, k, v, token_major(out), lse.float().contiguous().unsqueeze(-1),
            philox_seed=None, philox_offset=None, attn_bias=None, cum_seq_q=None, cum_seq_k=None,
            max_q=s_q, max_k=s_k, dropout_p=0.0, is_causal=causal, scale=scale)
    if kernel in ("cudnn", "flash"):
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), cum_seq_q=None, cum_seq_k=None,
            max_q=s_q, max_k=s_k, dropout_p=0.0, is_causal=causal, philox_seed=None,
            philox_offset=None, scale=scale)
    padded = -(-s_q // 32) * 32
    lse = torch.nn.functional.pad(lse.float(), (0, padded - s_q)).contiguous()
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, token_major(out), lse, None, None, dropout_p=0.0,
        grad_input_mask=[True, True, True, False], is_causal=causal, scale=scale)
    return dq, dk, dv


def _spans(bounds: Sequence[int]) -> list[slice]:
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _variable_length(kernel: str, q: torch.Tensor) -> bool:
    """Whether segments of ``q``'s tokens run in one call of FlashAttention's variable-length
    entry point (one sequence of tokens, on CUDA)."""
    return kernel == "flash" and q.device.type != "cpu" and q.shape[0] == 1


def _packed(t: torch.Tensor) -> torch.Tensor:
    """``[1, heads, tokens, dim]`` as the variable-length kernels take it, ``[tokens, heads, dim]``
    (a view: token-major tensors need no copy)."""
    return t[0].transpose(0, 1)


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_packed`: ``[tokens, heads, dim]`` as ``[1, heads, tokens, dim]``."""
    return t.unsqueeze(0).transpose(1, 2)


@functools.lru_cache(maxsize=64)
def _cu_seqlens(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """The cumulative sequence lengths (int32, on ``device``) of segments ``bounds`` and the
    longest's length: copied once per set of segments (a micro-batch's documents, a tile's), not
    per layer and pass, and from pinned memory without waiting, where a copy from pageable
    memory would wait for the device's queue to drain."""
    lengths = torch.tensor(bounds, dtype=torch.int32)
    if device.type == "cuda":
        lengths = lengths.pin_memory().to(device, non_blocking=True)
    else:
        lengths = lengths.to(device)
    return lengths, max(b - a for a, b in zip(bounds, bounds[1:]))


def segments_forward(kernel: str, q, k, v, bounds: Sequence[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each segment ``[bounds[i], bounds[i + 1])`` of the tokens (the
    documents of a sequence, ``bounds`` from 0 to every token): ``q`` ``[b, heads, tokens, dim]``,
    ``k`` and ``v`` with as many or fewer heads (grouped). Returns ``(out, lse)`` as
    :func:`forward`, ``out`` laid out ``[tokens, b, heads, dim]`` in memory.

    FlashAttention on CUDA runs every segment in one call of its variable-length entry point
    (cumulative sequence lengths, int32); other kernels run a causal block per segment."""
    if _variable_length(kernel, q):
        cu, longest = _cu_seqlens(tuple(bounds), q.device)
        out, lse, *_ = _aten._flash_attention_forward(_packed(q), _packed(k), _packed(v), cu, cu, longest, longest,
                                                        0.0, True, False, scale=scale)
        if lse.shape != (q.shape[1], q.shape[2]):  # (FlashAttention's varlen entry point before 2.7 padded it)
            raise RuntimeError(f"FlashAttention's variable-length log-sum-exp is {tuple(lse.shape)}, not "
                               f"{(q.shape[1], q.shape[2])} (heads, tokens): this PyTorch's build pads it")
        return _unpacked(out), lse.unsqueeze(0)
    b, n, tokens, d = q.shape
    out = torch.empty((tokens, b, n, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
    lse = torch.empty((b, n, tokens), dtype=wide(q.dtype), device=q.device)
    for span in _spans(bounds):
        part_out, part_lse = forward(kernel, rows(q, span), rows(k, span), rows(v, span), True, scale)
        rows(out, span).copy_(part_out)
        lse[..., span].copy_(part_lse)
    return out, lse


def segments_backward(kernel: str, dout, q, k, v, out, lse, bounds: Sequence[int], scale: float,
                      grad_dtype: Optional[torch.dtype] = None):
    """``(dq, dk, dv)`` of :func:`segments_forward`, ``dk`` and ``dv`` with ``k``'s heads in
    ``grad_dtype`` (``k``'s unless given), grouped heads' gradients summed as :func:`backward`
    sums them; FlashAttention's variable-length backward rounds them per query head, then sums,
    and holds, for the call, a float32 accumulator of ``(tokens + 128·segments)·heads·dim``
    elements (dim rounded up to a multiple of 32): 128 rows more per document."""
    if _variable_length(kernel, q):
        cu, longest = _cu_seqlens(tuple(bounds), q.device)
        # (without dropout the kernel reads no random state: placeholders of the forward's shapes)
        rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        grads = _aten._flash_attention_backward(
            _packed(token_major(dout)), _packed(q), _packed(k), _packed(v), _packed(token_major(out)),
            lse[0].to(wide(q.dtype)).contiguous(), cu, cu, longest, longest, 0.0, True, rng_state, unused, scale=scale)
        dq, dk, dv = (_unpacked(g) for g in grads)
        return dq, dk.to(grad_dtype or k.dtype), dv.to(grad_dtype or v.dtype)
    dq = torch.empty_like(q)
    dk, dv = (torch.empty_like(t, dtype=grad_dtype or t.dtype) for t in (k, v))
    dout = token_major(dout)
    for span in _spans(bounds):
        dqb, dkb, dvb = backward(kernel, rows(dout, span), rows(q, span), rows(k, span), rows(v, span),
                                 rows(out, span), lse[..., span], True, scale)
        rows(dq, span).copy_(dqb)
        rows(dk, span).copy_(dkb)
        rows(dv, span).copy_(dvb)
    return dq, dk, dv


def expand_kv(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention for a kernel that takes one key/value head per query head: each
    key/value head of ``[b, heads, tokens, dim]`` repeated for the ``groups`` query heads it
    serves (a copy; ``kv`` itself when ``groups`` is 1)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def fold_kv(dkv: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_kv`: each group's query heads' gradients summed."""
    return dkv if groups == 1 else dkv.unflatten(1, (-1, groups)).sum(2)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are merged and gradients summed in: float32, or the input's if wider."""
    return torch.promote_types(dtype, torch.float32)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Attention over the keys of two blocks from each one's ``(out, lse)``; the output in
    :func:`wide` precision, so that a chain of merges rounds once, when its caller casts it."""
    merged = torch.logaddexp(lse, block_lse)
    acc = wide(out.dtype)
    mixed = (out.to(acc) * torch.exp(lse - merged).unsqueeze(-1)
             + block_out.to(acc) * torch.exp(block_lse - merged).unsqueeze(-1))
    return mixed, merged


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """:func:`merge` into ``out`` and ``lse`` (both in :func:`wide` precision), in place: the same
    operations in the same order, so the same bits, without a new output per block."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


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
