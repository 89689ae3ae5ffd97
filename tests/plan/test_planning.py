"""``mode=profile`` and ``mode=plan`` as a user runs them."""

import json
import logging
import subprocess

from conftest import PYTHON, REPO, run_in_process

from memo.plan.bilevel import addresses, read_plan
from memo.dsa.buffers import read_buffers, validate
from memo.profile.trace import read_trace


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(REPO / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_plan_mode_writes_trace_plan_and_row_and_prints_the_comparison(tmp_path, caplog):
    # in this process, as run.py runs the job (the command line's own behaviour is the other tests')
    out = tmp_path / "plan"
    with caplog.at_level(logging.INFO, logger="memo"):
        done = run_in_process(out, "mode=plan", "model=7b", "model.num_layers=4", "seq=256k", "parallel.tp=8")
    assert done["status"] == "ok", done["error"]
    row = json.loads((out / "result.json").read_text())
    assert row["status"] == "ok" and row["mode"] == "plan" and row["dtype"] == "bfloat16"
    assert row["profile.layers_identical"] == "1,2"
    s, h = 256 * 1024, 4096
    assert row["layer.skeletal_bytes"] > (4 + 12 / 8) * s * h * 2  # see test_profile for the exact sum
    for level in ("forward", "backward"):
        assert row[f"plan.{level}_peak_bytes"] == row[f"plan.{level}_lower_bound_bytes"] > 0
        # The caching allocator rounds, splits and caches: it holds more than the plan needs.
        assert row[f"simulated.{level}.peak_reserved"] > row[f"plan.{level}_peak_bytes"]
    assert row["plan.iteration_peak_bytes"] >= row["plan.flat_lower_bound_bytes"]
    assert row["plan.arena_bytes"] == row["plan.iteration_peak_bytes"]
    log = caplog.text  # what run.py writes to run.log
    assert "caching allocator reserves" in log and "plan written to" in log

    trace = read_trace(out / "trace.csv")
    memory_plan = read_plan(out / "plan.json")
    offsets = addresses(memory_plan, trace)
    buffers = read_buffers(out / "trace.csv")
    assert validate(buffers, [offsets[int(b.id)] for b in buffers]) <= memory_plan.arena_bytes


def test_profile_mode_writes_only_the_trace_and_a_rerun_keeps_it(tmp_path):
    out = tmp_path / "profile"
    done = run("mode=profile", "seq=1k", f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        ".memo-run", "result.json", "run.log", "trace.csv", "trace.json"]
    before = (out / "trace.csv").read_bytes()
    again = run("mode=profile", "seq=2k", f"hydra.run.dir={out}", cwd=tmp_path)
    assert again.returncode == 2 and "holds another run" in again.stderr
    assert (out / "trace.csv").read_bytes() == before


def test_a_method_that_cannot_be_traced_is_one_line_and_a_row(tmp_path):
    out = tmp_path / "memo"
    done = run("mode=plan", "method=memo", f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: method=memo moves skeletal tensors")
    assert done.stderr.count("\n") == 1
    assert json.loads((out / "result.json").read_text())["status"] == "error"
