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

from memo.fit.rates import attention_flops, gemm_flops, host_bandwidth
from memo.gpucheck.common import arguments, step_device, write_rows
from memo.model.attention import select_backend


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
