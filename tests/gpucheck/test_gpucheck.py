"""The GPU validation pack: which steps a command runs and in what time, results kept per code,
and every step's rows, rehearsed on the CPU (``--cpu``)."""

import math
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import memo.gpucheck.__main__ as pack
from memo.gpucheck.__main__ import FIRST_BUDGET_S, STEPS, Step, run_step
from memo.gpucheck.common import REPO, source_digest


def test_the_first_steps_come_first_and_fit_one_command_of_eight_minutes():
    first = [step.name for step in STEPS if step.first]
    assert first == ["smoke", "cp_kernels", "numerics", "probe"]
    assert [step.first for step in STEPS] == sorted((step.first for step in STEPS), reverse=True)
    assert FIRST_BUDGET_S <= 7.5 * 60  # with the pack's own start and the wheels' install


def test_the_source_digest_names_the_code_and_only_the_code(tmp_path):
    for name, text in [("run.py", "print()\n"), ("memo/a.py", "x = 1\n"), ("conf/config.yaml", "a: 1\n")]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = source_digest(tmp_path)
    (tmp_path / "results.csv").write_text("not code\n")
    (tmp_path / "memo" / "notes.txt").write_text("not code\n")
    assert source_digest(tmp_path) == before
    (tmp_path / "memo" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before and len(before) == 12


class _FakeSteps:
    """Stands for the steps' processes: each run writes ``<step>.csv`` with its count."""

    def __init__(self):
        self.ran = []

    def __call__(self, step, out, cpu):
        self.ran.append(step.name)
        (out / f"{step.name}.csv").write_text(f"run\n{len(self.ran)}\n")
        (out / f"{step.name}.log").write_text("log\n")
        return {"step": step.name, "status": "ok", "seconds": 0.0, "detail": "", "command": "fake"}


def test_a_step_of_this_code_is_kept_and_one_of_other_code_is_set_aside_then_run_again(tmp_path, monkeypatch):
    fake = _FakeSteps()
    monkeypatch.setattr(pack, "run_step", fake)
    monkeypatch.setattr(pack, "source_digest", lambda: "aaaaaaaaaaaa")
    assert pack.main(["--cpu", "--out", str(tmp_path)]) == 0
    assert fake.ran == ["smoke", "cp_kernels", "numerics", "probe"]  # the first steps only
    assert json.loads((tmp_path / "probe.json").read_text())["source_digest"] == "aaaaaaaaaaaa"

    assert pack.main(["--cpu", "--out", str(tmp_path), "--only", "probe", "calibration"]) == 0
    assert fake.ran[4:] == ["calibration"]  # probe's result is this code's
    index = pd.read_csv(tmp_path / "steps.csv")  # every step the folder holds, this call's two as they went
    assert list(index["step"]) == ["smoke", "cp_kernels", "numerics", "probe", "calibration"]
    assert list(index["status"]) == ["ok", "ok", "ok", "done before", "ok"]
    assert "## smoke" in (tmp_path / "summary.md").read_text()

    monkeypatch.setattr(pack, "source_digest", lambda: "bbbbbbbbbbbb")  # the code changed
    assert pack.main(["--cpu", "--out", str(tmp_path), "--only", "probe"]) == 0
    assert fake.ran[5:] == ["probe"]
    earlier = tmp_path / "earlier" / "aaaaaaaaaaaa"
    assert sorted(p.name for p in earlier.iterdir()) == ["probe.csv", "probe.json", "probe.log"]
    assert (earlier / "probe.csv").read_text() == "run\n4\n"
    assert (tmp_path / "probe.csv").read_text() == "run\n6\n"

    assert pack.main(["--cpu", "--out", str(tmp_path), "--only", "probe", "--redo"]) == 0
    assert fake.ran[6:] == ["probe"]  # asked for again: the one of this code is set aside too
    assert (tmp_path / "earlier" / "bbbbbbbbbbbb" / "probe.csv").read_text() == "run\n6\n"
    failing = _FakeSteps()
    monkeypatch.setattr(pack, "run_step", lambda *a: failing(*a) | {"status": "failed"})
    assert pack.main(["--cpu", "--out", str(tmp_path), "--only", "probe", "--redo"]) == 1
    monkeypatch.setattr(pack, "run_step", fake)
    assert pack.main(["--cpu", "--out", str(tmp_path), "--only", "probe"]) == 0
    assert fake.ran[7:] == ["probe"]  # its result of this code failed: run again, not kept
    assert pack.main(["--cpu", "--out", str(tmp_path), "--all"]) == 0
    # every step but probe, whose result is this code's
    assert fake.ran[8:] == ["smoke", "cp_kernels", "numerics", "timeline", "models", "throughput", "overlap", "longest",
                            "calibration", "tiles", "boundary", "frontier", "checkpoints", "documents"]


def test_a_failing_step_records_why(tmp_path):
    record = run_step(Step("broken", ("memo.gpucheck.no_such_step",), 60), tmp_path, cpu=True)
    assert record["status"] == "failed" and "No module named memo.gpucheck.no_such_step" in record["detail"]


def test_a_job_killed_with_its_step_is_set_aside_and_run_again_and_a_finished_one_is_kept(tmp_path, monkeypatch):
    import memo.gpucheck.common as common
    from memo.results import claim_run_dir, write_json_atomic

    def run_py(command, **kwargs):  # what run.py does: claim the directory (refused if taken), write a row
        run_dir = Path(next(a for a in command if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        claim_run_dir(run_dir)
        write_json_atomic(run_dir / "result.json", {"status": "ok", "attempt": len(launched)})
        launched.append(run_dir)
        return subprocess.CompletedProcess(command, 0, "", "")

    launched = []
    monkeypatch.setattr(common.subprocess, "run", run_py)
    killed = tmp_path / "throughput-memo-64k"
    claim_run_dir(killed)  # the job the step's budget killed: a claim, no row
    (killed / "metrics.jsonl").write_text('{"step": 1}\n')
    assert common.run_job(killed, "seq=64k") == [{"status": "ok", "attempt": 0}]
    assert sorted(p.name for p in (killed / "interrupted" / "1").iterdir()) == [".memo-run", "metrics.jsonl"]
    assert common.run_job(killed, "seq=64k") == [{"status": "ok", "attempt": 0}]  # finished: kept
    interrupted = tmp_path / "throughput-memo-128k"  # stopped by a signal: its row says so
    claim_run_dir(interrupted)
    write_json_atomic(interrupted / "result.json", {"status": "interrupted"})
    assert common.run_job(interrupted, "seq=128k") == [{"status": "ok", "attempt": 1}]
    assert json.loads((interrupted / "interrupted" / "1" / "result.json").read_text()) == {"status": "interrupted"}
    assert common.run_job(interrupted, "seq=128k") == [{"status": "ok", "attempt": 1}]
    assert launched == [killed, interrupted]


def test_a_step_cut_short_by_its_budget_keeps_the_rows_of_its_finished_jobs(tmp_path, monkeypatch):
    import memo.gpucheck.jobs as jobs

    def run_job(run_dir, *overrides):
        if len(ran) == 2:
            raise KeyboardInterrupt  # the budget's kill, as the third job runs
        ran.append(run_dir.name)
        return [{"status": "ok", "mfu": 0.5, "method.name": overrides[-1]}]

    ran = []
    monkeypatch.setattr(jobs, "run_job", run_job)
    with pytest.raises(KeyboardInterrupt):
        jobs.main(["throughput", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "throughput.csv")
    assert list(table["job"]) == ["none-8k", "megatron_full_recompute-8k"] and list(table["mfu"]) == [0.5, 0.5]


def test_the_timeline_step_gathers_each_jobs_table_and_says_which_did_not_run(tmp_path, monkeypatch):
    import memo.gpucheck.timeline as timeline

    def run_job(run_dir, *overrides):
        if "method=none" in overrides:  # keeping everything does not fit
            return [{"status": "oom", "error": "CUDA out of memory"}]
        run_dir.mkdir(parents=True)
        pd.DataFrame([{"category": "attention_forward", "seconds": 0.5}, {"category": "idle", "seconds": 0.1}]
                     ).to_csv(run_dir / "timeline.csv", index=False)
        pd.DataFrame([{"name": "flash_fwd_kernel", "category": "attention_forward", "calls": 2, "seconds": 0.5}]
                     ).to_csv(run_dir / "timeline_kernels.csv", index=False)
        (run_dir / "timeline.json.gz").write_bytes(b"trace")
        return [{"status": "ok", "iter_time_s": 1.0, "mfu": 0.3, "mfu_ceiling": 0.5}]

    monkeypatch.setattr(timeline, "run_job", run_job)
    assert timeline.main(["--out", str(tmp_path)]) == 1  # one job did not run
    table = pd.read_csv(tmp_path / "timeline.csv")
    assert list(table["job"]) == ["memo-layers"] * 2 + ["memo-tiles"] * 2 + ["megatron_full_recompute"] * 2 + ["none"]
    assert list(table["category"].fillna("-")) == ["attention_forward", "idle"] * 3 + ["-"]
    assert table["status"].tolist()[-1] == "oom" and (table["trace_bytes"].dropna() == 5).all()
    assert len(pd.read_csv(tmp_path / "timeline_kernels.csv")) == 3


@pytest.mark.slow
def test_the_pack_rehearsed_on_the_cpu_leaves_every_steps_rows(tmp_path):
    def pack_run(*args):
        done = subprocess.run([sys.executable, "-m", "memo.gpucheck", "--cpu", "--out", str(tmp_path), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return pd.read_csv(tmp_path / "steps.csv").set_index("step")

    steps = pack_run()
    assert list(steps.index) == ["smoke", "cp_kernels", "numerics", "probe"]
    assert set(steps["status"]) == {"ok"} and set(steps["source_digest"]) == {source_digest()}
    smoke = pd.read_csv(tmp_path / "smoke.csv").set_index("check")
    assert smoke.loc["collectives over one rank", "status"] == "ok"
    assert "blocks flash" in smoke.loc["attention kernels against float64", "detail"]
    assert set(smoke["status"]) == {"ok", "skipped"} and (smoke["status"] == "ok").sum() == 7
    kernels = pd.read_csv(tmp_path / "cp_kernels.csv")
    checked = kernels[kernels["status"].notna()]
    assert set(zip(checked["attention"], checked["kernel"])) == {
        (attention, kernel) for attention in ("whole", "blocks", "whole-grouped", "blocks-grouped")
        for kernel in ("flash", "math")}
    errors = checked.filter(like="error_")
    assert (errors.max(axis=1) <= checked["tolerance"]).all() and (errors.min(axis=1) > 0).all()
    timed = kernels[kernels["status"].isna()]
    # (a whole kernel's backward is forward and backward less forward, timed once each here)
    assert (timed.loc[(timed["attention"] == "blocks") | (timed["phase"] == "forward"), "seconds"] > 0).all()
    # every kernel at the shorter length; at the longer the two a run here uses (flash, whole and blocks)
    by_length = timed.groupby("seq").apply(lambda t: sorted(set(zip(t["attention"], t["kernel"]))))
    assert by_length.to_dict() == {256: [("blocks", "flash"), ("blocks", "math"), ("whole", "flash"),
                                         ("whole", "math")], 512: [("blocks", "flash"), ("whole", "flash")]}
    assert len(timed[timed["attention"] == "blocks"]) == 3 * 2 * 2  # kernels at a length, cp 2 and 4, phases
    numerics = pd.read_csv(tmp_path / "numerics.csv")
    assert set(numerics["method"]) == {"memo", "megatron_full_recompute", "memo plan=true vs plan=false"}
    assert (numerics["status"] == "ok").all()
    assert numerics.loc[numerics["tile_tokens"].notna(), "method"].tolist() == ["memo"]  # tiles of 64
    compared = numerics.dropna(subset=["grad_error"])  # the plan row compares losses only
    assert (compared["grad_error"] <= compared["tolerance"]).all()
    summary = (tmp_path / "summary.md").read_text()
    assert "# GPU validation pack: cpu" in summary and "## numerics" in summary and "megatron-core" in summary

    # the later steps, each alone; the GPU-only ones say why they did not run
    steps = pack_run("--only", "throughput", "calibration", "overlap", "longest", "probe", "models", "tiles",
                     "checkpoints", "documents")
    assert steps.loc["probe", "status"] == "done before"
    assert set(steps.loc[["throughput", "calibration", "models", "tiles", "checkpoints", "documents"],
                         "status"]) == {"ok"}
    assert set(steps.loc[["overlap", "longest"], "status"]) == {"skipped"}
    assert all(steps.loc[["overlap", "longest"], "detail"].str.startswith("needs a GPU: "))
    throughput = pd.read_csv(tmp_path / "throughput.csv")
    assert list(throughput["job"]) == ["memo-true-256"]
    assert (throughput["status"] == "ok").all() and (throughput["mfu"] > 0).all()
    assert len(pd.read_csv(tmp_path / "calibration.csv")) == 1
    models = pd.read_csv(tmp_path / "models.csv")  # the Llama shape, each row with the fit's prediction
    assert list(models["job"]) == ["memo-256", "megatron_full_recompute-256"]
    assert (models["status"] == "ok").all() and (models["predicted_peak_bytes"] > 0).all()
    assert (models["model.name"] == "tiny_llama").all() and models["time_error"].notna().all()
    tiles = pd.read_csv(tmp_path / "tiles.csv")  # tiled memo, swapped, with what the walk declared
    assert list(tiles["job"]) == ["memo-tiny_llama-256-2l"] and (tiles["status"] == "ok").all()
    assert (tiles["tiles.tiles"] == 4).all() and (tiles["declared_device_bytes"] > 0).all()
    assert tiles["tiles.alpha_mean"].between(0, 1).all()
    (checkpoints,) = pd.read_csv(tmp_path / "checkpoints.csv").to_dict("records")  # the CPU: bit for bit
    assert (checkpoints["status"], checkpoints["resumed_from_step"], checkpoints["optimizer"]) == ("ok", 3, "torch_adamw")
    assert checkpoints["max_loss_diff"] == 0 and checkpoints["max_tensor_diff"] == 0
    assert checkpoints["valid_loss_diff"] == 0
    documents = pd.read_csv(tmp_path / "documents.csv")  # packed against one by one, fp32
    assert list(documents["method"]) == ["none", "memo", "memo"] and (documents["status"] == "ok").all()
    assert documents["tile_tokens"].tolist()[2] == 64
    assert (documents["grad_error"] <= 1e-5).all() and (documents["documents"] == "100 1 39 116").all()


def test_overlap_counts_copy_time_under_compute_and_compute_idle_during_copies():
    from memo.gpucheck.overlap import overlap_rows

    # kernels busy 0-10 and 20-30; a D2H copy 5-25 is under compute for 5 + 5 of its 20 units,
    # and the GPU computes nothing for 10 of them
    (row,) = overlap_rows({"d2h": [(5.0, 25.0)]}, [(0.0, 10.0), (20.0, 30.0), (2.0, 8.0)])
    assert (row["copy_us"], row["overlap_fraction"], row["compute_idle_us"]) == (20.0, 0.5, 10.0)


def test_plan_row_allows_ten_times_the_spread_of_two_unplanned_runs_and_nothing_on_the_cpu():
    from memo.gpucheck.numerics import plan_row

    def job(first, last, status="ok"):
        return {"status": status, "loss_first": first, "loss_last": last}

    # the H200's figures (bf16, 125M, 8k tokens, four steps): plan=true 2.3e-6 from plan=false,
    # plan=false 9.5e-6 from its repeat: the bound is 1e-4 (the floor over 9.5e-5)
    unplanned = job(10.974966049194336, 8.392183303833008)
    row = plan_row(job(10.974966049194336, 8.39216423034668), unplanned, job(10.974966049194336, 8.392263412475586))
    assert row["status"] == "ok" and row["first_loss_error"] == 0 and row["tolerance"] == 1e-4
    assert row["loss_error"] == pytest.approx(1 - 8.39216423034668 / 8.392183303833008)
    assert row["repeat_loss_error"] == pytest.approx(8.392263412475586 / 8.392183303833008 - 1)
    # a wide spread widens the bound; a gap beyond it fails
    wide = job(10.97, 8.4)  # 9.3e-4 from plan=false
    assert plan_row(job(10.97, 8.40), unplanned, wide)["tolerance"] == pytest.approx(10 * (8.4 / 8.392183303833008 - 1))
    assert plan_row(job(10.97, 8.50), unplanned, job(10.97, 8.3922))["status"] == "failed"
    # the CPU's arithmetic is deterministic, and the CPU runs no repeat: the same 2.3e-6 gap fails there
    assert plan_row(job(10.97, 8.39216423034668), unplanned, None)["status"] == "failed"
    failed = plan_row(job(10.97, 8.39), job(None, None, "error"), None)
    assert failed["status"] == "failed" and failed["loss_error"] is None and "error" in failed["worst_parameter"]


def test_the_frontier_step_trains_the_longest_length_its_budget_allows():
    from memo.gpucheck.frontier import TRAIN_BUDGET_S, trained_length

    assert trained_length(1 << 20, TRAIN_BUDGET_S / 2, 16384) == 1 << 20  # two steps within the budget
    # four times the budget: half the length (time as the square of it), on the tiles' grid
    assert trained_length(1 << 20, 2 * TRAIN_BUDGET_S, 16384) == 1 << 19
    assert trained_length(1 << 20, 3 * TRAIN_BUDGET_S, 16384) == int((1 << 20) / 6 ** 0.5) // 16384 * 16384
    assert trained_length(32768, 1e9, 16384) == 16384  # never below one tile


def test_the_boundary_step_leaves_the_device_its_longest_length_needs_and_tries_one_past_its_margin():
    from memo.gpucheck.boundary import budget_bytes, over_length, timed_length

    # a step of 240 s at 1M tokens: a minute at half of it (time as the square of the length)
    assert timed_length(1 << 20, 240.0, 60.0, 16384) == 1 << 19
    assert timed_length(1 << 20, 1e9, 60.0, 16384) == 16384  # never below one tile
    # 97 GB predicted with 3% kept free: a device of 100 GB, and 0.1% over
    assert budget_bytes(97 * 10**9, 0.03) == math.ceil(100 * 10**9 * 1.001)
    # from 97 GB at 512K, 50 KB a token: the whole 100 GB device is 97% of 103.09 GB, 6.09 GB more,
    # 121,856 tokens: 8 tiles of 16K (7.4 tiles rounded up) past 512K
    assert over_length(1 << 19, 97 * 10**9, 50_000, 100 * 10**9, 0.03, 16384) == (1 << 19) + 8 * 16384


def test_the_frontier_arithmetic_scales_what_grows_with_the_length_to_what_the_margin_leaves():
    from memo.gpucheck.frontier import arithmetic, scaled_length

    # 80 GB at 1M tokens, 20 GB of it fixed, on a 100 GB device: a 5% margin leaves 75 GB for
    # what was 60 GB, 1.25 times the length
    assert scaled_length(1 << 20, 80 * 10**9, 20 * 10**9, 100 * 10**9, 0.05) == int((1 << 20) * 1.25)
    row = {"method.name": "memo", "model.name": "llama3_8b", "status": "ok", "hardware.name": "h200",
           "cluster.gpus": 1, "seq": 1 << 20, "predicted_device_bytes": 80 * 10**9, "predicted_weights_bytes": 5 * 10**9,
           "predicted_gradients_bytes": 5 * 10**9, "predicted_optimizer_bytes": 8 * 10**9,
           "predicted_reserved_bytes": 2 * 10**9, "predicted_device_capacity_bytes": 100 * 10**9}
    (taken,) = arithmetic(0.05, [row, {**row, "method.name": "megatron_full_recompute"}])
    assert (taken["job"], taken["seq"], taken["fixed_bytes"]) == ("arithmetic h200 x1", int((1 << 20) * 1.25), 20 * 10**9)
