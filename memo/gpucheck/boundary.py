"""Pack step ``boundary``: the fit's longest length proven on this GPU, from both sides.

Llama-3.1-8B's shape with :data:`LAYERS` layer, MEMO in tiles of 16K, Adam's states on the device
and the loss in tiles of 4K (every setting explicit, so that a run checked against the fit and one
tried as given are the same run). The host the runs may use is capped at :data:`HOST_GIB` GiB
(α, solved against it, swaps less where less is given; the device's bytes do not depend on it),
far from the machine's 128: the device is what binds, and each row says both.

1. ``fit``: the fit (``mode=fit``, this device's figures) at 1M tokens gives a step's time; the
   length whose step takes about :data:`STEP_S` seconds (attention grows as the square of the
   length) is ``T``, and the fit at ``T`` and eight tiles past it gives the bytes a token there.
2. A ballast allocation of this process leaves the runs a device of ``P(T) / (1 − margin)`` bytes:
   ``T`` is then the longest length the fit lets fit, with ``fit.memory_margin`` kept free.
3. ``longest``: one step at ``T``, checked by the fit first (``train.fit_check=true``): it must
   run, and its peak be within 3% of the fit's (:func:`memo.fit.calibration.compare`).
4. ``refused``: one step at ``L``, the first length (of 16K tiles, by fits of a few lengths past
   the estimate from the bytes a token near ``T``) whose prediction less the margin is the whole
   device and what the fit adds for the driver and libraries, checked: refused in one line before
   anything is allocated.
5. ``bypassed``: the same step tried as given: it must run out of *device* memory (were the fit
   off by more than its margin, it would not).

``--cpu`` rehearses it with ``tiny_llama`` of one layer in tiles of 512 on a "device" of the budget
(``hardware.device_memory_gib``, no ballast) and leaves out the bypassed run: a CPU has no device
memory to run out of.

    python -m memo.gpucheck.boundary --out DIR [--cpu]
"""

import math
import sys
import time

from memo.gpucheck.common import arguments, compose, row_figures, run_job, runs_dir, write_rows

LAYERS = 1
# the host the runs may use (GiB): α, solved against it, keeps what they pin small (a few seconds
# to pin, far from the machine's 128 GiB); the device's bytes do not depend on α
HOST_GIB = 24
STEP_S = 60.0  # a step at the longest length takes about this long (seconds, by the fit)
PROBE_TOKENS = 1 << 20  # the length the fit first times
FIT_FIGURES = ["seq", "status", "predicted_device_bytes", "margin_bytes", "predicted_device_capacity_bytes",
               "predicted_host_bytes_per_device", "predicted_iter_time_s", "predicted_peak_phase"]


def settings(cpu: bool) -> tuple[list[str], int, int, float]:
    """The overrides every job shares, the tile (tokens; lengths are multiples of it), the length
    first timed and the seconds a step may take."""
    if cpu:
        return (["model=tiny_llama", f"model.num_layers={LAYERS}", "method=memo", "method.keep_all=never", "method.tile_tokens=512",
                 "train.loss_tile_tokens=256", "train.optimizer_offload=none", "train.dtype=fp32", "hardware=cpu"],
                512, 4096, 20.0)
    return (["model=llama3_8b", f"model.num_layers={LAYERS}", "method=memo", "method.keep_all=never", "method.tile_tokens=16k",
             "train.loss_tile_tokens=4096", "train.optimizer_offload=none", "train.dtype=bf16", "hardware=auto",
             f"hardware.host_memory_gib={HOST_GIB}"],
            16384, PROBE_TOKENS, STEP_S)


