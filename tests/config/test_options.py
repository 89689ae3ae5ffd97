"""Every configuration key is described at run time, and ``python run.py --help`` lists them all."""

import dataclasses
import os
import subprocess
import typing

from omegaconf import OmegaConf

from memo.config import RunConfig
from memo.config.options import asks_for_help, collect, listing

from conftest import PYTHON, REPO


def _leaves(schema: type, prefix: str = ""):
    """(dotted key, field) of every leaf of ``schema``, walked here apart from memo.config.options."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def _config_keys(node, prefix: str = "") -> set[str]:
    """The leaf keys OmegaConf makes of the schema."""
    keys = set()
    for key, value in node.items():
        if isinstance(value, dict):
            keys |= _config_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def test_every_key_has_a_one_line_help():
    leaves = dict(_leaves(RunConfig))
    assert len(leaves) > 100
    lacking = [key for key, f in leaves.items() if not f.metadata.get("help", "").strip()]
    assert not lacking, f"fields without metadata={{'help': ...}}: {lacking}"
    multiline = [key for key, f in leaves.items() if "\n" in f.metadata["help"]]
    assert not multiline, f"helps of more than one line: {multiline}"


def test_options_cover_every_key_of_the_schema():
    keys = [o.key for o in collect()]
    assert keys == list(dict(_leaves(RunConfig)))
    assert set(keys) == _config_keys(OmegaConf.to_container(OmegaConf.structured(RunConfig)))


def test_listing_shows_keys_with_types_and_defaults():
    text = listing(width=100)
    for line in ("  train.steps: int = 10", "  model.init_from: str or null = null",
                 "  model.num_layers: int = (from conf/model/)", "  plan: bool = false",
                 "  fit.tile_tokens: list[str] = [whole,8k,16k,32k]", "  model.norm_epsilon: float = 1e-05"):
        assert line in text.splitlines()
    assert max(map(len, text.splitlines())) <= 100
    assert text.index("  mode: str") < text.index("  model.name") < text.index("  method.name")


def test_help_flags():
    assert asks_for_help(["-h"]) and asks_for_help(["model=7b", "--help"])
    assert not asks_for_help(["--hydra-help"]) and not asks_for_help(["--hydra-help", "--help"])
    assert not asks_for_help(["train.steps=3"])


def test_run_help_lists_keys_and_writes_nothing(tmp_path):
    # -X importtime: which modules --help imports, on stderr
    done = subprocess.run([PYTHON, "-X", "importtime", str(REPO / "run.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: python run.py")
    words = " ".join(done.stdout.split())
    assert "model 1.3b, 125m" in words and "(default: tiny_llama)" in words  # the groups' files
    assert "train.steps: int = 10" in words
    help_ = dict(_leaves(RunConfig))["train.micro_batch_size"].metadata["help"]
    assert help_ in words
    assert list(tmp_path.iterdir()) == []  # no outputs/: Hydra never ran
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "megatron")}
