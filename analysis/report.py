"""Tables and figures of one or more sweeps, written as files.

    python -m analysis.report DIR [DIR ...] [--out OUT] [--format png,svg]

For each experiment found in the rows (the ``experiment`` column; rows without one count as
``end_to_end``) it writes, into OUT, what that experiment measures:

* ``end_to_end``, ``scalability`` and any other: ``<name>_mfu``, ``<name>_tgs`` and
  ``<name>_longest_sequence`` tables, ``<name>_mfu_vs_seq`` and ``<name>_tgs_vs_seq`` figures;
* ``ablation``: the ``<name>`` table, the MFU and TGS figures and ``<name>_step_time``;
* ``alpha_sweep``: the ``<name>`` table and the ``<name>_alpha`` figure;
* ``convergence``: the ``<name>_validation`` table (where the runs validated), ``<name>_loss``
  and ``<name>_step_time`` figures;
* ``anchors``: the ``<name>`` table, our longest sequence next to each peer's published one.

An experiment's ``_cpu_smoke`` version gets the same. Each table is written as CSV
(numbers in the rows' units: tokens, bytes, seconds, MFU as a fraction) and as Markdown (for
reading: failed cells say OOM, OOHM or ERR); each figure in every ``--format``. Products without
rows to show are left out.

OUT defaults to ``DIR/report`` for one sweep directory, and for several to ``report`` in the
directory they share (``multirun/ablation/*`` reports into ``multirun/ablation/report``). The
report's own files are replaced on a rerun (they are derived); nothing else is written or removed,
and OUT may not be, or be inside, a run's directory.
"""

import argparse
import io
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis import figures, rows, tables
from memo.results import replace_file_atomic

FORMATS = ("png", "svg", "pdf")

# A table is made from the runs of one experiment, numeric or for display:
# (runs, display) -> DataFrame. A figure from its runs and their steps: (runs, steps) -> Figure.
Table = Callable[[pd.DataFrame, bool], pd.DataFrame]
Plot = Callable[[pd.DataFrame, pd.DataFrame], Figure]

END_TO_END_TABLES: dict[str, tuple[str, Table]] = {
    "_mfu": ("MFU by model, devices, variant and sequence length",
             lambda runs, display: tables.end_to_end_table(runs, "mfu", display)),
    "_tgs": ("TGS (tokens / device / s) by model, devices, variant and sequence length",
             lambda runs, display: tables.end_to_end_table(runs, "tgs", display)),
    "_longest_sequence": ("Longest sequence that ran ok, with its MFU, TGS and iteration time",
                          tables.longest_sequence),
}
TABLES: dict[str, dict[str, tuple[str, Table]]] = {
    "ablation": {"": ("MFU, memory and allocator retries by variant and sequence length",
                      tables.ablation_table)},
    "alpha_sweep": {"": ("Iteration time and MFU by α and sequence length (* the best α)",
                         tables.alpha_sweep_table)},
    "convergence": {"_validation": ("Validation loss (nats per token) at the last validation, whole and by "
                                    "span of positions in the sequence", tables.validation_table)},
    "anchors": {"": ("Longest sequence predicted to fit against the peers' published figures (tokens; "
                     "where nothing fits, the term that binds)", tables.anchors_table)},
    "frontier": {"": ("Longest sequence predicted to fit per setting and method, with the layout, tiles and "
                      "placement of Adam's states chosen, beside the peers' published figures",
                      tables.frontier_table)},
}
SEQ_FIGURES: dict[str, Plot] = {
    "_mfu_vs_seq": lambda runs, steps: figures.metric_vs_seq(runs, "mfu"),
    "_tgs_vs_seq": lambda runs, steps: figures.metric_vs_seq(runs, "tgs"),
}
FIGURES: dict[str, dict[str, Plot]] = {
    "anchors": {},
    "frontier": {},
    "ablation": {**SEQ_FIGURES, "_step_time": lambda runs, steps: figures.step_times(steps)},
    "alpha_sweep": {"_alpha": lambda runs, steps: figures.alpha_sweep(runs)},
    "convergence": {
        "_loss": lambda runs, steps: figures.loss_curves(steps),
        "_step_time": lambda runs, steps: figures.step_times(steps),
    },
}


