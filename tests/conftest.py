"""Shared fixtures: composing configs as ``run.py`` does, and a one-process parallel state."""

import hashlib
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

warnings.filterwarnings("ignore", message=r"full scope is deprecated")

from memo.config import Run, register_configs, resolve  # noqa: E402
from memo.execute import distributed  # noqa: E402
from memo.execute.distributed import ProcessInfo  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
PYTHON = sys.executable

register_configs()

# The session's local SLURM cluster (fixture ``slurm_cluster``), started only by tests that ask.
pytest_plugins = ("slurm_cluster",)


def compose_config(*overrides: str):
    """The configuration ``python run.py OVERRIDES`` would run."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def file_hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the hash of its bytes: equal before and after means no byte
    changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def resolve_config(*overrides: str) -> Run:
    """``compose_config(*overrides)`` resolved as a job on this machine's CPU resolves it."""
    return resolve(compose_config(*overrides), gpu_visible=False)


@pytest.fixture
def single_process():
    """Megatron's parallel state for one CPU process (tp = cp = pp = dp = 1)."""
    cfg = compose_config()
    distributed.initialize(cfg.parallel, "cpu", ProcessInfo(rank=0, world_size=1, local_rank=0))
    yield
    distributed.shutdown()


def run_in_process(output_dir: Path, *overrides: str) -> dict:
    """Run one job in this process, as ``python run.py OVERRIDES`` would, and return its row."""
    from memo.modes.train import run_job

    return run_job(compose_config(*overrides), output_dir, overrides)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under_torchrun(worker: str, processes: int = 2, *args: str):
    """Run ``tests/<worker>`` (with ``args``) in ``processes`` gloo processes; fails the test unless
    all exit 0."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    result = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
         str(free_port()), str(REPO / "tests" / worker), *args],
        cwd=REPO, env=env, timeout=600, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result
