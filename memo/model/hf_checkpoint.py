"""Weights in Hugging Face ``transformers``' format (``config.json`` and safetensors), both ways.

``model.init_from=DIR`` starts training from a Llama, Qwen2 or Qwen3 checkpoint that
``transformers`` saved (``save_pretrained``): :func:`check` finds, before a model is built, that
``DIR/config.json`` describes the run's model (:mod:`memo.config.hf_model` reads it) and that its
weight files are whole and hold exactly its tensors; :func:`load` copies every tensor into this
rank's shard of the Megatron model; :func:`save` writes
the model back in the same format. Neither needs ``transformers``: the format is read as JSON
and safetensors.

What changes between the two layouts:

* Megatron fuses q, k and v into one ``linear_qkv`` whose rows run group by group (the query
  heads of a key/value group, then its key head, then its value head); ``transformers`` keeps
  ``q_proj``, ``k_proj`` and ``v_proj`` apart. Biases (Qwen2) the same way.
* Megatron's SwiGLU FC1 is ``[gate; up]`` (``linear_fc1``), ``transformers``' ``gate_proj`` and
  ``up_proj``; under tensor parallelism each rank holds its rows of both (Megatron's partition
  stride 2), which :func:`shard` and :func:`unshard` follow.
* Everything else is renamed only (Qwen3's ``q_norm`` and ``k_norm`` are Megatron's
  ``q_layernorm`` and ``k_layernorm``). Transformer Engine's layers keep the norms' weights inside
  the next linear layer (``layer_norm_weight``); both layer specs are understood.

The vocabulary must not be padded (``make_vocab_size_divisible_by`` and tp divide it, as for
Llama-3's and Qwen2.5's): padded rows would add logits that the checkpoint's model never had.
"""

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from memo.config import ConfigError, ModelConfig, hf_model
from memo.model.gpt import head_size, padded_vocab_size
from memo.results import create_file_atomic, new_file_mode

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _our_shape(model: ModelConfig) -> dict:
    shape = {key: getattr(model, key) for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "activation", "normalization",
        "norm_epsilon", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights", "vocab_size",
        "rotary_base", "rope_scaling", "qk_layernorm")}
    shape["num_query_groups"] = model.num_query_groups or model.num_attention_heads
    shape["kv_channels"] = model.kv_channels if head_size(model) * model.num_attention_heads != model.hidden_size \
        else None
    if model.rope_scaling:
        shape["rope_scaling_factor"] = model.rope_scaling_factor
    return shape


def _vocab_multiples(vocab: int, tp: int) -> list[int]:
    """The ``make_vocab_size_divisible_by`` values up to 128 that leave a vocabulary of ``vocab``
    unpadded at tensor parallelism ``tp``, largest first."""
    return [m for m in range(128, 0, -1) if vocab % math.lcm(m, tp) == 0]


def check_config(model: ModelConfig, directory: Path, tp: int) -> None:
    """Refuse a checkpoint whose ``config.json`` describes another model than ``model``, or a
    vocabulary that Megatron would pad under tensor parallelism ``tp``.

    Raises:
        ConfigError: naming the first field that differs and the value to set, in one line.
    """
    theirs, ours = hf_model.shape(hf_model.read_config(directory), directory), _our_shape(model)
    for key, value in theirs.items():
        if key in ours and ours[key] != value and not (isinstance(value, float) and
                                                       abs(ours[key] - value) <= 1e-12 * abs(value)):
            raise ConfigError(f"model.init_from={directory} holds a model with {key}={value}, and "
                              f"model.{key}={ours[key]}; set model.{key}={value}, or model=hf to read every "
                              "field from the checkpoint")
    if padded_vocab_size(model, tp) != model.vocab_size:
        multiples = _vocab_multiples(model.vocab_size, tp)
        fix = (f"set model.make_vocab_size_divisible_by={multiples[0]}" if multiples else
               f"choose a parallel.tp that divides {model.vocab_size}")
        raise ConfigError(f"model.init_from: model.vocab_size={model.vocab_size} would be padded to "
                          f"{padded_vocab_size(model, tp)} rows at tp={tp}, adding logits the checkpoint "
                          f"lacks; {fix}")


