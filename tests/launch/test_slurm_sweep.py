"""Sweeps through a real SLURM scheduler (the local cluster of slurm/cluster.sh), as a user runs
them: ``python run.py -m hydra/launcher=slurm_local +experiment=...``. Every job leaves its row:
a job that fails its checks, a job killed by the scheduler, and a preempted job that is requeued."""

import getpass
import json
import subprocess
import time
from pathlib import Path

import pytest

from analysis.rows import load_results

from conftest import PYTHON, REPO

pytestmark = pytest.mark.slow
QUICK = ["train.steps=2", "train.warmup_steps=1"]
# The jobs' own work is not what these tests are about: the tiny GPT with a vocabulary of 1000
# (whose output layer no longer takes most of a step), at 256 tokens where a step's length does
# not matter.
SMALL = ["seq=256", "model.vocab_size=1000"]


def sweep_command(sweep_dir: Path, *overrides: str) -> list[str]:
    return [PYTHON, str(REPO / "run.py"), "-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={sweep_dir}",
            *overrides]


def wait_for_steps(path: Path, steps: int, process: subprocess.Popen, deadline_s: float = 120) -> None:
    """Wait until the step log at ``path`` has ``steps`` lines (the job is running)."""
    deadline = time.monotonic() + deadline_s
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {steps} step(s) in {path} after {deadline_s} s"
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def no_job_left_behind(slurm_cluster):
    """Cancel what a test left queued or running, so that a failure does not hold the next test's
    job behind it on the one node."""
    yield
    subprocess.run(["scancel", "--full", "--user", getpass.getuser()], env=slurm_cluster.env, timeout=30,
                   check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "--noheader"], env=slurm_cluster.env, capture_output=True,
                               text=True, timeout=30, check=False)
        if not queue.stdout.strip():
            return
        time.sleep(1)


