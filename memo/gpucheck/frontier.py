"""Pack step ``frontier``: Llama-3.1-8B-shaped on the lent GPU with Adam's states on the host, at
the longest length the fit predicts for it, measured against the fit.

The fit runs here first, on this machine's device and host memory (``hardware=auto``): MEMO in
tiles of 16K, the optimizer on the host, for ``model=llama3_8b`` with 32, 16, 8, 4 and 2 of its
layers (one process: the template is traced once). The most layers whose longest sequence reaches
:data:`MIN_TOKENS` are trained, at that length, or shorter where two steps would take more than
:data:`TRAIN_BUDGET_S` by the fit's predicted time (attention grows as the square of the length).
Rows: each depth's prediction, then the run's MFU, peak memory and host bytes beside the fit's
for the same configuration (:func:`memo.fit.calibration.compare`). ``--cpu`` rehearses it with
``tiny_llama`` in tiles of 512 tokens on a device of 0.25 GiB, the optimizer on the device (the
CPU has no device memory to free: offloading is refused there).

    python -m memo.gpucheck.frontier --out DIR [--cpu]
"""

import math
import sys

from memo.gpucheck.common import arguments, row_figures, run_job, runs_dir, write_rows

MIN_TOKENS = 256 * 1024  # a depth is trained only if it reaches this many tokens
TRAIN_BUDGET_S = 240.0  # two training steps' predicted seconds, at most
DEPTHS = (32, 16, 8, 4, 2)
FIT_FIGURES = ["model.num_layers", "status", "seq", "predicted_reason", "predicted_device_bytes",
               "predicted_host_bytes_per_node", "predicted_optimizer_host_bytes", "predicted_iter_time_s",
               "predicted_alpha_min", "predicted_checkpoint_every", "error"]


def settings(cpu: bool) -> tuple[list[str], list[str], tuple[int, ...], int, int]:
    """The overrides of the fit and of the run, the depths tried, the tokens a depth must reach and
    the tile (tokens; lengths are multiples of it)."""
    if cpu:
        shared = ["model=tiny_llama", "method=memo", "method.tile_tokens=512", "train.dtype=bf16"]
        fit = [*shared, "hardware=h200", "hardware.device_memory_gib=0.25", "fit.device_reserved_gib=0",
               "fit.seq_step=512", "fit.seq_limit=4k"]
        return fit, shared, (4, 2), 1024, 512
    shared = ["model=llama3_8b", "method=memo", "method.tile_tokens=16k", "train.optimizer_offload=host",
              "train.dtype=bf16"]
    return [*shared, "hardware=auto", "fit.seq_step=16k"], shared, DEPTHS, MIN_TOKENS, 16384


def trained_length(seq: int, predicted_iter_s: float, tile: int) -> int:
    """``seq`` tokens, or fewer (a multiple of ``tile``) so that two steps take about
    :data:`TRAIN_BUDGET_S` by a prediction of ``predicted_iter_s`` seconds at ``seq``, time taken to
    grow as the square of the length."""
    if 2 * predicted_iter_s <= TRAIN_BUDGET_S:
        return seq
    shorter = seq * math.sqrt(TRAIN_BUDGET_S / (2 * predicted_iter_s))
    return max(tile, int(shorter) // tile * tile)


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from memo.fit.calibration import compare
    from memo.results import read_rows

    fit, run, depths, minimum, tile = settings(args.cpu)
    depth_list = ",".join(str(d) for d in depths)
    predicted = run_job(runs_dir(args.out) / "frontier-fit", "mode=fit", "seq=max", *fit,
                        f"model.num_layers={depth_list}", multirun=True, timeout_s=300)
    rows = [{"job": "fit", **{k: p.get(k) for k in FIT_FIGURES}} for p in predicted]
    write_rows(args.out, "frontier", rows)
    reached = [p for p in predicted if p.get("status") == "ok" and p["seq"] >= minimum]
    if not reached:
        print(f"frontier: no depth reaches {minimum} tokens here", flush=True)
        return 1
    chosen = max(reached, key=lambda p: int(p["model.num_layers"]))
    layers, seq = int(chosen["model.num_layers"]), trained_length(int(chosen["seq"]),
                                                                   chosen["predicted_iter_time_s"], tile)
    name = f"memo-{layers}l-{seq}"
    run_dir = runs_dir(args.out) / f"frontier-{name}"
    row = run_job(run_dir, *run, f"model.num_layers={layers}", f"seq={seq}", "train.steps=2",
                  "train.warmup_steps=1")[0]
    figures = row_figures(row) | {"job": name, "model.num_layers": layers, "longest_predicted": chosen["seq"],
                                  "tiles.host_bytes": row.get("tiles.host_bytes"),
                                  "tiles.alpha_mean": row.get("tiles.alpha_mean"),
                                  "tiles.checkpoint_every": row.get("tiles.checkpoint_every")}
    if row.get("status") == "ok":
        (again,) = compare(read_rows(run_dir))
        figures |= {k: again[k] for k in ("predicted_iter_time_s", "time_error", "predicted_peak_bytes",
                                           "memory_error")}
    rows.append(figures)
    write_rows(args.out, "frontier", rows)
    print(f"frontier: {name}: {row.get('status')} MFU {row.get('mfu')} peak {row.get('peak_allocated_bytes')}",
          flush=True)
    return 0 if row.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
