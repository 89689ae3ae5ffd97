"""Export a checkpoint to Hugging Face ``transformers``' format.

    python -m memo.modes.export CHECKPOINT OUTPUT

``CHECKPOINT`` is a ``step_<n>/`` directory that training saved (:mod:`memo.execute.checkpoint`),
or a directory of them (its last); ``OUTPUT`` receives ``config.json`` and ``model.safetensors``
(:func:`memo.model.hf_checkpoint.save`: Llama, or Qwen2 where the query, key and value
projections have biases), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads, and
where the run had a tokenizer (``train.tokenizer``, or ``--tokenizer``) its files and
``generation_config.json`` with its begin- and end-of-text ids, as ``save_pretrained`` leaves
them. The model's shape and dtype are read from the checkpoint; its weights are loaded whole into
one CPU process (any layout it was saved at), so the host needs the model's size in memory,
twice. Files get the user's umask; an ``OUTPUT`` that holds a checkpoint, or anything of a run
(its claim, rows, configuration or checkpoints), is refused.
"""

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf

from memo.config import ConfigError, HardwareConfig, MethodConfig, ModelConfig, RunConfig, TrainConfig, resolve
from memo.config.hf_model import CONFIG_FILE
from memo.data.tokenizer import LocalTokenizer, TokenizerError
from memo.execute import checkpoint, distributed
from memo.model import hf_checkpoint
from memo.policy import build_model
from memo.results import CHECKPOINTS_DIR, CLAIM_FILE, CONFIG_DIR, METRICS_FILE, RESULT_FILE, create_file_atomic

log = logging.getLogger("memo")


GENERATION_CONFIG_FILE = "generation_config.json"
# what save_pretrained leaves beside tokenizer.json, copied where the tokenizer's directory has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# what a run directory or a checkpoint holds: an export there would mix with them
_RUN_FILES = (CLAIM_FILE, RESULT_FILE, METRICS_FILE, CONFIG_DIR, CHECKPOINTS_DIR, "common.pt", ".metadata")


def _check_output(output: Path) -> None:
    """Refuse an ``output`` that holds an exported model, or anything of a run, before any work.

    Raises:
        ConfigError: naming what is there.
    """
    kept = [output / n for n in (CONFIG_FILE, hf_checkpoint.WEIGHTS_FILE, hf_checkpoint.INDEX_FILE)
            if (output / n).exists()]
    if kept:
        raise ConfigError(f"{kept[0]} exists and is kept; export to another directory")
    of_a_run = [output / n for n in _RUN_FILES if (output / n).exists()] + [c.path for c in checkpoint.checkpoints(output)]
    if of_a_run:
        raise ConfigError(f"{output} holds {of_a_run[0].name}, part of a training run; export to a directory of its own")


def _tokenizer(facts: dict, given: Optional[str]) -> Optional[LocalTokenizer]:
    """The tokenizer of the run (``given``, else the run's ``train.tokenizer``, else that of the
    Hugging Face directory it started from), or None: ``none``, or a run without one.

    Raises:
        ConfigError: a tokenizer that is gone or unreadable.
    """
    data = facts.get("data", {})
    path = given if given is not None else data.get("train.tokenizer")
    origin = Path(facts["origin"]) / "tokenizer.json" if facts.get("origin") else None
    if path is None and origin is not None and origin.is_file():
        path = str(origin)
    if path is None or path == "none":
        return None
    if not Path(path).is_file():
        raise ConfigError(f"the run's tokenizer {path} is not there; give its tokenizer.json with --tokenizer, or "
                          "--tokenizer none to export the weights alone")
    try:
        return LocalTokenizer(path, data.get("train.eod_token"), eod_setting="the run's train.eod_token")
    except TokenizerError as error:
        raise ConfigError(f"--tokenizer: {error}") from None


def _write_tokenizer(tokenizer: LocalTokenizer, output: Path) -> None:
    """The tokenizer's files and ``generation_config.json`` into ``output``: the one beside the
    tokenizer where there is one (a Hugging Face directory's own), else its ids."""
    source = Path(tokenizer.path)
    copies = {"tokenizer.json": source, **{n: source.parent / n for n in (*TOKENIZER_FILES[1:], GENERATION_CONFIG_FILE)}}
    for name, path in copies.items():
        if path.is_file():
            create_file_atomic(output / name, path.read_bytes())
    if not (output / GENERATION_CONFIG_FILE).exists():
        ids = {k: v for k, v in (("bos_token_id", tokenizer.bos), ("eos_token_id", tokenizer.eod)) if v is not None}
        create_file_atomic(output / GENERATION_CONFIG_FILE, json.dumps(ids, indent=2) + "\n")


def export(source: Path, output: Path, tokenizer: Optional[str] = None) -> Path:
    """Write the weights of the checkpoint ``source`` (or the last in a directory of them) to
    ``output`` in ``transformers``' format, with the run's tokenizer (``tokenizer``: a
    tokenizer.json, ``none``, or None for the run's own); returns the checkpoint exported.

    Raises:
        ConfigError: a checkpoint that cannot be read, a model ``transformers`` has no format
            for, a tokenizer that is gone, or an ``output`` that holds an export or a run already.
    """
    output = Path(output)
    _check_output(output)  # before the model is loaded, which takes a while
    found = checkpoint.find(Path(source))
    facts = checkpoint.saved_facts(found.path)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in facts["model_config"].items() if k in known and k != "init_from"})
    hf_checkpoint.hf_config(model, torch.float32)  # a shape transformers has a format for, before any work
    words = _tokenizer(facts, tokenizer)
    token_ids = {} if words is None else {k: v for k, v in (("bos_token_id", words.bos),
                                                            ("eos_token_id", words.eod)) if v is not None}
    # One process of the model as saved, with nothing that swaps or walks tiles: only its weights count.
    run = resolve(OmegaConf.structured(RunConfig(model=model, method=MethodConfig(name="none"), seq="1k",
                                                 hardware=HardwareConfig(name="cpu"),
                                                 train=TrainConfig(dtype=facts["dtype"], load=None))),
                  gpu_visible=False)
    distributed.initialize(run.workload.parallel, "cpu", distributed.ProcessInfo(rank=0, world_size=1, local_rank=0))
    try:
        built = build_model(run.workload, "cpu")
        checkpoint.load_weights(found.path, built.chunks, facts)
        try:
            hf_checkpoint.save(built.chunks, model, output, token_ids, positions=facts["data"].get("seq", 0))
            if words is not None:
                _write_tokenizer(words, output)
        except FileExistsError as error:
            raise ConfigError(str(error)) from None
    finally:
        distributed.shutdown()
    return found.path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_<n>/ directory, or a directory of them (its last)")
    parser.add_argument("output", type=Path, help="receives config.json and model.safetensors (a new directory)")
    parser.add_argument("--tokenizer", help="the tokenizer.json to ship with the model (default: the run's "
                        "train.tokenizer); none: the weights alone")
    args = parser.parse_args(argv)
    try:
        exported = export(args.checkpoint, args.output, args.tokenizer)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{exported} -> {args.output} (transformers' format)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
