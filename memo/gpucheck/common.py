"""What the pack's steps share: where they write, how they run a training job, and the verdict of
a step that cannot run here."""

import argparse
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pandas as pd

from memo.results import create_file_atomic, finished_row, set_aside_unfinished

REPO = Path(__file__).resolve().parents[2]
# what decides a result: the package, the configuration and the entry point
_SOURCES = ("memo/**/*.py", "memo/**/*.c", "conf/**/*.yaml", "run.py", "pyproject.toml")
CODE_PATHS = ("memo", "conf", "run.py", "pyproject.toml")  # what _SOURCES covers, as git paths
# the tiny model as ``--cpu`` rehearses it: GPT-2's 50257-token output layer is most of its CPU step
# (0.8 s of one at 256 tokens), and no check in the pack depends on the vocabulary's size
CPU_TINY = ["model=tiny", "model.vocab_size=1000"]


def source_digest(root: Path = REPO) -> str:
    """Twelve hex digits naming the code a result was made by: a hash of the package's sources,
    the configuration and the entry point, the same on every machine that has the same files (a
    lent GPU machine gets the working tree without its git history)."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in _SOURCES for p in root.glob(pattern) if p.is_file()}):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def placed_model(workload, device, attention_backend: str = "auto", host_budget: float = 2**50):
    """``workload``'s GPT on ``device`` with its layers run as training runs them (its activation
    policy's :meth:`memo.policy.ActivationPolicy.prepare`): ``(model, layer runtime)``. The host
    budget (bytes) defaults to more than any step here swaps."""
    from memo.model import build_gpt
    from memo.policy import policy_of

    policy = policy_of(workload)
    model = build_gpt(workload, device.type, attention_backend, layers=policy.layers).module
    return model, policy.prepare(model, workload, device, host_budget)


def step_device(cpu: bool):
    """``(device, dtype)`` a step computes on: the CPU in fp32 (``--cpu``), else GPU 0 in bf16
    (nothing asked of CUDA yet: a step may first say that no GPU is visible)."""
    import torch

    return (torch.device("cpu"), torch.float32) if cpu else (torch.device("cuda", 0), torch.bfloat16)


def runs_dir(out: Path) -> Path:
    """Where a step's training jobs write, under the pack's directory: one folder per code
    (:func:`source_digest`), so a job of other code is never taken for this code's."""
    return out / "runs" / source_digest()


def arguments(description: str, argv=None) -> argparse.Namespace:
    """A step's command line: ``--out DIR`` (the pack's directory) and ``--cpu``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="the pack's directory")
    parser.add_argument("--cpu", action="store_true", help="the tiny model on the CPU")
    return parser.parse_args(argv)


def compose(*overrides: str):
    """The configuration ``python run.py OVERRIDES`` would run."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from memo.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def write_rows(out: Path, step: str, rows: list[dict]) -> Path:
    """The step's rows as ``<step>.csv`` (never over an earlier file: the pack decides to redo)."""
    path = out / f"{step}.csv"
    path.unlink(missing_ok=True)
    create_file_atomic(path, pd.DataFrame(rows).to_csv(index=False))
    return path


def skip(out: Path, step: str, reason: str) -> int:
    """Mark a step that cannot run here (``<step>.skipped`` holds why); its exit status."""
    path = out / f"{step}.skipped"
    path.unlink(missing_ok=True)
    create_file_atomic(path, reason + "\n")
    print(f"{step}: skipped ({reason})")
    return 0


def run_job(run_dir: Path, *overrides: str, timeout_s: float = 480, multirun: bool = False) -> list[dict]:
    """Run ``python run.py OVERRIDES`` in a process of its own and return its rows (one, or one
    per job of a ``-m`` sweep); a ``run_dir`` that holds rows already is not run again. A job
    that leaves no row (it crashed or ran past ``timeout_s``) gives one row with status ``error``
    or ``timeout`` and the tail of its output. A job killed with its step (the step's budget) left
    its claim and no row: its files move to ``interrupted/<n>/`` and it runs again."""
    # a directory name is part of an override: nothing there that Hydra's grammar reads
    run_dir = run_dir.with_name(re.sub(r"[^A-Za-z0-9._-]+", "-", run_dir.name))
    done_before = _finished_rows(run_dir, multirun)
    if done_before:  # a pack cut short goes on where it stopped
        return done_before
    if not multirun and run_dir.exists():  # a job killed with its step holds a claim and no row
        set_aside_unfinished(run_dir)
    location = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    command = [sys.executable, "run.py", *overrides, location, *(["-m"] if multirun else [])]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        status, tail = None, (done.stdout + done.stderr)[-600:]
    except subprocess.TimeoutExpired as expired:
        status, tail = "timeout", str(expired.stdout or "")[-600:]
    rows = _finished_rows(run_dir, multirun)
    if rows and status is None:
        return rows
    last = tail.strip().splitlines()
    return [{"status": status or "error", "error": last[-1] if last else "no output",
             "overrides": " ".join(overrides), "wall_s": time.monotonic() - start}]


def _finished_rows(run_dir: Path, multirun: bool) -> list[dict]:
    """The rows of the finished jobs in ``run_dir`` (a sweep's: in its job folders), those set
    aside as interrupted left out."""
    if not run_dir.is_dir():
        return []
    folders = sorted((p for p in run_dir.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name)) if multirun else [run_dir]
    return [row for row in map(finished_row, folders) if row is not None]


def row_figures(row: dict, keys: Optional[list[str]] = None) -> dict:
    """The columns of a training row the pack's tables keep, with ``mfu_of_ceiling``: the share of
    what the kernels allow the run got (``mfu / mfu_ceiling``)."""
    keys = keys or ["method.name", "model.name", "seq", "alpha", "plan", "status", "error", "mfu", "mfu_ceiling", "tgs",
                    "iter_time_s", "peak_allocated_bytes", "peak_reserved_bytes", "alloc_retries",
                    "swap.alpha", "device_name", "result_path"]
    figures = {key: row.get(key) for key in keys}
    mfu, ceiling = row.get("mfu"), row.get("mfu_ceiling")
    return figures | {"mfu_of_ceiling": mfu / ceiling if mfu and ceiling else None}


