"""Pack step ``cp_kernels``: every attention kernel that runs here, whole and in blocks, against a
float64 reference, then timed.

Whole-sequence attention (one ``scaled_dot_product_attention`` call with each SDPA backend) and
context-parallel attention cut into blocks (:mod:`memo.model.attention_blocks`: each query chunk
against every earlier key chunk whole and its own causally, merged by log-sum-exp, the backward
given the merged output and log-sum-exp) are first compared with textbook attention in float64:
the output and dq, dk, dv as normwise relative errors (``error``, against ``tolerance``), with one
key/value head per query head and again with grouped ones, as Llama's (``whole-grouped``,
``blocks-grouped``: handed to the kernels as they are where they take them). A kernel that fails
the check is not timed.

Then each kernel that passed is timed at 64k tokens, and the two a run here would use (its
whole-sequence kernel and the block kernel that follows it) at 128k. The blocks one
context-parallel rank of ``cp`` runs (the same for ``all_gather`` and ``p2p`` without the
transfers; on one GPU there is no other rank) are set against a ``1/cp`` share of the fastest
whole-sequence kernel's time: ``ratio`` is the price of cutting attention into blocks. The first
GPU run thus says which block kernel to use. The rows are written after each stage, so a step cut
short by its budget keeps what it found.

    python -m memo.gpucheck.cp_kernels --out DIR [--cpu]
"""

import math
import sys

import torch

from memo.fit.rates import mean_seconds
from memo.gpucheck.common import arguments, step_device, write_rows
from memo.model import attention_blocks as blocks
from memo.model.attention import causal_attention, select_backend
from memo.model.context_parallel import rank_chunks

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # normwise, as the numerics step's


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
        return {a: (out.to(q.dtype), lse) for a, (out, lse) in merged.items()}

    saved = forward()
    dout = torch.randn_like(chunk[0][0])

    def backward():
        for a, j in work:
            out, lse = saved[a]
            blocks.backward(kernel, dout, chunk[0][a], chunk[1][j], chunk[2][j], out, lse, j == a, scale)

    return forward, backward


def _textbook(q, k, v, dout, scale: float):
    """Output and (dq, dk, dv) of causal attention in float64, ``[b, n, s, d]`` (keys and values
    with as many heads or fewer, each serving a group of query heads)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q @ keys.transpose(-1, -2)) * scale
    s = q.shape[2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    out = scores.softmax(-1) @ values
    out.backward(dout.double())
    return out.detach(), (q.grad, k.grad, v.grad)


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


def _in_blocks(kernel: str, q, k, v, dout, scale: float, chunks: int):
    """Output and (dq, dk, dv) of causal attention as ``chunks`` query chunks' blocks."""
    c = q.shape[2] // chunks
    part = [t.split(c, dim=2) for t in (q, k, v, dout)]
    merged = []
    for a in range(chunks):
        found = None
        for j in range(a + 1):
            block = blocks.forward(kernel, part[0][a], part[1][j], part[2][j], j == a, scale)
            found = block if found is None else blocks.merge(*found, *block)
        merged.append((found[0].to(q.dtype), found[1]))
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
    for a in range(chunks):
        out, lse = merged[a]
        for j in range(a + 1):
            for grad, d in zip(grads, blocks.backward(kernel, part[3][a], part[0][a], part[1][j], part[2][j],
                                                      out, lse, j == a, scale), strict=True):
                grad.narrow(2, (a if grad is grads[0] else j) * c, c).add_(d)
    return torch.cat([o for o, _ in merged], dim=2), grads


