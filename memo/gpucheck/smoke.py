"""Pack step ``smoke``: one short pass over every place the GPU path can break, so that a single
command tells what is broken.

The environment and what can be page-locked; the SDPA kernel for head sizes 64 and 128; every
attention kernel that runs here, whole and in context-parallel blocks (PyTorch's private entry
points), against float64; context-parallel attention with each exchange and the tiled column- and
row-parallel products over a process group of one rank (the collectives a group of one still
calls: all_gather's gather and reduce-scatter, Ulysses' all-to-alls, the tiled layers'
reduce-scatters; :mod:`memo.gpucheck.one_rank`); ``none`` for three steps; ``memo``'s bf16 gradients against
``none`` with each SDPA kernel that runs here (the swapped layers' norms, rotary, GeLU and linear
layers writing into the rounding buffers, the tiled loss and embedding); a ``-m`` sweep of two
``memo`` jobs in one process (the second registers its slab where the first one's was);
``plan=true`` with ``memo`` (whole layers and in tiles, whose blocks switch the arena's phase
block by block), ``full_recompute`` and ``none`` (``--cpu``: ``memo``, as the rehearsal of the
path the others take); ``profile.backend=cuda``.

    python -m memo.gpucheck.smoke --out DIR [--cpu]
"""

import sys
import traceback

import torch

from memo import hardware
from memo.gpucheck import one_rank
from memo.gpucheck.common import CPU_TINY, arguments, run_job, runs_dir, step_device, write_rows
from memo.gpucheck.cp_kernels import kernel_errors
from memo.gpucheck.numerics import compare_methods, kernels
from memo.model.attention import select_backend


class _Rows(list):
    """The step's rows, written after each one: a step cut short by its budget keeps them."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def append(self, row: dict) -> None:
        super().append(row)
        write_rows(self.out, "smoke", self)


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
        results = run_job(runs_dir(out) / f"smoke-{name}", *overrides, multirun=multirun)
        bad = [r for r in results if r.get("status") != "ok"]
        detail = "; ".join(f"{r.get('status')}: {r.get('error')}" for r in bad) or f"{len(results)} ok"
        return ("failed" if bad else "ok"), detail
    _check(rows, name, run)


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device, dtype = step_device(args.cpu)
    rows = _Rows(args.out)

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

    def attention_kernels():
        rows = kernel_errors(device, dtype, 200, 2, 64)  # chunks of 50 tokens, two sequences
        bad = [f"{r['attention']} {r['kernel']}" for r in rows if r["status"] != "ok"]
        ran = ", ".join(f"{r['attention']} {r['kernel']}" for r in rows)
        return ("failed" if bad else "ok"), (f"beyond tolerance: {', '.join(bad)}" if bad else ran)

    _check(rows, "attention kernels against float64", attention_kernels)

    def collectives():
        with one_rank.one_rank_group(device) as group:
            found = one_rank.context_parallel(device, dtype, select_backend(device.type, dtype, 64), group)
            found |= {f"tiled {name}": e for name, e in one_rank.tiled_linear(device, dtype, group).items()}
        bad = [name for name, error in found.items() if error > one_rank.TOLERANCE[dtype]]
        detail = "; ".join(f"{name} {error:.1e}" for name, error in found.items())
        return ("failed" if bad else "ok"), detail

    _check(rows, "collectives over one rank", collectives)
    tiny = CPU_TINY if args.cpu else ["model=tiny"]
    small = [*tiny, "seq=256", "train.steps=3", "train.warmup_steps=1"]
    if args.cpu:
        rows.append({"check": "none three steps", "status": "skipped",
                     "detail": "the rehearsal runs the step's jobs with the two memo jobs below"})
    else:
        _jobs(rows, args.out, "none three steps", *small)

    def gradients():
        # every fused kernel: memo refuses the math one (its backward keeps the s×s probabilities)
        names = ["auto"] if args.cpu else [name for name in kernels(device, dtype, 64) if name != "math"]
        if not names:
            return "failed", "no fused attention kernel runs here, and memo refuses the math one"
        found = compare_methods([*tiny, "model.num_layers=4", "train.loss=tiled"], 256, device,
                                dtype, methods=[("memo", 0.5, None), ("memo", None, 64)],
                                kernel_names=names)
        bad = [f"{r['kernel']}: {r['grad_error']:.1e}" for r in found if r["status"] != "ok"]
        return ("failed" if bad else "ok"), ("; ".join(bad) or f"kernels {', '.join(names)} within tolerance")

    _check(rows, "memo gradients against none, each kernel, whole layers and tiles", gradients)
    _jobs(rows, args.out, "two memo jobs in one process", *small, "method=memo", "method.keep_all=never", "train.seed=1,2",
          "method.tile_tokens=whole", multirun=True)
    # the plan's solve bounded: the smoke is about the GPU path, not the planner's optimality
    planner = ["planner.time_limit_s=10", "planner.mip=none"]
    if args.cpu:
        # the rehearsal runs the step's own machinery once; the CPU paths of these are the suite's
        for name, why in [("plan=true", "the suite trains with the plan on the CPU "
                                        "(tests/plan/test_plan_runtime.py)"),
                          ("profile.backend=cuda", "needs a GPU: the CUDA caching allocator's trace")]:
            rows.append({"check": name, "status": "skipped", "detail": why})
    else:
        for method in ("memo", "full_recompute", "none"):
            _jobs(rows, args.out, f"plan=true {method}", *small, f"method={method}", "plan=true",
                  "method.tile_tokens=whole", "method.keep_all=never", *planner)
        _jobs(rows, args.out, "plan=true memo in tiles", *small, "method=memo", "method.keep_all=never", "method.tile_tokens=64", "plan=true",
              *planner)
        _jobs(rows, args.out, "profile.backend=cuda", "model=tiny", "seq=1k", "mode=profile",
              "profile.backend=cuda")
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
