"""A Hydra launcher that runs a sweep on SLURM through submitit, sized by each job's parallel layout.

hydra-submitit-launcher gives every job of a sweep the same resources. An experiment of the
paper mixes 7B on 8 GPUs with 65B on 64, so this launcher composes each job's configuration
first and asks for what its layout needs: one task per process (GPU), ``devices_per_node``
tasks per node, ``tp·cp·pp·dp / devices_per_node`` nodes; planning modes get one task and no
GPU. Jobs of the same shape go out as one job array.

Each task reads its rank, world size and master address from submitit's environment; only
rank 0 writes the job's files. On a timeout or preemption submitit requeues the job (up to
``max_num_timeout`` times): the job's own ``result.json``, if it finished, is kept and the job
is not run again; an unfinished attempt (no row, or an ``interrupted`` one) is moved whole to
``interrupted/<n>/`` and the job runs again.

A job that dies without writing its row (killed by the scheduler, out of host memory, a node
failure) gets one written here from its configuration and its SLURM state, so every job of a
sweep leaves a row. ``hydra.launcher.dry_run=true`` prints the arrays and their ``#SBATCH``
lines and submits nothing.
"""

import functools
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.errors import HydraException
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, open_dict

from memo.config import ConfigError, parse_seq, validate
from memo.results import (RESULT_FILE, config_row, create_file_atomic, finished_row, json_text,
                          set_aside_unfinished)

log = logging.getLogger(__name__)

POLL_S = 5.0  # between status queries while a sweep runs
STATE_TO_STATUS = {"OUT_OF_MEMORY": "oom"}  # SLURM's final state -> row status; others: error


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    """``hydra/launcher`` presets in ``conf/hydra/launcher/``; submitit's SLURM fields plus ours.

    ``nodes``, ``tasks_per_node`` and ``gpus_per_node`` are set per job from its layout.
    """

    _target_: str = "hydra_plugins.memo_launch.slurm_launcher.SlurmLauncher"
    devices_per_node: int = 8  # processes (GPUs) per node that a layout is split into
    gpus: bool = True  # one GPU per task; false on CPU-only clusters
    dry_run: bool = False  # print the job arrays, submit nothing
    max_num_timeout: int = 3  # requeues after a timeout (preemptions do not count)


ConfigStore.instance().store(group="hydra/launcher", name="memo_slurm", node=SlurmLauncherConf,
                             provider="memo")


@dataclass(frozen=True)
class JobShape:
    """What one job asks SLURM for."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int  # 0: no GPU

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def job_shape(cfg: DictConfig, devices_per_node: int, gpus: bool) -> JobShape:
    """The nodes, tasks and GPUs a composed run configuration needs.

    Raises:
        ConfigError: if a layout larger than one node does not fill whole nodes.
    """
    p = cfg.parallel
    processes = cfg.launch.processes if "launch" in cfg else 1
    world = (processes if processes > 1 else p.tp * p.cp * p.pp * p.dp) if cfg.mode == "train" else 1
    needs_gpu = gpus and (cfg.mode == "train" or cfg.profile.backend == "cuda")
    if world <= devices_per_node:
        return JobShape(1, world, world if needs_gpu else 0)
    if world % devices_per_node:
        raise ConfigError(
            f"parallel.tp·cp·pp·dp = {world} processes do not fill whole nodes of "
            f"hydra.launcher.devices_per_node={devices_per_node}; change parallel.dp or the preset"
        )
    return JobShape(world // devices_per_node, devices_per_node, devices_per_node if needs_gpu else 0)


def job_output_dir(sweep_config: DictConfig) -> Path:
    """The directory Hydra gives the job ``sweep_config`` describes (``hydra.job.num`` set)."""
    return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)


def fallback_row(cfg: DictConfig, overrides: Sequence[str], output_dir: Path, job: Any, error: str) -> dict:
    """The row of a job that ended without writing one: its configuration and SLURM's verdict."""
    state = getattr(job, "state", "UNKNOWN")
    row = config_row(cfg)
    try:
        row["seq"] = parse_seq(cfg.seq)
    except ConfigError:
        pass
    row.update(
        status=STATE_TO_STATUS.get(state, "error"),
        error=f"the job ended without a result (SLURM state {state}): {error}",
        overrides=" ".join(filter_overrides(overrides)),
        output_dir=str(output_dir),
        **{"slurm.job_id": getattr(job, "job_id", None), "slurm.state": state},
    )
    return row


