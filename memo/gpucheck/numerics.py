"""Pack step ``numerics``: every activation method's gradients against keeping everything.

One forward and backward pass of a small multi-layer GPT, and of a small Llama-shaped model,
per method, from the same weights and tokens as ``method=none``; per method the largest normwise relative error over the parameters,
``‖g − g_none‖ / ‖g_none‖``, and the loss's relative error. Tolerances (:data:`TOLERANCE`): fp32 on
the CPU 1e-5 (the test suite asserts equality there); bf16 on a GPU 2e-2, since recomputing the
dropped ``S − k`` rows runs cuBLAS kernels chosen for another shape, so the GPU's gradients are not
bit-exact, only as close as bf16 rounding of the same sums in another order allows. ``plan=true``
against ``plan=false`` over several steps is a pair of training jobs (:func:`plan_row`).

    python -m memo.gpucheck.numerics --out DIR [--cpu]
"""

import sys
from typing import Optional

import torch

from memo.config import resolve
from memo.execute import distributed
from memo.data.batches import SyntheticTokens, micro_batches
from memo.execute.distributed import ProcessInfo
from memo.gpucheck.common import (CPU_TINY, arguments, compose, placed_model, run_job, runs_dir,
                                  step_device, write_rows)
from memo.model import dtype_label, dtype_setting
from memo.model.attention import select_backend

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# the Llama shape's size on a GPU (tiny_llama widened): six layers of width 1024
LLAMA_GPU = ["model.num_layers=6", "model.hidden_size=1024", "model.ffn_hidden_size=3584"]
# method, alpha (memo's), tokens per sequence tile (None: whole layers), as the pack compares them
METHODS = [("memo", 0.0, None), ("memo", 0.5, None), ("memo", 1.0, None), ("full_swap", None, None),
           ("full_recompute", None, None), ("megatron_full_recompute", None, None)]
# the layers walked in sequence tiles: a quarter of the sequence per tile, the tile attention's
# block kernels and its float32 key and value accumulators on the device
TILES = 4


