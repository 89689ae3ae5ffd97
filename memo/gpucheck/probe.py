"""Pack step ``probe``: the physical bounds MFU is judged against.

* the SDPA kernel :func:`memo.model.attention.select_backend` picks for Megatron-shaped q, k, v at
  head sizes 64 and 128;
* dense GEMM throughput (bf16 on a GPU, fp32 on the CPU) on square matrices, FLOP/s;
* causal attention throughput, forward and forward + backward, at several lengths (FLOP/s of
  the causal half: ``2·s²·h`` forward, the backward 2.5 times that);
* host ↔ device bandwidth over ``cudaHostRegister``-ed memory, both ways (GPU only).

    python -m memo.gpucheck.probe --out DIR [--cpu]
"""

import sys

import torch

from memo.gpucheck.common import arguments, mean_seconds, step_device, write_rows
from memo.model.attention import causal_attention, select_backend


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, repeat: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / mean_seconds(lambda: a @ b, device, repeat)


def attention_flops(device: torch.device, dtype: torch.dtype, seq: int, heads: int, head_dim: int,
                    backend: str, repeat: int) -> tuple[float, float]:
    """Causal attention FLOP/s of the forward pass and of forward plus backward."""
    q, k, v = (torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    forward_flops = 2 * seq * seq * heads * head_dim  # QKᵀ and PV, causal half of 2·2·s²·h
    forward = mean_seconds(lambda: causal_attention(q, k, v, backend), device, repeat)
    both = mean_seconds(lambda: causal_attention(q, k, v, backend).sum().backward(), device, repeat)
    return forward_flops / forward, 3.5 * forward_flops / both


def host_bandwidth(device: torch.device, nbytes: int, repeat: int) -> tuple[float, float]:
    """H2D and D2H bytes/s between registered host memory and the device."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)) != 0:
        raise RuntimeError("cudaHostRegister failed")
    try:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h2d = nbytes / mean_seconds(lambda: dev.copy_(host, non_blocking=True), device, repeat)
        d2h = nbytes / mean_seconds(lambda: host.copy_(dev, non_blocking=True), device, repeat)
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())
    return h2d, d2h


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device, dtype = step_device(args.cpu)
    rows = []
    for head_dim in (64, 128):
        rows.append({"what": "sdpa_kernel", "head_dim": head_dim,
                     "value": select_backend(device.type, dtype, head_dim), "unit": "name"})
    n, repeat = (512, 3) if args.cpu else (8192, 20)
    rows.append({"what": "gemm", "size": n, "value": gemm_flops(device, dtype, n, repeat), "unit": "FLOP/s"})
    backend = select_backend(device.type, dtype, 128)
    for seq in ((1024, 2048) if args.cpu else (8192, 32768, 131072)):
        forward, both = attention_flops(device, dtype, seq, 2 if args.cpu else 32, 128, backend,
                                        2 if args.cpu else 5)
        rows += [{"what": "attention_forward", "seq": seq, "value": forward, "unit": "FLOP/s"},
                 {"what": "attention_forward_backward", "seq": seq, "value": both, "unit": "FLOP/s"}]
    if args.cpu:
        rows.append({"what": "host_bandwidth", "value": None,
                     "unit": "skipped (needs a GPU: cudaHostRegister)"})
    else:
        h2d, d2h = host_bandwidth(device, 1 << 30, 10)
        rows += [{"what": "h2d", "value": h2d, "unit": "B/s"}, {"what": "d2h", "value": d2h, "unit": "B/s"}]
    for row in rows:
        print(f"probe: {row}", flush=True)
    write_rows(args.out, "probe", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
