"""Result rows into tables, figures and a report, checked against values worked out by hand."""

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread
from result_rows import write_run, write_sweep

from analysis import figures, report, rows, tables
from analysis.rows import load_results, load_steps

MEMO = {"method.name": "memo"}
SEVEN_B = {"model.name": "7b", "model.num_layers": 32, "model.hidden_size": 4096}
THIRTEEN_B = {"model.name": "13b", "model.num_layers": 40, "model.hidden_size": 5120}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every experiment's CPU smoke version (tests/result_rows.py)."""
    return write_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture
def end_to_end(tmp_path):
    """Two models on 8 GPUs; one cell of each failure; two parallel layouts of one cell."""
    d = tmp_path / "e2e"
    common = dict(experiment="end_to_end", world_size=8)
    write_run(d, "13b_memo_64k", **common, **THIRTEEN_B, **MEMO, seq=65536, mfu=0.5, tgs=100.0)
    write_run(d, "7b_none_64k", **common, **SEVEN_B, seq=65536, mfu=0.4, tgs=400.0)
    write_run(d, "7b_none_128k", **common, **SEVEN_B, seq=131072, status="oom")
    write_run(d, "7b_memo_64k_tp8", **common, **SEVEN_B, **MEMO, seq=65536, mfu=0.45,
              tgs=450.0, **{"parallel.tp": 8})
    write_run(d, "7b_memo_64k_tp4", **common, **SEVEN_B, **MEMO, seq=65536, mfu=0.55,
              tgs=550.0, **{"parallel.tp": 4, "parallel.cp": 2})
    write_run(d, "7b_memo_128k", **common, **SEVEN_B, **MEMO, seq=131072, mfu=0.6, tgs=300.0)
    write_run(d, "7b_memo_1408k", **common, **SEVEN_B, **MEMO, seq=1441792, status="oohm")
    write_run(d, "7b_memo_1408k_tp8", **common, **SEVEN_B, **MEMO, seq=1441792, status="error",
              error="boom", **{"parallel.tp": 8})
    write_run(d, "7b_selective_64k", **common, **SEVEN_B, seq=65536, status="error", error="boom",
              **{"method.name": "megatron_selective"})
    return d


# ---------------------------------------------------------------- rows


def test_load_results_reads_every_run_recursively(sweep):
    df = load_results(sweep)
    assert len(df) == 7 + 8 + 6 + 3
    assert df["result_path"].str.endswith("result.json").all()


def test_no_result_is_a_one_line_error_naming_the_directories(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as error:
        load_results(tmp_path / "empty", tmp_path / "missing")
    message = str(error.value)
    assert "\n" not in message
    assert str(tmp_path / "empty") in message and f"{tmp_path / 'missing'} not a directory" in message


def test_a_corrupt_result_is_a_one_line_error_naming_the_file(tmp_path):
    write_run(tmp_path, "good")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "result.json").write_text('{"status": "ok",\n')
    with pytest.raises(ValueError, match=r"bad/result.json: not valid JSON") as error:
        load_results(tmp_path)
    assert "\n" not in str(error.value)
    (tmp_path / "bad" / "result.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad/result.json: not a JSON object"):
        load_results(tmp_path)


