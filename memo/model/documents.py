"""Documents kept apart in a packed sequence (``train.document_mask``).

Megatron's datasets pack documents one after another into each sequence, each ending with its
end-of-document token. With documents kept apart (the long-context recipe of Llama 3) a query
attends only to the keys of its own document, causally; rotary positions restart at every
document; and no token is predicted across a boundary.

:class:`Documents` says where a sequence's documents start. Attention of a span of queries over a
span of keys is cut into *blocks* (:meth:`Documents.blocks`): for each document both spans meet,
the queries and keys of it, attended causally where they are the same tokens (a square block,
aligned as every kernel aligns it) and in full where all the keys come before all the queries.
Key spans wholly in other documents give no block at all, so the attention computed is that of
the documents alone, never a masked square (:meth:`Documents.squared_lengths` sizes it).

:func:`document_attention` is core attention over a whole sequence of documents: one causal
block per document, with the block kernels of :mod:`memo.model.attention_blocks`. It saves what
attention over the whole sequence saves (q, k, v, the output and its log-sum-exp, every token),
so that MEMO places them as it places causal attention's.
"""

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence, Union

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from memo.model import attention_blocks as blocks


class Block(NamedTuple):
    """Queries ``[q_start, q_end)`` attending to keys ``[k_start, k_end)`` of one document
    (token indices of the sequence), causally (the same tokens) or in full (every key earlier)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool


@dataclass(frozen=True)
class Documents:
    """The documents of one packed sequence of ``tokens`` tokens: document ``i`` is
    ``[starts[i], starts[i + 1])`` (the last one ends with the sequence)."""

    starts: tuple[int, ...]
    tokens: int
    ends: tuple[int, ...] = field(init=False, repr=False, compare=False)  # where each document ends

    def __post_init__(self):
        if not self.starts or self.starts[0] != 0 or any(b <= a for a, b in zip(self.starts, self.starts[1:])) \
                or self.starts[-1] >= self.tokens:
            raise ValueError(f"document starts {self.starts} must rise from 0 within {self.tokens} tokens")
        object.__setattr__(self, "ends", (*self.starts[1:], self.tokens))

    @staticmethod
    def of(tokens: Union[torch.Tensor, Sequence[int]], eod: int) -> "Documents":
        """The documents of a sequence of token ids: each ends with its end-of-document token
        ``eod`` (included), and the token after one begins the next."""
        ids = torch.as_tensor(tokens).reshape(-1)
        ends = (ids[:-1] == eod).nonzero().flatten() + 1
        return Documents((0, *ends.tolist()), len(ids))

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every document, in order."""
        return list(zip(self.starts, self.ends))

    def cu_seqlens(self, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """The cumulative sequence lengths the variable-length kernels take: ``[0, ..., tokens]``,
        int32."""
        return torch.tensor((*self.starts, self.tokens), dtype=torch.int32, device=device)

    def position_ids(self) -> torch.Tensor:
        """Each token's position within its document (int64, ``[tokens]``): where rotary
        positions restart."""
        lengths = torch.tensor([end - start for start, end in self.spans()])
        starts = torch.tensor(self.starts).repeat_interleave(lengths)
        return torch.arange(self.tokens) - starts

    def blocks(self, queries: tuple[int, int], keys: tuple[int, int]) -> list[Block]:
        """The blocks of attention of the queries ``[queries)`` over the keys ``[keys)`` that
        documents leave: per document, the part of each span in it, where the keys are the
        queries' own tokens (causal) or all before them (full). Keys after the queries give none.

        Raises:
            ValueError: spans that overlap but are not the same tokens (no kernel aligns that block).
        """
        (q0, q1), (k0, k1) = queries, keys
        found = []
        meet_q, meet_k = self._meeting(q0, q1), self._meeting(k0, k1)
        for d in range(max(meet_q.start, meet_k.start), min(meet_q.stop, meet_k.stop)):
            start, end = self.starts[d], self.ends[d]
            qa, qb, ka, kb = max(q0, start), min(q1, end), max(k0, start), min(k1, end)
            if qa >= qb or ka >= kb or ka >= qb:
                continue
            if (qa, qb) == (ka, kb):
                found.append(Block(qa, qb, ka, kb, True))
            elif kb <= qa:
                found.append(Block(qa, qb, ka, kb, False))
            else:
                raise ValueError(f"queries [{q0}, {q1}) and keys [{k0}, {k1}) overlap but are not the same tokens")
        return found

    def _meeting(self, start: int, end: int) -> range:
        """The indices of the documents with a token in ``[start, end)`` (found by bisection: a
        tile meets few of many documents)."""
        if start >= end:
            return range(0)
        return range(bisect.bisect_right(self.starts, start) - 1, bisect.bisect_right(self.starts, end - 1))

    def squared_lengths(self) -> int:
        """``Σ n²`` over the documents' lengths ``n`` (tokens²): what ``s²`` is to the attention
        FLOPs of a whole sequence (:func:`memo.metrics.flops.model_flops`)."""
        return sum((end - start) ** 2 for start, end in self.spans())


@dataclass
class DocumentParams(PackedSeqParams):
    """Megatron's packed-sequence parameters for a sequence of documents kept apart, in Megatron's
    ``sbhd`` layout (one sequence per micro-batch, not ``thd``): the :class:`Documents` our
    attention cuts into blocks, and each token's position within its document. GPTModel hands it
    to every layer's attention as ``packed_seq_params``."""

    documents: Optional[Documents] = None
    # each token's position within its document, on the device
    position_ids: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _angles: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False, compare=False)

    @staticmethod
    def of(documents: Documents, device: Union[str, torch.device]) -> "DocumentParams":
        """The parameters of ``documents``, their positions on ``device``."""
        # (Megatron makes the rotary table max_seqlen rows long: one per token of the sequence,
        # whose rows at the positions within documents rotary_angles takes, and whose runs of
        # rows a recomputation of the last tokens takes)
        return DocumentParams(qkv_format="sbhd", max_seqlen_q=documents.tokens, max_seqlen_kv=documents.tokens,
                              documents=documents, position_ids=documents.position_ids().to(device))

    def forget_angles(self) -> None:
        """Drop the angles :meth:`rotary_angles` made (``8·s·d`` bytes, with the rotary table's
        cos and sin of them), once the micro-batch's passes are done."""
        self._angles = None

    def rotary_angles(self, freqs: torch.Tensor) -> torch.Tensor:
        """The rotary angles of each token's position within its document: for ``freqs`` of
        positions ``0 .. s−1`` (``[s, 1, 1, d]``), its rows at those positions, made once so that
        every layer rotates with one table (:class:`memo.model.rotary.RotaryTable`). ``freqs``
        may be a run of rows of that tensor (a recomputation's last tokens): the same run of the
        angles is returned.

        Raises:
            ValueError: ``freqs`` neither of the documents' tokens nor a run of such a tensor.
        """
        base = freqs if freqs._base is None else freqs._base  # (the tensor a view of angles views)
        rows, row = freqs.shape[0], freqs[0].numel()
        if base.numel() != self.documents.tokens * row or not (freqs.is_contiguous() and base.is_contiguous()):
            raise ValueError(f"rotary angles of {rows} positions are not a run of the {self.documents.tokens} "
                             "positions of the documents")
        if self._angles is None or self._angles[0] is not base:
            whole = base.view(self.documents.tokens, *freqs.shape[1:])
            self._angles = (base, whole[self.position_ids.to(base.device)])
        first = (freqs.storage_offset() - base.storage_offset()) // row
        return self._angles[1][first:first + rows]


