"""Shared fixtures: composing configs as ``run.py`` does, and a one-process parallel state."""

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

warnings.filterwarnings("ignore", message=r"full scope is deprecated")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers share the machine's cores (pyproject's addopts): PyTorch takes one
    # thread in each worker and in every process a test starts (run.py, torchrun, notebooks'
    # kernels), as torchrun's workers and SLURM's CPU tasks do, instead of each taking them all.
    os.environ["OMP_NUM_THREADS"] = "1"

from memo.collector import frozen_after  # noqa: E402
from memo.config import Run, register_configs, resolve  # noqa: E402
from memo.execute import distributed  # noqa: E402
from memo.execute.distributed import ProcessInfo  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
PYTHON = sys.executable

register_configs()

# The session's local SLURM cluster (fixture ``slurm_cluster``), started only by tests that ask.
pytest_plugins = ("slurm_cluster",)


_GROUP = pytest.StashKey[str]()
# the groups that take longest (minutes each on two cores), longest first
_FIRST = ["slurm", "test_gpucheck", "torchrun2", "test_fit", "torchrun4", "test_training", "test_notebooks",
          "test_experiments"]


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """The test modules import torch and megatron-core: the collector walks their objects no more
    (:mod:`memo.collector`)."""
    with frozen_after():
        yield


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (pyproject's addopts), the tests that share a
    session's expensive resource run in one worker: every test of the local SLURM cluster (one
    cluster a session: ``slurm_cluster``), and the tests of each shared torchrun launch
    (``@pytest.mark.torchrun``, one group per process count); every other test with the tests of
    its module, whose module-scoped fixtures are then made once."""
    for item in items:
        mark = item.get_closest_marker("torchrun")
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            group = "slurm"
        elif mark is not None:
            group = f"torchrun{mark.args[0]}"
        else:
            group = item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group
    # the longest groups first, so that no worker starts one when the other is nearly done (in this
    # order: pyproject's --no-loadscope-reorder keeps pytest-xdist from putting the most tests first)
    items.sort(key=lambda item: _FIRST.index(item.stash[_GROUP]) if item.stash[_GROUP] in _FIRST else len(_FIRST))


# The suite's model where a test names none: the paper's tiny GPT, whose sizes the hand counts
# of many tests are written for (run.py's default is tiny_llama, which tests name where they mean it).
DEFAULT_MODEL = "model=tiny"
_NAMES_A_MODEL = ("model=", "+workload=", "+experiment=")


# The layers' tiles where a test sets none: whole layers, as before runs chose their own (the
# choice depends on this machine's free memory; tests of it set method.tile_tokens=auto).
DEFAULT_TILES = "method.tile_tokens=whole"


def compose_config(*overrides: str):
    """The configuration ``python run.py OVERRIDES`` would run, with ``model=tiny`` unless the
    overrides name a model (or a workload or an experiment, which do), and whole layers unless
    they set ``method.tile_tokens``."""
    if not any(o.startswith(_NAMES_A_MODEL) for o in overrides):
        overrides = (DEFAULT_MODEL, *overrides)
    if not any(o.startswith("method.tile_tokens=") for o in overrides):
        overrides = (*overrides, DEFAULT_TILES)
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


def _one_process():
    """Megatron's parallel state for one CPU process (tp = cp = pp = dp = 1), until the end."""
    distributed.initialize(compose_config().parallel, "cpu", ProcessInfo(rank=0, world_size=1, local_rank=0))
    try:
        yield
    finally:
        distributed.shutdown()


one_process = contextlib.contextmanager(_one_process)  # the same, for a block of a test
single_process = pytest.fixture(name="single_process")(_one_process)
# the same for every test of a module (the tests that train in-process, several runs each)
parallel_state = pytest.fixture(scope="module", name="parallel_state")(_one_process)


