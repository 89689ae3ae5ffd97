"""The local SLURM cluster (slurm/cluster.sh): sacct reports how every job ended, also a job
killed hard, so submitit's clients learn of such a job instead of waiting for it forever."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import UncompletedJobError


REPO = Path(__file__).resolve().parents[2]

# sacct's states of a job that will not run again.
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def sbatch(cluster, directory, script: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", f"--partition={cluster.partition}", f"--chdir={directory}",
         f"--output={directory}/%j.out", f"--wrap={script}"],
        env=cluster.env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def final_states(cluster, job_ids, deadline_s: float = 60) -> dict:
    """{job id: (State, ExitCode)} from sacct once every job has ended."""
    deadline = time.monotonic() + deadline_s
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(job_ids)],
            env=cluster.env, capture_output=True, text=True, timeout=30, check=True).stdout
        # A cancelled job reads "CANCELLED by 0".
        states = {job: (state.split()[0], code)
                  for job, state, code in (line.split("|") for line in out.splitlines() if line)}
        if all(states.get(job, ("",))[0] in TERMINAL for job in job_ids):
            return states
        assert time.monotonic() < deadline, f"jobs still not done: {states}"
        time.sleep(0.5)


def executor(cluster, folder):
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(timeout_min=5, slurm_partition=cluster.partition)
    return ex


@pytest.mark.slow
@pytest.mark.timeout(90, func_only=True)
def test_sacct_reports_how_each_job_ended(slurm_cluster, tmp_path):
    ok = sbatch(slurm_cluster, tmp_path, f"echo done > {tmp_path}/ok.txt")
    exit3 = sbatch(slurm_cluster, tmp_path, "exit 3")
    killed = sbatch(slurm_cluster, tmp_path, "kill -9 $$")

    states = final_states(slurm_cluster, [ok, exit3, killed])

    assert states[ok] == ("COMPLETED", "0:0")
    assert (tmp_path / "ok.txt").read_text() == "done\n"
    assert states[exit3] == ("FAILED", "3:0")
    # A batch script killed by a signal: FAILED, with the signal after the colon.
    state, code = states[killed]
    assert state == "FAILED" and code.split(":")[1] == str(signal.SIGKILL.value), states[killed]


@pytest.mark.slow
@pytest.mark.timeout(90, func_only=True)
def test_submitit_returns_a_result(slurm_cluster, tmp_path, monkeypatch):
    slurm_cluster.use(monkeypatch)

    def add(a, b):  # defined here so that it is pickled by value, not imported by the job
        return a + b

    job = executor(slurm_cluster, tmp_path).submit(add, 2, 3)
    assert job.result() == 5
    assert final_states(slurm_cluster, [job.job_id])[job.job_id] == ("COMPLETED", "0:0")


@pytest.mark.slow
@pytest.mark.timeout(90, func_only=True)
def test_submitit_learns_of_a_job_killed_hard(slurm_cluster, tmp_path, monkeypatch):
    slurm_cluster.use(monkeypatch)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    job = executor(slurm_cluster, tmp_path).submit(die)
    start = time.monotonic()
    # No result file will ever come: only sacct's final state ends the wait.
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        job.result()
    assert time.monotonic() - start < 60
    state, _ = final_states(slurm_cluster, [job.job_id])[job.job_id]
    assert state in TERMINAL - {"COMPLETED"}


def test_a_non_root_machine_skips_the_cluster_tests_visibly_but_ci_fails_them(tmp_path):
    # the fixture's own decision, in a process that is not root (pytest's outcome tells which)
    test = tmp_path / "test_needs_cluster.py"
    test.write_text("def test_it(slurm_cluster):\n    pass\n")
    conftest = tmp_path / "conftest.py"
    conftest.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                        "import os\nos.geteuid = lambda: 1000\npytest_plugins = ['slurm_cluster']\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    for ci, outcome in ((None, "1 skipped"), ("true", "1 error")):
        run_env = env if ci is None else {**env, "CI": ci}
        done = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", str(test)],
                              cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=120)
        assert outcome in done.stdout, done.stdout[-1500:]
        assert "run the tests as root" in done.stdout
