"""Pack step ``frontier``: one layer of Llama-3.1-8B at the longest length its step's time allows
on the lent GPU, measured against the fit, and the arithmetic that takes the measured error to the
frontier tables.

The fit runs here first, on this machine's device and host memory (``hardware=auto``): MEMO in
tiles of 16K, Adam's states on the device, ``model=llama3_8b`` with :data:`LAYERS` layer, the
longest length (``seq=max``). One layer reaches lengths whose attention takes far longer than a
step should here, so the run trains at that length or shorter, where two steps would take more
than :data:`TRAIN_BUDGET_S` by the fit's predicted time (attention grows as the square of the
length), and its peak and time are compared with the fit's for the same configuration
(:func:`memo.fit.calibration.compare`).

Then the arithmetic: the committed frontier rows of memo with Llama-3.1-8B's 32 layers
(``results/cpu/frontier/{1gpu,8gpu}``, 2 TiB of host a node) are taken to what they become with
the measured error as the margin (at least ``fit.memory_margin``): the bytes that do not grow with
the length (weights, gradients, Adam, what the device reserves) kept, the rest taken to grow in
proportion to it, each row's length scaled by what the new margin leaves them. Printed, and rows
of their own (``job`` ``arithmetic ...``). ``--cpu`` rehearses it with ``tiny_llama`` in tiles of
512 tokens on a device of 0.25 GiB.

    python -m memo.gpucheck.frontier --out DIR [--cpu]
"""

import math
import sys

from memo.gpucheck.common import arguments, row_figures, run_job, runs_dir, write_rows

TRAIN_BUDGET_S = 240.0  # two training steps' predicted seconds, at most
LAYERS = 1
FIT_FIGURES = ["model.num_layers", "status", "seq", "predicted_reason", "predicted_device_bytes",
               "predicted_host_bytes_per_node", "predicted_iter_time_s", "margin_bytes", "error"]
# the committed frontier rows the arithmetic takes on: memo, Llama-3.1-8B, 32 layers
FRONTIER_ROWS = ("results/cpu/frontier/1gpu", "results/cpu/frontier/8gpu")


def settings(cpu: bool) -> tuple[list[str], list[str], int]:
    """The overrides of the fit and of the run, and the tile (tokens; lengths are multiples of it)."""
    shared = [f"model.num_layers={LAYERS}", "method=memo", "method.keep_all=never", "train.optimizer_offload=none"]
    if cpu:
        shared = ["model=tiny_llama", *shared, "method.tile_tokens=512", "train.dtype=fp32", "hardware=cpu",
                  "hardware.device_memory_gib=0.25"]
        return [*shared, "fit.seq_step=512", "fit.seq_limit=64k"], shared, 512
    shared = ["model=llama3_8b", *shared, "method.tile_tokens=16k", "train.dtype=bf16", "hardware=auto"]
    return [*shared, "fit.seq_step=16k", "fit.seq_limit=16384k"], shared, 16384


