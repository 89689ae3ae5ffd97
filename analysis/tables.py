"""The paper's tables from result rows (:mod:`analysis.rows`).

Every table function takes the rows as loaded (any experiments' rows already selected, see
:func:`analysis.rows.experiment_groups`) and returns a DataFrame. By default its cells are numbers
in the rows' units (``mfu`` a fraction, ``tgs`` tokens per device per second, times in seconds,
memory in bytes; columns ``seq`` in tokens) and NaN where the run did not finish ``ok``. With
``display=True`` the cells are strings for reading (MFU in %, memory in GiB, sequence lengths as
``64K``) and a failed cell says why: ``OOM`` (device memory), ``OOHM`` (host memory for
offloaded activations) or ``ERR``.

Where several configurations fill one cell (say two parallel layouts of one model, method and
sequence length), the cell is the one of highest MFU, as the paper reports the best parallel
configuration of each system; a cell without an ``ok`` run shows its most telling failure.
"""

from collections.abc import Iterable

import pandas as pd

from analysis.rows import training_runs

STATUS_TEXT = {"oom": "OOM", "oohm": "OOHM", "error": "ERR"}
STATUS_RANK = {"ok": 0, "oom": 1, "oohm": 2, "error": 3}  # ok first; an error says the least

# Variants in the order of the ablation (each without, then with the plan); others follow by name.
VARIANT_ORDER = (
    "full_recompute", "full_recompute+plan", "full_swap", "full_swap+plan", "memo", "memo+plan",
)

# Memory and allocator columns the ablation shows when the rows have them (GPU or CPU runs).
MEMORY_COLUMNS = (
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes", "swap.host_bytes",
    "alloc_retries",
)

MIB, GIB = 1024**2, 1024**3


def seq_label(tokens: float) -> str:
    """A sequence length as the paper writes it: 4096 tokens is ``4K``, 1441792 is ``1408K``."""
    return f"{tokens / 1024:g}K"


def variant_order(variants: Iterable[str]) -> list[str]:
    """The distinct ``variants``, those of :data:`VARIANT_ORDER` first, then the others by name."""
    def key(variant):
        known = variant in VARIANT_ORDER
        return (0, VARIANT_ORDER.index(variant), "") if known else (1, 0, variant)

    return sorted(set(variants), key=key)


def format_value(metric: str, value: float) -> str:
    """One number of column ``metric`` for reading; NaN is the empty string."""
    if pd.isna(value):
        return ""
    if isinstance(value, str):
        return value
    if metric == "mfu":
        return f"{100 * value:.1f}%"
    if metric == "tgs":
        return f"{value:,.0f}"
    if metric.endswith("_bytes"):
        return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.1f} MiB"
    if metric.endswith("_s"):
        return f"{value:.2f} s"
    if metric == "seq":
        return seq_label(value)
    if metric == "alloc_retries":
        return f"{value:.0f}"
    return f"{value:.4g}"


