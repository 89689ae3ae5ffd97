"""Predictions against measured runs, as a table: how far ``mode=fit`` is from what a cluster did
(:mod:`memo.fit.calibration`).

    python -m analysis.calibration results/gpu multirun/ablation/*

For every training row that ended ``ok``, the configuration it ran is predicted again and the
relative errors ``predicted / measured − 1`` are given for the time per iteration and, where the
run measured a device (``peak_reserved_bytes``), for the peak memory the caching allocator held.
Tune ``fit.*`` until the time errors of your cluster's rows are small.
"""

import argparse
import sys
from collections.abc import Sequence

import pandas as pd

from analysis.rows import load_results
from memo.fit import calibration


def compare(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per ``ok`` training row: measured and predicted time and peak memory, and errors."""
    return pd.DataFrame(calibration.compare(rows.to_dict("records")))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="directories searched for result.json rows")
    args = parser.parse_args(argv)
    try:
        table = compare(load_results(*args.dirs))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table.to_markdown(index=False) if len(table) else "no training rows that ended ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
