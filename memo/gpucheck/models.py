"""Pack step ``models``: the Llama-3 shape on the GPU, measured next to the fit's prediction.

``model=llama3_8b`` in bf16 with as many of its layers as one GPU holds beside the whole optimizer
(8 of 32 on an H200: 2.8B parameters, 45 GB of weights, gradients and Adam states; 4 on an H100),
trained by ``memo`` and by Megatron's full recomputation (with the tiled loss: its own loss's
whole-sequence logits alone would not fit) at 64K and 128K tokens: MFU, TGS, peak memory, and the
fit's predicted time and peak for the same configuration (:func:`memo.fit.calibration.compare`).
A job the device cannot hold leaves an ``oom`` row. ``--cpu`` rehearses it with ``tiny_llama`` at
256 tokens.

    python -m memo.gpucheck.models --out DIR [--cpu]
"""

import sys

from memo.gpucheck.common import arguments, row_figures, run_job, runs_dir, write_rows

METHODS = (("memo", "method.keep_all=never"), ("megatron_full_recompute", "train.loss=tiled"))


def layers_here() -> int:
    """Layers of llama3_8b that one of this machine's GPUs holds with room for activations."""
    import torch

    return 8 if torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30 else 4


def jobs(cpu: bool) -> tuple[list[str], list[str]]:
    """The overrides every job shares, and the lengths."""
    if cpu:
        return ["model=tiny_llama", "train.steps=3", "train.warmup_steps=1"], ["256"]
    return (["model=llama3_8b", f"model.num_layers={layers_here()}", "train.steps=4", "train.warmup_steps=2"],
            ["64k", "128k"])


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from memo.fit.calibration import compare
    from memo.results import read_rows

    common, lengths = jobs(args.cpu)
    rows = []
    for seq in lengths:
        for method, *extra in METHODS:
            name = f"{method}-{seq}"
            run_dir = runs_dir(args.out) / f"models-{name}"
            row = run_job(run_dir, *common, f"seq={seq}", f"method={method}", *extra)[0]
            figures = row_figures(row) | {"job": name}
            if row.get("status") == "ok":
                (predicted,) = compare(read_rows(run_dir))
                figures |= {k: predicted[k] for k in ("predicted_iter_time_s", "time_error",
                                                      "predicted_peak_bytes", "memory_error")}
            rows.append(figures)
            write_rows(args.out, "models", rows)  # a step cut short by its budget keeps its table
            print(f"models: {name}: {row.get('status')} MFU {row.get('mfu')} of a ceiling of {row.get('mfu_ceiling')}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