def format_cells(values: pd.DataFrame, status: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``values`` of column ``metric`` as strings, the failure of ``status`` where not ``ok``.

    Both frames have the same shape; a cell whose status is missing (never run) is empty.
    """
    def cell(value, state):
        if isinstance(state, str) and state != "ok":
            return STATUS_TEXT.get(state, state.upper())
        return format_value(metric, value)

    table = values.astype(object)
    for column in table:
        table[column] = [cell(v, s) for v, s in zip(values[column], status[column])]
    return table


def best_cells(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One training run per distinct ``keys``: the ``ok`` one of highest MFU, else the failure
    of lowest :data:`STATUS_RANK`."""
    runs = training_runs(df).dropna(subset=["seq"])
    rank = runs["status"].map(STATUS_RANK).fillna(len(STATUS_RANK))
    mfu = pd.to_numeric(runs["mfu"], errors="coerce") if "mfu" in runs else 0.0
    order = pd.DataFrame({"rank": rank, "mfu": mfu}, index=runs.index)
    ranked = runs.loc[order.sort_values(["rank", "mfu"], ascending=[True, False]).index]
    cells = ranked.drop_duplicates(subset=keys, keep="first")
    return cells.astype({"seq": "int64"})


def ordered_keys(cells: pd.DataFrame, index: list[str]) -> pd.Index:
    """The distinct ``index`` values of ``cells``: models by size, variants by
    :func:`variant_order`, anything else by value."""
    ranks = {"variant": variant_order(cells["variant"]), "model.name": _models_by_size(cells)}

    def key(column):
        if column.name in ranks:
            return column.map({v: i for i, v in enumerate(ranks[column.name])})
        return column

    keys = cells[index].drop_duplicates().sort_values(index, key=key)
    if len(index) == 1:
        return pd.Index(keys[index[0]], name=index[0])
    return pd.MultiIndex.from_frame(keys)


def end_to_end_table(df: pd.DataFrame, metric: str = "mfu", display: bool = False) -> pd.DataFrame:
    """``metric`` by (``model.name``, ``gpus``, ``variant``) and sequence length.

    Models are in order of size, then GPUs, then variants (:func:`variant_order`).
    """
    index = ["model.name", "gpus", "variant"]
    return _pivot(best_cells(df, index + ["seq"]), index, metric, display)


def longest_sequence(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """Per (``model.name``, ``gpus``, ``variant``): the longest ``seq`` that ran ``ok`` (or was
    predicted to fit), with that run's ``mfu``, ``tgs``, ``iter_time_s`` and parallel ``layout``;
    NaN where no sequence length ran ``ok``."""
    index = ["model.name", "gpus", "variant"]
    cells = best_cells(df, index + ["seq"])
    metrics = [m for m in ("mfu", "tgs", "iter_time_s", "layout") if m in cells]
    ok = cells[cells["status"] == "ok"].sort_values("seq")
    longest = ok.drop_duplicates(subset=index, keep="last").set_index(index)[["seq", *metrics]]
    table = longest.reindex(ordered_keys(cells, index)).astype({"seq": "Int64"})
    if display:
        return table.apply(lambda column: column.map(lambda v: format_value(column.name, v)))
    return table


def ablation_table(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """MFU, and the memory and allocator columns the rows have (:data:`MEMORY_COLUMNS`), by
    (metric, ``variant``) and sequence length; variants in :data:`VARIANT_ORDER`."""
    cells = best_cells(df, ["variant", "seq"])
    ok = cells[cells["status"] == "ok"]
    metrics = ["mfu"] + [m for m in MEMORY_COLUMNS if m in ok and ok[m].notna().any()]
    blocks = {m: _pivot(cells, ["variant"], m, display) for m in metrics}
    return pd.concat(blocks, names=["metric"])


def best_alpha(df: pd.DataFrame) -> pd.Series:
    """Per sequence length, the α (``alpha_used``) of the shortest iteration among ``ok`` runs;
    ties go to the smaller α (less host memory and traffic)."""
    cells = best_cells(df, ["alpha_used", "seq"])
    ok = cells[(cells["status"] == "ok") & cells["alpha_used"].notna()]
    best = ok.sort_values(["seq", "iter_time_s", "alpha_used"]).drop_duplicates("seq")
    return best.set_index("seq")["alpha_used"].rename("best_alpha")


def alpha_sweep_table(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """``iter_time_s`` and ``mfu`` by (metric, α used) and sequence length.

    Runs without a numeric α are left out. With ``display``, the best α of each sequence length
    (:func:`best_alpha`) is marked with ``*``.
    """
    cells = best_cells(df, ["alpha_used", "seq"])
    cells = cells[cells["alpha_used"].notna()]
    blocks = {m: _pivot(cells, ["alpha_used"], m, display) for m in ("iter_time_s", "mfu")}
    table = pd.concat(blocks, names=["metric"])
    if display:
        for seq, alpha in best_alpha(df).items():
            for metric in blocks:
                table.loc[(metric, alpha), seq_label(seq)] += "*"
    return table


def position_label(bucket: int, buckets: int) -> str:
    """The span of positions bucket ``bucket`` of ``buckets`` covers, as shares of the sequence."""
    return f"{100 * bucket // buckets}-{100 * (bucket + 1) // buckets}%"


def validation_table(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """The last validation loss (nats per token) of each ``ok`` run that validated, whole
    (``all``) and by span of positions (``0-25%``, ...: ``train.eval_buckets`` equal shares of the
    sequence), by sequence length, variant and α used. Empty when no run validated."""
    if "valid_loss_by_position" not in df:
        return pd.DataFrame()
    runs = df[(df["status"] == "ok") & df["valid_loss_by_position"].map(lambda v: isinstance(v, list))]
    records = []
    for _, run in runs.iterrows():
        buckets = run["valid_loss_by_position"]
        records.append({"seq": run["seq"], "variant": run["variant"], "alpha_used": run["alpha_used"],
                        "all": run["valid_loss"],
                        **{position_label(b, len(buckets)): v for b, v in enumerate(buckets)}})
    if not records:
        return pd.DataFrame()
    table = pd.DataFrame(records).set_index(["seq", "variant", "alpha_used"]).sort_index()
    table = table.astype(float)
    return table.round(4).rename(index=seq_label, level="seq") if display else table


def _pivot(cells: pd.DataFrame, index: list[str], metric: str, display: bool) -> pd.DataFrame:
    if metric not in cells:
        raise ValueError(f"the rows have no column {metric!r}")
    values = cells.pivot(index=index, columns="seq", values=metric)
    status = cells.pivot(index=index, columns="seq", values="status")
    order = ordered_keys(cells, index)
    values, status = values.reindex(order), status.reindex(order)
    if not display:
        return values.where(status == "ok").astype(float)
    table = format_cells(values, status, metric)
    return table.rename(columns=seq_label)


def _models_by_size(cells: pd.DataFrame) -> list[str]:
    # Layer parameters scale as layers x hidden^2; a row without the shape sorts last by name.
    names = cells["model.name"].unique()
    if {"model.num_layers", "model.hidden_size"} <= set(cells):
        layers, hidden = (pd.to_numeric(cells[c], errors="coerce")
                          for c in ("model.num_layers", "model.hidden_size"))
        size = layers * hidden**2
        sizes = size.groupby(cells["model.name"]).max().to_dict()
    else:
        sizes = {}
    known = {n: s for n, s in sizes.items() if pd.notna(s)}
    return sorted(names, key=lambda n: (n not in known, known.get(n, 0), n))


ANCHOR_INDEX = ["anchor.peer", "model.name", "hardware.name", "gpus", "anchor.peer_tokens"]


def binding_term(row: pd.Series) -> str:
    """What keeps a prediction that did not fit (``oom`` or ``oohm``) from fitting: the model's
    states alone where they and the reserved bytes exceed the device, else the activations; the
    host memory of swapped activations for ``oohm``. Empty for any other row."""
    if row["status"] == "oohm":
        reason = row.get("predicted_reason")
        return "host memory of Adam's states" if isinstance(reason, str) and "Adam's states" in reason \
            else "host memory of swapped activations"
    if row["status"] != "oom" or pd.isna(row.get("predicted_device_capacity_bytes")):
        return ""
    states = sum(row[f"predicted_{k}_bytes"] for k in ("weights", "gradients", "optimizer"))
    capacity = row["predicted_device_capacity_bytes"]
    kept = f"model states {states / GIB:.1f} GiB (optimizer {row['predicted_optimizer_bytes'] / GIB:.1f})"
    if states + row["predicted_reserved_bytes"] > capacity:
        return f"{kept} of {capacity / GIB:.0f} GiB"
    return f"activations: {kept} leave {(capacity - states - row['predicted_reserved_bytes']) / GIB:.1f} GiB"


def anchors_table(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """Per published result (``anchor.*``: the peer, its model and GPUs, its longest sequence in
    tokens) and per variant: the longest sequence predicted to fit (``seq``, tokens), its share
    of the peer's figure (``of_peer``) and, where nothing fits, the term that binds (``binding``)."""
    runs = df[df["anchor.peer"].notna()].copy() if "anchor.peer" in df else df.iloc[0:0]
    if runs.empty:
        return pd.DataFrame()
    runs["gpus"] = pd.to_numeric(runs.get("cluster.gpus", runs["gpus"]), errors="coerce").astype("Int64")
    runs["binding"] = runs.apply(binding_term, axis=1)
    index = [*ANCHOR_INDEX, "variant"]
    cells = runs.sort_values("status", key=lambda s: s.map(STATUS_RANK)).drop_duplicates(index)
    table = cells.set_index(index)[["status", "seq", "binding"]].sort_index()
    table["seq"] = table["seq"].where(table["status"] == "ok").astype("Int64")
    peer = pd.to_numeric(table.index.get_level_values("anchor.peer_tokens"), errors="coerce")
    table["of_peer"] = (table["seq"].astype(float) / peer).round(3)
    if display:
        shown = table.copy()
        shown["seq"] = [seq_label(s) if pd.notna(s) else STATUS_TEXT.get(status, status)
                        for s, status in zip(table["seq"], table["status"], strict=True)]
        shown["of_peer"] = table["of_peer"].map(lambda v: f"{v:.2f}×" if pd.notna(v) else "")
        return shown.drop(columns="status").rename_axis(index={"anchor.peer_tokens": "peer's tokens"})
    return table


FRONTIER_INDEX = ["model.name", "hardware.name", "gpus", "host_gib", "variant"]


def frontier_table(df: pd.DataFrame, display: bool = False) -> pd.DataFrame:
    """Per setting (model, hardware, GPUs, host memory of a node in GiB) and variant: the longest
    sequence predicted to fit (``seq``, tokens) with the layout, tiles (``tile_tokens``, tokens;
    empty for whole layers) and placement of Adam's states (``optimizer``) the search chose, the
    term that binds where nothing fits, and beside it the peer's published figure (``peer``,
    ``peer_tokens``) and our share of it (``of_peer``)."""
    if df.empty:
        return pd.DataFrame()
    runs = df.copy()
    runs["gpus"] = pd.to_numeric(runs.get("cluster.gpus", runs["gpus"]), errors="coerce").astype("Int64")
    runs["host_gib"] = (pd.to_numeric(runs["hardware.host_memory_bytes"], errors="coerce") / GIB).round().astype("Int64")
    runs["binding"] = runs.apply(binding_term, axis=1)
    for column in ("anchor.peer", "anchor.peer_tokens", "layout", "predicted_tile_tokens", "train.optimizer_offload"):
        if column not in runs:
            runs[column] = pd.NA
    cells = runs.sort_values("status", key=lambda s: s.map(STATUS_RANK)).drop_duplicates(FRONTIER_INDEX)
    table = cells.set_index(FRONTIER_INDEX)[["status", "seq", "layout", "predicted_tile_tokens",
                                             "train.optimizer_offload", "binding", "anchor.peer",
                                             "anchor.peer_tokens"]].sort_index()
    table = table.rename(columns={"predicted_tile_tokens": "tile_tokens", "train.optimizer_offload": "optimizer",
                                  "anchor.peer": "peer", "anchor.peer_tokens": "peer_tokens"})
    ok = table["status"] == "ok"
    table["seq"] = table["seq"].where(ok).astype("Int64")
    for column in ("layout", "tile_tokens", "optimizer"):
        table[column] = table[column].where(ok)
    table["tile_tokens"] = pd.to_numeric(table["tile_tokens"], errors="coerce").astype("Int64")
    table["peer_tokens"] = pd.to_numeric(table["peer_tokens"], errors="coerce").astype("Int64")
    table["of_peer"] = (table["seq"].astype(float) / table["peer_tokens"].astype(float)).round(3)
    if display:
        shown = table.astype(object)
        shown["seq"] = [seq_label(s) if pd.notna(s) else STATUS_TEXT.get(status, status)
                        for s, status in zip(table["seq"], table["status"], strict=True)]
        shown["tile_tokens"] = [seq_label(t) if pd.notna(t) else ("whole" if status == "ok" else "")
                                for t, status in zip(table["tile_tokens"], table["status"], strict=True)]
        shown["peer_tokens"] = table["peer_tokens"].map(lambda v: f"{v:,}" if pd.notna(v) else "")
        shown["of_peer"] = table["of_peer"].map(lambda v: f"{v:.2f}×" if pd.notna(v) else "")
        return shown.drop(columns="status").fillna("")
    return table