# ---------------------------------------------------------------- names and layouts


def _layer_names(prefix: str, i: int, model: ModelConfig) -> dict:
    """Our parameter names of layer ``i`` -> the checkpoint's (a tuple where ours fuses several)."""
    ours, theirs = f"decoder.layers.{i}.", f"{prefix}layers.{i}."
    names = {
        ours + "input_layernorm.weight": theirs + "input_layernorm.weight",
        ours + "self_attention.linear_qkv.weight": tuple(theirs + f"self_attn.{p}_proj.weight" for p in "qkv"),
        ours + "self_attention.linear_proj.weight": theirs + "self_attn.o_proj.weight",
        ours + "pre_mlp_layernorm.weight": theirs + "post_attention_layernorm.weight",
        ours + "mlp.linear_fc1.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
        ours + "mlp.linear_fc2.weight": theirs + "mlp.down_proj.weight",
    }
    if model.add_qkv_bias:
        names[ours + "self_attention.linear_qkv.bias"] = tuple(theirs + f"self_attn.{p}_proj.bias" for p in "qkv")
    if model.qk_layernorm:
        names.update({ours + f"self_attention.{p}_layernorm.weight": theirs + f"self_attn.{p}_norm.weight"
                      for p in "qk"})
    return names


def names(model: ModelConfig) -> dict:
    """Every parameter of the whole model: our name -> the checkpoint's name (or names, in the
    order they are fused)."""
    prefix = "model."
    table = {"embedding.word_embeddings.weight": prefix + "embed_tokens.weight",
             "decoder.final_layernorm.weight": prefix + "norm.weight"}
    for i in range(model.num_layers):
        table.update(_layer_names(prefix, i, model))
    if model.untie_embeddings_and_output_weights:
        table["output_layer.weight"] = "lm_head.weight"
    return table


def chunk_names(chunk: torch.nn.Module, model: ModelConfig) -> dict:
    """:func:`names` of the parameters one model chunk holds (a pipeline stage's, its layers
    numbered within it): the embedding where it comes first, its layers, and the final norm and
    output layer where it comes last (on a pipeline's last stage a tied embedding's copy, read from
    the embedding's tensor)."""
    prefix = "model."
    table = {}
    if chunk.pre_process:
        table["embedding.word_embeddings.weight"] = prefix + "embed_tokens.weight"
    for local, layer in enumerate(chunk.decoder.layers):
        whole = _layer_names(prefix, layer.layer_number - 1, model)
        table.update({ours.replace(f"decoder.layers.{layer.layer_number - 1}.", f"decoder.layers.{local}.", 1): theirs
                      for ours, theirs in whole.items()})
    if chunk.post_process:
        table["decoder.final_layernorm.weight"] = prefix + "norm.weight"
        if model.untie_embeddings_and_output_weights:
            table["output_layer.weight"] = "lm_head.weight"
        elif not chunk.pre_process:
            table["output_layer.weight"] = prefix + "embed_tokens.weight"
    return table


# Transformer Engine's spec keeps each norm's weight in the linear layer after it
_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _module_name(name: str, present: set) -> str:
    if name in present:
        return name
    for local, te in _TE_NAMES.items():
        if name.endswith(local) and name.replace(local, te) in present:
            return name.replace(local, te)
    raise KeyError(f"the model has no parameter {name}")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's QKV rows (weights or biases): per group its query heads, key head, value head."""
    return torch.cat([t.unflatten(0, (groups, -1)) for t in (q, k, v)], dim=1).flatten(0, 1)


def _split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple:
    groups = model.num_query_groups or model.num_attention_heads
    head = head_size(model)
    per_group = model.num_attention_heads // groups * head
    q, k, v = qkv.unflatten(0, (groups, -1)).split([per_group, head, head], dim=1)
    return tuple(t.flatten(0, 1).clone() for t in (q, k, v))


def from_megatron(tensors: dict, model: ModelConfig) -> dict:
    """The whole model's tensors in our names as ``transformers``' tensors (the inverse of what
    :func:`load` reads)."""
    out = {}
    for ours, theirs in names(model).items():
        out.update(_theirs(ours, theirs, tensors[ours], model))
    return out


