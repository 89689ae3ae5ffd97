"""Under torchrun: context-parallel attention against textbook causal attention over the whole
sequence, forward and backward, and the gathered keys and values not kept from the forward pass
to the backward. Exits non-zero (with the first difference) if any case differs."""

import gc
import math
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend

from memo.model import context_parallel
from memo.model.context_parallel import context_parallel_attention, split_for_rank

# (tokens per chunk, heads, head size): 2·cp chunks a sequence; odd and even head counts
CASES = [(1, 2, 16), (3, 3, 8), (5, 1, 32)]
KERNELS = [(SDPBackend.MATH, torch.float64, 1e-12), (SDPBackend.FLASH_ATTENTION, torch.float32, 1e-5)]


def textbook(q, k, v, scale):
    """softmax(q·kᵀ·scale + causal mask)·v on ``[s, b, n, d]``, as ``[s, b, n·d]``."""
    s = q.shape[0]
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v)
    return out.reshape(s, q.shape[1], -1)


gathered: list[weakref.ref] = []  # the tensors each forward pass gathers, as weak references


def _watched_gather(local, group):
    whole = gather_sequence(local, group)
    gathered.append(weakref.ref(whole))
    return whole


gather_sequence = context_parallel.gather_sequence
context_parallel.gather_sequence = _watched_gather


def check(comm: str, tokens: int, heads: int, dim: int, kernel, dtype, tolerance: float, group) -> str:
    """What differs from textbook attention (empty: nothing) for one case on this rank."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(tokens)
    q, k, v, grad = (torch.randn(tokens, 2, heads, dim, generator=generator, dtype=dtype) for _ in range(4))
    grad = grad.reshape(tokens, 2, heads * dim)
    scale = 1 / math.sqrt(dim)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = textbook(*whole, scale)
    expected.backward(grad)
    local = [split_for_rank(t, 0, rank, cp).requires_grad_() for t in (q, k, v)]
    gathered.clear()
    got = context_parallel_attention(*local, group, kernel, scale, comm_type=comm)
    gc.collect()
    if len(gathered) != (2 if comm == "all_gather" else 0) or any(ref() is not None for ref in gathered):
        return "the gathered keys and values outlive the forward pass"
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


def main() -> int:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    checked = 0
    for comm in ("all_gather", "a2a"):
        for chunk, heads, dim in CASES:
            heads *= cp if comm == "a2a" else 1  # Ulysses splits the heads over the ranks
            for kernel, dtype, tolerance in KERNELS:
                failure = check(comm, 2 * cp * chunk, heads, dim, kernel, dtype, tolerance, group)
                if failure:
                    print(f"rank {rank} of {cp}: {comm}, {2 * cp * chunk} tokens, {heads} heads, "
                          f"{kernel.name}: {failure}")
                    return 1
                checked += 1
    print(f"rank {rank} of {cp}: {checked} cases match textbook attention", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