class SlurmLauncher(BaseSubmititLauncher):
    """See the module docstring; configured by :class:`SlurmLauncherConf`."""

    _EXECUTOR = "slurm"

    def __init__(self, devices_per_node: int, gpus: bool, dry_run: bool, **params: Any) -> None:
        super().__init__(**params)
        if devices_per_node < 1:
            raise ConfigError(f"hydra.launcher.devices_per_node={devices_per_node} must be at least 1")
        self.devices_per_node = devices_per_node
        self.gpus = gpus
        self.dry_run = dry_run

    # -- on the cluster, in every task of a job ---------------------------------------------

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
        singleton_state: dict,
    ) -> JobReturn:
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        forks_leave_requeueing_to_the_task()
        env = submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True  # every task sees its node's GPUs
        )
        # submitit names the master by the first node's name, which need not resolve
        os.environ["MASTER_ADDR"] = node_address(submitit.JobEnvironment().hostnames[0])
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        with open_dict(sweep_config.hydra):
            sweep_config.hydra.job.id = submitit.JobEnvironment().job_id
            sweep_config.hydra.job.num = job_num
        output_dir = job_output_dir(sweep_config)
        finished = finished_row(output_dir)
        if finished is not None:  # requeued after it had finished: keep that row
            log.info("%s exists; not running this job again", output_dir / RESULT_FILE)
            return JobReturn(
                overrides=sweep_overrides, cfg=sweep_config, working_dir=os.getcwd(),
                task_name="run", status=JobStatus.COMPLETED, _return_value=finished,
            )
        if env.rank == 0:
            moved = set_aside_unfinished(output_dir)
            if moved is not None:
                log.warning("an earlier attempt of this job was interrupted; its logs are in %s", moved)
        return run_job(
            hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
            job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir",
        )

    # -- on the submitting machine -----------------------------------------------------------

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = []
        for i, overrides in enumerate(job_overrides):
            num = initial_job_idx + i
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg.hydra):
                cfg.hydra.job.num = num
            jobs.append((num, list(overrides), cfg, job_shape(cfg, self.devices_per_node, self.gpus)))
        arrays: dict[JobShape, list] = {}
        for job in jobs:
            arrays.setdefault(job[3], []).append(job)

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if self.dry_run:
            self._print_arrays(arrays, sweep_dir)
            _remove_if_only_sweep_config(sweep_dir)
            return [
                JobReturn(overrides=o, cfg=c, status=JobStatus.COMPLETED, _return_value=None)
                for _, o, c, _ in jobs
            ]
        for num, overrides, cfg, _ in jobs:
            problem = _config_problem(cfg)
            if problem:  # the job still runs, to leave its error row with the others
                log.warning("job #%d (%s) will fail: %s", num, " ".join(filter_overrides(overrides)), problem)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        submitted = {}
        for shape, members in arrays.items():
            executor = self._executor(shape)
            handles = executor.map_array(self, *zip(*[
                (o, "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
                for num, o, _, _ in members
            ]))
            log.info(
                "array %s: %d job(s), %d node(s) x %d task(s), %d GPU(s) per node",
                handles[0].job_id.split("_")[0], len(members), shape.nodes, shape.tasks_per_node,
                shape.gpus_per_node,
            )
            submitted.update({num: handle for (num, *_), handle in zip(members, handles)})
        _wait(list(submitted.values()))
        returns = [self._collect(num, o, cfg, submitted[num]) for num, o, cfg, _ in jobs]
        crashed = [f"#{num} ({submitted[num].state})" for (num, *_), r in zip(jobs, returns)
                   if r.status == JobStatus.FAILED]
        if crashed:  # after every row is written: the sweep's exit status tells of the crash
            raise HydraException(
                f"{len(crashed)} of {len(jobs)} job(s) ended without a result: {', '.join(crashed)}; "
                f"their rows say so, and their logs are under {self.params['submitit_folder']}"
            )
        return returns

    def _parameters(self, shape: JobShape) -> dict[str, Any]:
        """submitit's ``slurm_*`` parameters for jobs of ``shape`` (the preset's fields, resized)."""
        skip = {"submitit_folder", "max_num_timeout", "nodes", "tasks_per_node", "gpus_per_node"}
        params = {k: v for k, v in self.params.items() if k not in skip}
        params.update(nodes=shape.nodes, tasks_per_node=shape.tasks_per_node)
        if shape.gpus_per_node:
            params["gpus_per_node"] = shape.gpus_per_node
        base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                "stderr_to_stdout"}
        return {k if k in base else f"slurm_{k}": v for k, v in params.items()}

    def _executor(self, shape: JobShape):
        import submitit

        executor = submitit.AutoExecutor(
            folder=self.params["submitit_folder"], cluster="slurm",
            slurm_max_num_timeout=self.params["max_num_timeout"],
        )
        executor.update_parameters(**self._parameters(shape))
        return executor

    def _dry_run_parameters(self, shape: JobShape) -> dict[str, Any]:
        """The ``sbatch`` parameters :meth:`_executor` would submit with, found without SLURM's
        commands (submitit's executor refuses to start where ``srun`` is missing)."""
        from submitit.slurm.slurm import SlurmExecutor

        class _NoCluster(SlurmExecutor):
            @classmethod
            def affinity(cls) -> int:
                return 1  # a dry run submits nothing: no srun needed

        executor = _NoCluster(folder=self.params["submitit_folder"],
                              max_num_timeout=self.params["max_num_timeout"])
        # as submitit's AutoExecutor takes them: None is "not set", slurm_-prefixed keys are SLURM's own
        params = {k: v for k, v in self._parameters(shape).items() if v is not None}
        specific = {k.removeprefix("slurm_"): v for k, v in params.items() if k.startswith("slurm_")}
        generic = {k: v for k, v in params.items() if not k.startswith("slurm_")}
        executor.update_parameters(**executor._convert_parameters(generic), **specific)
        return dict(executor.parameters)

    def _print_arrays(self, arrays: dict, sweep_dir: Path) -> None:
        from submitit.slurm.slurm import _make_sbatch_string

        total = sum(len(m) for m in arrays.values())
        print(f"dry run: {total} job(s) in {len(arrays)} array(s); nothing submitted; output in {sweep_dir}")
        for shape, members in arrays.items():
            params = dict(self._dry_run_parameters(shape), map_count=len(members))
            script = _make_sbatch_string(
                command="python -u -m submitit.core._submit", folder=self.params["submitit_folder"], **params
            )
            setup = set(self.params.get("setup") or ())
            print(
                f"\narray of {len(members)} job(s): {shape.nodes} node(s) x {shape.tasks_per_node} task(s) = "
                f"{shape.tasks} process(es), {shape.gpus_per_node * shape.nodes} GPU(s)"
            )
            shown = [line for line in script.splitlines() if line.startswith("#SBATCH") or line in setup]
            print("\n".join(shown))
            for num, overrides, cfg, _ in members:
                problem = _config_problem(cfg)
                mark = f"  <- {problem}" if problem else ""
                print(f"  #{num}: {' '.join(filter_overrides(overrides))}{mark}")

    def _collect(self, num: int, overrides: list, cfg: DictConfig, handle) -> JobReturn:
        """The job's return, after making sure it left a row."""
        try:
            value = handle.results()[0]
            if isinstance(value, JobReturn):
                return value
            return JobReturn(overrides=overrides, cfg=cfg, status=JobStatus.COMPLETED, _return_value=value)
        except Exception as error:  # noqa: BLE001 - a job that died still gets its row
            output_dir = job_output_dir(cfg)
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            if not (output_dir / RESULT_FILE).exists():
                row = fallback_row(cfg, overrides, output_dir, handle, message)
                try:
                    create_file_atomic(output_dir / RESULT_FILE, json_text(row))
                    log.warning("job #%d ended without a row (%s); wrote one with status %s",
                                num, handle.state, row["status"])
                except FileExistsError:
                    pass
            return JobReturn(overrides=overrides, cfg=cfg, status=JobStatus.FAILED, _return_value=error)