def block_kernel(backend: str, q: torch.Tensor) -> str:
    """The block kernel for documents' blocks of ``q``'s device, dtype and head size: as
    :func:`memo.model.attention_blocks.kernel_for` chooses, but FlashAttention's where that would be
    cuDNN's, which builds (and keeps) a graph for every block shape it meets, and documents' blocks
    have as many shapes as documents have lengths."""
    return blocks.kernel_for("flash" if backend == "cudnn" else backend, q)


def documents_of(layer_arguments: dict) -> Optional[Documents]:
    """The documents kept apart that a layer's keyword arguments carry (``packed_seq_params``,
    :class:`DocumentParams`), or ``None``."""
    params = layer_arguments.get("packed_seq_params")
    return params.documents if isinstance(params, DocumentParams) else None


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents: Documents, kernel: str, scale: float):
        b, n, s, d = q.shape
        groups = n // k.shape[1]
        # the output token-major, as Megatron's layer reads it; the log-sum-exp wide, as the
        # block kernels give it
        out = torch.empty((s, b, n, d), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
        lse = torch.empty((b, n, s), dtype=blocks.wide(q.dtype), device=q.device)
        for start, end in documents.spans():  # each document's own causal block
            span = slice(start, end)
            keys, values = (blocks.expand_kv(blocks.rows(t, span), groups) for t in (k, v))
            part_out, part_lse = blocks.forward(kernel, blocks.rows(q, span), keys, values, True, scale)
            blocks.rows(out, span).copy_(part_out)
            lse[..., span].copy_(part_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.documents, ctx.kernel, ctx.scale, ctx.groups = documents, kernel, scale, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout = blocks.token_major(dout)
        for start, end in ctx.documents.spans():
            span = slice(start, end)
            keys, values = (blocks.expand_kv(blocks.rows(t, span), ctx.groups) for t in (k, v))
            dqb, dkb, dvb = blocks.backward(ctx.kernel, blocks.rows(dout, span), blocks.rows(q, span), keys, values,
                                            blocks.rows(out, span), lse[..., span], True, ctx.scale)
            blocks.rows(dq, span).copy_(dqb)
            # grouped heads' gradients summed in float32 or wider, then rounded once
            blocks.rows(dk, span).copy_(blocks.fold_kv(dkb.to(blocks.wide(dkb.dtype)), ctx.groups))
            blocks.rows(dv, span).copy_(blocks.fold_kv(dvb.to(blocks.wide(dvb.dtype)), ctx.groups))
        return dq, dk, dv, None, None, None


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, kernel: str,
                       scale: float) -> torch.Tensor:
    """Causal attention within each document of ``documents``: ``q`` ``[b, heads, s, dim]``,
    ``k`` and ``v`` ``[b, kv heads, s, dim]`` (as the kernels take them; grouped where fewer),
    with the block kernel ``kernel`` (:func:`memo.model.attention_blocks.choose`). Returns the
    output ``[b, heads, s, dim]``, laid out ``[s, b, heads, dim]`` in memory."""
    if documents.tokens != q.shape[2]:
        raise ValueError(f"documents of {documents.tokens} tokens for a sequence of {q.shape[2]}")
    return _DocumentAttention.apply(q, k, v, documents, kernel, scale)
