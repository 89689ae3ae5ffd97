"""Typed run configuration: the schema Hydra validates against, the checks it cannot express, and
the resolved :class:`Run` (with its :class:`Workload`) that the modes pass on."""

from memo.config.schema import (
    ClusterConfig,
    FitConfig,
    HardwareConfig,
    MethodConfig,
    ModelConfig,
    ParallelConfig,
    PlannerConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    register_configs,
)
from memo.config.resolve import DTYPE_BYTES, Run, SeqSearch, Workload, resolve, shards_optimizer
from memo.config.validate import ConfigError, parse_alpha, parse_seq, validate

__all__ = [
    "ClusterConfig",
    "FitConfig",
    "ConfigError",
    "DTYPE_BYTES",
    "HardwareConfig",
    "MethodConfig",
    "ModelConfig",
    "ParallelConfig",
    "PlannerConfig",
    "ProfileConfig",
    "Run",
    "RunConfig",
    "SeqSearch",
    "TrainConfig",
    "parse_alpha",
    "parse_seq",
    "register_configs",
    "resolve",
    "shards_optimizer",
    "validate",
    "Workload",
]