@functools.cache  # once a process: a fork hook cannot be taken back
def forks_leave_requeueing_to_the_task() -> None:
    """SLURM sends a job's timeout or preemption signal (submitit's ``USR_SIG``) to every process
    of its step, and a process the task forks (megatron-core's checkpoint writers, a data loader's
    workers) inherits submitit's handler of it: each would save the job's submission and requeue
    it, racing the task for submitit's files (``A temporary saved file already exists``, which
    ended the task's run as an error). A forked process ignores the signal; the task acts on it."""
    import submitit

    signum = getattr(signal, f"SIG{submitit.JobEnvironment.USR_SIG}")
    os.register_at_fork(after_in_child=lambda: signal.signal(signum, signal.SIG_IGN))


def node_address(node: str) -> str:
    """The address SLURM reaches ``node`` at (its ``NodeAddr``; the name where none is given): a
    node's name need not resolve (names the cluster alone knows, or several node daemons of one
    machine, as slurm/cluster.sh starts)."""
    try:
        shown = subprocess.run(["scontrol", "show", "node", "--oneliner", node], capture_output=True, text=True,
                               check=False).stdout
    except OSError:  # no scontrol in the job's environment (a container): the name, as submitit gives it
        return node
    return next((field.split("=", 1)[1] for field in shown.split() if field.startswith("NodeAddr=")), node)