def test_a_corrupt_step_line_names_file_and_line(tmp_path):
    run = write_run(tmp_path, "run", steps=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo\n')
    with pytest.raises(ValueError, match=r"run/metrics.jsonl:3: not valid JSON") as error:
        load_steps(tmp_path)
    assert "\n" not in str(error.value)


def test_derived_columns(tmp_path):
    write_run(tmp_path, "old", seq=2048, world_size=4)  # no experiment, no plan column
    write_run(tmp_path, "fixed", **MEMO, alpha="0.125", plan=True)
    write_run(tmp_path, "solved", **MEMO, alpha="auto", **{"swap.alpha": 0.375})
    write_run(tmp_path, "swap", alpha="auto", **{"method.name": "full_swap", "swap.alpha": 1.0})
    df = rows.add_derived(load_results(tmp_path)).set_index(
        load_results(tmp_path)["result_path"].str.split("/").str[-2])
    assert df.loc["old", "experiment"] == "end_to_end"
    assert df.loc["old", "variant"] == "none" and not df.loc["old", "plan"]
    assert df.loc["old", "gpus"] == 4 and df.loc["old", "seq"] == 2048
    assert math.isnan(df.loc["old", "alpha_used"])
    assert df.loc["fixed", "variant"] == "memo+plan" and df.loc["fixed", "alpha_used"] == 0.125
    assert df.loc["solved", "alpha_used"] == 0.375
    assert df.loc["swap", "variant"] == "full_swap" and df.loc["swap", "alpha_used"] == 1.0


def test_repeats_keep_an_ok_run_then_the_latest(tmp_path):
    write_run(tmp_path, "a", mfu=0.1, end_time="2026-11-21T10:00:00+00:00")
    write_run(tmp_path, "b", mfu=0.2, end_time="2026-11-21T11:00:00+00:00")
    write_run(tmp_path, "c", status="oom", end_time="2026-11-21T12:00:00+00:00")
    write_run(tmp_path, "other_seq", seq=2048, status="oom")  # another configuration
    kept = rows.latest_runs(load_results(tmp_path))
    assert sorted(kept["result_path"].str.split("/").str[-2]) == ["b", "other_seq"]


def test_training_runs_keep_predictions_apart_and_leave_out_other_modes(tmp_path):
    write_run(tmp_path, "train")
    write_run(tmp_path, "older", mode=None)
    write_run(tmp_path, "plan", mode="plan", mfu=None)
    write_run(tmp_path, "fit", mode="fit", mfu=None, predicted_mfu=0.25, predicted_device_bytes=2**33)
    kept = rows.training_runs(load_results(tmp_path))
    names = kept["result_path"].str.split("/").str[-2]
    assert sorted(names) == ["fit", "older", "train"]
    fit = kept[names == "fit"].iloc[0]
    # A prediction stands in the measured columns, under a variant of its own.
    assert fit["mfu"] == 0.25 and fit["variant"].endswith(" (predicted)")
    assert not kept.loc[names != "fit", "variant"].str.contains("predicted").any()


def test_steps_carry_their_run(sweep):
    steps = load_steps(sweep)
    assert len(steps) == 8 * 4 + 3 * 6  # ablation and convergence runs log steps
    run = steps[steps["run_dir"].str.endswith("abl_memo_True_2048")]
    assert list(run["step"]) == [1, 2, 3, 4]
    assert list(run["timed"]) == [False, True, True, True]
    assert set(run["variant"]) == {"memo+plan"} and set(run["seq"]) == {2048}
    assert set(run["experiment"]) == {"ablation_cpu_smoke"}


def test_groups_by_experiment_and_family(sweep, tmp_path):
    df = load_results(sweep)
    assert list(rows.experiment_groups(df, "ablation")) == ["ablation_cpu_smoke"]
    assert len(rows.experiment_groups(df)) == 4
    assert rows.experiment_family("alpha_sweep_cpu_smoke") == "alpha_sweep"


def test_results_dirs_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMO_RESULTS", f"{tmp_path / 'a'},{tmp_path / 'b'}:relative")
    assert rows.dirs_from_env() == [tmp_path / "a", tmp_path / "b", rows.REPO / "relative"]
    monkeypatch.delenv("MEMO_RESULTS")
    assert rows.dirs_from_env() == [rows.REPO / "multirun"]


# ---------------------------------------------------------------- tables


def test_seq_labels_and_formats():
    assert [tables.seq_label(s) for s in (1024, 4096, 65536, 1441792, 1536)] == [
        "1K", "4K", "64K", "1408K", "1.5K"]
    assert tables.format_value("mfu", 0.4567) == "45.7%"
    assert tables.format_value("peak_allocated_bytes", 3 * 2**30) == "3.00 GiB"
    assert tables.format_value("swap.host_bytes", 3 * 2**20) == "3.0 MiB"
    assert tables.format_value("iter_time_s", 12.345) == "12.35 s"
    assert tables.format_value("tgs", float("nan")) == ""


def test_end_to_end_table_numbers(end_to_end):
    table = tables.end_to_end_table(load_results(end_to_end))
    assert list(table.columns) == [65536, 131072, 1441792]
    assert list(table.index) == [  # models by size, variants in order, then by name
        ("7b", 8, "memo"), ("7b", 8, "megatron_selective"), ("7b", 8, "none"), ("13b", 8, "memo")]
    assert table.loc[("7b", 8, "memo")].tolist()[:2] == [0.55, 0.6]  # the better layout of 64K
    assert math.isnan(table.loc[("7b", 8, "memo"), 1441792])
    assert math.isnan(table.loc[("7b", 8, "none"), 131072])


def test_end_to_end_table_display_says_why_a_cell_failed(end_to_end):
    table = tables.end_to_end_table(load_results(end_to_end), display=True)
    assert list(table.columns) == ["64K", "128K", "1408K"]
    assert table.loc[("7b", 8, "memo")].tolist() == ["55.0%", "60.0%", "OOHM"]  # OOHM beats ERR
    assert table.loc[("7b", 8, "none")].tolist() == ["40.0%", "OOM", ""]
    assert table.loc[("7b", 8, "megatron_selective"), "64K"] == "ERR"
    tgs = tables.end_to_end_table(load_results(end_to_end), "tgs", display=True)
    assert tgs.loc[("7b", 8, "memo"), "64K"] == "550"


def test_longest_sequence(end_to_end):
    table = tables.longest_sequence(load_results(end_to_end))
    memo = table.loc[("7b", 8, "memo")]
    assert (memo["seq"], memo["mfu"], memo["tgs"]) == (131072, 0.6, 300.0)
    assert table.loc[("7b", 8, "none"), "seq"] == 65536
    assert pd.isna(table.loc[("7b", 8, "megatron_selective"), "seq"])  # never ran ok
    shown = tables.longest_sequence(load_results(end_to_end), display=True)
    assert shown.loc[("7b", 8, "memo")].tolist() == ["128K", "60.0%", "300", "1.25 s", "tp1 cp1 pp1 dp1"]
    assert shown.loc[("7b", 8, "megatron_selective"), "seq"] == ""


def test_ablation_table_orders_variants_and_adds_memory_columns(tmp_path):
    for name, method, plan in (("z", "megatron_selective", False), ("m", "memo", True),
                               ("s", "full_swap", True), ("f", "full_recompute", False),
                               ("fp", "full_recompute", True)):
        write_run(tmp_path, name, seq=1024, plan=plan, mfu=0.4, peak_allocated_bytes=2**31,
                  alloc_retries=3 if method == "memo" else 0, **{"method.name": method})
    write_run(tmp_path, "m2k", seq=2048, plan=True, status="oom", **MEMO)
    table = tables.ablation_table(load_results(tmp_path))
    assert list(table.index.get_level_values("variant").unique()) == [
        "full_recompute", "full_recompute+plan", "full_swap+plan", "memo+plan", "megatron_selective"]
    assert list(table.index.get_level_values("metric").unique()) == [
        "mfu", "peak_allocated_bytes", "peak_rss_bytes", "alloc_retries"]
    assert table.loc[("alloc_retries", "memo+plan"), 1024] == 3
    shown = tables.ablation_table(load_results(tmp_path), display=True)
    assert shown.loc[("peak_allocated_bytes", "memo+plan")].tolist() == ["2.00 GiB", "OOM"]


def test_alpha_sweep_table_marks_the_best_alpha(sweep):
    runs = rows.experiment_groups(load_results(sweep))["alpha_sweep_cpu_smoke"]
    table = tables.alpha_sweep_table(runs)
    assert table.loc[("iter_time_s", 0.0), 2048] == 3.0
    assert table.loc[("mfu", 0.5), 1024] == 0.5
    assert tables.best_alpha(runs).to_dict() == {1024: 0.5, 2048: 0.5}
    shown = tables.alpha_sweep_table(runs, display=True)
    assert shown.loc[("iter_time_s", 0.5)].tolist() == ["1.00 s*", "2.00 s*"]
    assert shown.loc[("mfu", 1.0)].tolist() == ["33.3%", "33.3%"]


def test_best_alpha_ties_go_to_the_smaller_alpha(tmp_path):
    for alpha, time in (("0.25", 2.0), ("0.75", 2.0), ("1", 3.0)):
        write_run(tmp_path, alpha, alpha=alpha, iter_time_s=time, **MEMO)
    assert tables.best_alpha(load_results(tmp_path)).to_dict() == {1024: 0.25}


# ---------------------------------------------------------------- figures


def test_metric_vs_seq_draws_one_line_per_variant_per_panel(end_to_end):
    fig = figures.metric_vs_seq(load_results(end_to_end), "mfu")
    seven, thirteen = fig.axes
    assert seven.get_title() == "7b, 8 devices" and thirteen.get_title() == "13b, 8 devices"
    assert [line.get_label() for line in seven.lines] == ["memo", "none"]
    assert seven.lines[0].get_xdata().tolist() == [65536, 131072]
    assert np.allclose(seven.lines[0].get_ydata(), [55.0, 60.0])
    assert seven.get_ylabel() == "MFU (%)" and seven.get_xlabel() == "sequence length (tokens)"
    tgs = figures.metric_vs_seq(load_results(end_to_end), "tgs").axes[0]
    assert tgs.lines[1].get_ydata().tolist() == [400.0]


def test_alpha_sweep_figure(sweep):
    runs = rows.experiment_groups(load_results(sweep))["alpha_sweep_cpu_smoke"]
    time_ax, mfu_ax = figures.alpha_sweep(runs).axes
    assert [line.get_label() for line in time_ax.lines] == ["1K", "2K"]
    assert time_ax.lines[1].get_xdata().tolist() == [0.0, 0.5, 1.0]
    assert time_ax.lines[1].get_ydata().tolist() == [3.0, 2.0, 3.0]
    assert np.allclose(mfu_ax.lines[0].get_ydata(), [100 / 3, 50, 100 / 3])


def test_loss_curves_label_runs_by_variant_and_alpha(sweep):
    steps = rows.steps_of(load_steps(sweep), load_results(sweep))
    convergence = steps[steps["experiment"] == "convergence_cpu_smoke"]
    (ax,) = figures.loss_curves(convergence).axes
    assert [line.get_label() for line in ax.lines] == [
        "memo α=0", "memo α=1", "megatron_full_recompute"]
    assert ax.lines[0].get_xdata().tolist() == [1, 2, 3, 4, 5, 6]
    assert np.allclose(ax.lines[0].get_ydata(), [10.9, 10.8, 10.7, 10.6, 10.5, 10.4])


def test_loss_curves_draw_a_runs_validation_beside_its_training(sweep):
    steps = rows.steps_of(load_steps(sweep), load_results(sweep))
    convergence = steps[steps["experiment"] == "convergence_cpu_smoke"].copy()
    alpha_0 = convergence["run_dir"].str.endswith("conv_memo_0") & convergence["step"].isin([3, 6])
    convergence.loc[alpha_0, "valid_loss"] = [10.8, 10.6]  # validated every third step
    (ax,) = figures.loss_curves(convergence).axes
    assert [line.get_label() for line in ax.lines] == [
        "memo α=0", "memo α=0 (validation)", "memo α=1", "megatron_full_recompute"]
    validation = ax.lines[1]
    assert validation.get_xdata().tolist() == [3, 6] and validation.get_ydata().tolist() == [10.8, 10.6]
    assert validation.get_color() == ax.lines[0].get_color() and validation.get_linestyle() == "--"


def test_step_times_mark_the_warm_up(sweep):
    steps = load_steps(sweep)
    ablation = steps[steps["experiment"] == "ablation_cpu_smoke"]
    one_k, two_k = figures.step_times(ablation).axes
    assert one_k.get_title() == "sequence 1K" and len(one_k.lines) == 4
    assert one_k.lines[0].get_ydata().tolist() == [2.0, 1.0, 1.0, 1.0]
    warmups = [c.get_offsets().tolist() for c in two_k.collections if len(c.get_offsets())]
    assert warmups == [[[1.0, 3.0]]] * 4
    assert "warm-up (not timed)" in [t.get_text() for t in two_k.get_legend().get_texts()]


def test_figures_refuse_empty_input(tmp_path):
    write_run(tmp_path, "oom", status="oom")
    df = load_results(tmp_path)
    with pytest.raises(ValueError, match="nothing to plot"):
        figures.metric_vs_seq(df, "mfu")
    with pytest.raises(ValueError, match="nothing to plot"):
        figures.alpha_sweep(df)
    with pytest.raises(ValueError, match="nothing to plot"):
        figures.loss_curves(load_steps(tmp_path))
    with pytest.raises(ValueError, match="nothing to plot"):
        figures.step_times(load_steps(tmp_path))


# ---------------------------------------------------------------- report


def _files(directory):
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_report_writes_tables_and_figures(sweep, capsys):
    before = _files(sweep)
    assert report.main([str(sweep)]) == 0
    out = sweep / "report"
    names = {p.name for p in out.iterdir()}
    stems = ["ablation_cpu_smoke", "alpha_sweep_cpu_smoke", "convergence_cpu_smoke_validation",
             "end_to_end_cpu_smoke_mfu",
             "end_to_end_cpu_smoke_tgs", "end_to_end_cpu_smoke_longest_sequence"]
    figs = ["ablation_cpu_smoke_mfu_vs_seq", "ablation_cpu_smoke_tgs_vs_seq",
            "ablation_cpu_smoke_step_time", "alpha_sweep_cpu_smoke_alpha",
            "convergence_cpu_smoke_loss", "convergence_cpu_smoke_step_time",
            "end_to_end_cpu_smoke_mfu_vs_seq", "end_to_end_cpu_smoke_tgs_vs_seq"]
    assert names == {f"{s}.{e}" for s in stems for e in ("csv", "md")} | {
        f"{f}.{e}" for f in figs for e in ("png", "svg")}
    assert all((out / n).stat().st_size > 0 for n in names)
    assert imread(out / "convergence_cpu_smoke_loss.png").shape[2] in (3, 4)
    assert (out / "ablation_cpu_smoke_mfu_vs_seq.svg").read_text().lstrip().startswith("<?xml")
    validation = pd.read_csv(out / "convergence_cpu_smoke_validation.csv", index_col=[0, 1, 2])
    # the two memo runs that validated (by hand: 6 - bucket, 1 less at α 1), not the one that did not
    assert list(validation.index) == [(1024, "memo", 0.0), (1024, "memo", 1.0)]
    assert list(validation.columns) == ["all", "0-25%", "25-50%", "50-75%", "75-100%"]
    assert validation.loc[(1024, "memo", 1.0)].tolist() == [3.5, 5.0, 4.0, 3.0, 2.0]
    assert "| 1K    | memo      |            1 |   3.5 |       5 |        4 |        3 |         2 |" in \
        (out / "convergence_cpu_smoke_validation.md").read_text()
    mfu = pd.read_csv(out / "end_to_end_cpu_smoke_mfu.csv", index_col=[0, 1, 2])
    assert mfu.loc[("tiny", 1, "memo"), "4096"] == pytest.approx(0.45)
    assert "| OOM  |" in (out / "end_to_end_cpu_smoke_mfu.md").read_text()
    assert (out / "end_to_end_cpu_smoke_mfu.md").read_text().endswith(
        "\nMFU against: cpu 0.12 TFLOP/s (measured)\n")
    printed = capsys.readouterr().out
    assert str(out / "ablation_cpu_smoke.csv") in printed
    assert "end_to_end_cpu_smoke: 7 runs (ok 6, oom 1)" in printed
    # A rerun replaces the report and nothing else; the run directories are untouched.
    assert report.main([str(sweep), "--format", "png"]) == 0
    after = _files(sweep)
    assert {p: b for p, b in after.items() if out not in p.parents} == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_report_command_line(sweep, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "analysis.report", str(sweep), "--out", str(out), "--format", "png"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "alpha_sweep_cpu_smoke_alpha.png").stat().st_size > 0
    assert not list(out.glob("*.svg"))


def test_report_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no result.json under" in err
    run = write_run(tmp_path / "sweep", "run")
    assert report.main([str(run)]) == 1  # DIR/report would be inside the run
    assert "inside the run directory" in capsys.readouterr().err
    assert not (run / "report").exists()
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "sweep"), "/"])
    assert "--out is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "sweep"), "--format", "gif"])


