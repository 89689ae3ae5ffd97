"""Typed run configuration: the schema Hydra validates against, the checks it cannot express, and
the resolved :class:`Run` (with its :class:`Workload` and :class:`Method`) that the modes pass on."""

from memo.config.method import AUTO, WHOLE_LAYERS, Method
from memo.config.resolve import DTYPE_BYTES, Choices, Run, Workload, resolve, shards_optimizer
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
from memo.config.validate import SeqSearch, validate
from memo.config.values import ConfigError, DoesNotFit, parse_alpha, parse_seq

__all__ = [
    "AUTO",
    "Choices",
    "ClusterConfig",
    "ConfigError",
    "DTYPE_BYTES",
    "DoesNotFit",
    "FitConfig",
    "HardwareConfig",
    "Method",
    "MethodConfig",
    "ModelConfig",
    "ParallelConfig",
    "PlannerConfig",
    "ProfileConfig",
    "Run",
    "RunConfig",
    "SeqSearch",
    "TrainConfig",
    "WHOLE_LAYERS",
    "Workload",
    "parse_alpha",
    "parse_seq",
    "register_configs",
    "resolve",
    "shards_optimizer",
    "validate",
]