def _theirs(ours: str, theirs, t: torch.Tensor, model: ModelConfig) -> dict:
    """Our whole tensor ``ours`` as the checkpoint's tensor(s) ``theirs``."""
    if isinstance(theirs, str):
        return {theirs: t}
    if "linear_qkv" in ours:
        return dict(zip(theirs, _split_qkv(t, model), strict=True))
    return dict(zip(theirs, (c.clone() for c in t.chunk(2, dim=0)), strict=True))


# ------------------------------------------------------------- tensor parallelism


def _split(param: torch.nn.Parameter) -> tuple[int, int]:
    """(dimension, stride) of a tensor-parallel parameter's split; (-1, 1) for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return -1, 1
    return param.partition_dim, getattr(param, "partition_stride", 1)


def shard(full: torch.Tensor, param: torch.nn.Parameter, rank: int, size: int) -> torch.Tensor:
    """This rank's part of ``full`` as ``param`` holds it: along its partition dimension, the
    ``stride`` pieces ``rank``, ``rank + size``, ... of ``size·stride`` equal ones."""
    dim, stride = _split(param)
    if dim < 0 or size == 1:
        return full
    parts = full.chunk(size * stride, dim=dim)
    return torch.cat([parts[k * size + rank] for k in range(stride)], dim=dim)


def unshard(local: torch.Tensor, param: torch.nn.Parameter, group, size: int) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard, split as ``param`` is (``param``
    itself, or its gradient), gathered over the tensor-parallel ``group`` of ``size`` ranks (the
    inverse of :func:`shard`)."""
    dim, stride = _split(param)
    local = local.detach()
    if dim < 0 or size == 1:
        return local.clone()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    pieces = [g.chunk(stride, dim=dim) for g in gathered]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(size)], dim=dim)


# ---------------------------------------------------------------------- files


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``directory``: those its index names, else its one file.

    Raises:
        ConfigError: naming the file that is missing or unreadable.
    """
    index = directory / INDEX_FILE
    if index.exists():
        try:
            files = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"model.init_from: {index} cannot be read ({type(error).__name__}: {error}); copy the "
                              "checkpoint's index again") from None
        paths = sorted({directory / f for f in files})
        absent = [p for p in paths if not p.is_file()]
        if absent:
            raise ConfigError(f"model.init_from: {absent[0]} is named by {INDEX_FILE} and missing ({len(absent)} of "
                              f"{len(paths)} files); copy the checkpoint whole")
        return paths
    single = directory / WEIGHTS_FILE
    if not single.exists():
        raise ConfigError(f"model.init_from={directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; give a "
                          "directory that transformers' save_pretrained wrote (safetensors)")
    return [single]


def _hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of ``model``'s checkpoint, by ``transformers``' name."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, head_size(model)
    q, kv = model.num_attention_heads * d, (model.num_query_groups or model.num_attention_heads) * d
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    shapes = {}
    for theirs in names(model).values():
        for name in (theirs,) if isinstance(theirs, str) else theirs:
            part = name.split(".")[-2]
            if part in ("q_norm", "k_norm"):
                shapes[name] = (d,)
            elif name.endswith("norm.weight"):
                shapes[name] = (h,)
            elif name.endswith(".bias"):
                shapes[name] = (rows[part],)
            elif part in rows:
                shapes[name] = (rows[part], h)
            else:
                shapes[name] = {"o_proj": (h, q), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.get(
                    part, (model.vocab_size, h))  # embed_tokens, lm_head
    return shapes


class _Checkpoint:
    """The tensors of a checkpoint directory, each read (whole or in part) only when asked for."""

    def __init__(self, directory: Path):
        self._files = {}  # tensor name -> its open safetensors file
        for path in _weight_files(directory):
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors' own error: a truncated or damaged file
                raise ConfigError(f"model.init_from: {path} cannot be read ({str(error).strip()}); copy it "
                                  "again, whole") from None
            self._files.update(dict.fromkeys(handle.keys(), handle))
        self.used: set = set()

    @classmethod
    def of(cls, model: ModelConfig, directory: Path) -> "_Checkpoint":
        """The checkpoint in ``directory``, checked to hold exactly ``model``'s tensors in their shapes.

        Raises:
            ConfigError: naming the first file or tensor that is unreadable, missing, extra or of
                another shape.
        """
        checkpoint = cls(directory)
        shapes = _hf_shapes(model)
        missing, unused = sorted(shapes.keys() - checkpoint.names()), sorted(checkpoint.names() - shapes.keys())
        if missing or unused:
            what = f"lacks {missing[0]}" if missing else f"holds {unused[0]}, which the model has no place for"
            raise ConfigError(f"model.init_from={directory} {what} ({len(missing)} missing, {len(unused)} unused); "
                              f"is it a checkpoint of model={model.name}'s shape?")
        for name, shape in shapes.items():
            found = tuple(checkpoint._files[name].get_slice(name).get_shape())
            if found != shape:
                raise ConfigError(f"model.init_from={directory}: {name} is {found}, and the model's config.json "
                                  f"makes it {shape}; the weights are not of that config")
        return checkpoint

    def names(self) -> set:
        return set(self._files)

    def rows(self, name: str, dim: int = 0, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Tensor ``name``, or its ``part``-th of ``parts`` equal pieces along ``dim``."""
        self.used.add(name)
        piece = self._files[name].get_slice(name)
        size = piece.get_shape()[dim] // parts
        index = [slice(None)] * len(piece.get_shape())
        index[dim] = slice(part * size, (part + 1) * size)
        return piece[tuple(index)]


