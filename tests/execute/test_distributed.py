"""The process layout is read from torchrun, SLURM, or nothing."""

import torch

from memo.execute import distributed
from memo.execute.distributed import ProcessInfo, process_info


def test_single_process_without_launcher():
    assert process_info({}) == ProcessInfo(rank=0, world_size=1, local_rank=0)


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    assert process_info(env) == ProcessInfo(3, 8, 1, "n1", 1234)


def test_slurm_step_variables(monkeypatch):
    seen = []
    monkeypatch.setattr(distributed, "_first_host", lambda nodes: seen.append(nodes) or "gpu07")
    env = {
        "SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
    }
    assert process_info(env) == ProcessInfo(9, 16, 1, "gpu07", 20000 + 123456 % 20000)
    assert seen == ["gpu[07-08]"]


def test_a_lone_slurm_task_is_a_single_process():
    # A batch script (one task) runs without srun: no rendezvous to wait for.
    assert process_info({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).world_size == 1


def test_a_cpu_job_gets_the_host_adapters_on_a_gpu_machine_and_a_gpu_job_seeds_megatron(monkeypatch):
    from megatron.core.tensor_parallel import random as megatron_random

    import memo.model.gpt as gpt
    from memo.model import host

    # what is patched here is put back after the test, whatever it leaves
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        monkeypatch.setattr(megatron_random, name, getattr(megatron_random, name))
    monkeypatch.setattr(torch.cuda, "current_device", torch.cuda.current_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    gpt._prepare_megatron("cpu")
    assert torch.cuda.current_device() == "cpu"  # Megatron's buffers land on the job's device
    assert megatron_random._get_cuda_rng_state is host._no_cuda_rng_state
    seeds = []
    monkeypatch.setattr(gpt, "model_parallel_cuda_manual_seed", seeds.append)
    torch.manual_seed(1234)
    gpt._prepare_megatron("cuda")  # e.g. profile.backend=cuda, which never seeded before
    assert seeds == [1234]
    assert megatron_random._get_cuda_rng_state is host._ORIGINALS["get_rng"]
    assert torch.cuda.current_device is host._ORIGINALS["current_device"]


def test_each_process_uses_its_local_gpu_even_where_the_scheduler_shows_it_one(monkeypatch):
    info = ProcessInfo(rank=11, world_size=16, local_rank=3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # every GPU of the node visible
    assert distributed.device_index(info) == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # SLURM bound one GPU to the task
    assert distributed.device_index(info) == 0
