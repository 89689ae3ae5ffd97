"""Megatron-core's fine-grained activation offloading (method=megatron_offload): the byte model of
memo.policy.megatron_offload against saved tensors counted on a real model, and what configuration
and training refuse."""

import dataclasses
import functools
from contextlib import nullcontext

import pytest
import torch
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode

import memo.model.gpt
from memo.config import ConfigError, Method, ParallelConfig, Workload, validate
from memo.policy import policy_of
from memo.policy.megatron_offload import (
    MIN_OFFLOADED_ELEMENTS,
    module_scopes,
    offloaded_bytes,
    offloaded_layers,
)
from memo.model import build_gpt, torch_dtype, uses_transformer_engine
from memo.model.attention import select_backend
from memo.model.gpt import transformer_config
from memo.profile.iteration import process_group, unchecked_rng_forks

from conftest import compose_config, resolve_config, run_in_process

MEGATRON_MIN_ELEMENTS = 1024 * 1024  # TransformerConfig.min_offloaded_tensor_size in megatron-core 0.16


def _model(name: str):
    # neither the loss's vocabulary nor the depth is part of a layer: small ones keep the real
    # forward pass cheap (three layers: one inner layer, whose input a layer makes)
    return dataclasses.replace(OmegaConf.to_object(compose_config(f"model={name}").model), vocab_size=256,
                               num_layers=3)


class _Counted:
    """Every tensor saved in one layer's forward, as Megatron's offload context sees them: the
    saved-tensor hooks pushed around each named module's forward (the innermost hooks are the ones
    called), and around the layer's for the rest."""

    def __init__(self, layer: torch.nn.Module):
        self.saves = []  # (module or None, tensor)
        self._wrap(layer, None)
        for name, modules in module_scopes(layer).items():
            for module in modules:
                self._wrap(module, name)

    def _wrap(self, module: torch.nn.Module, name):
        forward = module.forward

        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            def pack(tensor):
                self.saves.append((name, tensor))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return forward(*args, **kwargs)

        module.forward = wrapped

    def bytes(self, modules: set, parameters: set, minimum: int, where) -> tuple[int, int, int]:
        """(host, device kept, device without offloading) by Megatron's rules, storages told apart
        by ``where(tensor)``."""
        saves = [(m, t) for m, t in self.saves if where(t) not in parameters]
        offloaded = [(m, t) for m, t in saves if m in modules and t.numel() >= minimum]
        # a page-locked copy each, as PyTorch's host allocator pins it: the next power of two
        host = sum(1 << (t.numel() * t.element_size() - 1).bit_length() for _, t in offloaded)
        offloaded_ids = {id(t) for _, t in offloaded}
        storages = {where(t): t.untyped_storage().nbytes() for _, t in saves}
        held = {where(t) for _, t in saves if id(t) not in offloaded_ids}
        kept = sum(size for key, size in storages.items() if key in held)
        return host, kept, sum(storages.values())


def _count(workload: Workload, modules: set, fake: bool) -> list[tuple[int, int, int]]:
    """Host, kept and method=none bytes of each inner layer of ``workload`` (method=none), counted
    at its length on real CPU tensors (storages told apart by address) or on fake ones (by storage
    object, every saved one held), tensor parallelism over a process group that moves nothing."""
    parallel = workload.parallel
    config = transformer_config(workload, "cpu")
    grouped = config.num_query_groups not in (None, config.num_attention_heads)
    attention = select_backend("cpu", torch_dtype(workload), config.kv_channels, "auto", grouped)
    where = (lambda t: id(t.untyped_storage())) if fake else (lambda t: t.untyped_storage().data_ptr())
    tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    with process_group(parallel, "fake"), tensors:
        torch.manual_seed(0)
        gpt = build_gpt(workload, "cpu", attention, layers=policy_of(workload).layers).module
        parameters = {where(p) for p in gpt.parameters()}
        counted = [_Counted(layer) for layer in gpt.decoder.layers[1:-1]]
        b, s = workload.micro_batch_size, workload.seq
        ids = torch.zeros(b, s, dtype=torch.long)
        with unchecked_rng_forks():
            gpt(ids, torch.arange(s).expand(b, s), None, labels=ids)
        return [c.bytes(modules, parameters, MEGATRON_MIN_ELEMENTS, where) for c in counted]


