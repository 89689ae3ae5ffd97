"""Peaks of our DSA planner on public instances and traces, against the max-load lower bound.

    python benchmarks/dsa.py                       # every CSV under ../shared/benchmarks/dsa
    python benchmarks/dsa.py path/to/trace.csv ... # or these files

Prints, per instance: buffers, lower bound, peak, gap to the bound, which planner found the
peak and the seconds it took. Every plan is checked by the independent validator first. A
benchmark, not a test: the times depend on the machine.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memo.plan.dsa import max_load, read_buffers, validate  # noqa: E402
from memo.plan.greedy import greedy_portfolio  # noqa: E402

DEFAULT = REPO.parent / "shared" / "benchmarks" / "dsa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"CSV files or folders (default {DEFAULT})")
    args = parser.parse_args()
    paths = []
    for path in args.paths or [DEFAULT]:
        paths.extend(sorted(path.rglob("*.csv")) if path.is_dir() else [path])
    if not paths:
        sys.exit("error: no CSV instances found; pass files or folders")
    print(f"{'instance':<28} {'buffers':>7} {'lower bound':>13} {'peak':>13} {'gap':>7} "
          f"{'planner':>16} {'seconds':>8}", flush=True)
    for path in paths:
        buffers = read_buffers(path)
        bound = max_load(buffers)
        greedy = greedy_portfolio(buffers)
        peak = validate(buffers, greedy.offsets)
        gap = peak / bound - 1 if bound else 0.0
        print(f"{path.parent.name[:12] + '/' + path.stem:<28} {len(buffers):>7} {bound:>13} {peak:>13} "
              f"{100 * gap:>6.1f}% {'greedy:' + greedy.order:>16} {greedy.seconds:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