def timed_length(probe: int, probe_s: float, step_s: float, tile: int) -> int:
    """The length (a multiple of ``tile``) whose step takes about ``step_s`` seconds, a step at
    ``probe`` tokens taking ``probe_s``: time taken to grow as the square of the length."""
    return max(tile, int(probe * math.sqrt(step_s / probe_s)) // tile * tile)


def budget_bytes(predicted: int, margin: float) -> int:
    """The device a run whose prediction is ``predicted`` bytes just fits, ``margin`` of it kept
    free (0.1% over, for the rounding of the margin and of the ballast: far less than the next
    tile's bytes)."""
    return math.ceil(predicted / (1 - margin) * 1.001)


def over_length(seq: int, predicted: int, slope: float, device: int, margin: float, tile: int) -> int:
    """The first length past ``seq`` (on the ``tile`` grid) whose prediction, with the device bytes
    growing ``slope`` a token from ``predicted`` at ``seq``, less ``margin`` of it is the whole
    ``device``: a fit off by less than its margin there predicts a run that cannot fit."""
    need = device / (1 - margin) - predicted
    return seq + max(1, math.ceil(need / slope / tile)) * tile


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    from memo.fit.calibration import compare
    from memo.results import read_rows

    shared, tile, probe, step_s = settings(args.cpu)
    config = compose(*shared)
    margin = config.fit.memory_margin
    runs, rows = runs_dir(args.out), []

    def fit(name: str, *lengths: int) -> list[dict]:
        found = run_job(runs / f"boundary-{name}", "mode=fit", f"seq={','.join(map(str, lengths))}", *shared,
                        multirun=len(lengths) > 1, timeout_s=240)
        rows.extend({"job": f"fit-{name}", **{k: r.get(k) for k in FIT_FIGURES}, "error": r.get("error")}
                    for r in found)
        write_rows(args.out, "boundary", rows)
        return found

    (timing,) = fit("probe", probe)
    if timing.get("predicted_iter_time_s") is None:
        return 1
    seq = timed_length(probe, timing["predicted_iter_time_s"], step_s, tile)
    at_seq, past = sorted(fit("affine", seq, seq + 8 * tile), key=lambda r: int(r["seq"]))
    predicted = at_seq["predicted_device_bytes"]
    slope = (past["predicted_device_bytes"] - predicted) / (8 * tile)  # near seq: the bytes a token
    device = budget_bytes(predicted, margin)
    # past the margin, and past what the fit adds for the driver and libraries (a run's free memory
    # already leaves out its own CUDA context): the first length checked by a fit of its own
    beyond = device + (int(config.fit.device_reserved_gib * 2**30) if not args.cpu else 0)
    first = over_length(seq, predicted, slope, beyond, margin, tile)
    tried = sorted(fit("over", *(first + k * tile for k in (0, 1, 2, 4, 8))), key=lambda r: int(r["seq"]))
    over = next((int(r["seq"]) for r in tried if (r.get("predicted_device_bytes") or 0) * (1 - margin) >= beyond),
                int(tried[-1]["seq"]))
    ballast, ballast_bytes, budget = _leave_device(device, args.cpu)
    base = [*shared, "train.steps=1", "train.warmup_steps=0", *budget]
    common = {"device_budget_bytes": device, "ballast_bytes": ballast_bytes, "memory_margin": margin}

    def train(name: str, length: int, *overrides: str) -> dict:
        start = time.monotonic()
        run_dir = runs / f"boundary-{name}-{length}"
        (row,) = run_job(run_dir, *base, f"seq={length}", *overrides, timeout_s=300)
        figures = row_figures(row) | {"job": name, "seq": length, "wall_s": time.monotonic() - start, **common}
        figures |= {k: row.get(k) for k in ("predicted_device_bytes", "predicted_host_bytes_per_device",
                                            "peak_tensor_bytes", "choice.seconds")}
        if row.get("status") == "ok" and args.cpu:  # the live tensors against the check's prediction
            figures |= {"predicted_peak_bytes": row["predicted_device_bytes"],
                        "measured_peak_bytes": row["peak_tensor_bytes"],
                        "memory_error": row["predicted_device_bytes"] / row["peak_tensor_bytes"] - 1}
        elif row.get("status") == "ok":
            (again,) = compare(read_rows(run_dir))
            figures |= {k: again[k] for k in ("predicted_peak_bytes", "measured_peak_bytes", "memory_error")}
        rows.append(figures)
        write_rows(args.out, "boundary", rows)
        return figures

    longest = train("longest", seq, "train.fit_check=true")
    refused = train("refused", over, "train.fit_check=true")
    error = longest.get("memory_error")
    held = longest.get("status") == "ok" and error is not None and abs(error) <= 0.03
    told = refused.get("status") == "oom" and "does not fit" in str(refused.get("error"))
    ran_out = True
    if not args.cpu:
        bypassed = train("bypassed", over)
        ran_out = bypassed.get("status") == "oom" and "out of memory" in str(bypassed.get("error")).lower()
    del ballast
    print(f"boundary: {seq} tokens {longest.get('status')} (memory error {longest.get('memory_error')}), "
          f"{over} refused: {told}, ran out of device memory as given: {ran_out}", flush=True)
    return 0 if held and told and ran_out else 1


def _leave_device(device: int, cpu: bool):
    """Leave the runs ``device`` bytes of the device: on a GPU a ballast tensor of this process
    (returned, to be held while they run) takes the rest of what is free, this process's own CUDA
    context standing for the runs'; on the CPU the budget is an override. Returns the ballast (None
    on the CPU), its bytes and the runs' overrides."""
    if cpu:
        return None, 0, [f"hardware.device_memory_gib={device / 2**30!r}"]
    import torch

    torch.empty(1, device="cuda")  # this process's context, as large as a run's
    free, total = torch.cuda.mem_get_info()
    context = total - free
    size = free - context - device
    if size <= 0:
        raise RuntimeError(f"the device has {free} bytes free, less than a budget of {device} and a context of {context}")
    return torch.empty(size, dtype=torch.uint8, device="cuda"), size, []


if __name__ == "__main__":
    sys.exit(main())
