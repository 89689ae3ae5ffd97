"""Pack step ``overlap``: how much of MEMO's host copies hides behind compute, from a
``torch.profiler`` trace of two training steps at a length where swapping should hide, for
whole layers (``model=1.3b`` at 32K) and for layers walked in tiles (64K in tiles of 8K, α per
tile solved on the machine).

Per job and copy direction: its total time and the fraction of it during which some compute
kernel runs; and the time the GPU computes nothing while a copy is in flight (what the step waits
on copies).

    python -m memo.gpucheck.overlap --out DIR [--cpu]
"""

import gc
import sys

import torch

from memo.gpucheck.common import arguments, placed_model, skip, write_rows
from memo.metrics.timeline import covered, union


def overlap_rows(copies: dict[str, list[tuple[float, float]]],
                 kernels: list[tuple[float, float]]) -> list[dict]:
    """Rows of copy time, the fraction of it under compute, and compute-idle time during copies
    (all times in the same unit, microseconds from the profiler)."""
    busy = union(kernels)
    rows = []
    for direction, spans in copies.items():
        total = sum(b - a for a, b in spans)
        hidden = sum(covered(span, busy) for span in spans)
        in_flight = union(spans)
        idle = sum(b - a for a, b in in_flight) - sum(covered(span, busy) for span in in_flight)
        rows.append({"direction": direction, "copies": len(spans), "copy_us": total,
                     "overlap_fraction": hidden / total if total else None, "compute_idle_us": idle})
    return rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    if args.cpu:
        return skip(args.out, "overlap", "needs a GPU: copies on CUDA streams beside compute kernels")
    torch.cuda.set_device(0)
    rows = []
    for walk, overrides in (("layers", ("seq=32k",)), ("tiles", ("seq=64k", "method.tile_tokens=8k"))):
        copies, kernels, figures, trace = _profiled_steps(overrides)
        gc.collect()  # the job's model and placement, before the next job's
        torch.cuda.empty_cache()
        rows += [r | {"walk": walk} | figures for r in overlap_rows(copies, kernels)]
        trace.export_chrome_trace(str(args.out / f"overlap_trace_{walk}.json.gz"))
        write_rows(args.out, "overlap", rows)  # a step cut short by its budget keeps the first job's
    return 0


def _profiled_steps(overrides: tuple[str, ...]):
    """Two profiled training steps of ``model=1.3b`` with memo and ``overrides``: the copies'
    spans per direction and the compute kernels' (microseconds), the job's figures (``seq`` in
    tokens, α: the mean over tiles for a walk in tiles) and the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    from memo.config import resolve
    from memo.gpucheck.common import compose
    from memo.execute import distributed
    from memo.execute.distributed import ProcessInfo
    from memo.data.batches import SyntheticTokens, micro_batches

    device = torch.device("cuda", 0)
    run = resolve(compose("model=1.3b", "method=memo", "method.keep_all=never", "train.dtype=bf16", "train.loss=tiled", *overrides),
                  gpu_visible=True)
    workload = run.workload
    distributed.initialize(workload.parallel, "cuda", ProcessInfo(0, 1, 0))
    try:
        torch.manual_seed(0)
        model, placement = placed_model(workload, device, host_budget=64 * 2**30)
        batches = micro_batches(SyntheticTokens(workload.model.vocab_size, 0), workload.seq, 1, 1, 0, 1, device)

        def step():
            (batch,) = next(batches)
            batch = placement.token_order(batch)
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss.float().mean().backward()

        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            step()
            step()
            torch.cuda.synchronize()
        placement.release()
    finally:
        distributed.shutdown()
    copies: dict[str, list] = {"d2h": [], "h2d": []}
    kernels = []
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        if "DtoH" in event.name:
            copies["d2h"].append(span)
        elif "HtoD" in event.name:
            copies["h2d"].append(span)
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            kernels.append(span)
    decided = placement.report().row
    alpha = decided["tiles.alpha_mean"] if "tiles.alpha_mean" in decided else decided["swap.alpha"]
    return copies, kernels, {"alpha": alpha, "seq": workload.seq}, trace


if __name__ == "__main__":
    sys.exit(main())
