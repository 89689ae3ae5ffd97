"""The process layout is read from torchrun, SLURM, or nothing."""

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
