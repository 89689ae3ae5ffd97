"""The work one training step does, counted operator by operator: every GEMM's FLOPs by the weight
it belongs to and the pass it serves, every attention kernel's calls and shapes, the key and value
bytes those kernels read, and the operators that would each launch a kernel on a GPU.

A :class:`WorkCounter` is a ``TorchDispatchMode``: it sees the ATen operators a step runs, after
autograd and the composite operators (``linear``, ``matmul``) have been taken apart, on real or
fake tensors alike. A GEMM is attributed by what it multiplies:

* an operand that views a weight, transposed (``x @ Wᵀ``): that weight's **forward** (the first
  pass, or a recomputation: both run the same product);
* an operand that is the weight as stored (``dY @ W``): its **input gradient**;
* neither, with a result of the weight's shape (``dYᵀ @ X``): its **weight gradient**.

A step that computes each product once does ``2·t·o·i`` FLOPs of each kind for a weight ``[o, i]``
over ``t`` tokens, so what a weight's forward FLOPs exceed that by is what was recomputed.

Attention is counted at its kernels (:data:`ATTENTION_FORWARD`, :data:`ATTENTION_BACKWARD`): the
query–key pairs each call attends (a causal square block of ``c`` tokens attends ``c·(c + 1)/2``
of them; a full block all of them), from which its FLOPs follow (``4·d`` per pair and query head
forward, as :mod:`memo.metrics.flops` counts). Copies between device and host are counted by
:class:`memo.swap.streams.CountedStreams`, where the swap runtime issues them; a training step is
counted by :func:`memo.profile.work.count_step`.
"""

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

GEMMS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.mm.out,
         _aten.addmm.out, _aten.bmm.out, _aten.addmm_.default}
# the fused attention entry points (memo.model.attention_blocks calls them; scaled_dot_product_attention
# reaches them too), with whether the call is causal taken from its ``is_causal`` argument
ATTENTION_FORWARD = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._flash_attention_forward.default,
}
ATTENTION_BACKWARD = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_cudnn_attention_backward.default,
    _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._flash_attention_backward.default,
}
# ATen operators that make views, allocate or read metadata: no kernel runs for them
_NO_KERNEL = {
    "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "permute", "expand", "slice",
    "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "unbind", "split", "split_with_sizes",
    "unflatten", "flatten", "narrow", "movedim", "diagonal", "lift_fresh", "is_same_size",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "empty", "empty_strided", "empty_like",
    "new_empty", "new_empty_strided", "_local_scalar_dense", "set_", "resize_", "view_as_real",
    "view_as_complex", "_neg_view", "_conj", "is_pinned", "record_stream", "promote_types", "result_type",
    "dim", "size", "stride", "numel", "is_contiguous", "is_nonzero", "item", "_has_compatible_shallow_copy_type",
}
FORWARD, INPUT_GRAD, WEIGHT_GRAD = "forward", "input_grad", "weight_grad"


@dataclass(frozen=True)
class AttentionCall:
    """One call of an attention kernel: ``[b, heads, tokens, dim]`` queries and keys."""

    backward: bool
    batch: int
    query_heads: int
    key_heads: int
    queries: int
    keys: int
    head_dim: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Query–key pairs attended per sequence and head (a causal block is square)."""
        return self.queries * (self.queries + 1) // 2 if self.causal else self.queries * self.keys

    @property
    def forward_flops(self) -> int:
        """The forward's FLOPs (QKᵀ and PV) over the pairs attended, every query head."""
        return 4 * self.batch * self.query_heads * self.head_dim * self.pairs


@dataclass
class StepWork:
    """What :class:`WorkCounter` counted."""

    gemm_flops: Counter = field(default_factory=Counter)  # (weight name, pass) → FLOPs
    other_gemm_flops: int = 0  # GEMMs with no weight of the model (none expected)
    attention: Counter = field(default_factory=Counter)  # AttentionCall → calls
    key_value_bytes_read: int = 0  # bytes of keys and values handed to the attention kernels
    kernels: Counter = field(default_factory=Counter)  # operator name → calls that launch a kernel

    def weight_flops(self, name: str, kind: str) -> int:
        return self.gemm_flops[(name, kind)]

    @property
    def recomputed_flops(self) -> int:
        """GEMM FLOPs of the forward products beyond one of each per token (as many as the
        weight's gradient product, ``2·t·o·i``), and every GEMM of no weight."""
        return self.other_gemm_flops + sum(flops - self.weight_flops(w, WEIGHT_GRAD)
                                           for (w, kind), flops in self.gemm_flops.items() if kind == FORWARD)

    def attention_pairs(self, backward: bool) -> int:
        """Query–key pairs the forward (or backward) kernels attended, every call, per head."""
        return sum(call.pairs * call.batch * n for call, n in self.attention.items() if call.backward == backward)

    def attention_forward_flops(self) -> int:
        return sum(call.forward_flops * n for call, n in self.attention.items() if not call.backward)

    @property
    def kernels_launched(self) -> int:
        return sum(self.kernels.values())


