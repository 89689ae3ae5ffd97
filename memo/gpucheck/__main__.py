"""Run the GPU validation pack: every step in order, each in a process of its own.

    python -m memo.gpucheck [--out DIR] [--cpu] [--redo] [--only STEP ...]

A step whose result (``<step>.csv``) is in ``DIR`` is skipped unless ``--redo``; a step that fails
or runs past its budget is recorded with why, and the pack goes on. ``summary.md`` names the
device, driver, versions, date and commands, and gathers every step's table.
"""

import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from memo.gpucheck.common import REPO
from memo.results import create_file_atomic


@dataclass(frozen=True)
class Step:
    name: str
    module: tuple[str, ...]  # python -m ... arguments before --out
    budget_s: int  # together 24.5 minutes, to keep the pack under 26 on one H100 (not yet timed there)


STEPS = [
    Step("smoke", ("memo.gpucheck.smoke",), 180),
    Step("probe", ("memo.gpucheck.probe",), 90),
    Step("cp_kernels", ("memo.gpucheck.cp_kernels",), 90),
    Step("numerics", ("memo.gpucheck.numerics",), 180),
    Step("overlap", ("memo.gpucheck.overlap",), 150),
    Step("throughput", ("memo.gpucheck.jobs", "throughput"), 360),
    Step("longest", ("memo.gpucheck.jobs", "longest"), 360),
    Step("calibration", ("memo.gpucheck.calibration",), 60),
]


def device_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"


def _driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none"
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "unknown"


def run_step(step: Step, out: Path, cpu: bool) -> dict:
    """Run one step in its own process group (its training jobs die with it at the budget)."""
    arguments = [*step.module, "--out", str(out), *(["--cpu"] if cpu else [])]
    command = [sys.executable, "-m", *arguments]
    start = time.monotonic()
    log = out / f"{step.name}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.monotonic() - start
    skipped = out / f"{step.name}.skipped"
    if code is None:
        status, detail = "timeout", f"ran past its budget of {step.budget_s} s; run the pack again to go on"
    elif code == 0 and skipped.exists():
        status, detail = "skipped", skipped.read_text().strip()
    elif code == 0:
        status, detail = "ok", ""
    else:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        status, detail = "failed", (tail[-1] if tail else f"exit status {code}")
    return {"step": step.name, "status": status, "seconds": round(seconds, 1), "detail": detail,
            "command": " ".join(["python", "-m", *arguments])}


def summary(out: Path, steps: pd.DataFrame, cpu: bool, argv: list[str]) -> str:
    import megatron.core
    import torch

    lines = [f"# GPU validation pack: {device_name(cpu)}", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- device: {device_name(cpu)}; driver: {_driver()}",
             f"- torch {torch.__version__} (CUDA {torch.version.cuda}), megatron-core "
             f"{megatron.core.__version__}, Python {platform.python_version()}",
             f"- command: `python -m memo.gpucheck {' '.join(argv)}`", "", "## Steps", "",
             steps.to_markdown(index=False), ""]
    for path in sorted(out.glob("*.csv")):
        if path.name == "steps.csv":
            continue
        table = pd.read_csv(path)
        lines += [f"## {path.stem}", "", table.to_markdown(index=False) if len(table) else "(no rows)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default: results/gpu/<date>-<device>")
    parser.add_argument("--cpu", action="store_true", help="every step with the tiny model on the CPU")
    parser.add_argument("--redo", action="store_true", help="run steps that have a result again")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="these steps only")
    args = parser.parse_args(argv)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(args.cpu).lower()).strip("-")
    out = args.out or REPO / "results" / "gpu" / f"{datetime.date.today().isoformat()}-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for step in STEPS:
        if args.only and step.name not in args.only:
            continue
        if (out / f"{step.name}.csv").exists() and not args.redo:
            records.append({"step": step.name, "status": "done before", "seconds": 0.0,
                            "detail": f"{step.name}.csv kept (--redo runs it again)", "command": ""})
        else:
            if args.redo:
                (out / f"{step.name}.csv").unlink(missing_ok=True)
            print(f"gpucheck: {step.name} (budget {step.budget_s} s) ...", flush=True)
            records.append(run_step(step, out, args.cpu))
        print(f"gpucheck: {step.name}: {records[-1]['status']} {records[-1]['detail']}", flush=True)
    steps = pd.DataFrame(records)
    index = {"steps.csv": steps.to_csv(index=False), "summary.md": summary(out, steps, args.cpu, argv)}
    for name, text in index.items():
        (out / name).unlink(missing_ok=True)  # the pack's own index, rewritten on every run
        create_file_atomic(out / name, text)
    print(f"gpucheck: summary in {out / 'summary.md'}")
    return 0 if all(r["status"] in ("ok", "skipped", "done before") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
