"""Run the GPU validation pack: its steps in order, each in a process of its own.

    python -m memo.gpucheck [--out DIR] [--cpu] [--redo] [--all | --only STEP ...]

Without ``--all`` or ``--only`` the pack runs its first steps, the most informative ones, whose
budgets together keep it inside one command of eight minutes: ``smoke`` (every place the GPU path
can break, quickly), ``cp_kernels`` (each block kernel against a float64 reference, then timed),
``numerics`` (every method's gradients against keeping everything) and ``probe`` (the physical
bounds). The others (``timeline``, ``models``, ``throughput``, ``overlap``, ``longest``, ``calibration``, ``tiles``,
``boundary``, ``frontier``, ``checkpoints``, ``documents``) run with
``--all`` or by name with ``--only``, when device time is left.

A step whose finished result (``<step>.csv``) in ``DIR`` was made by the code checked out now
(:func:`memo.gpucheck.common.source_digest`) is skipped unless ``--redo`` (one that failed or ran
past its budget runs again); a result of other code
is moved to ``DIR/earlier/<its digest>/`` before the step runs again, so nothing is lost. A step
that fails or runs past its budget is recorded with why, and the pack goes on. ``summary.md``
names the device, driver, versions, date and commands, and gathers every step's table.
"""

import argparse
import datetime
import json
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

from memo.gpucheck.common import CODE_PATHS, REPO, source_digest
from memo.results import create_file_atomic, git_revision


@dataclass(frozen=True)
class Step:
    name: str
    module: tuple[str, ...]  # python -m ... arguments before --out
    budget_s: int  # wall seconds, the step's process start included
    first: bool = False  # in the pack a plain run makes: the first steps, within one 8-minute command


STEPS = [
    Step("smoke", ("memo.gpucheck.smoke",), 225, first=True),
    Step("cp_kernels", ("memo.gpucheck.cp_kernels",), 55, first=True),
    Step("numerics", ("memo.gpucheck.numerics",), 110, first=True),
    Step("probe", ("memo.gpucheck.probe",), 60, first=True),
    Step("timeline", ("memo.gpucheck.timeline",), 300),
    Step("models", ("memo.gpucheck.models",), 300),
    Step("throughput", ("memo.gpucheck.jobs", "throughput"), 360),
    Step("overlap", ("memo.gpucheck.overlap",), 150),
    Step("longest", ("memo.gpucheck.jobs", "longest"), 360),
    Step("calibration", ("memo.gpucheck.calibration",), 60),
    Step("tiles", ("memo.gpucheck.tiles",), 420),
    Step("boundary", ("memo.gpucheck.boundary",), 480),
    Step("frontier", ("memo.gpucheck.frontier",), 480),
    Step("checkpoints", ("memo.gpucheck.checkpoints",), 300),
    Step("documents", ("memo.gpucheck.documents",), 150),
]
FIRST_BUDGET_S = sum(step.budget_s for step in STEPS if step.first)
CPU_BUDGET_FACTOR = 3


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


def _commit() -> str:
    """The checkout's commit, said to be only the base where the code (what the source digest
    hashes) differs from it: a copied working tree can carry an older history than its files."""
    commit, changed = git_revision(REPO, CODE_PATHS)
    if commit is None:
        return "no git history"
    return f"changes on commit {commit}" if changed else f"commit {commit}"


def run_step(step: Step, out: Path, cpu: bool) -> dict:
    """Run one step in its own process group (its training jobs die with it at the budget; the
    CPU rehearsal, on a machine that may be busy with other work, gets three times the GPU's)."""
    budget_s = step.budget_s * (CPU_BUDGET_FACTOR if cpu else 1)
    arguments = [*step.module, "--out", str(out), *(["--cpu"] if cpu else [])]
    command = [sys.executable, "-m", *arguments]
    start = time.monotonic()
    log = out / f"{step.name}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.monotonic() - start
    skipped = out / f"{step.name}.skipped"
    if code is None:
        status, detail = "timeout", f"ran past its budget of {budget_s} s; run the pack again to go on"
    elif code == 0 and skipped.exists():
        status, detail = "skipped", skipped.read_text().strip()
    elif code == 0:
        status, detail = "ok", ""
    else:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        status, detail = "failed", (tail[-1] if tail else f"exit status {code}")
    return {"step": step.name, "status": status, "seconds": round(seconds, 1), "detail": detail,
            "command": " ".join(["python", "-m", *arguments])}