def _storage(t: torch.Tensor) -> Optional[StorageWeakRef]:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class WorkCounter(TorchDispatchMode):
    """Count the work of what runs inside it (see the module docstring).

    Args:
        weights: ``(name, weight)`` of the GEMMs' weights (``[out, in]``), several weights under
            one name counted together (:func:`linear_weights`: every layer's under the layer's
            name for it).
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        super().__init__()
        named = list(weights)
        self._by_storage = {_storage(w): name for name, w in named}
        # a weight gradient is known by its shape only: the name of the weights of that shape, or
        # none where weights of two names share it
        names_of = defaultdict(set)
        for name, w in named:
            names_of[tuple(w.shape)].add(name)
        self._by_shape = {shape: next(iter(names)) for shape, names in names_of.items() if len(names) == 1}
        self.work = StepWork()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in _NO_KERNEL:
            self.work.kernels[name] += 1
        if func in GEMMS:
            self._gemm(func, args, kwargs, out)
        elif func in ATTENTION_FORWARD:
            self._attention(False, args[0], args[1], args[2], _causal(func, args, kwargs, False))
        elif func in ATTENTION_BACKWARD:
            self._attention(True, args[1], args[2], args[3], _causal(func, args, kwargs, True))
        return out

    def _gemm(self, func, args, kwargs, out) -> None:
        if func in (_aten.addmm.default, _aten.addmm.out, _aten.addmm_.default, _aten.baddbmm.default):
            a, b = args[1], args[2]
        else:
            a, b = args[0], args[1]
        *batch, m, k = a.shape
        n = b.shape[-1]
        flops = 2 * m * n * k * (batch[0] if batch else 1)
        for operand in (b, a):
            known = self._by_storage.get(_storage(operand))
            if known is not None:
                # x @ Wᵀ multiplies a transposed view of the weight, dY @ W the weight as stored
                transposed = operand.dim() == 2 and operand.stride(0) == 1 and operand.stride(1) != 1
                self.work.gemm_flops[(known, FORWARD if transposed else INPUT_GRAD)] += flops
                return
        result = out if isinstance(out, torch.Tensor) else kwargs.get("out", args[0])
        weight = self._by_shape.get(tuple(result.shape[-2:]))
        if weight is not None and not batch:
            self.work.gemm_flops[(weight, WEIGHT_GRAD)] += flops
        else:
            self.work.other_gemm_flops += flops

    def _attention(self, backward: bool, q, k, v, causal: bool) -> None:
        if q.dim() == 3:  # the variable-length entry points: [tokens, heads, dim]
            q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
        b, hq, sq, d = q.shape
        call = AttentionCall(backward, b, hq, k.shape[1], sq, k.shape[2], d, causal)
        self.work.attention[call] += 1
        self.work.key_value_bytes_read += k.numel() * k.element_size() + v.numel() * v.element_size()


def linear_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The weights of ``model``'s linear layers (Megatron's column- and row-parallel ones, the
    output layer among them), each named as in the model with its layer's number as ``*``
    (``decoder.layers.*.mlp.linear_fc1``): every layer's product of a kind counted together."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return [(re.sub(r"\.layers\.\d+\.", ".layers.*.", name), module.weight)
            for name, module in model.named_modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None]


def _causal(func, args, kwargs, backward: bool) -> bool:
    """The ``is_causal`` argument of an attention call, positional or by name."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    schema = func._schema
    names = [a.name for a in schema.arguments]
    position = names.index("is_causal") if "is_causal" in names else names.index("causal")
    return bool(args[position]) if position < len(args) else bool(schema.arguments[position].default_value)

