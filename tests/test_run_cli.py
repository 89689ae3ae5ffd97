"""``run.py`` as a user runs it: a job, a sweep, and one-line errors for bad input."""

import json
import subprocess

import pytest

from conftest import PYTHON, REPO

FAST = ["train.steps=2", "train.warmup_steps=1"]


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(REPO / "run.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_a_job_writes_its_row_and_step_log(tmp_path):
    out = tmp_path / "job"
    done = run("seq=256", "train.steps=3", "train.warmup_steps=1", f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = json.loads((out / "result.json").read_text())
    assert row["status"] == "ok" and row["tgs"] > 0 and 0 < row["mfu"] < 1
    assert row["hardware.name"] == "cpu" and row["hardware.peak_flops_source"] == "measured"
    assert row["model.name"] == "tiny" and row["method.name"] == "none" and row["seq"] == 256
    assert row["overrides"].startswith("seq=256 train.steps=3")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["timed"] for s in steps] == [False, True, True]
    assert "step 3/3" in (out / "run.log").read_text()


@pytest.mark.slow
def test_a_sweep_writes_one_row_per_combination(tmp_path):
    sweep = tmp_path / "sweep"
    done = run("-m", "model=tiny", "seq=1k,2k", "method=none,megatron_full_recompute",
               *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    assert sorted((r["seq"], r["method.name"]) for r in rows) == [
        (1024, "megatron_full_recompute"), (1024, "none"),
        (2048, "megatron_full_recompute"), (2048, "none"),
    ]
    assert all(r["status"] == "ok" for r in rows)


def test_an_invalid_combination_in_a_sweep_leaves_an_error_row_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    done = run("-m", "parallel.tp=3,1", "seq=128", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {r["parallel.tp"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/result.json"))}
    assert rows[3]["status"] == "error" and rows[1]["status"] == "ok"


@pytest.mark.parametrize(
    "args, starts",
    [
        (["parallel.tp=3"], "error: parallel.tp=3 does not divide model.num_attention_heads=4"),
        (["seq=12q"], "error: seq=12q is not a sequence length"),
        (["model=13c"], "error: model=13c is not a known model; choose one of: 1.3b, 125m, 13b"),
        (["-m", "method=none,memo_typo"], "error: method=memo_typo is not a known method"),
    ],
)
def test_bad_input_fails_with_one_line(tmp_path, args, starts):
    done = run(*args, f"hydra.run.dir={tmp_path / 'job'}", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), done.stderr
    assert "Traceback" not in done.stdout
