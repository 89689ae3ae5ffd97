"""Pack step ``tiles``: MEMO in sequence tiles on the GPU, from 256K to 1M tokens.

Layers walked in bf16 in tiles of 16K tokens and swapped (α per tile and the checkpoint interval
solved on the machine), as many layers as one GPU holds beside the whole optimizer at each length
within the step's budget: ``model=7b`` with 4 layers at 256K, ``model=llama3_8b`` with 1 at 1M.
7b's 32 key-value heads do not fit at 1M on 80 GiB: its whole-sequence stores alone (keys and
values, their float32 gradient accumulators, the input store) are 56 GiB, and a fake-tensor trace
of one layer peaks at 78.3 GiB of activations before 6.8 GiB of model states; Llama-3.1-8B's 8
key-value heads make that 44.5 GiB beside 21.3 GiB (its 128K vocabulary). Per job: MFU, the peak
memory, and what the walk declared on the device (its whole-sequence stores and tile buffers,
``tiles.store_bytes + tiles.tile_buffer_bytes``) with α, k, the measured bandwidth and tile times.
A job the device cannot hold leaves an ``oom`` row. ``--cpu`` rehearses it with ``tiny_llama`` at
256 tokens in tiles of 64.

    python -m memo.gpucheck.tiles --out DIR [--cpu]
"""

import sys

from memo.gpucheck.common import arguments, row_figures, run_job, runs_dir, write_rows

TILE_FIGURES = ["tiles.tiles", "tiles.tile_tokens", "tiles.checkpoint_every", "tiles.alpha_min", "tiles.alpha_mean",
                "tiles.alpha_max", "tiles.host_bandwidth_bytes_per_s", "tiles.first_tile_time_s",
                "tiles.last_tile_time_s", "tiles.host_bytes", "tiles.store_bytes", "tiles.tile_buffer_bytes"]


def jobs(cpu: bool) -> tuple[list[str], list[tuple[str, str, int]]]:
    """The overrides every job shares, and each job's (model, length, layers)."""
    if cpu:
        return (["method.tile_tokens=64", "train.steps=2", "train.warmup_steps=1"], [("tiny_llama", "256", 2)])
    return (["method.tile_tokens=16k", "train.dtype=bf16", "train.steps=2", "train.warmup_steps=1"],
            [("7b", "256k", 4), ("llama3_8b", "1024k", 1)])


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    common, each = jobs(args.cpu)
    rows = []
    for model, seq, layers in each:
        name = f"memo-{model}-{seq}-{layers}l"
        row = run_job(runs_dir(args.out) / f"tiles-{name}", *common, f"model={model}", "method=memo", "method.keep_all=never", f"seq={seq}",
                      f"model.num_layers={layers}")[0]
        figures = row_figures(row) | {key: row.get(key) for key in TILE_FIGURES} | {"job": name, "layers": layers}
        if row.get("status") == "ok":
            declared = row["tiles.store_bytes"] + row["tiles.tile_buffer_bytes"]
            peak = row.get("peak_allocated_bytes") or 0  # (none measured on the CPU)
            figures |= {"declared_device_bytes": declared,
                        "declared_share_of_peak": declared / peak if peak else None}
        rows.append(figures)
        write_rows(args.out, "tiles", rows)  # a step cut short by its budget keeps its table
        print(f"tiles: {name}: {row.get('status')} MFU {row.get('mfu')} of a ceiling of {row.get('mfu_ceiling')} "
              f"alpha {row.get('tiles.alpha_mean')}",
              flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
