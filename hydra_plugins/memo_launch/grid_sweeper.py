"""A Hydra sweeper whose sweep is a union of grids, for experiments that are not one product.

Hydra's basic sweeper runs the Cartesian product of its ``params``. The paper's experiments are
unions of products: the ablation runs full recomputation with and without the memory plan but
full swapping and MEMO only with it; the convergence runs sweep α for MEMO and run Megatron
once. ``hydra/sweeper=grid`` takes ``params`` (shared by every job) and ``grids`` (a list of
``key: values`` mappings, each expanded as a product and added to the sweep):

    hydra:
      sweeper:
        params: {seq: 128k}
        grids:
          - {method: memo, alpha: "0,0.5,1"}
          - {method: megatron_full_recompute}

gives four jobs. A grid's value replaces the shared one of the same key, and the command line
replaces both (``python run.py -m +experiment=convergence seq=4k``). Without ``grids`` it is the
basic sweeper; it is the suite's default (``conf/config.yaml``). A sweep directory that holds an
earlier sweep is refused before anything is written there.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser

from memo.config import ConfigError

log = logging.getLogger(__name__)


@dataclass
class GridSweeperConf:
    """``hydra/sweeper=grid``: shared ``params`` and a list of ``grids`` (see module docstring)."""

    _target_: str = "hydra_plugins.memo_launch.grid_sweeper.GridSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[dict[str, str]] = None
    grids: list[Any] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/sweeper", name="grid", node=GridSweeperConf, provider="memo")


def _as_overrides(mapping: dict) -> list[str]:
    return [f"{key}={value}" for key, value in mapping.items()]


class GridSweeper(BasicSweeper):
    """The basic sweeper over the union of ``grids`` (each merged with ``params``)."""

    def __init__(
        self, max_batch_size: Optional[int], params: Optional[dict] = None, grids: Optional[list] = None
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.grids = [dict(g) for g in grids or []] or [{}]
        self._arguments: list[str] = []

    def sweep(self, arguments: list[str]) -> Any:
        # Hydra would write this sweep's multirun.yaml over an earlier sweep's
        earlier = Path(str(self.config.hydra.sweep.dir)) / "multirun.yaml"
        if earlier.exists():
            raise ConfigError(f"{earlier.parent} holds an earlier sweep and is kept; give this sweep "
                              "another hydra.sweep.dir")
        self._arguments = list(arguments)
        return super().sweep(arguments)

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra's check that every job of ``batch`` composes, before the launcher runs any; skipped
        for the SLURM launcher, which composes every job of the batch before it submits (or prints)
        anything: there it would only compose each job twice."""
        from hydra_plugins.memo_launch.slurm_launcher import SlurmLauncher  # submitit's import, if used

        if isinstance(self.launcher, SlurmLauncher):
            return
        super().validate_batch_is_legal(batch)

    def split_arguments(self, overrides, max_batch_size):  # replaces the basic sweeper's product
        """All jobs of every grid, in grid order, a job listed twice run once, in batches."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs: list[list[str]] = []
        for grid in self.grids:
            # Later entries win key by key: shared params, then the grid, then the command line.
            lines = _as_overrides(self.params) + _as_overrides(grid) + self._arguments
            product = BasicSweeper.split_arguments(parser.parse_overrides(lines), None)[0]
            jobs.extend(job for job in product if job not in jobs)
        log.info("sweep of %d job(s) from %d grid(s)", len(jobs), len(self.grids))
        size = max_batch_size or len(jobs)
        return [jobs[i:i + size] for i in range(0, len(jobs), size)]