def trained_length(seq: int, predicted_iter_s: float, tile: int) -> int:
    """``seq`` tokens, or fewer (a multiple of ``tile``) so that two steps take about
    :data:`TRAIN_BUDGET_S` by a prediction of ``predicted_iter_s`` seconds at ``seq``, time taken to
    grow as the square of the length."""
    if 2 * predicted_iter_s <= TRAIN_BUDGET_S:
        return seq
    shorter = seq * math.sqrt(TRAIN_BUDGET_S / (2 * predicted_iter_s))
    return max(tile, int(shorter) // tile * tile)


def scaled_length(seq: int, predicted: int, fixed: int, capacity: int, margin: float) -> int:
    """``seq`` tokens predicted to need ``predicted`` bytes of a ``capacity``-byte device, of which
    ``fixed`` do not grow with the length, taken to the length that fills ``capacity`` less
    ``margin`` of it, the rest growing in proportion to the length (to first order)."""
    return int(seq * (capacity * (1 - margin) - fixed) / (predicted - fixed))


def arithmetic(margin: float, rows) -> list[dict]:
    """:func:`scaled_length` of each memo Llama-3.1-8B row of 32 layers in ``rows`` at ``margin``."""
    found = []
    for row in rows:
        if (row.get("method.name"), row.get("model.name"), row.get("status")) != ("memo", "llama3_8b", "ok"):
            continue
        fixed = sum(row.get(k) or 0 for k in ("predicted_weights_bytes", "predicted_gradients_bytes",
                                              "predicted_optimizer_bytes", "predicted_reserved_bytes"))
        capacity = row["predicted_device_capacity_bytes"]
        seq = scaled_length(row["seq"], row["predicted_device_bytes"], fixed, capacity, margin)
        found.append({"job": f"arithmetic {row['hardware.name']} x{row.get('cluster.gpus')}", "seq": seq,
                      "committed_seq": row["seq"], "predicted_device_bytes": row["predicted_device_bytes"],
                      "fixed_bytes": fixed, "capacity_bytes": capacity, "margin": margin,
                      "host_bytes_per_node": row.get("predicted_host_bytes_per_node"),
                      "host_capacity_per_node_bytes": row.get("predicted_host_capacity_per_node_bytes")})
    return found


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from memo.fit.calibration import compare
    from memo.gpucheck.common import REPO, compose
    from memo.results import read_rows

    fit, run, tile = settings(args.cpu)
    (chosen,) = run_job(runs_dir(args.out) / "frontier-fit", "mode=fit", "seq=max", *fit, timeout_s=300)
    rows = [{"job": "fit", **{k: chosen.get(k) for k in FIT_FIGURES}}]
    write_rows(args.out, "frontier", rows)
    if chosen.get("status") != "ok":
        print(f"frontier: the fit found no length: {chosen.get('error') or chosen.get('predicted_reason')}",
              flush=True)
        return 1
    seq = trained_length(int(chosen["seq"]), chosen["predicted_iter_time_s"], tile)
    name = f"memo-{LAYERS}l-{seq}"
    run_dir = runs_dir(args.out) / f"frontier-{name}"
    row = run_job(run_dir, *run, f"seq={seq}", "train.steps=2", "train.warmup_steps=1")[0]
    figures = row_figures(row) | {"job": name, "model.num_layers": LAYERS, "longest_predicted": chosen["seq"],
                                  "tiles.host_bytes": row.get("tiles.host_bytes"),
                                  "tiles.alpha_mean": row.get("tiles.alpha_mean"),
                                  "tiles.checkpoint_every": row.get("tiles.checkpoint_every")}
    margin = compose(*run).fit.memory_margin
    if row.get("status") == "ok" and not args.cpu:
        (again,) = compare(read_rows(run_dir))
        figures |= {k: again[k] for k in ("predicted_iter_time_s", "time_error", "predicted_peak_bytes",
                                           "memory_error")}
        margin = max(margin, -again["memory_error"])  # a fit below the measured peak widens it
    rows.append(figures)
    taken = arithmetic(margin, (r for d in FRONTIER_ROWS for r in read_rows(REPO / d)))
    rows += taken
    write_rows(args.out, "frontier", rows)
    print(f"frontier: {name}: {row.get('status')} MFU {row.get('mfu')} peak {row.get('peak_allocated_bytes')} "
          f"memory error {figures.get('memory_error')}; with a margin of {margin:.3f}:", flush=True)
    for t in taken:
        print(f"  {t['job']}: {t['committed_seq']} tokens committed -> {t['seq']} = {t['committed_seq']} x "
              f"({t['capacity_bytes']} x (1 - {margin:.3f}) - {t['fixed_bytes']}) / ({t['predicted_device_bytes']} - "
              f"{t['fixed_bytes']})", flush=True)
    return 0 if row.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
