"""Train one configuration, or sweep many with ``-m``: ``python run.py model=7b seq=64k,128k -m``.

``mode=profile`` traces one iteration's allocations instead, and ``mode=plan`` also plans them
(see :mod:`memo.modes.profile`); ``mode=fit`` predicts memory, α, the longest sequence and the time
per iteration, and searches layouts (see :mod:`memo.modes.fit`). All three run anywhere, for any
model size.

Each job claims its Hydra output directory (a directory that holds another run is refused and
left as it is), then writes ``.hydra/``, ``result.json`` and ``metrics.jsonl`` there. A mistake
in the configuration ends the run with one line on stderr (exit status 2); in a sweep it leaves
an ``error`` row and the sweep goes on with the next job. Ctrl-C or SIGTERM leaves an
``interrupted`` row and ends the process (exit status 130 or 143).
"""

import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import memo  # noqa: F401  (its warning filter, before megatron-core is imported)
from memo.collector import freeze_at_exit, frozen_after
from memo.config import ConfigError, register_configs, validate
from memo.config.choices import check_group_choices
from memo.config.options import asks_for_help, help_text, show
from memo.execute.launch import LAUNCHED, launch, leave_error
from memo.results import claim_run_dir, continue_run_dir

CONF_DIR = Path(__file__).resolve().parent / "conf"
def _rank() -> int:
    """This process's rank under torchrun, a launch, or a SLURM job's tasks (whose ``RANK`` the
    SLURM launcher sets as each task starts: read when asked, not at import)."""
    return int(os.environ.get("RANK", "0"))


register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    try:  # caught here: past this function Hydra would add a report of its own
        if hydra_cfg.mode == RunMode.RUN:
            validate(cfg)  # fail fast, before the heavy imports; a sweep records it in a row
        output_dir = Path(hydra_cfg.runtime.output_dir)
        if _launches(cfg, hydra_cfg):  # the job's ranks, started here; rank 0 claims the directory, writes the row
            code = launch(cfg.launch.processes, _rank_command(hydra_cfg, output_dir))
            if code >= 128 or (code and hydra_cfg.mode == RunMode.RUN):
                sys.exit(code)  # rank 0 printed the refusal, or the interrupt, which ends a sweep too
            return
        rank = _rank()
        if rank != 0:  # what every rank would log, rank 0 logs
            logging.getLogger("memo").setLevel(logging.WARNING)
        claimed = rank == 0
        if claimed:  # before anything is written there, Hydra's .hydra/ included
            take = continue_run_dir if cfg.mode == "train" and cfg.train.resume else claim_run_dir
            take(output_dir, _hydra_files(cfg, hydra_cfg))
        with frozen_after():  # torch's and megatron-core's objects: the collector walks them no more
            if cfg.mode == "train":
                from memo.modes.train import run_job as job
            elif cfg.mode == "fit":
                from memo.modes.fit import fit_job as job
            else:
                from memo.modes.profile import profile_and_plan as job
        row = job(cfg, output_dir, hydra_cfg.overrides.task, claimed=claimed)
    except ConfigError as error:
        _fail(str(error))
    if row["status"] == "error" and hydra_cfg.mode == RunMode.RUN:
        _fail(row["error"])


def _launches(cfg: DictConfig, hydra_cfg: DictConfig) -> bool:
    """Whether this process starts the job's ranks (``launch.processes``): not a rank itself (of a
    launch, torchrun, or as many SLURM tasks), and in a sweep only a job whose settings are valid
    (an invalid one runs here, to leave its row).

    Raises:
        ConfigError: in one of SLURM's tasks, where there are several and not as many.
    """
    processes = cfg.launch.processes
    if processes == 1 or LAUNCHED in os.environ or "RANK" in os.environ:
        return False
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) if "SLURM_PROCID" in os.environ else 1
    if tasks == processes:  # SLURM started the ranks (hydra/launcher=slurm sizes a job so)
        return False
    if tasks > 1:
        raise ConfigError(f"launch.processes={processes} in each of SLURM's {tasks} tasks; start one task per node "
                          f"to launch them, or {processes} tasks and no launch")
    if hydra_cfg.mode != RunMode.RUN:
        try:
            validate(cfg)
        except ConfigError:
            return False
    return True


# Hydra's own settings a rank must not inherit: where this command's job and sweep write, its mode
_PARENTS_HYDRA = ("hydra.run.", "hydra.sweep.", "hydra.mode", "hydra.job.num", "hydra.job.id", "hydra/launcher",
                  "hydra.launcher", "hydra/sweeper", "hydra.sweeper")


def _rank_command(hydra_cfg: DictConfig, output_dir: Path) -> list[str]:
    """``python run.py`` as this job was composed (its config name and directories, its overrides,
    Hydra's own but where to write), writing into ``output_dir``."""
    sources = [f"--config-dir={s.path}" for s in hydra_cfg.runtime.config_sources
               if s.provider == "command-line" and s.schema == "file"]
    own = [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(_PARENTS_HYDRA)]
    return [sys.executable, str(Path(__file__).resolve()), f"--config-name={hydra_cfg.job.config_name}", *sources,
            *hydra_cfg.overrides.task, *own, f"hydra.run.dir={output_dir}"]


def _hydra_files(cfg: DictConfig, hydra_cfg: DictConfig) -> dict[str, str]:
    """What Hydra's ``.hydra/`` holds: the job's configuration, Hydra's, and the overrides."""
    return {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml({"hydra": hydra_cfg}),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
    }


def _secondary_rank_arguments(argv: list[str]) -> list[str]:
    """Under torchrun or a launch every process composes the config; only rank 0 writes results,
    so the others get a scratch output directory (in place of any given) instead of a stray one
    under outputs/."""
    if _rank() == 0:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"memo-rank{_rank()}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    kept = [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    return [*kept, f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]


def _one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages (and their causes) as one line."""
    parts = []
    while error is not None:
        for line in str(error).splitlines():
            line = line.strip()
            if line and not line.startswith(("full_key:", "reference_type=", "object_type=")):
                parts.append(line.rstrip("."))
        error = error.__cause__
    return "; ".join(dict.fromkeys(parts))


def _fail(message: str) -> None:
    if _rank() == 0:  # every rank refuses alike: the line once (another's, where it alone fails, the launch prints)
        print(f"error: {message}", file=sys.stderr)
    else:
        leave_error(_rank(), message)
    sys.exit(2)


if __name__ == "__main__":
    if asks_for_help(sys.argv[1:]):  # every key with its description, instead of Hydra's generic help
        show(help_text(CONF_DIR))
        sys.exit(0)
    freeze_at_exit()  # this process's files are closed by then: see memo.collector
    sys.argv = _secondary_rank_arguments(sys.argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # Let errors reach us as exceptions instead of Hydra's multi-line report.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        check_group_choices(sys.argv[1:], CONF_DIR)
        main()
    except ConfigError as error:
        _fail(str(error))
    except (HydraException, OmegaConfBaseException) as error:
        _fail(_one_line(error))
    except OSError as error:  # Hydra could not make the output directory
        _fail(f"{error.filename or ''}: {error.strerror or error}; choose a writable hydra.run.dir")
    except KeyboardInterrupt as error:  # the row, if any, is written and says so
        signum = getattr(error, "signum", signal.SIGINT)
        if _rank() == 0:
            print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)
