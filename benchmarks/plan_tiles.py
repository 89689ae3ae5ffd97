"""Bi-level plans of layers walked in tiles, from three layers of three tiles, and how long they take.

    python benchmarks/plan_tiles.py                 # 7b at 1M, llama3_8b at 1M, 65b at 4M
    python benchmarks/plan_tiles.py --only 65b
    python benchmarks/plan_tiles.py --csv results/cpu/plan_tiles.csv

Per configuration (method memo in tiles, bf16, fake tensors, rank 0), as ``mode=plan`` plans it:
seconds to trace the template (two iterations of three layers of three tiles) and to plan its
iteration at the run's length and tile (making that iteration of the template is in neither); the largest level-1 block of a tile's forward and
backward and of a block of its attention against their lower bounds; the level-2 peak (the arena)
against the most bytes alive at once; and the reserved peak of PyTorch's caching allocator
(simulated) for the same requests. A benchmark, not a test: the times depend on the machine.
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
from memo.dsa.caching_allocator import simulate  # noqa: E402
from memo.plan.bilevel import plan_iteration  # noqa: E402
from memo.policy import policy_of  # noqa: E402
from memo.profile.template import iteration_template  # noqa: E402
from memo.results import create_file_atomic  # noqa: E402

K = 1024
# model, tokens, tensor-parallel ranks (with sequence parallelism when more than one), tile tokens
CASES = [("7b", 1024 * K, 8, 16 * K), ("llama3_8b", 1024 * K, 1, 16 * K), ("65b", 4096 * K, 8, 16 * K)]
GIB = 2**30


def largest(memory_plan, kind: str):
    """The largest level-1 block of ``kind`` (its variants included)."""
    return max((level for name, level in memory_plan.blocks.items() if name.split("#")[0] == kind),
               key=lambda level: level.peak)


def run(name: str, seq: int, tp: int, tile: int, time_limit_s: float) -> dict:
    model = ModelConfig(**OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    method = Method(name="memo", layer_activations="swap")
    workload = Workload(model, method, ParallelConfig(tp=tp, sequence_parallel=tp > 1), seq, dtype="bf16",
                        loss="tiled", layer_tile_tokens=tile)
    start = time.perf_counter()
    template = iteration_template(workload, model.num_layers, policy_of(workload).traced)
    traced = time.perf_counter() - start
    trace = template.instance(seq, model.num_layers, layer_tile_tokens=tile)
    start = time.perf_counter()
    memory_plan = plan_iteration(trace, time_limit_s, identical_layers=False)
    planned = time.perf_counter() - start
    row = {"model": name, "seq": seq, "tp": tp, "tile": tile, "tiles": seq // tile, "layers": model.num_layers,
           "events": len(trace.events), "trace_s": round(traced, 2), "plan_s": round(planned, 2)}
    for label, kind in (("tile_fwd", "layer.fwd.t"), ("tile_bwd", "layer.bwd.t"), ("block_fwd", "layer.fwd.t.b"),
                        ("block_bwd", "layer.bwd.t.db")):
        level = largest(memory_plan, kind)
        row.update({f"{label}_peak": level.peak, f"{label}_bound": level.lower_bound})
    row.update(arena=memory_plan.arena_bytes, flat_bound=memory_plan.flat_lower_bound,
               iter_solver=memory_plan.iteration.solver, reserved=simulate(trace.events).peak_reserved)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases of this model only")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per bi-level plan (default 60)")
    parser.add_argument("--csv", type=Path, help="also write the rows to this CSV file (must not exist)")
    args = parser.parse_args()
    if args.csv is not None and args.csv.exists():
        sys.exit(f"error: {args.csv} exists and is kept; choose another path")
    print(f"{'model':<10} {'seq':>6} {'tp':>3} {'tile':>5} {'trace s':>8} {'plan s':>7} {'tile fwd MiB':>13} "
          f"{'bound':>7} {'tile bwd MiB':>13} {'bound':>7} {'arena GiB':>10} {'alive GiB':>10} {'cached GiB':>11}",
          flush=True)
    rows = []
    for name, seq, tp, tile in CASES:
        if args.only and name != args.only:
            continue
        r = run(name, seq, tp, tile, args.time_limit)
        rows.append(r)
        mib = 2**20
        print(f"{name:<10} {seq // K:>5}k {tp:>3} {tile // K:>4}k {r['trace_s']:>8.1f} {r['plan_s']:>7.2f} "
              f"{r['tile_fwd_peak'] / mib:>13.1f} {r['tile_fwd_bound'] / mib:>7.1f} {r['tile_bwd_peak'] / mib:>13.1f} "
              f"{r['tile_bwd_bound'] / mib:>7.1f} {r['arena'] / GIB:>10.3f} {r['flat_bound'] / GIB:>10.3f} "
              f"{r['reserved'] / GIB:>11.3f}", flush=True)
    if args.csv is not None and rows:
        create_file_atomic(args.csv, pandas.DataFrame(rows).to_csv(index=False))  # never replaces a file


if __name__ == "__main__":
    main()
