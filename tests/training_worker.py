"""A training job in several processes, as ``torchrun run.py OVERRIDES`` runs it (``run_job`` in
each process, rank 0 writing the row and the step log), as a check of ``tests/checks_worker.py``,
so that the suite's multi-process training comparisons share one launch. ``torchrun run.py``
itself is tested by ``test_training.py``'s data-parallel test."""

from pathlib import Path

from memo.execute.distributed import ProcessInfo
from memo.modes.train import run_job

from conftest import compose_config


def _without_deepspeeds_shared_memory_all_reduce() -> None:
    """DeepSpeed compiles its shared-memory all-reduce for the CPU when its communication starts
    (a C++ extension: 75 s on two cores, and again for every checkout, whose path its build
    command names); only its inference all-reduce uses it, none of Ulysses' all-to-alls."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def train(info: ProcessInfo, out: Path, *overrides: str) -> str:
    """Run the job; raises unless its row (every rank's) says ``ok``."""
    if any(o.startswith("method=deepspeed") for o in overrides):
        _without_deepspeeds_shared_memory_all_reduce()
    row = run_job(compose_config(*overrides), out, overrides, info=info)
    assert row["status"] == "ok" and row["world_size"] == info.world_size, row["error"]
    return f"status ok in {out}"
