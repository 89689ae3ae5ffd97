"""Bi-level plans of our own traces against the caching allocator, and how long they take.

    python benchmarks/plan.py                       # tiny, 1.3b, 7b at 4k-1024k (tp 1 and 8), 65b at 1408k
    python benchmarks/plan.py --only 65b            # rows whose model is 65b
    python benchmarks/plan.py --csv results/cpu/plan.csv

Per configuration (method none, bf16, fake tensors, rank 0): seconds to trace and to plan, the
layer's level-1 forward and backward peaks against their lower bounds, the level-2 peak of the
iteration against its bound, and the reserved peak of PyTorch's caching allocator (simulated)
for the layer's transient requests and for the whole iteration. A benchmark, not a test: the
times depend on the machine.
"""

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from memo.config import Method, ModelConfig, ParallelConfig, Workload  # noqa: E402
from memo.plan.bilevel import plan_iteration  # noqa: E402
from memo.results import create_file_atomic  # noqa: E402
from memo.dsa.caching_allocator import simulate  # noqa: E402
from memo.policy import policy_of  # noqa: E402
from memo.profile.iteration import trace_iteration  # noqa: E402
from memo.profile.layers import transient_events  # noqa: E402
from memo.profile.trace import layer_phase  # noqa: E402

K = 1024
CASES = [("tiny", 4 * K, 1), ("1.3b", 64 * K, 1)] + [
    ("7b", seq * K, tp) for tp in (1, 8) for seq in (4, 64, 256, 1024)
] + [("65b", 1408 * K, 8)]


def run(name: str, seq: int, tp: int, time_limit_s: float) -> dict:
    model = ModelConfig(**OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    start = time.perf_counter()
    workload = Workload(model, Method(name="none"), ParallelConfig(tp=tp), seq, dtype="bf16")
    trace = trace_iteration(workload, policy_of(workload))
    traced = time.perf_counter() - start
    memory_plan = plan_iteration(trace, time_limit_s)
    planned = time.perf_counter() - start - traced
    layer = memory_plan.layers_checked[0]
    fwd, bwd, it = memory_plan.blocks["layer.fwd"], memory_plan.blocks["layer.bwd"], memory_plan.iteration
    return {
        "model": name, "seq": seq, "tp": tp, "events": len(trace.events),
        "trace_s": round(traced, 2), "plan_s": round(planned, 2),
        "fwd_peak": fwd.peak, "fwd_bound": fwd.lower_bound,
        "fwd_reserved": simulate(transient_events(trace, layer_phase(layer, "fwd"))).peak_reserved,
        "bwd_peak": bwd.peak, "bwd_bound": bwd.lower_bound,
        "bwd_reserved": simulate(transient_events(trace, layer_phase(layer, "bwd"))).peak_reserved,
        "iter_peak": it.peak, "iter_bound": it.lower_bound, "iter_gap": it.gap, "iter_solver": it.solver,
        "iter_reserved": simulate(trace.events).peak_reserved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases of this model only")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds per bi-level plan (default 60)")
    parser.add_argument("--csv", type=Path, help="also write the rows to this CSV file (must not exist)")
    args = parser.parse_args()
    if args.csv is not None and args.csv.exists():
        sys.exit(f"error: {args.csv} exists and is kept; choose another path")
    gib = 2**30
    print(f"{'model':<6} {'seq':>8} {'tp':>3} {'trace s':>8} {'plan s':>7} {'L1 fwd GiB':>11} "
          f"{'bound':>8} {'cached':>8} {'L1 bwd GiB':>11} {'bound':>8} {'cached':>8} {'L2 GiB':>9} "
          f"{'gap':>8} {'cached':>9}", flush=True)
    rows = []
    for name, seq, tp in CASES:
        if args.only and name != args.only:
            continue
        r = run(name, seq, tp, args.time_limit)
        rows.append(r)
        print(f"{name:<6} {seq // K:>7}k {tp:>3} {r['trace_s']:>8.2f} {r['plan_s']:>7.2f} "
              f"{r['fwd_peak'] / gib:>11.3f} {r['fwd_bound'] / gib:>8.3f} {r['fwd_reserved'] / gib:>8.3f} "
              f"{r['bwd_peak'] / gib:>11.3f} {r['bwd_bound'] / gib:>8.3f} {r['bwd_reserved'] / gib:>8.3f} "
              f"{r['iter_peak'] / gib:>9.1f} {100 * r['iter_gap']:>7.3f}% {r['iter_reserved'] / gib:>9.1f}",
              flush=True)
    if args.csv is not None and rows:
        create_file_atomic(args.csv, pandas.DataFrame(rows).to_csv(index=False))  # never replaces a file


if __name__ == "__main__":
    main()
