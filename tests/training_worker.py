"""A training job in several processes, as ``torchrun run.py OVERRIDES`` runs it (``run_job`` in
each process, rank 0 writing the row and the step log), as a check of ``tests/checks_worker.py``,
so that the suite's multi-process training comparisons share one launch. ``torchrun run.py``
itself is tested by ``test_training.py``'s data-parallel test."""

import time
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


def resume(info: ProcessInfo, out: Path, first_steps: str, layout: str, *overrides: str) -> str:
    """A job that goes on in this launch's processes from a checkpoint one process saved: rank 0
    trains ``overrides`` for ``first_steps`` steps alone (in ``out/first``), then every rank trains
    them with ``layout`` (comma-separated overrides) from that checkpoint (in ``out/second``)."""
    done = out / "first.done"
    if info.rank == 0:
        alone = ProcessInfo(rank=0, world_size=1, local_rank=0)
        first = [*overrides, f"train.steps={first_steps}"]
        row = run_job(compose_config(*first), out / "first", first, info=alone)
        assert row["status"] == "ok", row["error"]
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()
    deadline = time.monotonic() + 300
    while not done.exists():  # (a failing rank 0 ends the launch)
        assert time.monotonic() < deadline, f"rank 0 saved no checkpoint in {out / 'first'} within 300 s"
        time.sleep(0.2)
    second = [*overrides, *layout.split(","), f"train.load={out / 'first' / 'checkpoints'}"]
    row = run_job(compose_config(*second), out / "second", second, info=info)
    assert row["status"] == "ok" and row["world_size"] == info.world_size, row["error"]
    return f"resumed from step {row['resumed_from_step']} in {out / 'second'}"