# host bytes per module in units of b·s·h·e/tp, by hand: at s = 6144 the tensors of b·s·h/tp
# elements pass Megatron's 2^20 (q, the attention output; sequence-parallel chunks b·s/tp·h with
# b = 2), tiny_llama's grouped k and v (h/4), the norms' statistics and the log-sum-exp do not
@pytest.mark.parametrize("model, tp, dtype, micro_batch_size, units, fake", [
    # grouped keys and values, RMSNorm, real tensors: q and the output, the output again
    ("tiny_llama", 1, "fp32", 1, {"core_attn": 2, "attn_proj": 1}, False),
    # sequence parallel, LayerNorm and biases, 16-bit (fake tensors: bf16 is slow here): the
    # layer's input and the norm's output (TE fuses the norm into the QKV projection); q, k, v
    # and the output; the output again
    ("tiny", 2, "bf16", 2, {"qkv_linear": 2, "core_attn": 4, "attn_proj": 1}, True),
    # with the MLP recomputed (Megatron's recompute_modules=[mlp]): the offloaded modules save as
    # before; what the MLP keeps is its input alone, on the device
    ("tiny_llama", 1, "fp32", 1, {"core_attn": 2, "attn_proj": 1, "mlp": None}, False),
])
def test_byte_model_equals_the_saved_tensors_counted_at_a_third_length(model, tp, dtype, micro_batch_size,
                                                                        units, fake):
    # 6144 tokens is neither traced length (2048, 4096 per sequence-parallel chunk) and splits the
    # saved tensors on both sides of Megatron's 2^20-element threshold
    recomputed = tuple(name for name, n in units.items() if n is None)
    units = {name: n for name, n in units.items() if n is not None}
    modules = list(units)
    method = Method(name="megatron_offload", offload_modules=tuple(modules),
                    **({"recompute_granularity": "selective", "recompute_modules": recomputed} if recomputed else {}))
    workload = Workload(_model(model), method, ParallelConfig(tp=tp, sequence_parallel=tp > 1), 6144,
                        micro_batch_size, dtype)
    predicted = offloaded_bytes(workload)
    counted = _count(dataclasses.replace(workload, method=dataclasses.replace(method, offload_modules=None)),
                     set(modules), fake)
    (host, kept, none), = counted  # the one inner layer
    assert (predicted.per_layer_host, predicted.per_layer_device_kept, predicted.per_layer_device_none) == (
        host, kept, none)
    assert 0 < predicted.per_layer_device_freed < predicted.per_layer_host
    unit = micro_batch_size * 6144 * workload.model.hidden_size * workload.dtype_bytes // tp
    pinned = 1 << (unit - 1).bit_length()  # each copy page-locked on its own
    assert predicted.host_by_module == {name: n * pinned for name, n in units.items()}