def tiled(methods, seq: int, tiles: int = TILES) -> list[tuple]:
    """``methods`` walking their layers in ``tiles`` sequence tiles of ``seq`` tokens (α unset)."""
    return [(method, None, seq // tiles) for method, _, _ in methods]


def gradients(method: str, alpha, model_overrides: list[str], seq: int, device: torch.device,
              dtype: torch.dtype, kernel: str = "auto", tile: Optional[int] = None
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients (fp32, by parameter name) of one pass of ``method`` on fixed tokens,
    its layers in tiles of ``tile`` tokens when given.

    Megatron's parallel state must be initialized for one process.
    """
    given = ([] if alpha is None else [f"alpha={alpha}"]) + ([] if tile is None else [f"method.tile_tokens={tile}"])
    run = resolve(compose(f"method={method}", *given, *model_overrides, f"seq={seq}",
                          f"train.dtype={dtype_setting(dtype)}"), gpu_visible=device.type == "cuda")
    torch.manual_seed(run.train.seed)
    model, placement = placed_model(run.workload, device, kernel)
    (batch,) = next(micro_batches(SyntheticTokens(run.workload.model.vocab_size, 0), seq, 1, 1, 0, 1, device))
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
    loss.backward()
    placement.release()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


# plan=true against plan=false, the last step's loss (the first step is the one recorded, unplanned
# in both): equal on the CPU; on a GPU the backward's atomic accumulations (the attention kernels'
# dq, among others) make two runs of the same code part after the first update, by about 1e-5
# relatively after four steps, so a third job, plan=false again, measures that spread and the plan
# may differ by ten times it (at least 1e-4), while a misplaced tensor corrupts the loss outright
PLAN_TOLERANCE_CPU = 1e-6
PLAN_SPREAD_FACTOR, PLAN_TOLERANCE_FLOOR = 10, 1e-4


def plan_row(planned: dict, unplanned: dict, again: Optional[dict]) -> dict:
    """The row comparing a ``plan=true`` job with a ``plan=false`` one: the last step's losses
    equal (:data:`PLAN_TOLERANCE_CPU`) without ``again``, else within ten times their distance from
    ``again`` (``plan=false`` run once more), and at least :data:`PLAN_TOLERANCE_FLOOR`, relatively."""
    jobs = [planned, unplanned] + ([again] if again is not None else [])
    ran = all(job.get("status") == "ok" for job in jobs)

    def error(a: dict, b: dict, key: str) -> Optional[float]:
        return abs(a[key] / b[key] - 1) if ran else None

    first, last = error(planned, unplanned, "loss_first"), error(planned, unplanned, "loss_last")
    repeat = error(again, unplanned, "loss_last") if again is not None else None
    if again is None:
        tolerance = PLAN_TOLERANCE_CPU
    else:
        tolerance = max(PLAN_SPREAD_FACTOR * repeat, PLAN_TOLERANCE_FLOOR) if ran else None
    ok = ran and last <= tolerance
    detail = ", ".join(str(job.get("status")) for job in jobs)
    return {"kernel": "auto", "method": "memo plan=true vs plan=false", "alpha": 0.5,
            "loss_error": last, "first_loss_error": first, "repeat_loss_error": repeat,
            "tolerance": tolerance, "status": "ok" if ok else "failed",
            "worst_parameter": f"last losses {planned.get('loss_last')} and {unplanned.get('loss_last')} "
                               f"(plan=false again: {again.get('loss_last') if again else 'not run'}; {detail})"}


def relative_errors(loss: float, grads: dict, reference: tuple[float, dict]) -> dict:
    """The loss's relative error and the largest normwise one over the parameters (and which)."""
    ref_loss, ref_grads = reference
    worst, name = 0.0, None
    for key, expected in ref_grads.items():
        error = (grads[key] - expected).norm().item() / max(expected.norm().item(), 1e-30)
        if error > worst or name is None:
            worst, name = error, key
    return {"loss_error": abs(loss - ref_loss) / abs(ref_loss), "grad_error": worst, "worst_parameter": name}


def judged(errors: dict, dtype: torch.dtype, **fields) -> dict:
    """A row of ``fields`` and :func:`relative_errors`' ``errors``, with the tolerance of ``dtype``
    (:data:`TOLERANCE`) and its verdict (``status``)."""
    ok = errors["grad_error"] <= TOLERANCE[dtype] and errors["loss_error"] <= TOLERANCE[dtype]
    return {**fields, "dtype": dtype_label(dtype), **errors, "tolerance": TOLERANCE[dtype],
            "status": "ok" if ok else "failed"}


def say(step: str, what: str, row: dict) -> None:
    """Print a :func:`judged` row's errors and verdict."""
    print(f"{step}: {what}: loss error {row['loss_error']:.2e}, gradient error {row['grad_error']:.2e} "
          f"({'ok' if row['status'] == 'ok' else 'ABOVE'} {row['tolerance']:g})", flush=True)


def kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[str]:
    """The SDPA kernels that run here for this head size, fastest first."""
    names = []
    for name in ("cudnn", "flash", "efficient", "math"):
        try:
            names.append(select_backend(device.type, dtype, head_dim, name))
        except Exception:  # noqa: BLE001 - a kernel that cannot run here is simply not listed
            continue
    return names


def compare_methods(model_overrides: list[str], seq: int, device: torch.device, dtype: torch.dtype,
                    methods=METHODS, kernel_names=("auto",)) -> list[dict]:
    """One row per (kernel, method): errors against ``none`` with the same kernel, and the verdict."""
    rows = []
    distributed.initialize(compose(*model_overrides).parallel, device.type, ProcessInfo(0, 1, 0))
    try:
        for kernel in kernel_names:
            reference = gradients("none", None, model_overrides, seq, device, dtype, kernel)
            for method, alpha, tile in methods:
                loss, grads = gradients(method, alpha, model_overrides, seq, device, dtype, kernel, tile)
                rows.append(judged(relative_errors(loss, grads, reference), dtype,
                                   model=compose(*model_overrides).model.name, kernel=kernel, method=method,
                                   alpha=alpha, tile_tokens=tile, seq=seq))
                say("numerics", f"{kernel} {method} alpha={alpha} tile={tile}", rows[-1])
    finally:
        distributed.shutdown()
    return rows


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    device, dtype = step_device(args.cpu)
    # one loss for all, so that only the activation methods differ
    overrides = [*CPU_TINY, "model.num_layers=4", "train.loss=tiled"] if args.cpu else \
        ["model=125m", "model.num_layers=6", "train.loss=tiled"]
    seq = 256 if args.cpu else 8192
    if not args.cpu:
        torch.cuda.set_device(0)
    # the CPU rehearses the step with one method of each kind: the suite checks them all there
    both_tiled = tiled([METHODS[1], METHODS[4]], seq)
    rows = compare_methods(overrides, seq, device, dtype,
                           methods=[METHODS[1], METHODS[-1], both_tiled[0]] if args.cpu else METHODS + both_tiled)
    # the Llama shape: grouped keys and values, SwiGLU and RMSNorm (CUDA's fused RMSNorm backward)
    llama = ["model=tiny_llama", "train.loss=tiled"]
    if not args.cpu:
        llama += LLAMA_GPU
    rows += compare_methods(llama, seq, device, dtype, methods=[METHODS[1]] if args.cpu else
                            [METHODS[1], METHODS[3], METHODS[4], METHODS[5], *both_tiled])
    common = [*CPU_TINY, "seq=256", "train.steps=3", "train.warmup_steps=1", "method=memo", "alpha=0.5"]
    if not args.cpu:
        common = ["model=125m", "seq=8k", "train.steps=4", "train.warmup_steps=1", "method=memo",
                  "alpha=0.5"]
    common += ["method.tile_tokens=whole", "train.optimizer_offload=none"]  # the plan against none, as such
    write_rows(args.out, "numerics", rows)  # kept if the training jobs run past the step's budget
    # the plan's solve bounded: its placement, not its optimality, is compared here
    common += ["planner.time_limit_s=10", "planner.mip=none"]
    names = ("true", "false") if args.cpu else ("true", "false", "false-again")
    planned, unplanned, *again = (run_job(runs_dir(args.out) / f"numerics-plan-{name}", *common,
                                          f"plan={name.split('-')[0]}")[0] for name in names)
    rows.append(plan_row(planned, unplanned, again[0] if again else None))
    write_rows(args.out, "numerics", rows)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
