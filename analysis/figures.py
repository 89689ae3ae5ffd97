"""Figures of result rows (:mod:`analysis.rows`) as matplotlib Figures.

Figures are built without pyplot, so nothing is shown and no display is needed: ``savefig``
renders with Agg (PNG) or the SVG backend. Each function raises :class:`NothingToPlot` (a
``ValueError``) when its input has nothing to draw, rather than returning an empty figure.
"""

import math

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from analysis.tables import best_cells, ordered_keys, seq_label, variant_order

PANEL_SIZE = (4.8, 3.6)  # inches
MAX_COLUMNS = 4  # panels per row

# Axis label and the factor from the rows' unit to the plotted one.
AXES = {
    "mfu": ("MFU (%)", 100.0),
    "tgs": ("TGS (tokens / device / s)", 1.0),
    "iter_time_s": ("iteration time (s)", 1.0),
    "loss": ("loss", 1.0),
}
SEQ_AXIS = "sequence length (tokens)"


class NothingToPlot(ValueError):
    """The rows given to a figure hold no value it could draw."""


def metric_vs_seq(df: pd.DataFrame, metric: str = "mfu") -> Figure:
    """``metric`` (``mfu`` or ``tgs``) against sequence length, one line per variant and one
    panel per (model, number of devices); only runs that finished ``ok`` are drawn."""
    keys = ["model.name", "gpus", "variant"]
    cells = best_cells(df, keys + ["seq"])
    ok = cells[(cells["status"] == "ok") & cells[metric].notna()] if metric in cells else cells[:0]
    if ok.empty:
        raise NothingToPlot(f"no run finished ok with a value of {metric!r}: nothing to plot")
    label, scale = AXES[metric]
    panels = ordered_keys(ok, ["model.name", "gpus"])
    fig, axes = _panels(len(panels))
    for ax, (model, gpus) in zip(axes, panels):
        panel = ok[(ok["model.name"] == model) & (ok["gpus"] == gpus)]
        for variant in variant_order(panel["variant"]):
            line = panel[panel["variant"] == variant].sort_values("seq")
            ax.plot(line["seq"].to_numpy(), line[metric].to_numpy(float) * scale, marker="o",
                    label=variant)
        _seq_axis(ax)
        ax.set(title=f"{model}, {gpus} device{'s' if gpus != 1 else ''}", ylabel=label)
        ax.legend(fontsize="small")
    return fig


def alpha_sweep(df: pd.DataFrame) -> Figure:
    """Iteration time and MFU against α (the fraction of tokens swapped), one line per
    sequence length; only runs that finished ``ok`` with a numeric α are drawn."""
    cells = best_cells(df, ["alpha_used", "seq"])
    ok = cells[(cells["status"] == "ok") & cells["alpha_used"].notna()]
    if ok.empty:
        raise NothingToPlot("no run finished ok with a numeric alpha: nothing to plot")
    fig, (time_ax, mfu_ax) = _panels(2)
    for seq in sorted(ok["seq"].unique()):
        line = ok[ok["seq"] == seq].sort_values("alpha_used")
        for ax, metric in ((time_ax, "iter_time_s"), (mfu_ax, "mfu")):
            label, scale = AXES[metric]
            ax.plot(line["alpha_used"].to_numpy(float), line[metric].to_numpy(float) * scale,
                    marker="o", label=seq_label(seq))
            ax.set(xlabel="α (fraction of tokens swapped)", ylabel=label)
    time_ax.legend(title="sequence", fontsize="small")
    return fig


def loss_curves(steps: pd.DataFrame) -> Figure:
    """Loss against step, one line per run (rows of :func:`analysis.rows.read_steps`) labelled
    by variant and α, one panel per sequence length; a run that validated (``train.eval_interval``)
    has its validation losses as dashed points of the same colour."""
    steps = _steps_with(steps, "loss")
    fig, panels = _step_panels(steps, "loss")
    for seq, label, run in _runs(steps):
        (line,) = panels[seq].plot(run["step"].to_numpy(), run["loss"].to_numpy(float), label=label)
        validated = run[run["valid_loss"].notna()] if "valid_loss" in run else run.iloc[:0]
        if not validated.empty:
            panels[seq].plot(validated["step"].to_numpy(), validated["valid_loss"].to_numpy(float), marker="o",
                             linestyle="--", color=line.get_color(), label=f"{label} (validation)")
    for ax in panels.values():
        ax.legend(fontsize="small")
    return fig


def step_times(steps: pd.DataFrame) -> Figure:
    """Iteration time against step, one line per run (rows of :func:`analysis.rows.read_steps`),
    one panel per sequence length; warm-up steps, left out of the timing metrics, are drawn as
    open circles."""
    steps = _steps_with(steps, "iter_time_s")
    fig, panels = _step_panels(steps, "iter_time_s")
    for seq, label, run in _runs(steps):
        ax = panels[seq]
        (line,) = ax.plot(run["step"].to_numpy(), run["iter_time_s"].to_numpy(float), label=label)
        warmup = run[run["timed"].eq(False)] if "timed" in run else run[:0]
        ax.scatter(warmup["step"].to_numpy(), warmup["iter_time_s"].to_numpy(float),
                   facecolors="none", edgecolors=line.get_color())
    for ax in panels.values():
        if any(len(points.get_offsets()) for points in ax.collections):
            ax.scatter([], [], facecolors="none", edgecolors="grey", label="warm-up (not timed)")
        ax.legend(fontsize="small")
    return fig


def _panels(n: int):
    columns = min(n, MAX_COLUMNS)
    rows = math.ceil(n / columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _seq_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda tokens, _: seq_label(tokens)))
    ax.set_xlabel(SEQ_AXIS)


def _steps_with(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    if column not in steps or steps[column].notna().sum() == 0:
        raise NothingToPlot(f"no step has a value of {column!r}: nothing to plot")
    return steps[steps[column].notna()]


def _step_panels(steps: pd.DataFrame, metric: str):
    """A figure with one panel per sequence length, as {seq: Axes}."""
    seqs = sorted(steps["seq"].unique())
    fig, axes = _panels(len(seqs))
    for ax, seq in zip(axes, seqs):
        ax.set(title=f"sequence {seq_label(seq)}", xlabel="step", ylabel=AXES[metric][0])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, dict(zip(seqs, axes))


def _runs(steps: pd.DataFrame):
    """(seq, label, steps) per run, ordered by variant, α and model."""
    runs = steps.drop_duplicates("run_dir")
    several_models = runs["model.name"].nunique(dropna=False) > 1
    rank = {v: i for i, v in enumerate(variant_order(runs["variant"]))}
    runs = runs.assign(rank=runs["variant"].map(rank))
    for _, run in runs.sort_values(["rank", "alpha_used", "model.name", "run_dir"]).iterrows():
        label = run["variant"]
        if pd.notna(run["alpha_used"]):
            label += f" α={run['alpha_used']:g}"
        if several_models:
            label += f" {run['model.name']}"
        yield run["seq"], label, steps[steps["run_dir"] == run["run_dir"]].sort_values("step")
