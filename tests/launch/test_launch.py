"""The SLURM launcher's pieces that need no cluster, and how a job behaves when it is stopped."""

import json
import subprocess

import pytest

import memo.modes.train
from hydra_plugins.memo_launch.slurm_launcher import (
    JobShape,
    fallback_row,
    job_shape,
)
from memo.config import ConfigError
from memo.results import claim_run_dir, finished_row, set_aside_unfinished, write_json_atomic

from conftest import PYTHON, REPO, compose_config, run_in_process


@pytest.mark.parametrize(
    "overrides, per_node, gpus, shape",
    [
        (["+workload=7b_8gpus"], 8, True, JobShape(1, 8, 8)),
        (["+workload=65b_64gpus"], 8, True, JobShape(8, 8, 8)),
        (["+workload=65b_64gpus"], 4, True, JobShape(16, 4, 4)),
        (["+workload=7b_8gpus", "parallel.dp=2"], 8, True, JobShape(2, 8, 8)),
        (["parallel.tp=2"], 8, False, JobShape(1, 2, 0)),
        (["+workload=65b_64gpus", "mode=plan"], 8, True, JobShape(1, 1, 0)),
        (["+workload=65b_64gpus", "mode=profile", "profile.backend=cuda"], 8, True, JobShape(1, 1, 1)),
        (["parallel=auto", "launch.processes=4"], 8, True, JobShape(1, 4, 4)),  # SLURM starts the four
    ],
)
def test_a_job_asks_for_the_nodes_tasks_and_gpus_of_its_layout(overrides, per_node, gpus, shape):
    # Hydra's plugin scan re-executes plugin modules, so compare fields, not classes.
    assert vars(job_shape(compose_config(*overrides), per_node, gpus)) == vars(shape)


def test_a_layout_that_does_not_fill_whole_nodes_is_refused_with_what_to_change():
    with pytest.raises(ConfigError, match=r"^parallel.tp·cp·pp·dp = 12 processes do not fill whole nodes of "
                                          r"hydra.launcher.devices_per_node=8; change parallel.dp"):
        job_shape(compose_config("parallel.tp=4", "parallel.dp=3"), 8, True)


def test_an_unfinished_attempt_is_set_aside_whole_and_a_second_one_does_not_overwrite_it(tmp_path):
    assert set_aside_unfinished(tmp_path) is None
    claim_run_dir(tmp_path, {"config.yaml": "seq: 1k\n"})
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run.log").write_text("first attempt\n")
    assert set_aside_unfinished(tmp_path) == tmp_path / "interrupted" / "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["interrupted"]
    claim_run_dir(tmp_path)  # the next attempt claims the directory again
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')
    write_json_atomic(tmp_path / "result.json", {"status": "interrupted"})
    assert set_aside_unfinished(tmp_path) == tmp_path / "interrupted" / "2"
    first = tmp_path / "interrupted" / "1"
    assert (first / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (first / "run.log").read_text() == "first attempt\n"
    assert (first / ".hydra" / "config.yaml").read_text() == "seq: 1k\n"
    assert (tmp_path / "interrupted" / "2" / "metrics.jsonl").read_text() == '{"step": 2}\n'
    assert (tmp_path / "interrupted" / "2" / "result.json").exists()


def test_an_attempt_whose_row_is_damaged_is_set_aside_byte_for_byte(tmp_path):
    """A requeued job does not run into a directory whose row cannot be read (it would be refused
    as another run's), nor lose that row: the attempt moves whole and the job runs again."""
    claim_run_dir(tmp_path)
    damaged = b'{"status": "ok", "mfu": 0.4'
    (tmp_path / "result.json").write_bytes(damaged)
    assert finished_row(tmp_path) is None
    assert set_aside_unfinished(tmp_path) == tmp_path / "interrupted" / "1"
    assert (tmp_path / "interrupted" / "1" / "result.json").read_bytes() == damaged
    claim_run_dir(tmp_path)  # the directory is free for the next attempt


def test_a_finished_attempt_is_never_set_aside(tmp_path):
    claim_run_dir(tmp_path)
    write_json_atomic(tmp_path / "result.json", {"status": "oom"})
    assert set_aside_unfinished(tmp_path) is None
    assert (tmp_path / "result.json").exists()


class _DeadJob:
    def __init__(self, state: str):
        self.job_id, self.state = "17_3", state


def test_a_job_that_died_gets_a_row_of_its_configuration_and_slurm_state(tmp_path):
    cfg = compose_config("+workload=7b_8gpus", "seq=128k", "method=memo", "+experiment=ablation")
    overrides = ["seq=128k", "method=memo", "hydra.launcher.partition=x"]
    row = fallback_row(cfg, overrides, tmp_path, _DeadJob("OUT_OF_MEMORY"),
                       "job 17_3 (task: 0) with path ... has not produced any output (state: OUT_OF_MEMORY)")
    assert row["status"] == "oom" and row["slurm.state"] == "OUT_OF_MEMORY" and row["slurm.job_id"] == "17_3"
    assert (row["model.name"], row["seq"], row["method.name"], row["experiment"]) == ("7b", 131072, "memo",
                                                                                     "ablation")
    assert (row["parallel.tp"], row["parallel.cp"]) == (4, 2)
    assert row["overrides"] == "seq=128k method=memo"
    assert row["error"].startswith("the job ended without a result (SLURM state OUT_OF_MEMORY): job 17_3")
    assert not any(key.startswith("hydra") for key in row)
    assert fallback_row(cfg, [], tmp_path, _DeadJob("NODE_FAIL"), "lost")["status"] == "error"


def test_a_run_stopped_by_the_scheduler_keeps_its_steps_and_an_interrupted_row(tmp_path, monkeypatch):
    """A scheduler's timeout signal ends in SystemExit (submitit's handler): the row says
    ``interrupted`` and the requeued attempt sets it aside and runs again."""
    real_run_steps = memo.modes.train.run_steps

    def stopped_after_two_steps(step, batches, train, hooks, *args, **kwargs):
        def stop(record):
            if record["step"] == 2:
                raise SystemExit(-1)

        real_run_steps(step, batches, train, [*hooks, stop], *args, **kwargs)

    monkeypatch.setattr(memo.modes.train, "run_steps", stopped_after_two_steps)
    with pytest.raises(SystemExit):
        run_in_process(tmp_path, "train.steps=4", "train.warmup_steps=1", "seq=128", "model.vocab_size=1000")
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "interrupted" and row["steps_done"] == 2
    assert row["error"] == "interrupted by the scheduler (timeout or preemption) after 2 step(s)"
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert set_aside_unfinished(tmp_path) == tmp_path / "interrupted" / "1"


# a process with submitit's handler of the requeue signal, as a job's task has it, that forks
_FORKED = """
import os, signal, submitit
from hydra_plugins.memo_launch.slurm_launcher import forks_leave_requeueing_to_the_task
signum = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
signal.signal(signum, lambda *_: None)
forks_leave_requeueing_to_the_task()
forks_leave_requeueing_to_the_task()
read, write = os.pipe()
if os.fork() == 0:
    os.write(write, b"ignored" if signal.getsignal(signum) is signal.SIG_IGN else b"handled")
    os._exit(0)
os.wait()
print(os.read(read, 16).decode(), "ignored" if signal.getsignal(signum) is signal.SIG_IGN else "handled")
"""


def test_a_process_a_task_forks_leaves_the_requeue_signal_to_the_task():
    # (SLURM signals a checkpoint's writer processes too: with submitit's handler, each requeued the job)
    done = subprocess.run([PYTHON, "-c", _FORKED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ignored", "handled"]
