"""Activation policies: how a run keeps what its layers save for the backward pass, one object
per kind of method, and the one reader of a method's settings (besides their checks in
:mod:`memo.config`).

A run's :class:`memo.config.Workload` resolves to one policy (:func:`policy_of`):

* :class:`MegatronLayers` (:mod:`~memo.policy.megatron`): Megatron-core's layers, keeping their
  activations or recomputing or offloading them as Megatron does (``none``,
  ``megatron_full_recompute``, ``megatron_selective``, ``megatron_offload``, ``deepspeed_ulysses``);
* :class:`OurLayers` and :class:`SwappedLayers` (:mod:`~memo.policy.whole_layers`): memo's layer
  over whole layers, recomputing them (``full_recompute``) or swapping token-wise (``memo``,
  ``full_swap``);
* :class:`SequenceTiles` (:mod:`~memo.policy.tiles`): memo's layers walked in sequence tiles
  (those three methods with ``method.tile_tokens``).

A policy says how the model builds its layers, gets what runs them ready for training (a
:class:`memo.model.placement.LayerRuntime`), what a trace of it runs, which layouts it can run, and
its terms of a prediction (:mod:`memo.fit`). A new kind of method is a new module here and its
file in ``conf/method/``; a new method of a kind that exists is its file alone.
"""

from memo.config import Workload
from memo.model import BuiltModel, build_gpt
from memo.policy.base import ActivationPolicy, LayerSeconds, OutOfHostMemory, Placed, Situation
from memo.policy.megatron import MegatronLayers
from memo.policy.tiles import SequenceTiles
from memo.policy.whole_layers import OurLayers, SwappedLayers

__all__ = ["ActivationPolicy", "LayerSeconds", "MegatronLayers", "OurLayers", "OutOfHostMemory", "Placed",
           "SequenceTiles", "Situation", "SwappedLayers", "build_model", "policy_of"]


def policy_of(workload: Workload) -> ActivationPolicy:
    """The activation policy ``workload`` runs with: its method's kind, its layers whole or in tiles."""
    method = workload.method
    if not method.ours:
        return MegatronLayers(method)
    if workload.layer_tile_tokens is not None:
        return SequenceTiles(method)
    return SwappedLayers(method) if method.swaps else OurLayers(method)


def build_model(workload: Workload, device_type: str, attention_backend: str = "auto") -> BuiltModel:
    """``workload``'s GPT for this rank, its layers as its policy builds them
    (:func:`memo.model.build_gpt` with :attr:`ActivationPolicy.layers`)."""
    return build_gpt(workload, device_type, attention_backend, layers=policy_of(workload).layers)
