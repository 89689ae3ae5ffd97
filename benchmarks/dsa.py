"""Peaks of our DSA planner on public instances and traces, against the max-load lower bound.

    python benchmarks/dsa.py                       # every CSV under ../shared/benchmarks/dsa
    python benchmarks/dsa.py path/to/trace.csv ... # or these files

Prints, per instance: buffers, the max-load bound, the proven lower bound, the peak, the gap
between them, which planner found the peak and the seconds it took (``--time-limit`` each).
Every plan is checked by the independent validator first. A file that is not an instance gets
one line on stderr naming it (and the line) and the others are still planned; the exit status is
then 1. A benchmark, not a test: the times depend on the machine.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo.dsa.buffers import max_load, read_buffers, validate  # noqa: E402
from memo.dsa.solve import plan  # noqa: E402

DEFAULT = REPO.parent / "shared" / "benchmarks" / "dsa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"CSV files or folders (default {DEFAULT})")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per instance (default 60)")
    args = parser.parse_args()
    paths = []
    for path in args.paths or [DEFAULT]:
        paths.extend(sorted(path.rglob("*.csv")) if path.is_dir() else [path])
    if not paths:
        sys.exit("error: no CSV instances found; pass files or folders")
    print(f"{'instance':<28} {'buffers':>7} {'max load':>13} {'lower bound':>13} {'peak':>13} "
          f"{'gap':>7} {'optimal':>7} {'planner':>16} {'seconds':>8}", flush=True)
    failed = 0
    for path in paths:
        try:
            buffers = read_buffers(path)
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            failed += 1
            continue
        result = plan(buffers, args.time_limit)
        peak = validate(buffers, result.offsets)
        print(f"{path.parent.name[:12] + '/' + path.stem:<28} {len(buffers):>7} {max_load(buffers):>13} "
              f"{result.lower_bound:>13} {peak:>13} {100 * result.gap:>6.1f}% {str(result.optimal):>7} "
              f"{result.solver:>16} {result.seconds:>8.2f}  {result.mip_message}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
