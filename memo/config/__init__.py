"""Typed run configuration: the schema Hydra validates against, and the checks it cannot express."""

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
from memo.config.validate import ConfigError, parse_alpha, parse_seq, resolve_loss, validate

__all__ = [
    "ClusterConfig",
    "FitConfig",
    "ConfigError",
    "HardwareConfig",
    "MethodConfig",
    "ModelConfig",
    "ParallelConfig",
    "PlannerConfig",
    "ProfileConfig",
    "RunConfig",
    "TrainConfig",
    "parse_alpha",
    "parse_seq",
    "register_configs",
    "resolve_loss",
    "validate",
]
