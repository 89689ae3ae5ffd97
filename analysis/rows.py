"""Load the ``result.json`` rows of one or more sweeps into a pandas DataFrame."""

import json
from pathlib import Path

import pandas as pd


def load_results(*dirs: str | Path) -> pd.DataFrame:
    """One row per run found under ``dirs`` (searched recursively), with a ``result_path`` column.

    Columns are the rows' dotted keys (``model.name``, ``seq``, ``method.name``, ``status``,
    ``mfu``, ...); runs without a result yet are absent.
    """
    rows = []
    for directory in dirs:
        for path in sorted(Path(directory).rglob("result.json")):
            rows.append({**json.loads(path.read_text()), "result_path": str(path)})
    return pd.DataFrame(rows)
