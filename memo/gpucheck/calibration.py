"""Pack step ``calibration``: the fit planner's predictions against the pack's own training rows
(steps ``throughput`` and ``longest``), with :func:`analysis.calibration.compare`: per row the
relative error of the predicted time per iteration and peak memory (``calibration.csv``), and
their mean and largest magnitude (``calibration_summary.csv``).

    python -m memo.gpucheck.calibration --out DIR [--cpu]
"""

import sys

from memo.gpucheck.common import arguments, runs_dir, skip, write_rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from analysis.rows import load_results
    from analysis.calibration import compare

    runs = runs_dir(args.out)
    dirs = sorted(runs.glob("throughput-*")) + sorted(runs.glob("longest-*"))
    if not dirs:
        return skip(args.out, "calibration", "no rows of the throughput or longest steps of this code yet: "
                    "python -m memo.gpucheck --only throughput calibration")
    table = compare(load_results(*dirs))
    summary = []
    for what in ("time_error", "memory_error") if len(table) else ():
        values = table[what].dropna().abs()
        if len(values):
            summary.append({"error": what, "rows": len(values), "mean_abs": values.mean(),
                            "max_abs": values.max()})
    print(table.to_string() if len(table) else "calibration: no ok training rows")
    write_rows(args.out, "calibration_summary", summary)
    write_rows(args.out, "calibration", table.to_dict("records"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
