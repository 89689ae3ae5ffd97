"""``run.py`` as a user runs it: a job, a sweep, and one-line errors for bad input."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, REPO, file_hashes

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
    assert row["model.name"] == "tiny_llama" and row["method.name"] == "none" and row["seq"] == 256  # the default
    assert row["overrides"].startswith("seq=256 train.steps=3")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["timed"] for s in steps] == [False, True, True]
    assert "step 3/3" in (out / "run.log").read_text()


@pytest.mark.slow
def test_a_sweep_writes_one_row_per_combination(tmp_path):
    sweep = tmp_path / "sweep"
    done = run("-m", "model=tiny", "model.vocab_size=1000", "seq=128,256", "method=none,megatron_full_recompute",
               *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    assert sorted((r["seq"], r["method.name"]) for r in rows) == [
        (128, "megatron_full_recompute"), (128, "none"),
        (256, "megatron_full_recompute"), (256, "none"),
    ]
    assert all(r["status"] == "ok" for r in rows)


def test_an_invalid_combination_in_a_sweep_leaves_an_error_row_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    done = run("-m", "parallel.tp=3,1", "seq=128", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {r["parallel.tp"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/result.json"))}
    assert rows[3]["status"] == "error" and rows[1]["status"] == "ok"
    # The same sweep directory again: refused before anything is written, the first sweep kept whole.
    before = file_hashes(sweep)
    again = run("-m", "parallel.tp=1", "seq=256", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {sweep} holds an earlier sweep and is kept; give this sweep another hydra.sweep.dir"]
    assert file_hashes(sweep) == before


@pytest.mark.parametrize(
    "args, starts",
    [
        (["parallel.tp=3"], "error: parallel.tp=3 does not divide model.num_attention_heads=8"),
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


def test_a_directory_that_cannot_be_made_fails_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    done = run(*FAST, f"hydra.run.dir={tmp_path / 'a_file' / 'job'}", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].endswith("Not a directory; choose a writable hydra.run.dir"), done.stderr


def _default_sigint() -> None:
    # a suite started in the background (`make test &`) hands its processes SIGINT ignored, and
    # Python then keeps it ignored: the job must see Ctrl-C as a terminal would send it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str, cwd) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, str(REPO / "run.py"), *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


@pytest.fixture(scope="module")
def two_runs_at_once(tmp_path_factory) -> tuple[Path, list]:
    """Two jobs started at once into one directory: that directory, and each job's process with
    its output (one run ends there; the next test reruns into what it left)."""
    tmp = tmp_path_factory.mktemp("two_runs")
    out = tmp / "job"
    runs = [_start("seq=128", *FAST, f"train.seed={seed}", f"hydra.run.dir={out}", cwd=tmp)
            for seed in (1, 2)]
    return out, [(p, *p.communicate(timeout=600)) for p in runs]


def test_two_runs_started_at_once_into_one_directory_one_runs_and_one_is_refused(two_runs_at_once):
    out, done = two_runs_at_once
    assert sorted(p.returncode for p, _, _ in done) == [0, 2], [err for _, _, err in done]
    refused = next(err for p, _, err in done if p.returncode == 2).strip().splitlines()
    assert len(refused) == 1 and refused[0].startswith(f"error: {out} holds another run"), refused
    row = json.loads((out / "result.json").read_text())
    config = yaml.safe_load((out / ".hydra" / "config.yaml").read_text())
    overrides = yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text())
    assert row["status"] == "ok" and config["train"]["seed"] == row["train.seed"]
    assert f"train.seed={row['train.seed']}" in overrides and row["overrides"] == " ".join(overrides)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]


def test_a_refused_rerun_leaves_every_byte_of_the_earlier_run(two_runs_at_once):
    out, done = two_runs_at_once
    assert 0 in [p.returncode for p, _, _ in done]
    before = file_hashes(out)
    assert {".memo-run", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "result.json",
            "metrics.jsonl", "run.log"} <= set(before)
    again = run("seq=256", *FAST, f"hydra.run.dir={out}", cwd=out.parent)
    assert again.returncode == 2 and "holds another run" in again.stderr
    assert file_hashes(out) == before


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_leave_an_interrupted_row_and_no_traceback(tmp_path, signum, status):
    out = tmp_path / "job"
    job = _start("seq=128", "train.steps=1000", "train.warmup_steps=1", f"hydra.run.dir={out}", cwd=tmp_path)
    log = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.1)
    job.send_signal(signum)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == status, stderr
    assert stderr.strip().splitlines()[-1] == f"interrupted by {signal.Signals(signum).name}"
    assert "Traceback" not in stdout + stderr
    steps = [json.loads(line) for line in log.read_text().splitlines()]  # every line whole
    row = json.loads((out / "result.json").read_text())
    assert row["status"] == "interrupted" and row["steps_done"] == len(steps) >= 1
    assert row["error"].startswith("interrupted by SIG")
