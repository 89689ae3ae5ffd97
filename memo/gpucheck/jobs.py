"""Pack steps ``throughput`` and ``longest``: training jobs, each in a process of its own.

* ``throughput``: MFU, TGS, peak allocated and reserved memory and allocator retries of
  ``none``, Megatron's full recomputation and ``memo``, each as such, at several lengths (1.3B on a
  GPU: 8k, 32k, 64k, 128k), and of ``memo`` as a run of it chooses (``memo-chosen``: keeping
  everything where that fits, else its tiles and Adam's place).
  ``--cpu`` rehearses the step with the last of them, ``memo`` with ``plan=true``: CPU figures
  say nothing, and every method trains on the CPU in the test suite.
* ``longest``: for a 7B-shaped model with as many layers as one GPU holds, the longest sequence
  each method trains, by bisection in steps of 32k tokens; every probe is a job of its own and
  its row is kept, ``oom`` ones included.

    python -m memo.gpucheck.jobs throughput --out DIR [--cpu]
"""

import sys

from memo.gpucheck.common import CPU_TINY, arguments, row_figures, run_job, runs_dir, skip, write_rows

METHODS = [["method=none"], ["method=megatron_selective"], ["method=megatron_full_recompute"],
           ["method=full_recompute"], ["method=memo"], ["method=memo", "plan=true"]]
# throughput's, trimmed to finish within its budget (all six ran past it at 64K on an H100): keeping
# everything, Megatron's recomputation and memo, the three a run chooses between
THROUGHPUT = [["method=none"], ["method=megatron_full_recompute"], ["method=memo"]]
# each method as such: whole layers and Adam on the device, memo swapping, not the run's own choice of them
AS_SUCH = ["method.tile_tokens=whole", "train.optimizer_offload=none", "method.keep_all=never"]
# and memo as a run of it chooses (memo.fit.choice): keeping everything where that fits, else its
# layers' tiles and Adam's place, the fastest that fits
CHOSEN = ("memo-chosen", ["method=memo", "method.tile_tokens=auto", "train.optimizer_offload=auto",
                          "method.keep_all=auto"])


def throughput(out, cpu: bool) -> list[dict]:
    methods = [METHODS[-1]] if cpu else THROUGHPUT
    if cpu:
        common, lengths = [*CPU_TINY, "train.steps=3", "train.warmup_steps=1"], ["256"]
    else:
        common = ["model=1.3b", "train.steps=5", "train.warmup_steps=2"]
        lengths = ["8k", "32k", "64k", "128k"]
    jobs = [("-".join(m.split("=")[1] for m in method), [*AS_SUCH, *method]) for method in methods]
    jobs += [] if cpu else [CHOSEN]
    rows = []
    for seq in lengths:
        for label, overrides in jobs:
            name = f"{label}-{seq}"
            row = run_job(runs_dir(out) / f"throughput-{name}", *common, f"seq={seq}", *overrides)[0]
            rows.append(row_figures(row) | {"job": name})
            write_rows(out, "throughput", rows)  # a step cut short by its budget keeps its table
            print(f"throughput: {name}: {row.get('status')} MFU {row.get('mfu')}", flush=True)
    return rows


def longest(out, layers: int = 8, step_tokens: int = 32 * 1024, top: int = 1024 * 1024) -> list[dict]:
    """Bisection over multiples of ``step_tokens`` up to ``top`` per method (7B shape, ``layers``)."""
    rows = []
    for method in METHODS[1:]:
        low, high = 0, top // step_tokens + 1  # low fits (0: nothing yet), high does not
        while high - low > 1:
            mid = (low + high) // 2
            seq = mid * step_tokens
            name = "-".join(m.split("=")[1] for m in method) + f"-{seq // 1024}k"
            row = run_job(runs_dir(out) / f"longest-{name}", "model=7b", f"model.num_layers={layers}",
                          f"seq={seq}", "train.steps=2", "train.warmup_steps=1", *AS_SUCH, *method)[0]
            rows.append(row_figures(row) | {"job": name})
            write_rows(out, "longest", rows)
            low, high = (mid, high) if row.get("status") == "ok" else (low, mid)
        print(f"longest: {' '.join(method)}: {low * step_tokens} tokens", flush=True)
    return rows


def main(argv=None) -> int:
    step, *rest = argv if argv is not None else sys.argv[1:]
    args = arguments(__doc__.splitlines()[0], rest)
    if step == "throughput":
        throughput(args.out, args.cpu)
    elif step == "longest":
        if args.cpu:
            return skip(args.out, step, "needs a GPU: the longest sequence of a 7B-shaped model on a GPU")
        longest(args.out)
    else:
        raise SystemExit(f"unknown step {step}; use throughput or longest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
