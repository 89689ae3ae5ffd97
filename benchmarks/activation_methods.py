"""Time per training step of each way of keeping activations, as a ratio to keeping everything.

Runs every (seq, method) job in this one process, one after the other, through the same
``run_job`` as ``run.py``, and prints a table; ``--csv`` also writes the rows (with the command,
the machine and the date). A benchmark, not a test: the figures depend on the machine.

    python benchmarks/activation_methods.py --seq 4k,8k,16k --csv results/cpu/activation_methods.csv
"""

import argparse
import csv
import os
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo.config import register_configs  # noqa: E402
from memo.modes.train import run_job  # noqa: E402

METHODS = {
    "none": ["method=none"],
    "memo alpha=0": ["method=memo", "alpha=0"],
    "memo alpha=1": ["method=memo", "alpha=1"],
    "full_recompute": ["method=full_recompute"],
    "megatron_full_recompute": ["method=megatron_full_recompute"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="4k,8k,16k", help="comma-separated lengths (default 4k,8k,16k)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="steps per job; the first is warm-up")
    parser.add_argument("--csv", type=Path, help="also write the rows here (refuses to overwrite)")
    parser.add_argument("overrides", nargs="*", help="more run.py overrides, e.g. hardware=cpu")
    args = parser.parse_args()
    if args.csv is not None and args.csv.exists():
        sys.exit(f"error: {args.csv} exists; pass another --csv")

    register_configs()
    rows = []
    print(f"{'seq':>6} {'method':<24} {'s/step':>8} {'vs none':>8} {'status':>7}", flush=True)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"), \
            tempfile.TemporaryDirectory() as scratch:
        for seq in args.seq.split(","):
            baseline = None
            for label, method in METHODS.items():
                overrides = [f"model={args.model}", f"seq={seq}", f"train.steps={args.steps}",
                             "train.warmup_steps=1", *method, *args.overrides]
                row = run_job(compose(config_name="config", overrides=overrides),
                              Path(scratch) / f"{seq}-{label}", overrides)
                time = row["iter_time_s"]
                baseline = time if label == "none" else baseline
                ratio = time / baseline if time and baseline else None
                rows.append({"seq": seq, "method": label, "iter_time_s": time, "ratio_to_none": ratio,
                             "status": row["status"], "alpha": row.get("swap.alpha"),
                             "tgs": row["tgs"], "mfu": row["mfu"]})
                shown = f"{time:8.3f} {ratio:8.3f}" if ratio else f"{'-':>8} {'-':>8}"
                print(f"{seq:>6} {label:<24} {shown} {row['status']:>7}", flush=True)
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.csv.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            command = "python " + " ".join(sys.argv)
            f.write(f"# {command}\n# {platform.node()} {platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} cores, {date.today().isoformat()}\n")
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        tmp.rename(args.csv)


if __name__ == "__main__":
    main()
