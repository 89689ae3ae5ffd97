"""Every configuration key with its type, default and description, read from :class:`RunConfig`.

The descriptions are the fields' ``metadata["help"]`` (memo.config.schema), so the listing is
never out of step with the schema. ``python -m memo.config.options`` prints it;
``python run.py --help`` prints it after a usage line and the config groups' choices.
"""

import dataclasses
import os
import shutil
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from memo.config import choices
from memo.config.schema import RunConfig

HELP_FLAGS = ("-h", "--help")


@dataclasses.dataclass(frozen=True)
class Option:
    """One key of the run configuration, as a user writes it on the command line."""

    key: str  # dotted: "train.steps"
    type: str  # "int", "list[str]", "int or null", ...
    default: str  # "10", "null", "[whole,8k]", "(from conf/model/)"
    help: str  # one line
    section: str  # "" for a top-level key, else the nested dataclass's field: "train"


def collect(schema: type = RunConfig, prefix: str = "") -> list[Option]:
    """Every leaf key of ``schema``, nested dataclasses walked in field order."""
    found = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            found += collect(kind, f"{prefix}{f.name}.")
            continue
        section = prefix.rstrip(".")
        found.append(Option(f"{prefix}{f.name}", type_name(kind), _default(f, section),
                            f.metadata.get("help", ""), section))
    return found


def sections(schema: type = RunConfig) -> dict[str, str]:
    """Each section's description: "" (the top-level keys) first, then the nested dataclasses'."""
    described = {"": "Top-level keys."}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            described[f.name] = f.metadata.get("help") or hints[f.name].__doc__.split("\n")[0]
    return described


def type_name(kind: Any) -> str:
    """``kind`` as a user writes a value of it: ``Optional[list[str]]`` is "list[str] or null"."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{type_name(inner)} or null"
    if typing.get_origin(kind) is list:
        return f"list[{type_name(args[0])}]"
    return kind.__name__


def format_value(value: Any) -> str:
    """``value`` in Hydra's override syntax: null, true, [whole,8k]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value) if value != "" else "''"


def _default(f: dataclasses.Field, section: str) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return format_value(f.default_factory())
    if f.default == MISSING:  # a config group's file sets it (model=7b sets model.*)
        return f"(from conf/{section}/)" if section in choices.GROUPS else "(required)"
    return format_value(f.default)


def listing(width: int | None = None) -> str:
    """Every key, grouped by section, each as ``key: type = default`` over its description,
    wrapped to ``width`` columns (the terminal's by default)."""
    width = max(width or shutil.get_terminal_size().columns, 40)
    wrap = {"width": width, "break_long_words": False, "break_on_hyphens": False}
    by_section: dict[str, list[Option]] = {}
    for option in collect():
        by_section.setdefault(option.section, []).append(option)
    lines = []
    for section, description in sections().items():
        title = f"{section}.*  {description}" if section else description
        lines += ["", *textwrap.wrap(title, **wrap)]
        for o in by_section.get(section, []):
            lines += textwrap.wrap(f"{o.key}: {o.type} = {o.default}", initial_indent="  ",
                                   subsequent_indent="      ", **wrap)
            lines += textwrap.wrap(o.help, initial_indent="      ", subsequent_indent="      ", **wrap)
    return "\n".join(lines[1:])


def asks_for_help(args: Sequence[str]) -> bool:
    """Whether command-line ``args`` ask for this listing (``--hydra-help`` stays Hydra's)."""
    return any(a in HELP_FLAGS for a in args) and "--hydra-help" not in args


def help_text(conf_dir: Path, width: int | None = None) -> str:
    """``python run.py --help``: the usage, the config groups' choices, then :func:`listing`."""
    width = max(width or shutil.get_terminal_size().columns, 40)
    defaults = _group_defaults(conf_dir / "config.yaml")
    lines = [
        "usage: python run.py [KEY=VALUE ...] [-m]",
        "",
        *textwrap.wrap("Train one configuration, or sweep many with -m: python run.py model=7b "
                       "seq=64k,128k -m. KEY=VALUE sets one of the keys listed below; GROUP=NAME picks "
                       "a file of conf/GROUP/, whose values replace the defaults shown. Hydra's own "
                       "options: --hydra-help.", width=width, break_on_hyphens=False),
        "",
        "Config groups:",
    ]
    groups = [*choices.GROUPS, *(g for g in defaults if g not in choices.GROUPS)]
    pad = max(map(len, groups)) + 4
    for group in groups:
        chosen = defaults.get(group)
        text = ", ".join(choices.options(conf_dir, group))
        text += f" (default: {chosen})" if chosen else f" (none by default: +{group}=NAME)"
        lines += textwrap.wrap(text, width=width, initial_indent=f"  {group:<{pad - 2}}",
                               subsequent_indent=" " * pad, break_on_hyphens=False)
    return "\n".join(lines) + "\n\n" + listing(width)


def _group_defaults(config_yaml: Path) -> dict[str, str]:
    """The groups' files chosen by ``config_yaml``'s defaults list: {"model": "tiny_llama", ...}."""
    chosen = {}
    for entry in OmegaConf.load(config_yaml).get("defaults", []):
        if OmegaConf.is_dict(entry):
            chosen.update({k: v for k, v in entry.items() if (config_yaml.parent / k).is_dir()})
    return chosen


def show(text: str) -> None:
    """Print ``text`` to stdout, quietly stopping where a reader (``| head``) has stopped reading."""
    try:
        print(text, flush=True)
    except BrokenPipeError:  # and Python's flush at exit must not hit the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main() -> None:
    """``python -m memo.config.options``: print :func:`listing`."""
    show(listing())


if __name__ == "__main__":
    main()