def _config_problem(cfg: DictConfig) -> Optional[str]:
    """Why the job ``cfg`` describes will stop at its configuration check, or None."""
    try:
        validate(cfg)
    except ConfigError as error:
        return str(error)
    return None


def _remove_if_only_sweep_config(sweep_dir: Path) -> None:
    """Undo what Hydra's sweeper created for a dry run: a new directory holding multirun.yaml."""
    if sweep_dir.is_dir() and [p.name for p in sweep_dir.iterdir()] == ["multirun.yaml"]:
        (sweep_dir / "multirun.yaml").unlink()
        for empty in (sweep_dir, *sweep_dir.parents[:2]):  # multirun/<experiment>/<time>
            if empty.resolve() == Path.cwd() or any(empty.iterdir()):
                break
            empty.rmdir()


def _wait(handles: list) -> None:
    """Block until every job ended, logging progress (ended, crashed, elapsed, time left)."""
    start = time.monotonic()
    crashed: dict[int, bool] = {}  # by position; asked once, as submitit may wait for a result file
    last = None
    while True:
        for i, handle in enumerate(handles):
            if i not in crashed and handle.done():
                crashed[i] = handle.exception() is not None  # an error row is a result, not a crash
        elapsed = time.monotonic() - start
        ended, failed = len(crashed), sum(crashed.values())
        if (ended, failed) != last:
            left = f", about {elapsed / ended * (len(handles) - ended):.0f} s left" if ended else ""
            log.info("%d/%d job(s) ended (%d crashed), %.0f s elapsed%s", ended, len(handles), failed,
                     elapsed, left)
            last = (ended, failed)
        if len(crashed) == len(handles):
            return
        time.sleep(POLL_S)
