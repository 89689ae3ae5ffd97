"""Pack step ``smoke``: one short pass over every place the GPU path has broken before, so that a
single command tells what is still broken.

The environment and what can be page-locked; the SDPA kernel for head sizes 64 and 128; ``none``
for three steps; ``memo``'s gradients against ``none`` with each SDPA kernel that runs here; a
``-m`` sweep of two ``memo`` jobs in one process (the second registers its slab where the first
one's was); ``plan=true`` with ``memo``, ``full_recompute`` and ``none`` (``--cpu``: ``memo``, as
the rehearsal of the path the others take); ``profile.backend=cuda``.

    python -m memo.gpucheck.smoke --out DIR [--cpu]
"""

import sys
import traceback

import torch

from memo import hardware
from memo.gpucheck.common import arguments, run_job, write_rows
from memo.gpucheck.numerics import compare_methods, kernels
from memo.model.attention import select_backend


def _check(rows: list, name: str, fn) -> None:
    """Run one check; a failure becomes its row (the smoke goes on)."""
    try:
        status, detail = fn()
    except Exception as error:  # noqa: BLE001 - every check leaves its row
        status, detail = "failed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    rows.append({"check": name, "status": status, "detail": detail})
    print(f"smoke: {name}: {status} ({detail})", flush=True)


def _jobs(rows: list, out, name: str, *overrides: str, multirun: bool = False) -> None:
    def run():
        results = run_job(out / "runs" / f"smoke-{name}", *overrides, multirun=multirun)
        bad = [r for r in results if r.get("status") != "ok"]
        detail = "; ".join(f"{r.get('status')}: {r.get('error')}" for r in bad) or f"{len(results)} ok"
        return ("failed" if bad else "ok"), detail
    _check(rows, name, run)


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    rows: list[dict] = []

    def environment():
        memlock = hardware.memlock_limit_bytes()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = torch.cuda.get_device_name(0) if gpus and not args.cpu else "cpu"
        pinnable = hardware.pinnable_memory_bytes() / 2**30
        lock = "unlimited" if memlock is None else f"{memlock / 2**30:.2f} GiB"
        return "ok", f"{name}, {gpus} GPU(s) visible, pinnable {pinnable:.1f} GiB, ulimit -l {lock}"

    _check(rows, "environment", environment)
    for head_dim in (64, 128):
        _check(rows, f"sdpa kernel, head size {head_dim}",
               lambda h=head_dim: ("ok", select_backend(device.type, dtype, h)))
    small = ["model=tiny", "seq=256", "train.steps=3", "train.warmup_steps=1"]
    _jobs(rows, args.out, "none three steps", *small)

    def gradients():
        names = ["auto"] if args.cpu else kernels(device, dtype, 64)
        found = compare_methods(["model=tiny", "model.num_layers=4", "train.loss=tiled"], 256, device,
                                dtype, methods=[("memo", 0.5)], kernel_names=names)
        bad = [f"{r['kernel']}: {r['grad_error']:.1e}" for r in found if r["status"] != "ok"]
        return ("failed" if bad else "ok"), ("; ".join(bad) or f"kernels {', '.join(names)} within tolerance")

    _check(rows, "memo gradients against none, each kernel", gradients)
    _jobs(rows, args.out, "two memo jobs in one process", *small, "method=memo", "train.seed=1,2",
          multirun=True)
    for method in ("memo",) if args.cpu else ("memo", "full_recompute", "none"):
        _jobs(rows, args.out, f"plan=true {method}", *small, f"method={method}", "plan=true")
    if args.cpu:
        rows.append({"check": "profile.backend=cuda", "status": "skipped",
                     "detail": "needs a GPU: the CUDA caching allocator's trace"})
    else:
        _jobs(rows, args.out, "profile.backend=cuda", "model=tiny", "seq=1k", "mode=profile",
              "profile.backend=cuda")
    write_rows(args.out, "smoke", rows)
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
