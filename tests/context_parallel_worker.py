"""Under torchrun (a check of ``tests/checks_worker.py``): context-parallel attention against
textbook causal attention over the whole sequence, forward and backward, for every exchange; nothing of other ranks' tokens kept from
the forward pass to the backward; the backward pass's buffers as the fit counts them. Raises
(with the first difference) if any case differs."""

import math

import torch
import torch.distributed as dist

from memo.execute.distributed import ProcessInfo
from memo.model.attention import causal_attention
from memo.model.context_parallel import exchange_bytes
from memo.model.context_parallel import CP_COMM_TYPES, split_for_rank
from memo.profile.recorder import AllocationRecorder

# (tokens per chunk, query heads, key/value heads, head size): 2·cp chunks a sequence; odd, even
# and grouped head counts
CASES = [(1, 2, 2, 16), (3, 3, 3, 8), (5, 1, 1, 32), (2, 4, 2, 8)]
KERNELS = [("math", torch.float64, 1e-12), ("flash", torch.float32, 1e-5)]


def textbook(q, k, v, scale):
    """softmax(q·kᵀ·scale + causal mask)·v on ``[s, b, n, d]``, as ``[s, b, n·d]``."""
    s, groups = q.shape[0], q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v)
    return out.reshape(s, q.shape[1], -1)


def check_case(comm: str, tokens: int, heads: int, kv_heads: int, dim: int, kernel: str, dtype, tolerance: float,
          group) -> str:
    """What differs from textbook attention (empty: nothing) for one case on this rank."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(tokens)
    q, grad = (torch.randn(tokens, 2, heads, dim, generator=generator, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(tokens, 2, kv_heads, dim, generator=generator, dtype=dtype) for _ in range(2))
    grad = grad.reshape(tokens, 2, heads * dim)
    scale = 1 / math.sqrt(dim)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = textbook(*whole, scale)
    expected.backward(grad)
    local = [split_for_rank(t, 0, rank, cp).requires_grad_() for t in (q, k, v)]
    saved_tokens = []
    def pack(t):
        saved_tokens.append(t.shape[2])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = causal_attention(*local, kernel, scale=scale, grouped=heads != kv_heads, cp_group=group,
                               cp_comm_type=comm)
    if saved_tokens != [tokens // cp] * 5:
        return (f"kept {saved_tokens} tokens of q, k, v, output and log-sum-exp, not this rank's "
                f"{tokens // cp}")
    got.backward(split_for_rank(grad, 0, rank, cp))
    pairs = [("output", got, split_for_rank(expected.detach(), 0, rank, cp))]
    pairs += [(f"d{name}", mine.grad, split_for_rank(ref.grad, 0, rank, cp))
              for name, mine, ref in zip("qkv", local, whole)]
    for name, a, b in pairs:
        try:
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
        except AssertionError as error:
            return f"{name} differs\n{error}"
    return ""


def _peak(events) -> int:
    live = top = 0
    for event in events:
        live += event.size if event.op == "malloc" else -event.size
        top = max(top, live)
    return top


def check_memory(comm: str, dtype, group) -> str:
    """What differs (empty: nothing) between the bytes the backward pass of one attention call
    allocates at its peak and the fit's term for the exchange, plus what attention without context
    parallelism allocates as well: dq, dk, dv (the incoming gradient, token-major as the output,
    is not copied)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    b, heads, dim, chunk = 2, 4 * cp, 16, 32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (split_for_rank(torch.randn(2 * cp * chunk, b, heads, dim, generator=generator, dtype=dtype),
                              0, rank, cp).requires_grad_() for _ in range(3))
    peaks = []
    # gloo's worker thread lets go of an exchange's own copies whenever it is done with the work,
    # sometimes after the next allocation: the least of three backward passes is the one whose
    # peak is the program's own
    for _ in range(3):
        out = causal_attention(q, k, v, "flash", scale=0.25, cp_group=group, cp_comm_type=comm)
        recorder = AllocationRecorder(lambda: "backward")
        with recorder:
            out.backward(torch.ones_like(out))
        peaks.append(_peak(recorder.events))
        q.grad = k.grad = v.grad = None
    own = 3 * q.numel() * dtype.itemsize
    expected = exchange_bytes(comm, cp, b, 2 * cp * chunk, heads * dim, dtype.itemsize) + own
    measured = min(peaks)
    # exact for all_gather and p2p; a bound for a2a, whose staging copies vary with cp and dtype
    if not measured <= expected <= measured * (1.0 if comm != "a2a" else 1.2):
        return f"{comm} {dtype}: the backward pass peaked at {measured} bytes, the fit counts {expected}"
    return ""


def check(info: ProcessInfo, out=None) -> str:
    """Every case, in a gloo group of the launch's processes; raises at the first difference.
    A check of ``tests/checks_worker.py``."""
    dist.init_process_group("gloo", init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            rank=info.rank, world_size=info.world_size)
    try:
        return _check_all(dist.new_group(list(range(info.world_size))))
    finally:
        dist.destroy_process_group()


def _check_all(group) -> str:
    rank, cp = dist.get_rank(), dist.get_world_size()
    checked = 0
    for comm in CP_COMM_TYPES:
        for chunk, heads, kv_heads, dim in CASES:
            if comm == "a2a":  # Ulysses splits the heads over the ranks
                heads, kv_heads = heads * cp, kv_heads * cp
            for kernel, dtype, tolerance in KERNELS:
                failure = check_case(comm, 2 * cp * chunk, heads, kv_heads, dim, kernel, dtype, tolerance,
                                     group)
                assert not failure, (f"rank {rank} of {cp}: {comm}, {2 * cp * chunk} tokens, "
                                     f"{heads}/{kv_heads} heads, {kernel}: {failure}")
                checked += 1
    for comm in CP_COMM_TYPES:
        for dtype in (torch.float32, torch.bfloat16):
            failure = check_memory(comm, dtype, group)
            assert not failure, f"rank {rank} of {cp}: {failure}"
    return f"{checked} cases match textbook attention; the exchange buffers are the fit's"
