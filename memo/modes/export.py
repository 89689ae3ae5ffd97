"""Export a checkpoint to Hugging Face ``transformers``' format.

    python -m memo.modes.export CHECKPOINT OUTPUT

``CHECKPOINT`` is a ``step_<n>/`` directory that training saved (:mod:`memo.execute.checkpoint`),
or a directory of them (its last); ``OUTPUT`` receives ``config.json`` and ``model.safetensors``
(:func:`memo.model.hf_checkpoint.save`: Llama, or Qwen2 where the query, key and value
projections have biases), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. The
model's shape and dtype are read from the checkpoint; its weights are loaded whole into one CPU
process (any layout it was saved at), so the host needs the model's size in memory, twice.
"""

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf

from memo.config import ConfigError, HardwareConfig, MethodConfig, ModelConfig, RunConfig, TrainConfig, resolve
from memo.execute import checkpoint, distributed
from memo.model import hf_checkpoint
from memo.policy import build_model

log = logging.getLogger("memo")


def export(source: Path, output: Path) -> Path:
    """Write the weights of the checkpoint ``source`` (or the last in a directory of them) to
    ``output`` in ``transformers``' format; returns the checkpoint exported.

    Raises:
        ConfigError: a checkpoint that cannot be read, a model ``transformers`` has no format
            for, or an ``output`` that holds a checkpoint already.
    """
    for name in (hf_checkpoint.CONFIG_FILE, hf_checkpoint.WEIGHTS_FILE, hf_checkpoint.INDEX_FILE):
        if (Path(output) / name).exists():  # before the model is loaded, which takes a while
            raise ConfigError(f"{Path(output) / name} exists and is kept; export to another directory")
    found = checkpoint.find(Path(source))
    facts = checkpoint.saved_facts(found.path)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in facts["model_config"].items() if k in known and k != "init_from"})
    hf_checkpoint.hf_config(model, torch.float32)  # a shape transformers has a format for, before any work
    # One process of the model as saved, with nothing that swaps or walks tiles: only its weights count.
    run = resolve(OmegaConf.structured(RunConfig(model=model, method=MethodConfig(name="none"), seq="1k",
                                                 hardware=HardwareConfig(name="cpu"),
                                                 train=TrainConfig(dtype=facts["dtype"], load=None))),
                  gpu_visible=False)
    distributed.initialize(run.workload.parallel, "cpu", distributed.ProcessInfo(rank=0, world_size=1, local_rank=0))
    try:
        built = build_model(run.workload, "cpu")
        checkpoint.load_weights(found.path, built.module, facts)
        try:
            hf_checkpoint.save(built.module, model, output)
        except FileExistsError as error:
            raise ConfigError(str(error)) from None
    finally:
        distributed.shutdown()
    return found.path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_<n>/ directory, or a directory of them (its last)")
    parser.add_argument("output", type=Path, help="receives config.json and model.safetensors")
    args = parser.parse_args(argv)
    try:
        exported = export(args.checkpoint, args.output)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{exported} -> {args.output} (transformers' format)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
