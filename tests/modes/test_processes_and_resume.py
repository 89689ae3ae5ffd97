"""A job's processes started by ``run.py`` itself (``launch.processes``), and a stopped run
continued in its own directory (``train.resume``), as a user runs them."""

import json
import signal
import time
from pathlib import Path

import pytest

from conftest import file_hashes
from test_run_cli import FAST, _start, run


RESUMABLE = ["model=tiny", "model.vocab_size=1000", "seq=128", "train.warmup_steps=1", "train.save_interval=2"]


def _logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_stopped_run_continues_in_its_directory_once_with_every_step_logged_once(tmp_path):
    from conftest import run_in_process

    out = tmp_path / "job"
    job = _start(*RESUMABLE, "train.steps=100000", f"hydra.run.dir={out}", cwd=tmp_path)
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline and not (
            (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 143
    saved = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert len(_logged(out)) >= saved >= 2
    total = saved + 2
    before = file_hashes(out)
    other = run(*RESUMABLE, "seq=256", f"train.steps={total}", "train.resume=true", f"hydra.run.dir={out}",
                cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.strip().splitlines() == [
        f"error: {out} holds a run with seq=128 (this run: 256); continue it with its own settings (train.steps may "
        "be raised), or give this run another hydra.run.dir"]
    assert file_hashes(out) == before
    # two continuations started at once: one goes on, the other finds it (running, or already done)
    runs = [_start(*RESUMABLE, f"train.steps={total}", "train.resume=true", f"hydra.run.dir={out}", cwd=tmp_path)
            for _ in range(2)]
    done = [(p.wait(timeout=600), p.stderr.read()) for p in runs]
    assert sorted(code for code, _ in done) == [0, 2], done
    refused = next(err for code, err in done if code == 2).strip().splitlines()
    assert len(refused) == 1 and ("holds a run in progress" in refused[0] or "holds a finished run" in refused[0])
    row = json.loads((out / "result.json").read_text())
    assert (row["status"], row["resumed_from_step"], row["steps_done"]) == ("ok", saved, total)
    uninterrupted = run_in_process(tmp_path / "uninterrupted", *RESUMABLE, f"train.steps={total}")
    assert uninterrupted["status"] == "ok"
    steps, expected = _logged(out), _logged(tmp_path / "uninterrupted")
    assert [s["step"] for s in steps] == list(range(1, total + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in expected]
    finished = run(*RESUMABLE, f"train.steps={total + 2}", "train.resume=true", f"hydra.run.dir={out}", cwd=tmp_path)
    assert finished.returncode == 2 and "holds a finished run (status ok); it is kept" in finished.stderr


def test_one_command_starts_the_processes_of_a_job_and_each_line_comes_once(tmp_path):
    import hf_models
    from conftest import run_in_process

    # Qwen3 at tp=2 without sequence parallelism: its query and key norms see each rank's heads only
    hf_models.make_new_checkpoint("qwen3_wide_heads", tmp_path / "qwen3")
    model = ["model=hf", f"model.init_from={tmp_path / 'qwen3'}", "seq=128", "train.steps=4", "train.warmup_steps=1"]
    out = tmp_path / "job"
    done = run("launch.processes=2", "parallel.tp=2", *model, f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = json.loads((out / "result.json").read_text())
    assert (row["status"], row["world_size"], row["parallel.tp"]) == ("ok", 2, 2)
    printed = done.stdout + done.stderr
    for line in ("params, seq 128", "step 1/4", "step 4/4", "status ok; row written"):
        assert printed.count(line) == 1, (line, printed)
    assert "Warning" not in printed
    assert run_in_process(tmp_path / "one", *model)["status"] == "ok"
    assert [s["loss"] for s in _logged(out)] == pytest.approx([s["loss"] for s in _logged(tmp_path / "one")],
                                                               abs=1e-5)
    # a refusal the ranks make once started: one line, exit status 2, the row says it
    refused = run("launch.processes=2", "parallel.cp=2", "seq=128", *FAST, "train.load=/nowhere",
                  f"hydra.run.dir={tmp_path / 'refused'}", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: train.load=/nowhere is neither a checkpoint (step_<n>/) nor a directory that holds one; give one, "
        "auto (the last in train.save_dir), or null to start afresh"]
    assert json.loads((tmp_path / "refused" / "result.json").read_text())["status"] == "error"
