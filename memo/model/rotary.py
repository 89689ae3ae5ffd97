"""RoPE with one cos/sin table per model, not a copy saved by every layer.

Megatron's unfused ``apply_rotary_pos_emb`` turns the angles into ``cos`` and ``sin`` in every
layer, for q and for k, and autograd saves those four ``[s, 1, 1, d]`` tensors for the layer's
backward: ``4·s·d`` elements per layer, as much as ``s·h/tp`` at 7B with tp = 8, beside the
``16·s·h/tp`` of the skeletal tensors themselves. Here one :class:`RotaryTable` per model turns
each angle tensor into ``cos`` and ``sin`` once (the model's rotary embedding caches its angles,
so the table lives as long as they do), and :class:`RotarySelfAttention` rotates q and k with a
function that saves nothing: its backward rotates the gradient back with the same table.

The rotation is Megatron's, operation for operation (``t·cos + rotate_half(t)·sin`` in the
activation dtype, non-interleaved halves), so losses and gradients are bit-identical to it.
"""

import weakref
from typing import Optional

import torch
from megatron.core.transformer.attention import SelfAttention

from memo.model.documents import DocumentParams
from memo.model.placement import Placed, Placement, copy_into, new_output


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryTable:
    """``cos`` and ``sin`` of angle tensors ``[s, 1, 1, d]`` in one dtype, made once per tensor
    and dropped with it. Shared by every layer of one model."""

    def __init__(self):
        self._tables: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of ``freqs`` in ``dtype``, made now if not yet. Angles that are a
        contiguous run of a larger angle tensor (Megatron's ``[s, 1, 1, d]`` view of its angles,
        a sequence tile's rows, a recomputation's) get that run of the larger one's table: one
        table per sequence length, of which a tile's graph, kept until its backward, holds views."""
        root = _root(freqs)
        self.fill(root, dtype)
        cos, sin = self._tables[(id(root), dtype)]
        if root is freqs:
            return cos, sin
        start = freqs.storage_offset() - root.storage_offset()
        return tuple(t.reshape(-1)[start:start + freqs.numel()].view(freqs.shape) for t in (cos, sin))

    def fill(self, freqs: torch.Tensor, dtype: torch.dtype) -> None:
        """Make the table of ``freqs`` (of the tensor it is a run of) in ``dtype`` if there is none yet."""
        root = _root(freqs)
        key = (id(root), dtype)
        if key not in self._tables:
            self._tables[key] = (torch.cos(root).to(dtype), torch.sin(root).to(dtype))
            weakref.finalize(root, self._tables.pop, key, None)


def _root(freqs: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor that contiguous ``freqs`` is a run of elements of (its base), or
    ``freqs`` itself."""
    base = freqs._base
    if base is None or not (base.is_contiguous() and freqs.is_contiguous()):
        return freqs
    return base


class _Rotate(torch.autograd.Function):
    """``t·cos + rotate_half(t)·sin``; the table is held by reference, not saved per call."""

    @staticmethod
    def forward(ctx, t, cos, sin, placement):
        ctx.table = (cos, sin)  # not save_for_backward: saved-tensor hooks must not copy it
        out = new_output(placement, t.shape, t.dtype, t.device)
        return torch.add(t * cos, _rotate_half(t) * sin, out=out)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.table
        # rotate_half is a signed permutation whose transpose is -rotate_half
        return grad * cos - _rotate_half(grad * sin), None, None, None


def rotate(t: torch.Tensor, freqs: torch.Tensor, table: RotaryTable, placement: Optional[Placement] = None) -> torch.Tensor:
    """``t`` (``[s, b, heads, d]``) rotated by the angles ``freqs`` (``[s, 1, 1, d]``), written
    where ``placement`` (a swap placement or ``None``) puts it."""
    cos, sin = table(freqs, t.dtype)
    return _Rotate.apply(t, cos, sin, placement)


class RotarySelfAttention(Placed, SelfAttention):
    """Megatron's ``SelfAttention`` rotating q and k with a shared :class:`RotaryTable`, and
    giving v its own storage so that the fused QKV output is not kept alive behind it. With a
    swap placement (``placement``) q, k and v are made in the rounding buffer that keeps them.

    ``rotary_table`` is bound in the layer spec. Documents kept apart
    (:class:`~memo.model.documents.DocumentParams`) rotate each token by the angles it is handed,
    those of its position within its document (:func:`memo.model.documents.rotate_within_documents`).
    Inference, Megatron's packed sequences and interleaved or partial rotations are left to
    Megatron's own path.
    """

    def __init__(self, *args, rotary_table: RotaryTable, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_table = rotary_table
        self._freqs = None

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        # Megatron splits q, k and v apart (split_qkv) in exactly these cases, so that
        # get_query_key_value_tensors below sees them and rotates q and k.
        own = (
            isinstance(rotary_pos_emb, torch.Tensor) and not args
            and kwargs.get("inference_context") is None
            and (kwargs.get("packed_seq_params") is None or isinstance(kwargs["packed_seq_params"], DocumentParams))
            and not self.config.rotary_interleaved and not self.config.attention_output_gate
            and not self.config.fused_single_qkv_rope and not self.config.flash_decode
        )
        if not own:
            if isinstance(kwargs.get("packed_seq_params"), DocumentParams):
                raise ValueError("documents kept apart rotate by their own positions in RotarySelfAttention only: "
                                 "whole, non-interleaved heads, without inference or output gates")
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                                   **kwargs)
        # (documents kept apart: the angles of positions within documents, which the model's
        # decoder is handed, memo.model.documents.rotate_within_documents)
        self._freqs = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            self._freqs = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                    split_qkv=True):
        """Megatron's q, k, v; q and k rotated here when :meth:`forward` took the angles."""
        qkv = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if self._freqs is None:
            return qkv
        query, key, value = qkv
        freqs = self._freqs
        if freqs.shape[-1] != query.shape[-1]:
            raise ValueError("RotarySelfAttention rotates whole heads only (rotary_percent=1)")
        table, placement = self.rotary_table, self.placement
        return rotate(query, freqs, table, placement), rotate(key, freqs, table, placement), \
            copy_into(value, placement)