def test_attention_output_is_copied_once_per_save_and_small_tensors_stay():
    # tiny_llama in fp32 at s = 6144 (h = 256, 8 query heads over 2 key/value heads of 32):
    # q and the attention output have s·h = 1.5M elements and go; k, v (s·h/4) and the
    # log-sum-exp (8·s) stay. The output is saved by the kernel and as the projection's input:
    # copied twice, freed once. Each copy is page-locked on its own: 6 MiB as 8.
    s, h, e = 6144, 256, 4
    workload = Workload(_model("tiny_llama"), Method(name="megatron_offload", offload_modules=("core_attn", "attn_proj")),
                        ParallelConfig(), s, 1, "fp32")
    offload = offloaded_bytes(workload)
    assert offload.host_by_module == {"core_attn": 2 * 2**23, "attn_proj": 2**23}
    assert offload.per_layer_device_freed == 2 * s * h * e
    # at 1M tokens k, v and the log-sum-exp pass the threshold too: q, k, v, out, lse, out
    s = 1 << 20
    big = offloaded_bytes(dataclasses.replace(workload, seq=s))
    assert big.per_layer_host == (3 * h + 2 * h // 4) * s * e + 8 * s * 4
    assert big.per_layer_device_freed == big.per_layer_host - s * h * e
    assert big.per_layer_device_none == offload.per_layer_device_none * (1 << 20) // 6144
    assert MIN_OFFLOADED_ELEMENTS == MEGATRON_MIN_ELEMENTS
    assert [offloaded_layers(n) for n in (1, 2, 32)] == [0, 1, 31]


def test_training_without_transformer_engine_or_gpu_is_refused_in_one_line(tmp_path, monkeypatch):
    row = run_in_process(tmp_path, "train.steps=2", "train.warmup_steps=1", "seq=128",
                         "method=megatron_offload")
    assert row["status"] == "error" and "\n" not in row["error"] and row["iter_time_s"] is None
    assert row["error"].startswith("method=megatron_offload is Megatron-core's fine-grained activation "
                                   "offloading, which needs a GPU and Transformer Engine"), row["error"]
    workload = resolve_config("method=megatron_offload", "model=tiny_llama", "seq=1024", "train.dtype=bf16").workload
    layers, name = policy_of(workload).layers, workload.method.name
    monkeypatch.setattr(memo.model.gpt, "HAVE_TE", True)
    with pytest.raises(ConfigError, match=r"which needs a GPU \(it copies"):
        uses_transformer_engine("cpu", "auto", layers, name)
    with pytest.raises(ConfigError, match=r"train.attention_backend=flash is not supported"):
        uses_transformer_engine("cuda", "flash", layers, name)
    # with both, Megatron's TransformerConfig fields are set on Transformer Engine's layers
    assert uses_transformer_engine("cuda", "auto", layers, name)
    config = transformer_config(workload, "cuda", local_spec=False, layers=layers)
    assert config.fine_grained_activation_offloading and config.offload_modules == ["core_attn", "attn_proj"]
    monkeypatch.setattr(memo.model.gpt, "HAVE_TE", False)
    with pytest.raises(ConfigError, match=r"needs Transformer Engine \(pip install '.\[gpu\]'\) \(it copies"):
        uses_transformer_engine("cuda", "auto", layers, name)
    assert not transformer_config(workload, "cpu", layers=layers).fine_grained_activation_offloading


@pytest.mark.parametrize("modules, message", [
    ("[core_attn,qkv_proj]", "method.offload_modules: qkv_proj is not a module Megatron offloads; "
                             "choose from: qkv_linear, core_attn, attn_proj"),
    ("[attn_norm]", "method.offload_modules: attn_norm has no effect here: Megatron skips it"),
    ("[core_attn,moe_act]",
     "method.offload_modules: moe_act has no effect here: it offloads mixture-of-experts"),
    ("[attn_proj]", "method.offload_modules: attn_proj's input is core_attn's output"),
    ("[]", "method.offload_modules=[] offloads nothing"),
])
def test_offload_modules_megatron_does_not_offload_here_are_refused(modules, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_config("method=megatron_offload", f"method.offload_modules={modules}"))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_offloading_combines_with_no_other_activation_method():
    default = compose_config("method=megatron_offload").method
    assert list(default.offload_modules) == ["core_attn", "attn_proj"]
    for overrides, message in [
        (["method=memo", "method.offload_modules=[core_attn]"],
         "cannot be combined with method.layer_activations=swap"),
        (["method=megatron_selective", "method.offload_modules=[core_attn]"],
         "offloads core_attn, whose recomputation"),
        (["method=megatron_full_recompute", "method.offload_modules=[core_attn]"],
         "with method.recompute_granularity=full: a layer recomputed whole saves nothing"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(*overrides))
    assert validate(compose_config("method=megatron_offload", "method.offload_modules=[qkv_linear]")).seq == 1024
    # Megatron's selective recomputation of other modules beside the offloading (its best at length)
    assert validate(compose_config("method=megatron_offload_recompute", "model=tiny_llama")).method.recompute_modules \
        == ("mlp",)


def test_recomputing_the_mlp_of_a_model_with_biases_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="mlp on model=tiny, whose linear layers have biases") as refused:
        validate(compose_config("method=megatron_offload_recompute", "model=tiny"))
    assert "\n" not in str(refused.value)
    validate(compose_config("method=megatron_offload_recompute", "model=tiny_llama"))
