"""Load the rows that runs leave (``result.json``, ``metrics.jsonl``) into pandas DataFrames.

Units are those of the rows: ``seq`` in tokens, memory in bytes, times in seconds, ``mfu`` a
fraction, ``tgs`` tokens per device per second. Derived columns (:func:`add_derived`):

* ``variant``: ``method.name``, with ``+plan`` appended when the memory plan was on, and
  `` (tiled loss)`` or `` (megatron loss)`` when the run's loss (``train.loss``) is not its
  method's own (``method.loss``): the Megatron baselines also run with memo's loss;
* ``alpha_used``: the fraction of tokens swapped, as used (``swap.alpha``) or else as requested
  (``alpha`` when a number; NaN for ``auto`` or no α);
* ``gpus``: the number of devices (``world_size``).
"""

import json
import os
from pathlib import Path

import pandas as pd

from memo.results import METRICS_FILE, read_rows

REPO = Path(__file__).resolve().parents[1]

# Rows without an ``experiment`` (older rows, plain sweeps) are read as this one: its tables fit
# any sweep of methods over sequence lengths.
UNTAGGED = "end_to_end"
PREDICTED_SUFFIX = " (predicted)"  # appended to the variant of mode=fit rows
SMOKE_SUFFIX = "_cpu_smoke"

# What makes two runs the same configuration: these columns and every column of the config
# groups below. Anything else (metrics, times, host, commit) may differ between repeats.
CONFIG_COLUMNS = ("experiment", "mode", "hardware.name", "hardware.host_memory_gib", "seq", "alpha", "plan", "world_size")
CONFIG_PREFIXES = ("model.", "method.", "parallel.", "train.")

# Columns of a run repeated on each of its steps in :func:`read_steps`.
RUN_COLUMNS = (
    "result_path", "run_dir", "experiment", "model.name", "method.name", "plan", "variant",
    "alpha", "swap.alpha", "alpha_used", "seq", "world_size", "gpus", "status",
)


def load_results(*dirs: str | Path) -> pd.DataFrame:
    """One row per run found under ``dirs`` (searched recursively), with a ``result_path`` column.

    Columns are the rows' dotted keys (``model.name``, ``seq``, ``method.name``, ``status``,
    ``mfu``, ...); runs without a result yet are absent.

    Raises:
        ValueError: if no ``result.json`` is found, or one is not a JSON object.
    """
    return pd.DataFrame(read_rows(*dirs))


def load_steps(*dirs: str | Path) -> pd.DataFrame:
    """One row per training step of every run under ``dirs`` that has a result: the steps
    (:func:`read_steps`) of :func:`load_results`.

    Raises:
        ValueError: as :func:`load_results` and :func:`read_steps`.
    """
    return read_steps(load_results(*dirs))


def read_steps(results: pd.DataFrame) -> pd.DataFrame:
    """One row per training step of the runs ``results`` (:func:`load_results`) lists.

    Each row has the step's record from ``metrics.jsonl`` (``step``, ``loss``, ``iter_time_s``,
    ``timed``, ...) and its run's :data:`RUN_COLUMNS`; ``run_dir`` identifies the run. Runs that
    logged no step (failed before it, or profiling modes) contribute nothing.

    Raises:
        ValueError: for a line of ``metrics.jsonl`` that is not a JSON object.
    """
    runs = add_derived(results)
    runs["run_dir"] = runs["result_path"].map(lambda p: str(Path(p).parent))
    frames = []
    for run in runs[list(RUN_COLUMNS)].to_dict("records"):
        path = Path(run["run_dir"]) / METRICS_FILE
        if path.exists():
            steps = [_parse_line(path, number, line) for number, line in _lines(path)]
            frames.append(pd.DataFrame([{**run, **step} for step in steps]))
    if not frames:
        return pd.DataFrame(columns=[*RUN_COLUMNS, "step"])
    return pd.concat(frames, ignore_index=True)


def _loss_suffix(df: pd.DataFrame) -> pd.Series:
    """`` (<loss> loss)`` where a run's loss is not its method's default, else empty."""
    if "train.loss" not in df or "method.loss" not in df:
        return pd.Series("", index=df.index)
    used, default = df["train.loss"], df["method.loss"]
    other = used.notna() & default.notna() & (used != "auto") & (used != default)
    return other.map({True: " (", False: ""}) + used.where(other, "").astype(str) \
        + other.map({True: " loss)", False: ""})