def _step_files(out: Path, step: str) -> list[Path]:
    """The files a step left in the pack's directory: ``<step>.*`` and ``<step>_*``."""
    return sorted(p for p in out.iterdir() if p.is_file() and re.match(rf"{re.escape(step)}[._]", p.name))


_INDEX_KEYS = ("step", "status", "seconds", "detail", "command", "source_digest")


def _record(out: Path, step: str) -> dict:
    path = out / f"{step}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def done_before(out: Path, step: str, digest: str) -> bool:
    """Whether ``out`` holds ``step``'s finished result (``ok`` or ``skipped``; one that failed or
    ran past its budget is run again) made by the code whose digest is ``digest``."""
    record = _record(out, step)
    return ((out / f"{step}.csv").exists() and record.get("source_digest") == digest
            and record.get("status") in ("ok", "skipped"))


def set_aside(out: Path, step: str) -> list[Path]:
    """Move an earlier result of ``step`` to ``out/earlier/<its digest>/`` (a numbered folder
    beside it if that one holds the step already); the paths it moved to."""
    files = _step_files(out, step)
    if not files:
        return []
    digest = _record(out, step).get("source_digest") or "unknown"
    target, n = out / "earlier" / digest, 1
    while target.exists() and any(target.glob(f"{step}.*")):
        n += 1
        target = out / "earlier" / f"{digest}-{n}"
    target.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.move(str(p), str(target / p.name))) for p in files]


def summary(out: Path, steps: pd.DataFrame, cpu: bool, argv: list[str]) -> str:
    import megatron.core
    import torch

    lines = [f"# GPU validation pack: {device_name(cpu)}", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- device: {device_name(cpu)}; driver: {_driver()}",
             f"- torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
             f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}), "
             f"megatron-core {megatron.core.__version__}, Python {platform.python_version()}",
             f"- code: source digest {source_digest()}, {_commit()}",
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
    parser.add_argument("--redo", action="store_true", help="run steps that have a result of this code again")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every step, not only the first ones")
    which.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="these steps only")
    args = parser.parse_args(argv)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(args.cpu).lower()).strip("-")
    out = args.out or REPO / "results" / "gpu" / f"{datetime.date.today().isoformat()}-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    digest = source_digest()
    chosen = [s for s in STEPS if (s.name in args.only if args.only else args.all or s.first)]
    factor = CPU_BUDGET_FACTOR if args.cpu else 1
    print(f"gpucheck: {', '.join(s.name for s in chosen)} (budgets {factor * sum(s.budget_s for s in chosen)} s) "
          f"of code {digest} into {out}", flush=True)
    records = []
    for step in chosen:
        if done_before(out, step.name, digest) and not args.redo:
            kept = f"{step.name}.csv of this code kept (--redo runs it again)"
            record = _record(out, step.name) | {"status": "done before", "detail": kept}
        else:
            moved = set_aside(out, step.name)
            if moved:
                print(f"gpucheck: {step.name}: the earlier result moved to {moved[0].parent}", flush=True)
            print(f"gpucheck: {step.name} (budget {factor * step.budget_s} s) ...", flush=True)
            record = run_step(step, out, args.cpu) | {"source_digest": digest}
            (out / f"{step.name}.json").unlink(missing_ok=True)
            create_file_atomic(out / f"{step.name}.json", json.dumps(record, indent=1) + "\n")
        records.append({key: record.get(key) for key in _INDEX_KEYS})
        print(f"gpucheck: {step.name}: {records[-1]['status']} {records[-1]['detail']}", flush=True)
    # The index lists every step whose result the folder holds, so a pack run over several calls
    # (one step each) ends with one summary of them all.
    this_run = {r["step"]: r for r in records}
    held = [this_run.get(s.name) or {key: _record(out, s.name).get(key) for key in _INDEX_KEYS}
            for s in STEPS if s.name in this_run or (out / f"{s.name}.json").exists()]
    steps = pd.DataFrame(held)
    index = {"steps.csv": steps.to_csv(index=False), "summary.md": summary(out, steps, args.cpu, argv)}
    for name, text in index.items():
        (out / name).unlink(missing_ok=True)  # the pack's own index, rewritten on every run
        create_file_atomic(out / name, text)
    print(f"gpucheck: summary in {out / 'summary.md'}")
    return 0 if all(r["status"] in ("ok", "skipped", "done before") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
