"""Megatron-core's fine-grained activation offloading (``method=megatron_offload``) in bytes: what
one layer copies to the host, and what it keeps on the device, at any length.

What Megatron-core 0.16 does (``megatron/core/pipeline_parallel/fine_grained_activation_offload.py``):

* Around the forward of each module named in ``offload_modules`` it pushes autograd's saved-tensor
  hooks, so *every* tensor autograd saves inside the module joins the module's offload group: its
  input, and what its operators save besides (attention's output and log-sum-exp, a norm's
  statistics). Parameters are marked not to be offloaded, and so is every tensor of fewer than
  ``min_offloaded_tensor_size`` elements (2**20 by default).
* When the module's forward ends, each of the others is copied, on a stream of its own, into a
  pinned host buffer of its own shape (a view is made contiguous: it moves its own elements).
  Nothing is shared: a storage saved twice is copied twice, within one group or across two (the
  attention output is saved by core attention's kernel and again as the projection's input). The
  group then holds the host copy in place of the device tensor, so the device storage goes once
  nothing else holds it. (Megatron also frees some inputs outright, ``forced_released_tensors``:
  core attention's q, k and v, the projection's input; on these layers nothing but the offloaded
  saves holds them, so that frees nothing more.)
* In the backward pass each group is copied back into fresh device tensors, one group ahead of the
  one whose backward runs.
* After the first iteration a pipeline stage's last layer offloads nothing, in every micro-batch:
  its groups would be needed back at once (:func:`offloaded_layers`).

Megatron's names on the dense Transformer Engine layer the method trains on: ``qkv_linear`` is the
QKV projection with the input norm fused into it (Megatron builds ``input_layernorm`` as
``IdentityOp`` there, which ``attn_norm`` skips), ``core_attn`` core attention, ``attn_proj`` the
output projection (:data:`memo.config.method.OFFLOAD_MODULES`, :func:`module_scopes`).

With Megatron's selective recomputation beside it (``method.recompute_modules``, e.g. ``mlp``: the
MLP saves its input alone and runs again in the backward pass) the traced layer recomputes as
the method does, so a recomputed module saves nothing for the offloading to take.

How the bytes are found: one forward pass of a three-layer model of the workload's shape, on fake
tensors, with the layers ``method=none`` builds on this machine (Megatron's local layers), records
every tensor autograd saves inside the middle layer, the named module it was saved in (forward
pre- and post-hooks) and its storage. This takes Transformer Engine's fused norm and QKV
projection, attention and output projection to save for their backward what these modules save:
the layer's input, the norm's output and statistics; q, k, v, the attention output and its
log-sum-exp; the projection's input. Two lengths give every size as ``base + slope·tokens``, as
:mod:`memo.profile.template` does; the size threshold is applied at the length asked for, so the
bytes are piecewise affine in tokens.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer import TransformerConfig

from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, Workload
from memo.config.method import OFFLOAD_MODULES
from memo.execute.optimizer_offload import pinned_block_bytes
from memo.model import LayerBuild, build_gpt, torch_dtype
from memo.model.attention import select_backend
from memo.model.gpt import transformer_config
from memo.profile.affine import Affine
from memo.profile.iteration import process_group, unchecked_rng_forks

# Megatron's default of TransformerConfig.min_offloaded_tensor_size (elements), which the method
# leaves as it is.
MIN_OFFLOADED_ELEMENTS: int = next(
    f.default for f in dataclasses.fields(TransformerConfig) if f.name == "min_offloaded_tensor_size")
_TRACED_TOKENS = (2048, 4096)  # per sequence-parallel chunk, as memo.profile.template traces
_TRACED_LAYERS = 3
_LAYER = 2  # Megatron's number of the traced layer: a layer makes its input, as for all but the first


@dataclass(frozen=True)
class OffloadedBytes:
    """One layer's activations under Megatron's offloading, per micro-batch on one rank, at
    ``tokens`` tokens (``seq / cp``, all tensor-parallel ranks together). Bytes throughout."""

    tokens: int
    # copied to the host by a layer that offloads (every layer of a stage but its last,
    # offloaded_layers): one page-locked copy per saved tensor, so a storage saved twice counts
    # twice, each rounded up to a power of two as PyTorch's host allocator pins it
    per_layer_host: int
    # the layer's saved activations left on the device until its backward: what is saved outside
    # the named modules, tensors below the size threshold, and storages one of those still holds
    per_layer_device_kept: int
    # what offloading takes off the device per offloading layer: method=none's kept bytes less
    # per_layer_device_kept (a stage's last layer keeps all of method=none's)
    per_layer_device_freed: int
    # per_layer_host by module name; each group comes back into device tensors of these bytes in
    # the backward pass, one group ahead of the one whose backward runs
    host_by_module: dict[str, int]

    @property
    def per_layer_device_none(self) -> int:
        """Bytes the layer keeps on the device for its backward without offloading (method=none)."""
        return self.per_layer_device_kept + self.per_layer_device_freed


def offloaded_layers(layers: int) -> int:
    """How many of a pipeline stage's ``layers`` layers offload in every step after the first: all
    but the last, whose groups Megatron keeps on the device (their reload would stall the backward
    pass that starts right after)."""
    return max(layers - 1, 0)


def offloaded_bytes(workload: Workload,
                    min_offloaded_elements: int = MIN_OFFLOADED_ELEMENTS) -> OffloadedBytes:
    """One layer's bytes on the host and on the device under ``workload.method.offload_modules``,
    for ``workload``'s model, tensor parallelism, sequence parallelism, micro-batch size and dtype
    at its ``seq / cp`` tokens (the context-parallel exchange's own tensors are not traced).

    Args:
        min_offloaded_elements: Megatron's ``min_offloaded_tensor_size``: saved tensors with fewer
            elements stay on the device.

    The traced layer is cached per shape, so a sweep traces each shape once (two fake-tensor
    forward passes, seconds).

    Raises:
        ConfigError: if the method offloads nothing, or the traced layer saves different tensors at
            different lengths (which cannot be scaled).
    """
    method = workload.method
    if not method.offloads:
        raise ConfigError(f"method={method.name} offloads nothing (method.offload_modules is unset)")
    unknown = sorted(set(method.offload_modules) - set(OFFLOAD_MODULES))
    if unknown:
        raise ConfigError(f"method.offload_modules: {', '.join(unknown)} not modelled; choose from: "
                          f"{', '.join(OFFLOAD_MODULES)}")
    parallel = workload.parallel
    layer = _layer(_frozen(workload.model), parallel.tp, parallel.sequence_parallel,
                   workload.micro_batch_size, workload.dtype, megatron_recompute(method))
    return layer.at(workload.seq // parallel.cp, frozenset(method.offload_modules), min_offloaded_elements)


def megatron_recompute(method: Method) -> tuple[tuple[str, object], ...]:
    """Megatron's recomputation settings of ``method`` as :class:`memo.model.LayerBuild` takes them
    (``TransformerConfig``'s ``recompute_*`` fields as (name, value) pairs); () for none."""
    if method.recompute_granularity is None:
        return ()
    recompute = (("recompute_granularity", method.recompute_granularity),
                 ("recompute_method", method.recompute_method), ("recompute_num_layers", method.recompute_num_layers))
    if method.recompute_modules is not None:
        recompute += (("recompute_modules", method.recompute_modules),)
    return recompute


@dataclass(frozen=True)
class _Save:
    """One tensor autograd saved in the traced layer."""

    module: Optional[str]  # the named module whose forward saved it; None: elsewhere in the layer
    elements: int
    element_size: int  # bytes
    storage: int  # index into the layer's storages


@dataclass(frozen=True)
class _LayerTrace:
    """What one layer saves at one length."""

    saves: tuple[_Save, ...]
    storage_bytes: tuple[int, ...]  # of every storage saved, in order of first save

    def structure(self) -> tuple:
        return tuple((s.module, s.element_size, s.storage) for s in self.saves), len(self.storage_bytes)


class _LayerBytes:
    """A traced layer's saved tensors with every size affine in tokens."""

    def __init__(self, small: _LayerTrace, large: _LayerTrace, tokens: tuple[int, int]):
        if small.structure() != large.structure():
            raise ConfigError("the traced layer saves different tensors at different lengths, so its "
                              "offloading cannot be scaled")
        self.saves = [(s.module, Affine.through(s.elements, b.elements, tokens), s.element_size, s.storage)
                      for s, b in zip(small.saves, large.saves)]
        self.storage_bytes = [Affine.through(a, b, tokens) for a, b in zip(small.storage_bytes, large.storage_bytes)]

    def at(self, tokens: int, modules: frozenset, min_elements: int) -> OffloadedBytes:
        host = dict.fromkeys(sorted(modules, key=OFFLOAD_MODULES.index), 0)
        still_held = set()  # storages a tensor left on the device refers to
        for module, elements, element_size, storage in self.saves:
            count = elements.at(tokens)
            if module in modules and count >= min_elements:
                # each copy is a page-locked tensor of its own, which the host allocator rounds
                host[module] += pinned_block_bytes(count * element_size)
            else:
                still_held.add(storage)
        none = sum(size.at(tokens) for size in self.storage_bytes)
        kept = sum(self.storage_bytes[s].at(tokens) for s in still_held)
        return OffloadedBytes(tokens=tokens, per_layer_host=sum(host.values()), per_layer_device_kept=kept,
                              per_layer_device_freed=none - kept, host_by_module=host)


def module_scopes(layer: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The submodules of a local-spec Megatron ``TransformerLayer`` whose forward passes make up
    each offloadable module of Transformer Engine's layer (``qkv_linear`` holds the input norm)."""
    attention = layer.self_attention
    return {"qkv_linear": [layer.input_layernorm, attention.linear_qkv],
            "core_attn": [attention.core_attention],
            "attn_proj": [attention.linear_proj]}


class _SaveRecorder:
    """Saved-tensor hooks' pack function that records what ``layer`` saves, by named module."""

    def __init__(self, layer: torch.nn.Module, parameters: set[int]):
        self._parameters = parameters  # ids of the parameters' storages
        self._in_layer = False
        self._module: Optional[str] = None
        self._storages: dict[int, int] = {}  # id(storage) -> index
        self._storage_bytes: list[int] = []
        self._held: list[torch.Tensor] = []  # keeps every storage seen alive, so no id is reused
        self.saves: list[_Save] = []
        self._handles = [layer.register_forward_pre_hook(lambda *_: self._enter_layer(True)),
                         layer.register_forward_hook(lambda *_: self._enter_layer(False))]
        for name, modules in module_scopes(layer).items():
            for module in modules:
                self._handles += [module.register_forward_pre_hook(functools.partial(self._enter, name)),
                                  module.register_forward_hook(lambda *_: self._leave())]

    def _enter_layer(self, inside: bool) -> None:
        self._in_layer = inside

    def _enter(self, name: str, *_) -> None:
        self._module = name

    def _leave(self) -> None:
        self._module = None

    def _storage(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._storages:
            self._storages[key] = len(self._storage_bytes)
            self._storage_bytes.append(storage.nbytes())
            self._held.append(tensor)
        return self._storages[key]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._in_layer and id(tensor.untyped_storage()) not in self._parameters:
            self.saves.append(
                _Save(self._module, tensor.numel(), tensor.element_size(), self._storage(tensor)))
        return tensor

    def trace(self) -> _LayerTrace:
        for handle in self._handles:
            handle.remove()
        return _LayerTrace(tuple(self.saves), tuple(self._storage_bytes))


def _trace_layer(model: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int, dtype: str,
                 recompute: tuple, tokens: int) -> _LayerTrace:
    parallel = ParallelConfig(tp=tp, sequence_parallel=sequence_parallel)
    workload = Workload(model, Method(name="none"), parallel, tokens, micro_batch_size, dtype)
    config = transformer_config(workload, "cpu")
    grouped = config.num_query_groups not in (None, config.num_attention_heads)
    # a real probe, outside fake mode
    attention = select_backend("cpu", torch_dtype(workload), config.kv_channels, "auto", grouped)
    if attention == "math":
        raise ConfigError(f"head size {config.kv_channels} in {dtype} has only SDPA's math kernel here, "
                          "whose s×s probabilities no fused attention keeps; offloading cannot be traced "
                          "for it")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with process_group(workload.parallel, "fake"), FakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        gpt = build_gpt(workload, "cpu", attention, layers=LayerBuild(recompute=recompute)).module
        parameters = {id(p.untyped_storage()) for p in gpt.parameters()}
        recorder = _SaveRecorder(gpt.decoder.layers[_LAYER - 1], parameters)
        ids = torch.zeros(micro_batch_size, tokens, dtype=torch.long)
        positions = torch.arange(tokens).unsqueeze(0).expand(micro_batch_size, tokens)
        with unchecked_rng_forks(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            gpt(ids, positions, None, labels=ids)
        return recorder.trace()


def _frozen(model: ModelConfig) -> tuple:
    """The model's shape as a hashable cache key, at the traced depth."""
    shape = dataclasses.replace(model, num_layers=_TRACED_LAYERS, init_from=None)
    return tuple(sorted(dataclasses.asdict(shape).items()))


@functools.lru_cache(maxsize=64)
def _layer(model: tuple, tp: int, sequence_parallel: bool, micro_batch_size: int, dtype: str,
           recompute: tuple) -> _LayerBytes:
    chunk = tp if sequence_parallel else 1
    tokens = tuple(t * chunk for t in _TRACED_TOKENS)
    shape = ModelConfig(**dict(model))
    small, large = (_trace_layer(shape, tp, sequence_parallel, micro_batch_size, dtype, recompute, t)
                    for t in tokens)
    return _LayerBytes(small, large, tokens)
