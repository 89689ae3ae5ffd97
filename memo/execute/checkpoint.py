"""Checkpoints of a training run, through megatron-core's distributed checkpointing.

A checkpoint is a directory ``step_<7 digits>/`` of ``train.save_dir`` in megatron-core's
``torch_dist`` format: the weights and the optimizer's state as sharded tensors in the model's
own (unsharded) coordinates, so that any tensor-, context- or data-parallel layout loads them;
the steps done, the samples consumed and the layout it was saved at, once; and each rank's
random-number generators, restored only at the same layout. The learning rate is a function of
the step (:mod:`memo.execute.schedule`) and sample ``i`` a function of the seed and ``i``
(:mod:`memo.execute.data`), so the step and the samples consumed are the whole position of the
run. MEMO's runtime (α, the buffers, a memory plan) is rebuilt by the run that loads, never saved.

Every rank writes into ``.step_<n>.partial/``; once all have, global rank 0 renames it to
``step_<n>/``. A process killed during a save leaves the earlier checkpoints whole and a partial
directory no load ever reads (the next save of that step replaces it).
"""

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from memo.config import ConfigError, TrainConfig

log = logging.getLogger("memo")

CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d{7})")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message is one line naming it and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its directory and the steps done when it was saved."""

    path: Path
    step: int


def step_dir(save_dir: Path, step: int) -> Path:
    """Where the checkpoint after ``step`` steps goes."""
    return Path(save_dir) / f"step_{step:07d}"


def checkpoints(save_dir: Path) -> list[Checkpoint]:
    """The complete checkpoints in ``save_dir``, by step (none if it does not exist)."""
    save_dir = Path(save_dir)
    found = [Checkpoint(p, int(m.group(1))) for p in save_dir.iterdir() if (m := _STEP_DIR.fullmatch(p.name))] \
        if save_dir.is_dir() else []
    return sorted(found, key=lambda c: c.step)


def to_load(train: TrainConfig, save_dir: Path) -> Optional[Checkpoint]:
    """The checkpoint ``train.load`` names: for ``auto`` the last one in ``save_dir`` (None if it
    has none), else the directory given, a checkpoint or a save directory (its last one).

    Raises:
        CheckpointError: a path that is neither, or a save directory without checkpoints.
    """
    if train.load is None:
        return None
    if train.load == "auto":
        found = checkpoints(save_dir)
        return found[-1] if found else None
    path = Path(train.load)
    match = _STEP_DIR.fullmatch(path.name)
    if match and path.is_dir():
        return Checkpoint(path, int(match.group(1)))
    found = checkpoints(path)
    if not found:
        raise CheckpointError(f"train.load={train.load} is neither a checkpoint (step_<n>/) nor a directory that holds "
                              "one; give one, auto (the last in train.save_dir), or null to start afresh")
    return found[-1]


def check_save_dir(save_dir: Path, resumed: Optional[Checkpoint]) -> None:
    """Refuse a save directory whose checkpoints this run would not continue: a run started afresh
    into one that has checkpoints, or one resumed before the last of them (later saves would
    replace theirs).

    Raises:
        ConfigError: saying which checkpoint is in the way and what to set.
    """
    found = checkpoints(save_dir)
    if not found:
        return
    start = resumed.step if resumed is not None else 0
    later = [c for c in found if c.step > start]
    if resumed is None or later:
        raise ConfigError(f"train.save_dir={save_dir} holds {found[-1].path.name}, which this run "
                          f"{'does not load' if resumed is None else f'(resumed at step {start}) would replace'}; "
                          "set train.load=auto to go on from it, or choose another train.save_dir")


class HostTensorSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` format, written without staging: its staging copies device
    tensors to the host and then synchronizes CUDA, which a CPU-only PyTorch refuses; tensors in
    host memory need no copy, and the write is synchronous."""

    def save(self, sharded_state_dict: dict, checkpoint_dir) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir)._replace(preload_fn=None).execute_sync()


def _layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(module: torch.nn.Module, optimizer, is_loading: bool) -> dict:
    """What every rank saves (or loads into): sharded model and optimizer state, its RNGs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = module.sharded_state_dict()
    return {
        "model": model,
        "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading),
        "rng": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


def save(save_dir: Path, step: int, consumed_samples: int, module: torch.nn.Module, optimizer) -> Checkpoint:
    """Save the run after ``step`` steps (collective: every rank calls it) and return it.

    Args:
        module: the model (unwrapped: what ``sharded_state_dict`` is asked of).
        optimizer: a :class:`memo.execute.optimizer.StepOptimizer`.
        consumed_samples: training samples (sequences) drawn so far, over all replicas.
    """
    final, partial = step_dir(save_dir, step), Path(save_dir) / f".step_{step:07d}.partial"
    if dist.get_rank() == 0:
        if final.exists():  # check_save_dir refused this at the start; another run wrote it since
            raise ConfigError(f"{final} exists and is kept; choose another train.save_dir")
        shutil.rmtree(partial, ignore_errors=True)  # left by a process killed while saving
        partial.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(module, optimizer, is_loading=False)
    state.update(format=CHECKPOINT_FORMAT, step=step, consumed_samples=consumed_samples, layout=_layout())
    strategy = None if torch.cuda.is_available() else HostTensorSaveStrategy("torch_dist", 1)
    dist_checkpointing.save(state, str(partial), sharded_strategy=strategy)
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(partial, final)
        directory = os.open(save_dir, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
    dist.barrier()
    return Checkpoint(final, step)


@dataclass(frozen=True)
class Resumed:
    """What a loaded checkpoint tells the run: where it goes on from."""

    step: int
    consumed_samples: int
    rng_restored: bool  # False when saved at another layout (each rank's generators differ)


def load(checkpoint: Checkpoint, module: torch.nn.Module, optimizer) -> Resumed:
    """Load ``checkpoint`` into the model and the optimizer (collective), at this run's layout.

    Raises:
        CheckpointError: a directory megatron-core cannot read, or of another format.
    """
    path = str(checkpoint.path)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as error:  # a torch.load of a missing or damaged file: many types
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); load another one, "
                              "or set train.load=null to start afresh") from None
    if common.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is a checkpoint of format {common.get('format')}, this version reads "
                              f"{CHECKPOINT_FORMAT}; load it with the version that wrote it")
    same_layout = common["layout"] == _layout()
    state = _sharded_state(module, optimizer, is_loading=True)
    if not same_layout:
        del state["rng"]
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as error:
        raise CheckpointError(f"{path} cannot be loaded into this model ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); load a checkpoint of the "
                              "same model") from None
    module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    log.info("resumed from %s: step %d, %d samples consumed%s", path, common["step"], common["consumed_samples"],
             "" if same_layout else f" (saved at {common['layout']}; random generators not restored)")
    return Resumed(common["step"], common["consumed_samples"], same_layout)
