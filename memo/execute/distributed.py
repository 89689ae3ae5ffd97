"""Start and stop ``torch.distributed`` and Megatron's parallel state for one job.

The process layout comes from the launcher: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), SLURM's ``srun`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_LOCALID``; the first node of the step is the master), or nothing: a single process.
NCCL on GPUs, gloo on the CPU.
"""

import os
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from memo.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits among the job's processes."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str] = None  # None for a single process
    master_port: Optional[int] = None


def process_info(env: Mapping[str, str] = os.environ) -> ProcessInfo:
    """Read the process layout from a launcher's environment variables (see module docstring)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessInfo(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    world = int(env.get("SLURM_STEP_NUM_TASKS", 1))
    if "SLURM_PROCID" in env and world > 1:
        return ProcessInfo(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_host(env["SLURM_STEP_NODELIST"]),
            # A port per job, so jobs sharing a node do not collide.
            master_port=int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)),
        )
    return ProcessInfo(rank=0, world_size=1, local_rank=0)


def _first_host(nodelist: str) -> str:
    """The address of the first node of ``nodelist``: its ``NodeAddr`` as SLURM reaches it (a
    node's name need not resolve: two node daemons of one machine, or names the cluster alone knows)."""
    first = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    try:
        node = subprocess.run(["scontrol", "show", "node", "--oneliner", first], capture_output=True, text=True,
                              check=False).stdout
    except OSError:
        return first
    return next((field.split("=", 1)[1] for field in node.split() if field.startswith("NodeAddr=")), first)


def check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """Raise a :class:`ConfigError` unless tp·cp·pp·dp equals the number of processes."""
    product = parallel.tp * parallel.cp * parallel.pp * parallel.dp
    if product != world_size:
        hint = ""
        if world_size % (parallel.tp * parallel.cp * parallel.pp) == 0:
            hint = f"; set parallel.dp={world_size // (parallel.tp * parallel.cp * parallel.pp)}"
        raise ConfigError(
            f"parallel.tp·cp·pp·dp = {parallel.tp}·{parallel.cp}·{parallel.pp}·{parallel.dp} "
            f"= {product} but {world_size} process(es) were launched{hint}"
        )


def device_index(info: ProcessInfo) -> int:
    """The GPU this process uses, among those it sees: its local rank, or (where the scheduler
    binds each task to its own GPUs, so every task sees fewer than the node has) the local rank
    modulo the visible count. Reads the count without initialising CUDA."""
    return info.local_rank % max(torch.cuda.device_count(), 1)


def initialize(parallel: ParallelConfig, device_type: str, info: ProcessInfo) -> None:
    """Join the process group and build Megatron's tensor/context/pipeline/data groups.

    Raises:
        ConfigError: if the parallel sizes do not match the launched processes.
    """
    check_world_size(parallel, info.world_size)
    join(device_type, info)
    build_groups(parallel, info)


def join(device_type: str, info: ProcessInfo) -> None:
    """Join the process group of the launched processes (NCCL's on GPUs, gloo's on the CPU),
    before their layout is known (a run that chooses it, ``parallel=auto``)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(device_index(info))
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
        )


def build_groups(parallel: ParallelConfig, info: ProcessInfo) -> None:
    """Megatron's tensor/context/pipeline/data groups of ``parallel`` over the joined processes.

    Raises:
        ConfigError: if the parallel sizes do not match the launched processes.
    """
    check_world_size(parallel, info.world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
    )


def shutdown() -> None:
    """Leave the process group, so the next job of a sweep can start afresh in this process."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