def write_report(results: pd.DataFrame, steps: pd.DataFrame, out: Path,
                 formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Write the tables and figures of ``results`` (:func:`analysis.rows.load_results`) and their
    ``steps`` (:func:`analysis.rows.read_steps`) into ``out``; returns the paths written.

    Raises:
        ValueError: if ``out`` is, or is inside, the directory of one of the runs.
    """
    _check_outside_runs(Path(out), results["result_path"])
    Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    for name, group in rows.experiment_groups(results).items():
        runs = rows.training_runs(group)
        if runs.empty:
            continue
        run_steps = rows.steps_of(steps, runs)
        family = rows.experiment_family(name)
        for suffix, (caption, table) in TABLES.get(family, END_TO_END_TABLES).items():
            numbers = table(runs, False)
            if numbers.empty:
                continue
            stem = Path(out) / f"{name}{suffix}"
            written.append(_write_text(stem.with_suffix(".csv"), numbers.to_csv()))
            markdown = table(runs, True).reset_index().to_markdown(index=False)
            basis = mfu_basis(runs)
            written.append(_write_text(stem.with_suffix(".md"),
                                       f"{caption}\n\n{markdown}\n" + (f"\n{basis}\n" if basis else "")))
        for suffix, plot in FIGURES.get(family, SEQ_FIGURES).items():
            try:
                figure = plot(runs, run_steps)
            except figures.NothingToPlot:
                continue
            for fmt in formats:
                written.append(_write_figure(Path(out) / f"{name}{suffix}.{fmt}", figure, fmt))
    return written


def mfu_basis(runs: pd.DataFrame) -> str:
    """The peak FLOP/s MFU was computed against, per hardware, and where each came from
    (``table``, ``config``, or ``measured`` on a CPU: the best matrix multiply the machine has
    shown), e.g. ``MFU against: cpu 0.12 TFLOP/s (measured)``; empty without such columns."""
    columns = ["hardware.name", "hardware.peak_flops", "hardware.peak_flops_source"]
    if not set(columns) <= set(runs.columns):
        return ""
    peaks = runs[columns].dropna(subset=["hardware.peak_flops"]).drop_duplicates()
    parts = [f"{name} {peak / 1e12:.3g} TFLOP/s ({source})"
             for name, peak, source in peaks.sort_values(columns[:2]).itertuples(index=False)]
    return "MFU against: " + "; ".join(parts) if parts else ""


def summary(results: pd.DataFrame) -> str:
    """One line per experiment: its runs by status (repeats included), e.g.
    ``ablation: 12 runs (ok 10, oom 2)``; predictions (mode=fit) count as runs, profile and plan
    rows are counted apart."""
    lines = []
    for name, group in rows.experiment_groups(results).items():
        training = rows.is_training(group) | rows.is_prediction(group)
        counts = Counter(group.loc[training, "status"].fillna("none"))
        order = sorted(counts, key=lambda s: (tables.STATUS_RANK.get(s, len(tables.STATUS_RANK)), s))
        by_status = ", ".join(f"{status} {counts[status]}" for status in order)
        parts = [f"{training.sum()} runs" + (f" ({by_status})" if counts else "")]
        if (~training).any():
            parts.append(f"{(~training).sum()} other rows (profile, plan)")
        lines.append(f"{name}: {'; '.join(parts)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep directories (searched recursively)")
    parser.add_argument("--out", type=Path, help="report directory (default: DIR/report, or "
                        "report in the directory several DIRs share)")
    parser.add_argument("--format", default="png,svg", help=f"figure formats, of {','.join(FORMATS)}")
    args = parser.parse_args(argv)
    formats = [f for f in args.format.split(",") if f]
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--format {args.format}: give formats among {','.join(FORMATS)}")
    out = args.out or default_out(args.dirs)
    if out is None:
        parser.error("--out is required: the sweep directories share no directory but the root")
    try:
        results = rows.load_results(*args.dirs)
        written = write_report(results, rows.read_steps(results), out, formats)
        for path in written:
            print(path)
    except ValueError as error:
        print(f"analysis.report: {error}", file=sys.stderr)
        return 1
    print(summary(results))
    for path in written:  # the comparison with published figures is read at once, not opened
        if rows.experiment_family(path.stem) in ("anchors", "frontier") and path.suffix == ".md":
            print(f"\n{path.read_text()}")
    return 0


def default_out(dirs: Sequence[Path]) -> Path | None:
    """``DIR/report`` for one directory; for several, ``report`` in the deepest directory they
    share (None if that is the file system's root)."""
    if len(dirs) == 1:
        return Path(dirs[0]) / "report"
    shared = Path(os.path.commonpath([Path(d).resolve() for d in dirs]))
    return None if shared == shared.parent else shared / "report"


def _check_outside_runs(out: Path, result_paths: pd.Series) -> None:
    out = out.resolve()
    for run_dir in {Path(p).parent.resolve() for p in result_paths}:
        if out == run_dir or run_dir in out.parents:
            raise ValueError(f"{out} is inside the run directory {run_dir}; give --out elsewhere")


def _write_text(path: Path, text: str) -> Path:
    replace_file_atomic(path, text.encode())
    return path


def _write_figure(path: Path, figure: Figure, fmt: str) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt)
    replace_file_atomic(path, buffer.getvalue())
    return path


if __name__ == "__main__":
    sys.exit(main())