def check(model: ModelConfig, directory, tp: int) -> None:
    """Everything :func:`load` checks, without a model: ``config.json`` describes ``model`` (at
    tensor parallelism ``tp``), and every weight file is present, whole and readable with exactly
    the model's tensors in their shapes; seconds, before a model is built.

    Raises:
        ConfigError: in one line naming the field, file or tensor.
    """
    check_config(model, Path(directory), tp)
    _Checkpoint.of(model, Path(directory))


def _read_shard(checkpoint: _Checkpoint, ours: str, theirs, param: torch.nn.Parameter, model: ModelConfig,
                rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of our tensor ``ours``, read from the checkpoint's ``theirs``: only the
    rows (or columns) it holds, so no rank ever holds the whole model."""
    dim, _ = _split(param)
    if dim < 0:  # replicated (the norms)
        return checkpoint.rows(theirs)
    if isinstance(theirs, str):
        return checkpoint.rows(theirs, dim, rank, tp)
    if "linear_qkv" in ours:  # this rank's query groups: rows of q, k and v alike
        groups = (model.num_query_groups or model.num_attention_heads) // tp
        return _fuse_qkv(*(checkpoint.rows(n, 0, rank, tp) for n in theirs), groups)
    # FC1 (partition stride 2): this rank's rows of gate, then of up
    return torch.cat([checkpoint.rows(n, dim, rank, tp) for n in theirs], dim=dim)


def load(chunks: list[torch.nn.Module], model: ModelConfig, directory) -> int:
    """Copy the checkpoint in ``directory`` into ``chunks`` (this rank's Megatron ``GPTModel``
    chunks of ``model``: its pipeline stage, its tensor-parallel shards), each rank reading only
    its part of every tensor; returns the checkpoint's tensors read.

    Raises:
        ConfigError: if the checkpoint is not of this model (one line naming the field), lacks one
            of its tensors, or holds tensors the model has no place for.
    """
    directory = Path(directory)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    check_config(model, directory, tp)
    checkpoint = _Checkpoint.of(model, directory)
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for ours, theirs in chunk_names(chunk, model).items():
            param = params[_module_name(ours, params.keys())]
            part = _read_shard(checkpoint, ours, theirs, param, model, rank, tp)
            if part.shape != param.shape:
                raise ConfigError(f"model.init_from: {ours} is {tuple(part.shape)} on this rank, the model's "
                                  f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(part)
    return len(checkpoint.used)


def gather(chunks: list[torch.nn.Module], model: ModelConfig, grads: bool = False) -> dict:
    """The whole model's tensors in ``transformers``' names (its weights, or with ``grads`` their
    gradients), gathered from every tensor-parallel rank and pipeline stage (a collective: every
    rank of the model-parallel group calls it with its model ``chunks``), on the host. A tied
    embedding's copy on the last stage is left out: the first stage's is the tensor."""
    group = parallel_state.get_tensor_model_parallel_group() if dist.is_initialized() else None
    size = parallel_state.get_tensor_model_parallel_world_size() if dist.is_initialized() else 1
    whole = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for ours, theirs in chunk_names(chunk, model).items():
            if ours == "output_layer.weight" and not model.untie_embeddings_and_output_weights:
                continue
            param = params[_module_name(ours, params.keys())]
            whole.update(_theirs(ours, theirs, unshard(param.grad if grads else param, param, group, size).cpu(),
                                 model))
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, whole, group=parallel_state.get_pipeline_model_parallel_group())
        whole = {name: t for stage in stages for name, t in stage.items()}
    return whole


# the context a config.json states where the run's is shorter: Llama-3.1's and Qwen2.5's
_POSITIONS = 131072


def hf_config(model: ModelConfig, dtype: torch.dtype, token_ids: Optional[dict] = None, positions: int = 0) -> dict:
    """``config.json`` of ``model`` as ``transformers`` reads it: Qwen3 where queries and keys have
    norms, Qwen2 where q, k and v have biases, Llama otherwise; with ``token_ids`` (``bos_token_id``,
    ``eos_token_id``) where the tokenizer is known (without them transformers' Llama assumes 1 and 2);
    ``max_position_embeddings`` the longer of ``positions`` (the tokens it was trained on) and 128K."""
    kind = "qwen3" if model.qk_layernorm else "qwen2" if model.add_qkv_bias else "llama"
    if model.activation != "swiglu" or model.normalization != "RMSNorm" or model.add_bias_linear or (
            model.qk_layernorm and model.add_qkv_bias):
        raise ConfigError(f"model={model.name} is not a Llama, Qwen2 or Qwen3 shape (SwiGLU, RMSNorm, no linear "
                          "biases, q and k biases or norms, not both): transformers' format has no place for it")
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]],
        "model_type": kind,
        "hidden_act": "silu",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
        "head_dim": head_size(model),
        "rms_norm_eps": model.norm_epsilon,
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "rope_theta": float(model.rotary_base),
        "max_position_embeddings": max(positions, _POSITIONS),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if kind != "qwen2":
        config.update(attention_bias=False, **({"mlp_bias": False} if kind == "llama" else {}))
    if model.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_scaling_factor, **hf_model.LLAMA3_SCALING}
    return {**config, **(token_ids or {})}


def save(chunks: list[torch.nn.Module], model: ModelConfig, directory, token_ids: Optional[dict] = None,
         positions: int = 0) -> None:
    """Write ``chunks`` (this rank's model chunks of ``model``) to ``directory`` in ``transformers``'
    format: ``config.json`` and one ``model.safetensors``. A collective over the model-parallel
    group (every rank calls it); the job's first rank writes. An existing ``directory`` with a checkpoint is never
    overwritten; each file appears whole (written beside, then renamed).

    Raises:
        FileExistsError: if ``directory`` holds a checkpoint already.
    """
    tensors = gather(chunks, model)
    if dist.is_initialized() and dist.get_rank() != 0:  # every replica gathered the same tensors
        return
    directory = Path(directory)
    for name in (hf_model.CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE):
        if (directory / name).exists():
            raise FileExistsError(f"{directory / name} exists and is kept; save to another directory")
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    partial = directory / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(partial), metadata={"format": "pt"})
    os.chmod(partial, new_file_mode())  # safetensors creates its files 0600, unreadable to the rest of a team
    os.link(partial, directory / WEIGHTS_FILE)  # fails rather than replace one that appeared meanwhile
    partial.unlink()
    create_file_atomic(directory / hf_model.CONFIG_FILE,
                       json.dumps(hf_config(model, dtype, token_ids, positions), indent=2) + "\n")

