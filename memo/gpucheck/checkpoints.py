"""Pack step ``checkpoints``: a save and a resume at 64K tokens with each optimizer path.

For Megatron's optimizer on the device, its distributed optimizer, and Adam on the host
(``train.optimizer_offload=host``, all the states there and half), ``memo`` (α fixed) trains a Llama-shaped model for six steps,
saving (and validating on one held-out sequence) after the third and the sixth; a second job
loads the third step's checkpoint in a new process and trains steps four to six. Its losses, its
last validation loss and its final weights and optimizer state are set beside the uninterrupted
run's: the GPU's attention backward sums in a nondeterministic order, so they agree to rounding
(``max_loss_diff``, ``valid_loss_diff``, ``max_tensor_diff``; a path whose losses differ by more
than ``LOSS_TOLERANCE`` is ``diverged``), not bit for bit as on the CPU
(``tests/execute/test_checkpoint.py``). ``--cpu`` rehearses it with the tiny model
(``common.CPU_TINY``), the CPU's one optimizer path, at 256 tokens.

    python -m memo.gpucheck.checkpoints --out DIR [--cpu]
"""

import json
import sys
from pathlib import Path

from memo.gpucheck.common import CPU_TINY, arguments, run_job, runs_dir, write_rows

# nondeterministic sums move a resumed run's losses by rounding (5e-5 on an H100); a wrong Adam
# step or moment moves them by tenths
LOSS_TOLERANCE = 1e-2
PATHS = {"device": [], "distributed": ["train.distributed_optimizer=true"], "host": ["train.optimizer_offload=host"],
         # half the states on the host: the device's sub-optimizer is resumed too
         "host_half": ["train.optimizer_offload=host", "train.optimizer_offload_fraction=0.5"]}


def _records(run_dir: Path) -> dict[int, dict]:
    """Each step's record in ``metrics.jsonl``, by step."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _max_tensor_diff(a: Path, b: Path) -> float:
    """The largest difference between two checkpoints' tensors (weights and Adam's state)."""
    import torch
    from megatron.core.dist_checkpointing import load_plain_tensors

    from memo.config import ParallelConfig
    import memo.execute.checkpoint  # noqa: F401 (it lets weights-only loads read the optimizer classes)
    from memo.execute import distributed

    distributed.initialize(ParallelConfig(), "cpu", distributed.ProcessInfo(rank=0, world_size=1, local_rank=0))
    try:
        first, second = load_plain_tensors(str(a)), load_plain_tensors(str(b))
    finally:
        distributed.shutdown()
    keys = [k for k, v in first.items() if isinstance(v, torch.Tensor)]
    if sorted(keys) != sorted(k for k, v in second.items() if isinstance(v, torch.Tensor)):
        return float("inf")
    return max((first[k].double() - second[k].double()).abs().max().item() for k in keys)


def main(argv=None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    if args.cpu:
        common, paths = [*CPU_TINY, "seq=256"], {"host_cpu": []}
    else:
        common, paths = ["model=tiny_llama", "seq=64k"], PATHS
    common += ["method=memo", "alpha=0.5", "train.warmup_steps=1", "train.save_interval=3",
               "train.eval_interval=3", "train.eval_iters=1"]
    rows = []
    for name, extra in paths.items():
        whole_dir = runs_dir(args.out) / f"checkpoints-{name}"
        resumed_dir = whole_dir.with_name(f"{whole_dir.name}-resumed")
        (whole,) = run_job(whole_dir, *common, *extra, "train.steps=6")
        row = {"path": name, "status": whole.get("status"), "error": whole.get("error"),
               "optimizer": whole.get("optimizer"), "device_name": whole.get("device_name")}
        if whole.get("status") == "ok":
            (resumed,) = run_job(resumed_dir, *common, *extra, "train.steps=6",
                                 f"train.load={whole_dir / 'checkpoints' / 'step_0000003'}")
            row.update(status=resumed.get("status"), error=resumed.get("error"),
                       resumed_from_step=resumed.get("resumed_from_step"))
            if resumed.get("status") == "ok":
                expected, got = _records(whole_dir), _records(resumed_dir)
                row["max_loss_diff"] = max(abs(got[s]["loss"] - expected[s]["loss"]) for s in got)
                row["valid_loss_diff"] = abs(got[6]["valid_loss"] - expected[6]["valid_loss"])
                row["max_tensor_diff"] = _max_tensor_diff(whole_dir / "checkpoints" / "step_0000006",
                                                          resumed_dir / "checkpoints" / "step_0000006")
                row["loss_last"] = got[6]["loss"]
                if row["max_loss_diff"] > LOSS_TOLERANCE:
                    row["status"] = "diverged"
        rows.append(row)
        write_rows(args.out, "checkpoints", rows)  # a step cut short by its budget keeps its table
        print(f"checkpoints: {name}: {row['status']} resumed from {row.get('resumed_from_step')}, loss within "
              f"{row.get('max_loss_diff')}, validation loss within {row.get('valid_loss_diff')}, tensors within {row.get('max_tensor_diff')}", flush=True)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
