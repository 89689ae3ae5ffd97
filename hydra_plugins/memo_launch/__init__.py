"""Hydra plugins for running the suite's sweeps (Hydra loads plugins from ``hydra_plugins``).

* ``hydra/sweeper=grid`` (:mod:`.grid_sweeper`): a sweep that is a union of grids;
* ``hydra/launcher=slurm`` and ``slurm_local`` (:mod:`.slurm_launcher`): SLURM through submitit,
  resources sized per job from its parallel layout.
"""