def add_derived(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` with ``experiment`` and ``plan`` filled in and the derived columns added."""
    df = df.copy()
    for column in ("experiment", "model.name", "method.name", "alpha", "swap.alpha", "seq",
                   "world_size", "status", "mode", "end_time"):
        if column not in df:
            df[column] = None
    df["experiment"] = df["experiment"].where(df["experiment"].notna(), UNTAGGED)
    df["plan"] = df["plan"].fillna(False).astype(bool) if "plan" in df else False
    method = df["method.name"].fillna("unknown").astype(str)
    predicted = is_prediction(df)
    df["variant"] = method + df["plan"].map({True: "+plan", False: ""}) + _loss_suffix(df) \
        + predicted.map({True: PREDICTED_SUFFIX, False: ""})
    # A prediction's figures stand where a measurement's would, so tables treat both alike.
    for metric in ("mfu", "tgs", "iter_time_s"):
        guess = f"predicted_{metric}"
        if guess in df:
            measured = df[metric] if metric in df else pd.Series(None, index=df.index, dtype=float)
            df[metric] = measured.where(~predicted, df[guess])
    if all(f"parallel.{k}" in df for k in ("tp", "cp", "pp", "dp")):
        df["layout"] = ("tp" + df["parallel.tp"].astype(str) + " cp" + df["parallel.cp"].astype(str)
                        + " pp" + df["parallel.pp"].astype(str) + " dp" + df["parallel.dp"].astype(str))
    requested = pd.to_numeric(df["alpha"], errors="coerce")  # "auto" becomes NaN
    df["alpha_used"] = pd.to_numeric(df["swap.alpha"], errors="coerce").fillna(requested)
    df["gpus"] = pd.to_numeric(df["world_size"], errors="coerce").astype("Int64")
    df["seq"] = pd.to_numeric(df["seq"], errors="coerce").astype("Int64")
    return df


def is_training(df: pd.DataFrame) -> pd.Series:
    """Whether each row is of a training run: ``mode`` train, or no ``mode`` as in older rows.

    Profiling, planning and fit-check rows carry no training metrics.
    """
    if "mode" not in df:
        return pd.Series(True, index=df.index)
    return df["mode"].isna() | (df["mode"] == "train")


def is_prediction(df: pd.DataFrame) -> pd.Series:
    """Whether each row is a ``mode=fit`` prediction (its figures are ``predicted_*``)."""
    if "mode" not in df:
        return pd.Series(False, index=df.index)
    return df["mode"] == "fit"


def training_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The rows tables are made of: training runs (:func:`is_training`) and predictions
    (:func:`is_prediction`, their variant marked " (predicted)"), derived columns added, repeats
    resolved by :func:`latest_runs`."""
    return latest_runs(df[is_training(df) | is_prediction(df)])


def steps_of(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``steps`` (:func:`read_steps`) of the training runs in ``runs``, repeats
    resolved as in the tables (:func:`training_runs`)."""
    return steps[steps["result_path"].isin(training_runs(runs)["result_path"])]


def latest_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration where the same configuration was run more than once.

    Of the repeats it keeps a run that finished ``ok`` if there is one (a failure next to a
    success is usually a transient one, such as a busy node), and among those the one that ended
    last (a repeat is usually a run after a fix). Configurations are compared on
    :data:`CONFIG_COLUMNS` and the columns of the config groups :data:`CONFIG_PREFIXES`.
    """
    if df.empty:
        return df
    df = add_derived(df)
    key = [c for c in df.columns if c in CONFIG_COLUMNS or c.startswith(CONFIG_PREFIXES)]
    order = pd.DataFrame({
        "failed": df["status"] != "ok",
        "end": pd.to_datetime(df["end_time"], utc=True, errors="coerce"),
    })
    ranked = df.loc[order.sort_values(["failed", "end"], ascending=[True, False]).index]
    return ranked.drop_duplicates(subset=key, keep="first").sort_index()


def experiment_family(name: str) -> str:
    """The experiment a name belongs to: ``ablation_cpu_smoke`` belongs to ``ablation``."""
    return name.removesuffix(SMOKE_SUFFIX)


def experiment_groups(df: pd.DataFrame, family: str | None = None) -> dict[str, pd.DataFrame]:
    """Rows by experiment name, in name order; with ``family``, only that family's experiments.

    Rows without an experiment are grouped under :data:`UNTAGGED`.
    """
    df = add_derived(df)
    groups = {name: group for name, group in df.groupby("experiment", sort=True)}
    return {n: g for n, g in groups.items() if family is None or experiment_family(n) == family}


def dirs_from_env(variable: str = "MEMO_RESULTS", default: str = "multirun") -> list[Path]:
    """The sweep directories listed in the environment variable ``variable``.

    The value is split on commas and on ``os.pathsep``; relative paths are taken from the
    repository root, so a notebook finds Hydra's ``multirun/`` whatever its working directory.
    """
    value = os.environ.get(variable) or default
    names = [n.strip() for part in value.split(",") for n in part.split(os.pathsep)]
    return [REPO / Path(name).expanduser() for name in names if name]


def _lines(path: Path):
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def _parse_line(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: not a JSON object")
    return record
