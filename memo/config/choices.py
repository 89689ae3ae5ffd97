"""Command-line checks Hydra would otherwise answer with a multi-line error and traceback hint."""

from pathlib import Path
from typing import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser

from memo.config.values import ConfigError

GROUPS = ("model", "method", "parallel", "hardware", "experiment", "workload")


def options(conf_dir: Path, group: str) -> list[str]:
    """The choices of config group ``group``: the YAML files in ``conf_dir/group``."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_group_choices(args: Sequence[str], conf_dir: Path) -> None:
    """Raise :class:`ConfigError` if an override picks a config-group option that does not exist.

    ``args`` are command-line arguments; sweeps (``model=7b,13b``) are checked value by value,
    and anything that is not a plain ``group=value`` override is left to Hydra.
    """
    candidates = [
        a for a in args if not a.startswith("-") and a.split("=", 1)[0].lstrip("+~") in GROUPS
    ]
    if not candidates:
        return
    for override in OverridesParser.create().parse_overrides(candidates):
        group = override.key_or_group
        if override.is_delete():
            continue
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
        available = options(conf_dir, group)
        for value in values:
            if value not in available:
                raise ConfigError(
                    f"{group}={value} is not a known {group}; choose one of: {', '.join(available)} "
                    f"(the files in conf/{group}/)"
                )
