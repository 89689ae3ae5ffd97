"""Pack step ``cp_kernels``: the local part of context-parallel attention against one SDPA call.

A context-parallel rank computes its queries' attention as blocks on the fused kernels' entry
points, merged by their log-sum-exp (:mod:`memo.model.attention_blocks`). On one GPU there is no
other rank, so the keys and values of the whole sequence are at hand: this step times the blocks
that rank 0 and rank ``cp − 1`` of ``cp`` ranks run (``all_gather``'s, the same as ``p2p``'s
without the transfers), forward and backward, against one causal SDPA call over the whole
sequence, whose share per rank is a ``1/cp`` of its time. ``ratio`` is the blocks' time over that
share: the price of cutting attention into blocks. First, at a short length, the blocks of every
rank together are checked against SDPA: output and gradients, as the largest difference
(``max_error``, against ``tolerance``).

    python -m memo.gpucheck.cp_kernels --out DIR [--cpu]
"""

import sys

import torch

from memo.gpucheck.common import arguments, mean_seconds, write_rows
from memo.model import attention_blocks as blocks
from memo.model.attention import causal_attention, select_backend
from memo.model.context_parallel import rank_chunks


def rank_blocks(q, k, v, rank: int, cp: int, kernel: str, scale: float):
    """``(forward, backward)`` callables running rank ``rank``'s blocks of ``[b, n, s, d]``
    attention: its two query chunks against every chunk up to their own."""
    c = q.shape[2] // (2 * cp)
    chunk = [t.split(c, dim=2) for t in (q, k, v)]
    work = [(a, j) for a in rank_chunks(rank, cp) for j in range(a + 1)]

    def forward():
        merged = {}
        for a, j in work:
            block = blocks.forward(kernel, chunk[0][a], chunk[1][j], chunk[2][j], j == a, scale)
            merged[a] = block if a not in merged else blocks.merge(*merged[a], *block)
        return merged

    saved = forward()
    dout = torch.randn_like(chunk[0][0])

    def backward():
        for a, j in work:
            out, lse = saved[a]
            blocks.backward(kernel, dout, chunk[0][a], chunk[1][j], chunk[2][j], out, lse, j == a, scale)

    return forward, backward


def block_errors(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int,
                 backend: str, chunks: int = 4) -> dict[str, float]:
    """The largest difference between attention computed as blocks of ``chunks`` chunks (each
    against the chunks before it whole and itself causally, merged by log-sum-exp; backward with
    the merged output and log-sum-exp) and one SDPA call, for the output and dq, dk, dv."""
    kernel, scale = blocks.block_kernel(backend), head_dim ** -0.5
    generator = torch.Generator(device.type).manual_seed(0)
    q, k, v, dout = (torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, generator=generator)
                     for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*whole, backend, scale=scale)
    expected.backward(dout.reshape(expected.shape))
    qh, kh, vh, dh = (t.permute(1, 2, 0, 3) for t in (q, k, v, dout))
    c = seq // chunks
    part = [t.split(c, dim=2) for t in (qh, kh, vh, dh)]
    merged = []
    for a in range(chunks):
        found = None
        for j in range(a + 1):
            block = blocks.forward(kernel, part[0][a], part[1][j], part[2][j], j == a, scale)
            found = block if found is None else blocks.merge(*found, *block)
        merged.append(found)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (qh, kh, vh)]
    for a in range(chunks):
        out, lse = merged[a]
        for j in range(a + 1):
            dq, dk, dv = blocks.backward(kernel, part[3][a].contiguous(), part[0][a], part[1][j], part[2][j],
                                         out, lse, j == a, scale)
            grads[0].narrow(2, a * c, c).add_(dq)
            grads[1].narrow(2, j * c, c).add_(dk)
            grads[2].narrow(2, j * c, c).add_(dv)
    out = torch.cat([o for o, _ in merged], dim=2).permute(2, 0, 1, 3).reshape(expected.shape)
    errors = {"output": (out.float() - expected.float()).abs().max().item()}
    for name, got, ref in zip(("dq", "dk", "dv"), grads, whole):
        errors[name] = (got - ref.grad.permute(1, 2, 0, 3).float()).abs().max().item()
    return errors


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    heads, head_dim = (2, 64) if args.cpu else (32, 128)
    lengths, repeat = ((1024,), 2) if args.cpu else ((64 * 1024, 128 * 1024), 3)
    backend = select_backend(device.type, dtype, head_dim)
    kernel, scale = blocks.block_kernel(backend), head_dim ** -0.5
    tolerance = 1e-4 if args.cpu else 5e-2  # fp32 on the CPU; bf16, summed in other orders, on a GPU
    rows = []
    errors = block_errors(device, dtype, 1024 if args.cpu else 4096, heads, head_dim, backend)
    for what, error in errors.items():
        rows.append({"check": what, "kernel": kernel, "max_error": error, "tolerance": tolerance})
        print(f"cp_kernels: {rows[-1]}", flush=True)
    if any(row["max_error"] > tolerance for row in rows):
        write_rows(args.out, "cp_kernels", rows)
        print("cp_kernels: the blocks differ from SDPA beyond the tolerance", flush=True)
        return 1
    for seq in lengths:
        q, k, v = (torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        forward = mean_seconds(lambda: causal_attention(q, k, v, backend, scale=scale), device, repeat)
        both = mean_seconds(lambda: causal_attention(q, k, v, backend, scale=scale).sum().backward(),
                        device, repeat)
        plain = {"forward": forward, "backward": both - forward}
        qh, kh, vh = (t.detach().permute(1, 2, 0, 3) for t in (q, k, v))
        for cp in (2, 4):
            for rank in (0, cp - 1):
                run_forward, run_backward = rank_blocks(qh, kh, vh, rank, cp, kernel, scale)
                measured = {"forward": mean_seconds(run_forward, device, repeat),
                            "backward": mean_seconds(run_backward, device, repeat)}
                for phase, seconds in measured.items():
                    share = plain[phase] / cp
                    rows.append({"seq": seq, "cp": cp, "rank": rank, "phase": phase, "kernel": kernel,
                                 "blocks_s": seconds, "sdpa_share_s": share, "ratio": seconds / share})
                    print(f"cp_kernels: {rows[-1]}", flush=True)
    write_rows(args.out, "cp_kernels", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
