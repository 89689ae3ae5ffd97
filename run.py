"""Train one configuration, or sweep many with ``-m``: ``python run.py model=7b seq=64k,128k -m``.

``mode=profile`` traces one iteration's allocations instead, and ``mode=plan`` also plans them
(see :mod:`memo.planning`); ``mode=fit`` predicts memory, α, the longest sequence and the time per
iteration, and searches layouts (see :mod:`memo.fitting`). All three run anywhere, for any model
size.

Each job writes ``result.json`` and ``metrics.jsonl`` into its Hydra output directory. A
mistake in the configuration ends the run with one line on stderr (exit status 2); in a sweep
it leaves an ``error`` row and the sweep goes on with the next job.
"""

import atexit
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

# Megatron-core announces every optional package it did not find, and warns about its own
# default cuda_graph_scope; neither is something a user of this suite can act on.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")
warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")

from memo.config import ConfigError, register_configs, validate  # noqa: E402
from memo.config.choices import check_group_choices  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent / "conf"
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    try:  # caught here: past this function Hydra would add a report of its own
        if hydra_cfg.mode == RunMode.RUN:
            validate(cfg)  # fail fast, before the heavy imports; a sweep records it in a row
        output_dir = Path(hydra_cfg.runtime.output_dir)
        if cfg.mode == "train":
            from memo.job import run_job

            row = run_job(cfg, output_dir, hydra_cfg.overrides.task)
        elif cfg.mode == "fit":
            from memo.fitting import fit_job

            row = fit_job(cfg, output_dir, hydra_cfg.overrides.task)
        else:
            from memo.planning import profile_and_plan

            row = profile_and_plan(cfg, output_dir, hydra_cfg.overrides.task)
    except ConfigError as error:
        _fail(str(error))
    if row["status"] == "error" and hydra_cfg.mode == RunMode.RUN:
        _fail(row["error"])


def _secondary_rank_overrides() -> list[str]:
    """Under torchrun every process composes the config; only rank 0 writes results, so the
    others get a scratch output directory instead of a stray one under outputs/."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return []
    scratch = tempfile.mkdtemp(prefix=f"memo-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]


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
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    sys.argv += _secondary_rank_overrides()
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
