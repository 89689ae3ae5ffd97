"""Time per training step with the sequence split over context-parallel processes, against one
process, on this machine's cores.

Each job is ``python run.py`` (cp = 1) or ``torchrun --nproc-per-node 2 run.py parallel.cp=2``
with each exchange (``all_gather``, ``p2p``, ``a2a``), the cores shared out between the processes
(``OMP_NUM_THREADS``); a job that cannot run shows its status and reason. A benchmark, not a
test: the figures depend on the machine.

    python benchmarks/context_parallel.py --seq 4k,8k
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("none", "memo")
LAYOUTS = {  # label: (processes, overrides)
    "cp=1": (1, []),
    "cp=2 all_gather": (2, ["parallel.cp=2", "parallel.cp_comm_type=all_gather"]),
    "cp=2 p2p": (2, ["parallel.cp=2", "parallel.cp_comm_type=p2p"]),
    "cp=2 a2a": (2, ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
}


def run(out: Path, processes: int, overrides: list[str]) -> dict:
    """The row of one job (``status`` ``error`` with the output's last line if it left none)."""
    launcher = [sys.executable, str(REPO / "run.py")] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-port", str(29500 + os.getpid() % 1000), str(REPO / "run.py")]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    done = subprocess.run([*launcher, *overrides, f"hydra.run.dir={out}"], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=1800)
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"status": "error", "error": lines[-1] if lines else "no output", "iter_time_s": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="4k,8k", help="comma-separated lengths (default 4k,8k)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="steps per job; the first is warm-up")
    args = parser.parse_args()
    print(f"{'seq':>6} {'method':<6} {'layout':<16} {'s/step':>8} {'vs cp=1':>8}  status", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for seq in args.seq.split(","):
            for method in METHODS:
                baseline = None
                for label, (processes, layout) in LAYOUTS.items():
                    overrides = [f"model={args.model}", f"seq={seq}", f"method={method}", "hardware=cpu",
                                 f"train.steps={args.steps}", "train.warmup_steps=1", *layout]
                    name = f"{seq}-{method}-{label}".replace(" ", "-").replace("=", "")
                    row = run(Path(scratch) / name, processes, overrides)
                    time = row.get("iter_time_s")
                    baseline = time if label == "cp=1" else baseline
                    ratio = time / baseline if time and baseline else None
                    shown = f"{time:8.3f} {ratio:8.3f}" if ratio else f"{'-':>8} {'-':>8}"
                    reason = f" ({row['error']})" if row.get("error") else ""
                    print(f"{seq:>6} {method:<6} {label:<16} {shown}  {row['status']}{reason}", flush=True)


if __name__ == "__main__":
    main()
