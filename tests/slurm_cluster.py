"""A real one-node SLURM cluster for the tests, run by ``slurm/cluster.sh``.

``tests/conftest.py`` loads it as a plugin, so a test names the fixture and points clients at it:
``subprocess.run(..., env=slurm_cluster.env)``, or ``slurm_cluster.use(monkeypatch)`` for
in-process clients such as submitit.
"""

import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from requirements import require

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / "slurm" / "cluster.sh"

INSTALL_TIMEOUT_S = 900  # apt-get on a fresh machine
START_TIMEOUT_S = 180  # the script itself gives up after about a minute
STOP_TIMEOUT_S = 120


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    env: dict  # os.environ plus what a client needs (SLURM_CONF); see client_env
    exports: dict  # only the variables cluster.sh exports
    partition: str = "debug"

    def use(self, monkeypatch) -> None:
        """Point this process's environment at the cluster for the duration of a test."""
        for name in list(os.environ):
            if name.startswith("SLURM_") and name not in self.env:
                monkeypatch.delenv(name)
        for name, value in self.exports.items():
            monkeypatch.setenv(name, value)


def client_env(exports: dict) -> dict:
    """os.environ with ``exports``, less the SLURM_* variables of any job this runs inside of:
    sbatch and srun would take those as options for the local cluster's jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, **exports}


def parse_exports(text: str) -> dict:
    """The ``export NAME=VALUE`` lines of ``text`` as a dict (VALUE is shell-quoted)."""
    exports = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            exports[name] = " ".join(shlex.split(value))
    return exports


def cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], env=client_env({}), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _require(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        pytest.fail(f"slurm/cluster.sh {what} failed (exit {result.returncode}):\n"
                    f"{result.stdout}\n{result.stderr}", pytrace=False)


def missing_requirement():
    """Why this machine cannot start the test cluster, or None."""
    if os.geteuid() != 0:
        return ("the SLURM tests start a local cluster (slurm/cluster.sh), which runs its daemons "
                "as root: run the tests as root")
    if shutil.which("apt-get") is None or shutil.which("dpkg-query") is None:
        return ("the SLURM tests install slurm and munge with apt-get (Debian or Ubuntu), "
                "which this machine lacks")
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running cluster for the whole session, stopped (and its state removed) at the end."""
    require(missing_requirement())
    _require(cluster_sh("install", timeout=INSTALL_TIMEOUT_S), "install")
    # Under /tmp rather than pytest's (deeper) tmp dirs: unix socket paths are limited to 107 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix="memo-slurm-", dir="/tmp"))
    try:
        started = cluster_sh("start", str(state_dir), timeout=START_TIMEOUT_S)
        _require(started, "start")
        exports = parse_exports(started.stdout)
        assert "SLURM_CONF" in exports, started.stdout
        yield SlurmCluster(state_dir=state_dir, env=client_env(exports), exports=exports)
    finally:
        stopped = cluster_sh("stop", str(state_dir), timeout=STOP_TIMEOUT_S)
        shutil.rmtree(state_dir, ignore_errors=True)
        _require(stopped, "stop")
