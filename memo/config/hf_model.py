"""A model's shape read from a Hugging Face checkpoint's ``config.json``: ``model=hf
model.init_from=DIR``.

``conf/model/hf.yaml`` fills every field of :class:`memo.config.ModelConfig` with the
interpolation ``${hf_model:FIELD,${.init_from}}``, which :func:`field_of` answers from
``DIR/config.json`` when the configuration is resolved; a field given on the command line
replaces its interpolation and is then checked against the file when the weights are read
(:func:`memo.model.hf_checkpoint.check_config`). Only JSON is read here: the weights are checked
by :mod:`memo.model.hf_checkpoint`, before the model is built.

Llama (``model_type`` llama, Llama 3.x), Qwen2 (qwen2, Qwen2 and Qwen2.5) and Qwen3's dense models
(qwen3: a norm of each query and key head, megatron-core's ``qk_layernorm``, and heads whose width
``head_dim`` need not be hidden ÷ heads, its ``kv_channels``) are read, tied or untied, with or
without Llama-3.1's RoPE scaling; whatever our layers cannot express (a sliding window, biases
with no place in Megatron's layer, another activation or RoPE scaling) is refused in one line
naming the field of ``config.json``.
"""

import functools
import json
import math
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from memo.config.values import ConfigError

CONFIG_FILE = "config.json"
MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Megatron-core's RotaryEmbedding applies Llama-3.1's scaling with these, whatever the factor
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# The padding Megatron-LM gives a vocabulary by default; a checkpoint's model is read with the
# largest power of two up to it that divides its vocabulary, so that no row is added
_VOCAB_MULTIPLE = 128
RESOLVER = "hf_model"


def read_config(directory) -> dict:
    """``DIR/config.json`` as a dict.

    Raises:
        ConfigError: if it is missing or not JSON, naming the file.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model.init_from={directory} has no {CONFIG_FILE}; give a directory that transformers' "
                          "save_pretrained wrote (config.json and safetensors)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.init_from={directory}: {path} cannot be read ({error}); give a directory that "
                          "transformers' save_pretrained wrote") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.init_from={directory}: {path} is not a JSON object; give a directory that "
                          "transformers' save_pretrained wrote")
    return config


def _refuse(directory, field: str, value, why: str) -> ConfigError:
    shown = value if isinstance(value, str) else json.dumps(value)  # JSON's true, false and objects
    return ConfigError(f"model.init_from={directory}: config.json has {field}={shown}: {why}")


def _required(config: dict, directory, field: str):
    if field not in config:
        raise ConfigError(f"model.init_from={directory}: config.json lacks {field}; is it a Llama or Qwen "
                          "checkpoint's?")
    return config[field]


def shape(config: dict, directory="DIR") -> dict:
    """The fields of :class:`memo.config.ModelConfig` that ``config`` (a ``transformers``
    config.json, version 4 or 5) decides, in our names and types.

    Raises:
        ConfigError: for a model our layers cannot express, naming the field of ``config.json``.
    """
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise _refuse(directory, "model_type", kind, "Llama 3.x (llama), Qwen2/2.5 (qwen2) and Qwen3's dense (qwen3) "
                                                     "checkpoints are read")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(directory, "hidden_act", config["hidden_act"], "our MLP is SwiGLU (hidden_act=silu)")
    if config.get("mlp_bias"):
        raise _refuse(directory, "mlp_bias", True, "Megatron's SwiGLU layer has no place for the MLP's biases")
    if kind in ("llama", "qwen3") and config.get("attention_bias"):
        # transformers' Llama and Qwen3 then have a bias on o_proj too, which Megatron's layer would
        # only have with every linear bias (add_bias_linear)
        raise _refuse(directory, "attention_bias", True, "Megatron's layer has no place for o_proj's bias")
    if kind in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise _refuse(directory, "use_sliding_window", True,
                      "our attention is causal over the whole sequence, not within a window")
    heads, hidden = _required(config, directory, "num_attention_heads"), _required(config, directory, "hidden_size")
    head_dim = config.get("head_dim") or hidden // heads
    rope = config.get("rope_parameters") or {}  # transformers 5 moves theta and the scaling in here
    scaling = config.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise _refuse(directory, "rope_theta", theta, "model.rotary_base is a whole number")
    vocab = _required(config, directory, "vocab_size")
    out = {
        "num_layers": _required(config, directory, "num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": _required(config, directory, "intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        # only where it is not hidden ÷ heads, as a conf/model/ file leaves it
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "qk_layernorm": kind == "qwen3",
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "norm_epsilon": float(_required(config, directory, "rms_norm_eps")),
        "add_bias_linear": False,
        "add_qkv_bias": kind == "qwen2",
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": math.gcd(vocab, _VOCAB_MULTIPLE),
        "rotary_base": int(theta),
        "rope_scaling": scaling is not None,
        "rope_scaling_factor": 8.0,
    }
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "llama3" or any(
                float(scaling.get(k, -1)) != v for k, v in LLAMA3_SCALING.items()):
            raise _refuse(directory, "rope_scaling", scaling,
                          f"Megatron-core applies Llama-3.1's only (rope_type llama3 with {LLAMA3_SCALING})")
        out["rope_scaling_factor"] = float(scaling["factor"])
    return out


def run_name(directory) -> str:
    """What a run started from ``directory`` is named: the directory's name, or for a snapshot of
    the Hugging Face cache (``models--ORG--NAME/snapshots/REV``) the model's (NAME)."""
    path = Path(directory).absolute()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


def field_of(field: str, directory) -> object:
    """``model.FIELD`` of the model in ``directory`` (the resolver ``hf_model``): its name, or a
    field of :func:`shape`.

    Raises:
        ConfigError: as :func:`shape` and :func:`read_config` do; for ``model=hf`` without
            ``model.init_from``.
    """
    if directory in (None, "", "None"):
        raise ConfigError("model=hf reads the model's shape from a checkpoint: set model.init_from=DIR, a directory "
                          "transformers' save_pretrained wrote")
    if field == "name":
        return run_name(directory)
    path = Path(directory) / CONFIG_FILE
    try:
        stamp = (path.stat().st_mtime_ns, path.stat().st_size)
    except OSError:
        stamp = None  # read_config says why
    return _shape_of(str(directory), stamp)[field]


@functools.lru_cache(maxsize=16)
def _shape_of(directory: str, stamp: Optional[tuple[int, int]]) -> dict:
    """:func:`shape` of ``directory``'s config.json as it was at ``stamp`` (its mtime, its size): read once
    for the ~20 fields a configuration resolves, each time it is resolved (a failure is not kept)."""
    return shape(read_config(directory), directory)


def register_resolver() -> None:
    """Make ``${hf_model:FIELD,DIR}`` available to the configuration (once per process)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, field_of)


# at import, not only in run.py's start-up: a SLURM job runs run.py's main function shipped by
# value (submitit), whose process never runs run.py's top level, and resolves the configuration there
register_resolver()
