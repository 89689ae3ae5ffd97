"""Pack step ``timeline``: where a step's device time goes, method by method.

Four layers of ``model=llama3_8b`` in bf16 at 64K tokens (a window of the model: every layer's work
is alike, and whole-layer memo keeps its last two on the device, so the first two show its
swapping), one step of each of ``memo`` in whole layers, ``memo`` in tiles of 16K,
Megatron's full recomputation (with the tiled loss) and ``none`` (keeping everything), each under
``torch.profiler`` (``train.timeline_step``: the second, warm, step of three). Per job its device
time by category (:mod:`memo.metrics.timeline`: attention's kernels forward and backward, the
GEMMs of the forward, of recomputation and of the backward, copies each way and how much of them
ran under a kernel, element-wise kernels, launch gaps, idle) into ``timeline.csv``, the kernels
that took the most time into ``timeline_kernels.csv``; each job's gzipped trace stays in its run's
directory (``timeline.json.gz``, listed with its size). A job the device cannot hold leaves a row
with its status. ``--cpu`` rehearses it with ``tiny_llama`` at 256 tokens, on the CPU's operators.

    python -m memo.gpucheck.timeline --out DIR [--cpu]
"""

import sys

import pandas as pd

from memo.gpucheck.common import arguments, run_job, runs_dir, write_rows

TRACE_LIMIT_BYTES = 20 * 2**20  # a gzipped trace above this is reported: narrow the window
# job name, method overrides
METHODS = (("memo-layers", ["method=memo", "method.keep_all=never", "method.tile_tokens=whole"]),
           ("memo-tiles", ["method=memo", "method.keep_all=never"]),
           ("megatron_full_recompute", ["method=megatron_full_recompute", "train.loss=tiled"]),
           ("none", ["method=none", "train.loss=tiled"]))


def jobs(cpu: bool) -> tuple[list[str], str, str]:
    """The overrides every job shares, the length, and memo's tile in tiles."""
    steps = ["train.steps=3", "train.warmup_steps=2", "train.timeline_step=2", "model.num_layers=4"]
    if cpu:
        return ["model=tiny_llama", "model.vocab_size=1000", *steps], "256", "64"
    return ["model=llama3_8b", "train.dtype=bf16", *steps], "64k", "16k"


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    common, seq, tile = jobs(args.cpu)
    times, kernels = [], []
    for name, method in METHODS:
        overrides = [*common, f"seq={seq}", *method]
        if name == "memo-tiles":
            overrides.append(f"method.tile_tokens={tile}")
        run_dir = runs_dir(args.out) / f"timeline-{name}"
        row = run_job(run_dir, *overrides)[0]
        figures = {"job": name, "status": row.get("status"), "error": row.get("error"),
                   "iter_time_s": row.get("iter_time_s"), "mfu": row.get("mfu"), "mfu_ceiling": row.get("mfu_ceiling")}
        table = run_dir / "timeline.csv"
        if row.get("status") == "ok" and table.exists():
            trace = run_dir / "timeline.json.gz"
            size = trace.stat().st_size
            figures |= {"trace": str(trace), "trace_bytes": size, "trace_over_limit": size > TRACE_LIMIT_BYTES}
            times += [figures | r for r in pd.read_csv(table).to_dict("records")]
            kernels += [{"job": name} | r for r in pd.read_csv(run_dir / "timeline_kernels.csv").to_dict("records")]
        else:
            times.append(figures)
        write_rows(args.out, "timeline", times)  # a step cut short by its budget keeps its table
        if kernels:
            write_rows(args.out, "timeline_kernels", kernels)
        print(f"timeline: {name}: {row.get('status')} {row.get('iter_time_s')} s/step", flush=True)
    return 0 if all(r["status"] == "ok" for r in times) else 1


if __name__ == "__main__":
    sys.exit(main())