def test_report_of_several_sweeps_goes_where_they_meet(tmp_path, capsys):
    for stamp in ("2026-11-21_10-00-00", "2026-11-21_11-00-00"):
        write_run(tmp_path / "ablation" / stamp, "0", experiment="ablation")
    (tmp_path / "ablation" / "report").mkdir()  # as a shell's ablation/* finds it on a rerun
    dirs = sorted(str(p) for p in (tmp_path / "ablation").iterdir())
    assert report.main([*dirs, "--format", "png"]) == 0
    assert (tmp_path / "ablation" / "report" / "ablation.csv").exists()
    assert "ablation: 2 runs (ok 2)" in capsys.readouterr().out


def test_report_of_untagged_rows_is_end_to_end(tmp_path, capsys):
    write_run(tmp_path / "sweep", "a", seq=1024)
    write_run(tmp_path / "sweep", "b", seq=2048, status="oom")
    write_run(tmp_path / "sweep", "profile", mode="profile", mfu=None)
    write_run(tmp_path / "sweep", "plan", mode="plan", mfu=None, experiment="planning")
    assert report.main([str(tmp_path / "sweep"), "--format", "png"]) == 0
    printed = capsys.readouterr().out
    assert "end_to_end: 2 runs (ok 1, oom 1); 1 other rows (profile, plan)" in printed
    assert "planning: 0 runs; 1 other rows (profile, plan)" in printed
    names = sorted(p.name for p in (tmp_path / "sweep" / "report").iterdir())
    assert names == [
        "end_to_end_longest_sequence.csv", "end_to_end_longest_sequence.md", "end_to_end_mfu.csv",
        "end_to_end_mfu.md", "end_to_end_mfu_vs_seq.png", "end_to_end_tgs.csv", "end_to_end_tgs.md",
        "end_to_end_tgs_vs_seq.png"]