def slurm_job_id(sweep_dir: Path) -> str:
    (folder,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
    return folder


@pytest.mark.timeout(300)
def test_an_experiment_runs_as_one_array_and_every_job_leaves_its_row(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        sweep_command(sweep, "+experiment=alpha_sweep_cpu_smoke", *SMALL, "alpha=0,0.5,1,2", *QUICK),
        cwd=tmp_path, env=slurm_cluster.env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout  # Hydra's log
    assert "array " in log and ": 4 job(s), 1 node(s) x 1 task(s), 0 GPU(s) per node" in log
    assert "4/4 job(s) ended (0 crashed)" in log
    array_id = log.split("] array ")[1].split(":")[0]
    tasks = sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    assert tasks == [f"{array_id}_{i}" for i in range(4)], "one array of four tasks"

    rows = load_results(sweep).set_index("alpha").sort_index()
    assert list(rows.index) == ["0", "0.5", "1", "2"]
    assert list(rows["status"]) == ["ok", "ok", "ok", "error"]
    assert rows.loc["2", "error"] == "alpha=2 must be a number in [0, 1] or auto"
    assert set(rows["experiment"]) == {"alpha_sweep_cpu_smoke"} and set(rows["world_size"]) == {1}
    ok = rows[rows["status"] == "ok"]
    assert list(ok["swap.alpha"]) == [0.0, 0.5, 1.0] and (ok["steps_timed"] == 1).all()
    assert (ok["mfu"] > 0).all()


@pytest.mark.timeout(300)
def test_a_job_the_scheduler_kills_gets_a_row_and_the_sweep_says_so(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    process = subprocess.Popen(
        sweep_command(sweep, *SMALL, "train.steps=5000", "+experiment=ablation_cpu_smoke", "method=none",
                      "plan=false"),
        cwd=tmp_path, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for_steps(sweep / "0" / "metrics.jsonl", 1, process)
    job = slurm_job_id(sweep)
    subprocess.run(["scancel", job], env=slurm_cluster.env, check=True, timeout=30)
    _, stderr = process.communicate(timeout=240)

    assert process.returncode == 2
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 1 job(s) ended without a result: #0 (CANCELLED")
    row = json.loads((sweep / "0" / "result.json").read_text())
    assert row["status"] == "error" and row["slurm.state"].startswith("CANCELLED")
    assert row["slurm.job_id"] == job and row["experiment"] == "ablation_cpu_smoke"
    assert (row["method.name"], row["seq"], row["train.steps"]) == ("none", 256, 5000)
    assert (sweep / "0" / "metrics.jsonl").read_text(), "the steps it made are kept"


@pytest.mark.timeout(300)
def test_a_preempted_job_is_requeued_and_goes_on_from_its_last_checkpoint(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # steps long enough (1k tokens) that the signal comes while the first attempt still runs,
    # with an output layer of 1000 tokens that keeps them short; a checkpoint every two steps
    process = subprocess.Popen(
        sweep_command(sweep, "seq=1k", "model.vocab_size=1000", "train.steps=12", "train.warmup_steps=1",
                      "train.save_interval=2"),
        cwd=tmp_path, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    job_dir = sweep / "0"
    wait_for_steps(job_dir / "metrics.jsonl", 3, process)  # the checkpoint of step 2 is written
    job = slurm_job_id(sweep)
    # What SLURM sends before a time limit or a preemption (submitit's --signal=USR2@...).
    subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster.env, check=True, timeout=30)
    _, stderr = process.communicate(timeout=240)

    assert process.returncode == 0, stderr[-3000:]
    row = json.loads((job_dir / "result.json").read_text())
    resumed = row["resumed_from_step"]
    assert row["status"] == "ok" and resumed >= 2 and resumed % 2 == 0
    steps = [json.loads(line)["step"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(resumed + 1, 13)), "the requeued attempt went on from the checkpoint"
    assert row["steps_timed"] == len(steps) - 1
    first = [json.loads(line)["step"] for line in
             (job_dir / "interrupted" / "1" / "metrics.jsonl").read_text().splitlines()]
    assert first[0] == 1 and resumed <= first[-1] < 12  # its steps are kept where it left them
    assert [c.name for c in sorted((job_dir / "checkpoints").iterdir())][-1] == "step_0000012"
    logs = "".join(p.read_text() for p in (sweep / ".submitit" / job).glob("*_log.*"))
    assert "this job is preempted" in logs and f"Requeued job {job}" in logs
    assert "an earlier attempt of this job was interrupted" in logs
    assert f"resumed from {job_dir / 'checkpoints' / f'step_{resumed:07d}'}" in logs


@pytest.mark.timeout(400)
def test_a_job_across_two_nodes_trains_as_one_process(slurm_cluster, tmp_path):
    """Two pipeline stages on the cluster's two nodes, each stage's two tensor-parallel ranks on
    one node (Megatron's order: tensor-parallel ranks next to each other, stages apart), the
    process group's master found at the first node's address: the losses and gradient norms of
    one process, as far as one process and four sum in another order (1e-4)."""
    from pipeline_worker import make_checkpoint

    from conftest import run_in_process

    make_checkpoint(tmp_path / "hf", tied=False)
    common = ["model=hf", f"model.init_from={tmp_path / 'hf'}", "seq=128", "train.steps=3", "train.warmup_steps=1",
              "train.micro_batches=4", "method=memo", "alpha=0.5"]
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        sweep_command(sweep, *common, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
        cwd=tmp_path, env=slurm_cluster.env, capture_output=True, text=True, timeout=380,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ": 1 job(s), 2 node(s) x 2 task(s), 0 GPU(s) per node" in done.stdout
    row = json.loads((sweep / "0" / "result.json").read_text())
    assert row["status"] == "ok" and row["world_size"] == 4, row["error"]
    accounted = subprocess.run(["sacct", "-X", "-n", "-P", "-j", slurm_job_id(sweep), "-o", "NNodes,NodeList"],
                               env=slurm_cluster.env, capture_output=True, text=True, timeout=30, check=True)
    assert accounted.stdout.split() == ["2|memo[1-2]"]
    one = run_in_process(tmp_path / "one", *common)
    assert one["status"] == "ok", one["error"]
    steps = {name: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
             for name, out in (("two", sweep / "0"), ("one", tmp_path / "one"))}
    for a, b in zip(steps["two"], steps["one"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
