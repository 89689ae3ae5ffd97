"""Pack step ``calibration``: the fit planner's predictions against the pack's own training rows
(steps ``throughput`` and ``longest``), with :func:`memo.fit.calibration.compare`: per row the
relative error of the predicted time per iteration and peak memory (``calibration.csv``), and
their mean and largest magnitude (``calibration_summary.csv``).

    python -m memo.gpucheck.calibration --out DIR [--cpu]
"""

import sys

from memo.gpucheck.common import arguments, runs_dir, skip, write_rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from memo.fit.calibration import compare
    from memo.results import read_rows

    runs = runs_dir(args.out)
    dirs = sorted(runs.glob("throughput-*")) + sorted(runs.glob("longest-*"))
    if not dirs:
        return skip(args.out, "calibration", "no rows of the throughput or longest steps of this code yet: "
                    "python -m memo.gpucheck --only throughput calibration")
    table = compare(read_rows(*dirs))
    summary = []
    for what in ("time_error", "memory_error"):
        values = [abs(line[what]) for line in table if line[what] is not None]
        if values:
            summary.append({"error": what, "rows": len(values), "mean_abs": sum(values) / len(values),
                            "max_abs": max(values)})
    for line in table or [{"calibration": "no ok training rows"}]:
        print(line, flush=True)
    write_rows(args.out, "calibration_summary", summary)
    write_rows(args.out, "calibration", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
