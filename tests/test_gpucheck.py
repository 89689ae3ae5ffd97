"""The GPU validation pack's orchestration, rows and summary, run on the CPU (``--cpu``)."""

import subprocess
import sys

import pandas as pd
import pytest

from memo.gpucheck.__main__ import Step, run_step
from memo.gpucheck.common import REPO


@pytest.mark.slow
def test_the_pack_runs_every_step_on_the_cpu_and_goes_on_where_it_stopped(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memo.gpucheck", "--cpu", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    steps = pd.read_csv(tmp_path / "steps.csv").set_index("step")
    assert list(steps.index) == ["smoke", "probe", "cp_kernels", "numerics", "overlap", "throughput",
                                 "longest", "calibration"]
    assert set(steps.loc[["overlap", "longest"], "status"]) == {"skipped"}
    assert all(steps.loc[["overlap", "longest"], "detail"].str.startswith("needs a GPU: "))
    assert set(steps.drop(["overlap", "longest"])["status"]) == {"ok"}
    numerics = pd.read_csv(tmp_path / "numerics.csv")
    assert set(numerics["method"]) >= {"memo", "full_swap", "full_recompute", "megatron_full_recompute"}
    assert (numerics["status"] == "ok").all()
    assert (numerics["grad_error"].dropna() <= numerics["tolerance"].dropna()).all()
    smoke = pd.read_csv(tmp_path / "smoke.csv")
    assert set(smoke["status"]) == {"ok", "skipped"} and len(smoke) == 8
    cp_kernels = pd.read_csv(tmp_path / "cp_kernels.csv")
    checks, timed = cp_kernels[cp_kernels["check"].notna()], cp_kernels[cp_kernels["check"].isna()]
    assert list(checks["check"]) == ["output", "dq", "dk", "dv"]
    assert (checks["max_error"] <= checks["tolerance"]).all()
    assert len(timed) == 8 and (timed["blocks_s"] > 0).all() and (timed["ratio"] > 0).all()
    throughput = pd.read_csv(tmp_path / "throughput.csv")
    assert list(throughput["job"]) == ["none-256", "memo-true-256"]
    assert (throughput["status"] == "ok").all() and (throughput["mfu"] > 0).all()
    summary = (tmp_path / "summary.md").read_text()
    assert "# GPU validation pack: cpu" in summary and "## numerics" in summary and "megatron-core" in summary

    again = subprocess.run([sys.executable, "-m", "memo.gpucheck", "--cpu", "--out", str(tmp_path),
                            "--only", "probe", "numerics"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0
    assert list(pd.read_csv(tmp_path / "steps.csv")["status"]) == ["done before", "done before"]


def test_a_failing_step_records_why(tmp_path):
    record = run_step(Step("broken", ("memo.gpucheck.no_such_step",), 60), tmp_path, cpu=True)
    assert record["status"] == "failed" and "No module named memo.gpucheck.no_such_step" in record["detail"]


def test_overlap_counts_copy_time_under_compute_and_compute_idle_during_copies():
    from memo.gpucheck.overlap import overlap_rows

    # kernels busy 0-10 and 20-30; a D2H copy 5-25 is under compute for 5 + 5 of its 20 units,
    # and the GPU computes nothing for 10 of them
    (row,) = overlap_rows({"d2h": [(5.0, 25.0)]}, [(0.0, 10.0), (20.0, 30.0), (2.0, 8.0)])
    assert (row["copy_us"], row["overlap_fraction"], row["compute_idle_us"]) == (20.0, 0.5, 10.0)