def kernel_errors(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int,
                  chunks: int = 4, batch: int = 2, groups: int = 1) -> list[dict]:
    """A row per kernel (whole: each SDPA backend that runs here; blocks: each block kernel that
    runs here) with the normwise relative errors of its output and gradients against float64.
    Two sequences a micro-batch and chunks of ``seq / chunks`` tokens: with a chunk not a multiple
    of 32 tokens, the layouts and paddings that one sequence of round lengths would not show.
    ``groups``: query heads per key/value head (grouped heads, handed to the kernels as they are
    where they take them; rows ``whole-grouped`` and ``blocks-grouped``)."""
    scale = head_dim ** -0.5
    generator = torch.Generator(device.type).manual_seed(0)
    # Megatron's [s, b, n, d], seen as the kernels take it
    q, dout = (torch.randn(seq, batch, heads, head_dim, device=device, dtype=dtype, generator=generator)
               .permute(1, 2, 0, 3) for _ in range(2))
    k, v = (torch.randn(seq, batch, heads // groups, head_dim, device=device, dtype=dtype, generator=generator)
            .permute(1, 2, 0, 3) for _ in range(2))
    expected, expected_grads = _textbook(q, k, v, dout, scale)
    rows, grouped = [], groups > 1
    label = "-grouped" if grouped else ""
    for name in ("cudnn", "flash", "efficient", "math"):
        try:
            select_backend(device.type, dtype, head_dim, name, grouped)
        except Exception:  # noqa: BLE001 - a kernel that cannot run here has no row
            continue
        whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = causal_attention(*(t.permute(2, 0, 1, 3) for t in whole), name, scale=scale, grouped=grouped)
        out.backward(dout.permute(2, 0, 1, 3).reshape(out.shape))
        rows.append(_row(f"whole{label}", name, out.view(seq, batch, heads, head_dim).permute(1, 2, 0, 3),
                         [t.grad for t in whole], expected, expected_grads, dtype))
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for kernel in blocks.BLOCK_KERNELS:
        if blocks.supports(kernel, device.type, capability, dtype, head_dim):
            out, grads = _in_blocks(kernel, q, k, v, dout, scale, chunks)
            rows.append(_row(f"blocks{label}", kernel, out, grads, expected, expected_grads, dtype))
    return rows


def _row(attention: str, kernel: str, out, grads, expected, expected_grads, dtype) -> dict:
    errors = {"output": _error(out, expected)}
    errors |= {f"d{n}": _error(g, e) for n, g, e in zip("qkv", grads, expected_grads, strict=True)}
    worst = max(errors.values())
    return {"attention": attention, "kernel": kernel, **{f"error_{k}": v for k, v in errors.items()},
            "tolerance": TOLERANCE[dtype], "status": "ok" if worst <= TOLERANCE[dtype] else "failed"}


def timings(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int,
            checked: list[dict], repeat: int) -> list[dict]:
    """Forward and backward seconds of each checked kernel: whole attention over ``seq`` tokens,
    and rank 0's blocks at cp = 2 and 4 against a ``1/cp`` share of the fastest whole kernel.
    ``math`` is timed on the CPU only: on a GPU its scores would not fit at these lengths."""
    scale = head_dim ** -0.5
    checked = [r for r in checked if r["status"] == "ok" and (r["kernel"] != "math" or device.type == "cpu")]
    q, k, v = (torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    rows, whole = [], {}
    for row in (r for r in checked if r["attention"] == "whole"):
        name = row["kernel"]
        forward = mean_seconds(lambda: causal_attention(q, k, v, name, scale=scale), device, repeat)
        both = mean_seconds(lambda: causal_attention(q, k, v, name, scale=scale).sum().backward(), device,
                            repeat)
        whole[name] = {"forward": forward, "backward": both - forward}
        rows += [{"seq": seq, "attention": "whole", "kernel": name, "phase": phase, "seconds": seconds}
                 for phase, seconds in whole[name].items()]
    fastest = min(whole.values(), key=lambda t: t["forward"] + t["backward"]) if whole else None
    qh, kh, vh = (t.detach().permute(1, 2, 0, 3) for t in (q, k, v))
    for row in (r for r in checked if r["attention"] == "blocks"):
        for cp in (2, 4):
            run_forward, run_backward = rank_blocks(qh, kh, vh, 0, cp, row["kernel"], scale)
            measured = {"forward": mean_seconds(run_forward, device, repeat),
                        "backward": mean_seconds(run_backward, device, repeat)}
            for phase, seconds in measured.items():
                share = fastest[phase] / cp if fastest else None
                rows.append({"seq": seq, "attention": "blocks", "kernel": row["kernel"], "cp": cp, "rank": 0,
                             "phase": phase, "seconds": seconds, "sdpa_share_s": share,
                             "ratio": seconds / share if share else None})
        for r in rows[-4:]:
            print(f"cp_kernels: {r}", flush=True)
    return rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device, dtype = step_device(args.cpu)
    heads, head_dim = (2, 64) if args.cpu else (32, 128)
    # the CPU rehearses the step's code: its figures say nothing
    short, long, repeat = (256, 512, 1) if args.cpu else (64 * 1024, 128 * 1024, 3)
    # the float64 reference holds [b, heads, s, s] scores: a short sequence and few heads
    checked = kernel_errors(device, dtype, 200 if args.cpu else 2000, 2 if args.cpu else 8, head_dim)
    # and grouped keys and values, as Llama's (four query heads a key head; two on the CPU's two heads)
    checked += kernel_errors(device, dtype, 200 if args.cpu else 2000, 2 if args.cpu else 8, head_dim,
                             groups=2 if args.cpu else 4)
    for row in checked:
        print(f"cp_kernels: {row}", flush=True)
    rows = list(checked)
    write_rows(args.out, "cp_kernels", rows)  # kept if the timings run past the step's budget
    rows += timings(device, dtype, short, heads, head_dim, checked, repeat)  # (the rows of one head a key)
    write_rows(args.out, "cp_kernels", rows)
    # the longer length for the kernels a run here would use only
    whole = select_backend(device.type, dtype, head_dim)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    used = {("whole", whole), ("blocks", blocks.choose(whole, device.type, capability, dtype, head_dim))}
    rows += timings(device, dtype, long, heads, head_dim,
                    [r for r in checked if (r["attention"], r["kernel"]) in used], repeat)
    write_rows(args.out, "cp_kernels", rows)
    return 0 if all(r["status"] == "ok" for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