def run_in_process(output_dir: Path, *overrides: str) -> dict:
    """Run one job in this process, as ``python run.py OVERRIDES`` would (the mode's job
    function, as run.py picks it), and return its row."""
    cfg = compose_config(*overrides)
    if cfg.mode == "train":
        from memo.modes.train import run_job as job
    elif cfg.mode == "fit":
        from memo.modes.fit import fit_job as job
    else:
        from memo.modes.profile import profile_and_plan as job
    return job(cfg, output_dir, overrides)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(worker: str, processes: int, *args: str, timeout: float = 840) -> str:
    """The output of ``tests/<worker>`` (with ``args``) in ``processes`` gloo processes; past
    ``timeout`` seconds the launch and its ranks are killed and what they wrote is returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    process = subprocess.Popen(
        [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
         str(free_port()), str(REPO / "tests" / worker), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its ranks die with it
    )
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return f"timed out after {timeout} s\n{process.communicate()[0]}"


# ---------------------------------------------------------------- checks sharing one torchrun launch


@dataclass(frozen=True)
class CheckResult:
    """One check of a shared torchrun launch (``tests/checks_worker.py``)."""

    spec: str
    processes: int
    messages: tuple[str, ...]  # the message of each rank that passed the check
    out_dir: Path  # what the check wrote (rank 0)
    output: str  # the end of the launch's output, to show when the check failed

    def passed(self) -> tuple[str, ...]:
        """Every rank's message; fails the test unless every rank passed the check."""
        assert len(self.messages) == self.processes, (
            f"{self.spec!r} did not pass on all {self.processes} processes (an earlier check's "
            f"failure ends the launch):\n{self.output}")
        return self.messages


class TorchrunChecks:
    """Every check that the session's selected tests name (``@pytest.mark.torchrun(processes,
    "module.function ARG...", ..., last=False)``), run in one torchrun launch per process count,
    started when the first test that needs it runs. Checks marked ``last`` run after the others
    (DeepSpeed's communication layer, once set up, stays with the process)."""

    def __init__(self, session: pytest.Session, root: Path):
        self.session, self.root = session, root
        self.launches: dict[int, tuple[list[str], Path, str]] = {}

    def specs(self, processes: int) -> list[str]:
        first, last = [], []
        for item in self.session.items:
            for mark in item.iter_markers("torchrun"):
                if mark.args[0] == processes:
                    for spec in mark.args[1:]:
                        group = last if mark.kwargs.get("last") else first
                        if spec not in first + last:
                            group.append(spec)
        return first + last

    def result(self, processes: int, spec: str) -> CheckResult:
        if processes not in self.launches:
            specs = self.specs(processes)
            out = self.root / f"torchrun{processes}"
            output = _torchrun("checks_worker.py", processes, str(out), *specs)
            (self.root / f"torchrun{processes}.log").write_text(output)  # each check's seconds
            self.launches[processes] = (specs, out, output)
        specs, out, output = self.launches[processes]
        index = specs.index(spec)
        messages = tuple(re.findall(rf"^rank \d+: ok #{index} [^\n]*?: (.*)$", output, re.M))
        tail = output if len(output) < 6000 else output[:1500] + "\n...\n" + output[-4500:]
        return CheckResult(spec, processes, messages, out / str(index), tail)


@pytest.fixture(scope="session")
def torchrun_checks(request, tmp_path_factory) -> TorchrunChecks:
    return TorchrunChecks(request.session, tmp_path_factory.mktemp("checks"))


@pytest.fixture
def torchrun_results(request, torchrun_checks) -> list[CheckResult]:
    """The results of this test's ``@pytest.mark.torchrun`` checks, in the order it names them."""
    mark = request.node.get_closest_marker("torchrun")
    assert mark is not None, "torchrun_results needs @pytest.mark.torchrun(processes, spec, ...)"
    return [torchrun_checks.result(mark.args[0], spec) for spec in mark.args[1:]]


def trace_of(workload, backend: str = "fake", seed: int = 1234):
    """The allocation trace of one iteration of ``workload``, its layers built and run as its
    activation policy runs them (what ``mode=profile`` traces)."""
    from memo.policy import policy_of
    from memo.profile.iteration import trace_iteration

    return trace_iteration(workload, policy_of(workload), backend, seed)
