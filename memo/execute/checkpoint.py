"""Checkpoints of a training run, through megatron-core's distributed checkpointing.

A checkpoint is a directory ``step_<7 digits>/`` of ``train.save_dir`` in megatron-core's
``torch_dist`` format: the weights and the optimizer's state as sharded tensors in the model's
own (unsharded) coordinates, so that any tensor-, context- or data-parallel layout loads them;
the steps done, the samples consumed and the layout it was saved at, and what fixes the steps
after it (:class:`RunFacts`), once; and each rank's random-number generators, restored only at
the same layout. The learning rate is a function of
the step (:mod:`memo.execute.schedule`) and sample ``i`` a function of the seed and ``i``
(:mod:`memo.data.batches`), so the step and the samples consumed are the whole position of the
run. MEMO's runtime (α, the buffers, a memory plan) is rebuilt by the run that loads, never saved.

Every rank writes into ``.step_<n>.partial/``; once all have, global rank 0 renames it to
``step_<n>/``. A process killed during a save leaves the earlier checkpoints whole and a partial
directory no load ever reads (the next save of that step replaces it).
"""

import dataclasses
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
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import save as save_distributed

from memo.config import ConfigError, ModelConfig, TrainConfig
from memo.execute.optimizer_offload import STATE_CLASSES

log = logging.getLogger("memo")

# megatron-core's loads are torch.loads of weights only; a checkpoint of the offloaded optimizer
# names its optimizer classes (registered once, as megatron-core registers its own classes)
torch.serialization.add_safe_globals(list(STATE_CLASSES))

CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d{7,})")  # (zero-padded to 7 digits: they sort as their steps)


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
    try:
        return find(Path(train.load))
    except CheckpointError as error:
        raise CheckpointError(f"train.load={error}; give one, auto (the last in train.save_dir), or null to start "
                              "afresh") from None


def find(path: Path) -> Checkpoint:
    """The checkpoint ``path`` is, or the last of the directory of them it is.

    Raises:
        CheckpointError: if it is neither.
    """
    match = _STEP_DIR.fullmatch(Path(path).name)
    if match and Path(path).is_dir():
        return Checkpoint(Path(path), int(match.group(1)))
    found = checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint (step_<n>/) nor a directory that holds one")
    return found[-1]


def check_save_dir(save_dir: Path, resumed: Optional[Checkpoint]) -> None:
    """Refuse a save directory whose checkpoints this run would not continue: a run started afresh
    into one that has checkpoints, or one resumed before the last of them (later saves would
    replace theirs).

    Raises:
        ConfigError: saying which checkpoint is in the way and what to set.
    """
    found = checkpoints(save_dir)
    start = resumed.step if resumed is not None else 0
    if any(c.step > start for c in found):
        raise ConfigError(f"train.save_dir={save_dir} holds {found[-1].path.name}, which this run "
                          f"{'does not load' if resumed is None else f'(resumed at step {start}) would replace'}; "
                          "set train.load=auto to go on from it, or choose another train.save_dir")


class HostTensorSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` format (PyTorch's distributed checkpoint, with megatron-core's
    keys and planner), written by this process. megatron-core's writer stages device tensors to
    the host and then synchronizes CUDA, which a CPU-only PyTorch refuses, and writes from forked
    processes that report to a ``multiprocessing`` manager it spawns once per process (on the CPU
    about 3 s, most of it the manager importing PyTorch to read their reports); tensors in host
    memory need neither."""

    def save(self, sharded_state_dict: dict, checkpoint_dir) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        save_distributed(mcore_to_pyt_state_dict(by_key, False),
                         storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1),
                         planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                  flatten_state_dict=False))


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


def _model_state(chunks: list[torch.nn.Module]) -> dict:
    """The sharded state of this rank's model chunks: the one chunk's, else each's under
    ``chunk<i>`` (as Megatron-LM keeps them apart; what a checkpoint holds is keyed by each
    tensor's place in the whole model, so any layout loads it)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _load_model_state(chunks: list[torch.nn.Module], state: dict) -> None:
    if len(chunks) == 1:
        chunks[0].load_state_dict(state)
        return
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"chunk{i}"])


def _sharded_state(chunks: list[torch.nn.Module], optimizer, is_loading: bool) -> dict:
    """What every rank saves (or loads into): sharded model and optimizer state, its RNGs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model_state(chunks)
    return {
        "model": model,
        "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading),
        "rng": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


@dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records of the run that saved it, besides its position: what a run that
    goes on from it must share (:func:`check_resumable`), and what an export needs to know."""

    model_config: dict  # a memo.config.ModelConfig as a dict
    dtype: str  # train.dtype's name of the weights' dtype: fp32, bf16, ...
    optimizer: str  # the optimizer state's format (memo.execute.optimizer.checkpoint_format)
    schedule: dict  # memo.execute.schedule.schedule_settings
    data: dict  # seq, train.seed and train.data: what sample i is
    # the Hugging Face directory the run started from (model.init_from), whose tokenizer an export
    # ships where the run had none; not compared by a run that goes on
    origin: Optional[str] = None

    @staticmethod
    def of(model: ModelConfig, dtype: str, optimizer: str, schedule: dict, seq: int, train: TrainConfig) -> "RunFacts":
        return RunFacts({**dataclasses.asdict(model), "init_from": None}, dtype, optimizer, schedule,
                        {"seq": seq, "train.seed": train.seed, "train.data": train.data,
                         "train.data_split": train.data_split, "train.tokenizer": train.tokenizer,
                         "train.eod_token": train.eod_token}, model.init_from)


# What a model's tensors do not depend on: a run may go on with these changed (a context
# extension raises the rotary base).
_FREE_MODEL_FIELDS = ("name", "init_from", "rotary_base", "rope_scaling", "rope_scaling_factor", "norm_epsilon")


def _agreed(problem: Optional[str]) -> None:
    """Raise ``problem`` (global rank 0's) on every rank, so that none waits for the others in a
    collective they have left."""
    shared = [problem]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise ConfigError(shared[0])


def save(save_dir: Path, step: int, consumed_samples: int, chunks: list[torch.nn.Module], optimizer,
         facts: RunFacts) -> Checkpoint:
    """Save the run after ``step`` steps (collective: every rank calls it) and return it.

    Args:
        chunks: this rank's model chunks (unwrapped: what ``sharded_state_dict`` is asked of).
        optimizer: a :class:`memo.execute.optimizer.StepOptimizer`.
        consumed_samples: training samples (sequences) drawn so far, over all replicas.
        facts: what the checkpoint records of the run (:class:`RunFacts`).
    """
    final, partial = step_dir(save_dir, step), Path(save_dir) / f".step_{step:07d}.partial"
    problem = None
    if dist.get_rank() == 0:
        if final.exists():  # check_save_dir refused this at the start; another run wrote it since
            problem = f"{final} exists and is kept; choose another train.save_dir"
        else:
            shutil.rmtree(partial, ignore_errors=True)  # left by a process killed while saving
            try:
                partial.mkdir(parents=True)
            except OSError as error:
                problem = f"cannot write a checkpoint into {save_dir} ({error.strerror}); choose another train.save_dir"
    _agreed(problem)
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state.update(format=CHECKPOINT_FORMAT, step=step, consumed_samples=consumed_samples, layout=_layout(),
                 run_facts=dataclasses.asdict(facts))  # (one key: beside "model" and "optimizer", no clash)
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


def _first_line(error: BaseException) -> str:
    if isinstance(error, CheckpointException) and error.failures:  # each rank's error, with its traceback
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0] if text else ''}"  # its first sentence


def _check_files(path: Path) -> None:
    """Refuse a checkpoint whose tensor files are shorter than its index says (a copy cut short, a
    full disk): torch's loader would fail in every rank with a traceback each, naming no file.

    Raises:
        CheckpointError: naming the first file that is short or missing.
    """
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:  # a missing or damaged .metadata: many types
        raise CheckpointError(f"{path}/.metadata is not readable ({_first_line(error)}); load another checkpoint, or "
                              "set train.load=null to start afresh") from None
    needed: dict[str, int] = {}
    for item in storage.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            found = "missing" if have is None else f"{have} bytes"
            raise CheckpointError(f"{path / name} is {found}, and the checkpoint's index needs {size}: the checkpoint "
                                  "is incomplete; load another one, or set train.load=null to start afresh")


def saved_facts(path: Path) -> dict:
    """What a checkpoint holds besides its tensors: ``step``, ``consumed_samples``, ``layout``
    and the fields of :class:`RunFacts`.

    Raises:
        CheckpointError: a directory megatron-core cannot read, or of another format.
    """
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (Exception, CheckpointException) as error:  # a torch.load of a missing or damaged file: many types
        raise CheckpointError(f"{path} is not a readable checkpoint ({_first_line(error)}); load another one, "
                              "or set train.load=null to start afresh") from None
    _check_files(Path(path))
    if common.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is a checkpoint of format {common.get('format')}, this version reads "
                              f"{CHECKPOINT_FORMAT}; load it with the version that wrote it")
    missing = [k for k in ("step", "consumed_samples", "layout", "run_facts") if k not in common]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; load a checkpoint this version saved")
    return {**{k: v for k, v in common.items() if k != "run_facts"}, **common["run_facts"]}


def check_resumable(path: Path, saved: dict, facts: RunFacts, auto: bool) -> None:
    """Refuse to go on from the checkpoint at ``path`` (:func:`saved_facts` ``saved``) where the
    run differs from the one that saved it in what fixes its steps: the model, the optimizer
    state's format and the learning-rate schedule; under ``train.load=auto`` also the data and
    the sequence length (a save directory another run's checkpoints are in). A checkpoint given by
    name may be continued at another length or on other data (a context extension).

    Raises:
        ConfigError: naming the first difference and what to set.
    """
    # (a field the model gained since keeps its value; one it lost is not compared)
    ours = facts.model_config
    different = [k for k in ours if k not in _FREE_MODEL_FIELDS and saved["model_config"].get(k, ours[k]) != ours[k]]
    if different:
        raise ConfigError(f"{path} is of another model (model.{different[0]}={saved['model_config'][different[0]]}); "
                          "load a checkpoint of this model, or export it (python -m memo.modes.export) to start from")
    if saved["optimizer"] != facts.optimizer or saved["dtype"] != facts.dtype:
        hint = {"megatron_distributed": "train.distributed_optimizer=true", "megatron": "train.distributed_optimizer="
                "false", "megatron_host_offload": "train.optimizer_offload=host"}.get(saved["optimizer"],
                                                                                   "the same device")
        raise ConfigError(f"{path} holds the {saved['optimizer']} optimizer's state of {saved['dtype']} weights, this "
                          f"run has the {facts.optimizer} optimizer's of {facts.dtype} ones; resume it with "
                          f"train.dtype={saved['dtype']} and {hint}")
    for key, value in saved["schedule"].items():
        if facts.schedule.get(key) != value:
            raise ConfigError(f"{path} was trained with {key}={value} (this run: {facts.schedule.get(key)}); set it "
                              "so, the rate of every step follows from the schedule")
    if auto and saved["data"] != facts.data:
        key = next(k for k in facts.data if saved["data"].get(k) != facts.data[k])
        raise ConfigError(f"{path} is of a run with {key}={saved['data'].get(key)} (this run: {facts.data[key]}); "
                          "choose another train.save_dir, or name the checkpoint in train.load to go on from it")


def _load_sharded(state: dict, path: Path) -> dict:
    try:
        return dist_checkpointing.load(state, str(path))
    except (Exception, CheckpointException) as error:  # (a BaseException)
        raise CheckpointError(f"{path} cannot be loaded into this model ({_first_line(error)}); it is damaged or of "
                              "another model: load another checkpoint, or set train.load=null to start afresh") from None


def load_weights(path: Path, chunks: list[torch.nn.Module], common: Optional[dict] = None) -> dict:
    """Load only the weights of the checkpoint at ``path`` into this rank's model ``chunks``
    (collective); returns its :func:`saved_facts` (``common``, where the caller read them already)."""
    common = saved_facts(path) if common is None else common
    _load_model_state(chunks, _load_sharded({"model": _model_state(chunks)}, path)["model"])
    return common


def load(checkpoint: Checkpoint, common: dict, chunks: list[torch.nn.Module], optimizer) -> Resumed:
    """Load ``checkpoint`` (its :func:`saved_facts` ``common``) into the model and the optimizer
    (collective), at this run's layout.

    Raises:
        CheckpointError: a checkpoint of another model, dtype or optimizer.
    """
    path = checkpoint.path
    same_layout = common["layout"] == _layout()
    state = _sharded_state(chunks, optimizer, is_loading=True)
    if not same_layout:
        del state["rng"]
    loaded = _load_sharded(state, path)
    try:
        _load_model_state(chunks, loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    except Exception as error:
        raise CheckpointError(f"{path} cannot be loaded into this model and optimizer ({_first_line(error)}); load "
                              "a checkpoint of the same model, dtype and optimizer") from None
    if same_layout:
        _set_rng_state(loaded["rng"])
    log.info("resumed from %s: step %d, %d samples consumed%s", path, common["step"], common["consumed_samples"],
             "" if same_layout else f" (saved at {common['layout']}; random generators not restored)")
    return Resumed(common["step"], common["consumed_samples"])