def test_anchors_set_our_longest_sequence_beside_the_peers_and_name_what_binds(tmp_path, capsys):
    GIB = tables.GIB
    sweep = tmp_path / "anchors"
    alst = {"experiment": "anchors", "mode": "fit", "model.name": "llama3_8b", "hardware.name": "h100",
            "anchor.peer": "ALST", "anchor.source": "arXiv:2506.13996 (abstract)", "predicted_reserved_bytes": 2 * GIB,
            "predicted_device_capacity_bytes": 80 * GIB, "predicted_mfu": 0.4, "predicted_tgs": 500.0,
            "predicted_iter_time_s": 100.0}
    eight = {**alst, "cluster.gpus": 8, "world_size": 8, "anchor.peer_tokens": 3_700_000}
    write_run(sweep, "0", **eight, **{"method.name": "memo", "seq": 983040, "status": "ok"})
    write_run(sweep, "1", **eight, **{"method.name": "megatron_full_recompute", "seq": 524288, "status": "ok"})
    # one GPU: 8B's weights, fp32 gradients and Adam's states alone exceed 80 GiB
    one = {**alst, "cluster.gpus": 1, "world_size": 1, "anchor.peer_tokens": 500_000, "seq": 65536,
           "predicted_weights_bytes": 15 * GIB, "predicted_gradients_bytes": 30 * GIB,
           "predicted_optimizer_bytes": 90 * GIB}
    write_run(sweep, "2", **one, **{"method.name": "memo", "status": "oom"})
    runs = rows.training_runs(load_results(sweep))
    table = tables.anchors_table(runs)
    cells = {(gpus, variant): row for (_, _, _, gpus, _, variant), row in table.iterrows()}
    memo8, megatron8 = cells[8, "memo (predicted)"], cells[8, "megatron_full_recompute (predicted)"]
    assert (memo8["seq"], megatron8["seq"]) == (983040, 524288)
    assert (memo8["of_peer"], megatron8["of_peer"]) == (round(983040 / 3_700_000, 3), round(524288 / 3_700_000, 3))
    assert memo8["binding"] == megatron8["binding"] == ""
    memo1 = cells[1, "memo (predicted)"]
    assert pd.isna(memo1["seq"]) and math.isnan(memo1["of_peer"])
    assert memo1["binding"] == "model states 135.0 GiB (optimizer 90.0) of 80 GiB"
    shown = tables.anchors_table(runs, display=True)
    assert sorted(shown["seq"]) == ["512K", "960K", "OOM"] and "0.27×" in set(shown["of_peer"])
    # the report writes it and prints it
    assert report.main([str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert "Longest sequence predicted to fit against the peers' published figures" in printed
    assert "| ALST" in printed and "model states 135.0 GiB" in printed


def test_the_frontier_sets_the_search_choices_beside_the_peer_per_setting_and_host(tmp_path, capsys):
    """One row per setting (host memory included: the same H200 with 2 TiB and with 128 GiB) and
    variant, with the layout, tiles and Adam's placement chosen; a host too small for Adam's states
    is named as what binds."""
    GIB = tables.GIB
    sweep = tmp_path / "frontier"
    h200 = {"experiment": "frontier", "mode": "fit", "model.name": "llama3_8b", "hardware.name": "h200",
            "cluster.gpus": 1, "world_size": 1, "method.name": "memo", "predicted_reserved_bytes": 2 * GIB,
            "predicted_device_capacity_bytes": 140 * GIB}
    write_run(sweep, "0", **h200, **{"hardware.host_memory_bytes": 2048 * GIB, "anchor.peer": "ALST",
                                     "anchor.peer_tokens": 1_200_000, "seq": 2097152, "status": "ok",
                                     "layout": "tp1 cp1 pp1 dp1", "predicted_tile_tokens": 8192,
                                     "train.optimizer_offload": "host"})
    write_run(sweep, "1", **h200, **{"hardware.host_memory_bytes": 128 * GIB, "seq": 65536, "status": "oohm",
                                     "predicted_reason": "out of host memory: Adam's states on the host take ..."})
    table = tables.frontier_table(rows.training_runs(load_results(sweep)))
    big, small = (table.xs(host, level="host_gib").iloc[0] for host in (2048, 128))
    assert (big["seq"], big["tile_tokens"], big["optimizer"], big["peer"]) == (2097152, 8192, "host", "ALST")
    assert big["of_peer"] == round(2097152 / 1_200_000, 3) and big["binding"] == ""
    assert pd.isna(small["seq"]) and small["binding"] == "host memory of Adam's states"
    shown = tables.frontier_table(rows.training_runs(load_results(sweep)), display=True)
    assert sorted(shown["seq"]) == ["2048K", "OOHM"] and "8K" in set(shown["tile_tokens"])
    assert report.main([str(sweep)]) == 0
    assert "placement of Adam's states chosen" in capsys.readouterr().out
