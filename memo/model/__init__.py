"""The Megatron-core GPT that every method trains, and what it needs to run on any device."""

from memo.model.gpt import (
    BuiltModel,
    LayerBuild,
    attention_width,
    build_gpt,
    count_parameters,
    dtype_label,
    dtype_setting,
    head_size,
    model_flops_parameters,
    padded_vocab_size,
    parameter_count,
    torch_dtype,
    uses_transformer_engine,
)

__all__ = [
    "BuiltModel",
    "LayerBuild",
    "attention_width",
    "build_gpt",
    "count_parameters",
    "dtype_label",
    "dtype_setting",
    "head_size",
    "model_flops_parameters",
    "padded_vocab_size",
    "parameter_count",
    "torch_dtype",
    "uses_transformer_engine",
]
