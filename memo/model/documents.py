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
block per document (:func:`memo.model.attention_blocks.segments_forward`: on CUDA all of them in
one call of FlashAttention's variable-length entry point, with the documents' cumulative lengths
in int32; elsewhere a block kernel call per document). It saves what attention over the whole
sequence saves (q, k, v, the output and its log-sum-exp, every token), so that MEMO places them as
it places causal attention's. A rotary angle per token, of its position within its document,
replaces the sequence's (:func:`rotate_within_documents`).
"""

import bisect
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence, Union

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
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

    def bounds(self) -> tuple[int, ...]:
        """Where each document starts, then where the sequence ends (``0 .. tokens``): the
        cumulative sequence lengths the variable-length kernels take."""
        return (*self.starts, self.tokens)

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


def chunk_blocks(documents: Optional[Documents], query_chunk: int, key_chunk: int,
                 tokens: int) -> list[tuple[slice, slice, bool]]:
    """``(query rows, key rows, causal)`` within sequence chunk ``query_chunk``'s queries and
    chunk ``key_chunk``'s keys (``tokens`` tokens each, rows counted from each chunk's first)
    that causal attention computes: the whole block (causal on the diagonal; none after it), or
    with ``documents`` each document's part of it (:meth:`Documents.blocks`), none where the
    chunks share no document."""
    q0, k0 = query_chunk * tokens, key_chunk * tokens
    if documents is None:
        return [] if key_chunk > query_chunk else [(slice(0, tokens), slice(0, tokens), key_chunk == query_chunk)]
    return [(slice(b.q_start - q0, b.q_end - q0), slice(b.k_start - k0, b.k_end - k0), b.causal)
            for b in documents.blocks((q0, q0 + tokens), (k0, k0 + tokens))]


@dataclass
class DocumentParams(PackedSeqParams):
    """Megatron's packed-sequence parameters for a sequence of documents kept apart, in Megatron's
    ``sbhd`` layout (one sequence per micro-batch, not ``thd``): the :class:`Documents` of the
    whole sequence, which our attention cuts into blocks, and the position within its document of
    each token this rank holds (all of them, or its part under context parallelism:
    :meth:`on_tokens`). GPTModel hands it to every layer's attention as ``packed_seq_params``."""

    documents: Optional[Documents] = None
    # the position within its document of each token of this rank, on the device
    position_ids: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @staticmethod
    def of(documents: Documents, device: Union[str, torch.device]) -> "DocumentParams":
        """The parameters of ``documents``, their positions on ``device``."""
        return DocumentParams(qkv_format="sbhd", max_seqlen_q=documents.tokens, max_seqlen_kv=documents.tokens,
                              documents=documents, position_ids=documents.position_ids().to(device))

    def on_tokens(self, position_ids: torch.Tensor) -> "DocumentParams":
        """The parameters of a rank that holds the tokens whose positions (within their
        documents) are ``position_ids``, a part of :attr:`position_ids` (context parallelism)."""
        return replace(self, position_ids=position_ids)

    def rotary_angles(self, freqs: torch.Tensor, embedding: RotaryEmbedding) -> torch.Tensor:
        """The rotary angles of the position within its document of each of this rank's ``n``
        tokens, in place of ``freqs``, those of their positions in the sequence (``[n, 1, 1, d]``,
        float32: ``4·n·d`` bytes kept): rows of ``freqs`` where they are the whole sequence's,
        else (a context-parallel rank's part, which lacks positions its documents have) rows of
        ``embedding``'s angles of positions ``0 .. longest document − 1`` (``6·longest·d`` bytes
        more for the call only, the half-width angles and the table of them), bit for bit the
        rows of every longer sequence's angles.

        Raises:
            ValueError: ``freqs`` not of this rank's tokens.
        """
        tokens = len(self.position_ids)
        if freqs.shape[0] != tokens:
            raise ValueError(f"rotary angles of {freqs.shape[0]} positions for {tokens} tokens of documents")
        if tokens == self.documents.tokens:
            # every token of the sequence: ``freqs`` are the angles of positions 0 .. s − 1, whose rows
            # these are; one gather, its size the same whatever the documents (a memory plan serves it)
            return freqs.index_select(0, self.position_ids.to(freqs.device))
        longest = max(end - start for start, end in self.documents.spans())
        return embedding.get_emb(longest)[self.position_ids.to(freqs.device)].view(freqs.shape)


def rotate_within_documents(model: GPTModel) -> None:
    """Have ``model``'s decoder hand its layers, with documents kept apart
    (:class:`DocumentParams`), the rotary angles of each token's position within its document
    (:meth:`DocumentParams.rotary_angles`): made once per forward pass, shared by every layer and
    sliced as the angles of sequence positions are (a tile's rows, a recomputation's tails)."""
    embedding = model.rotary_pos_emb

    def within_documents(_decoder, args, kwargs):
        documents, freqs = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")
        if isinstance(documents, DocumentParams) and isinstance(freqs, torch.Tensor):
            return args, {**kwargs, "rotary_pos_emb": documents.rotary_angles(freqs, embedding)}
        return None

    model.decoder.register_forward_pre_hook(within_documents, with_kwargs=True)


def block_kernel(backend: str, q: torch.Tensor, documents: Optional[Documents]) -> str:
    """The block kernel for blocks of ``q``'s device, dtype and head size:
    :func:`memo.model.attention_blocks.kernel_for`'s, but with ``documents`` FlashAttention's
    where that would be cuDNN's, which builds (and keeps) a graph for every block shape it meets,
    and documents' blocks have as many shapes as documents have lengths."""
    return blocks.kernel_for("flash" if backend == "cudnn" and documents is not None else backend, q)


def documents_of(layer_arguments: dict) -> Optional[Documents]:
    """The documents kept apart that a layer's keyword arguments carry (``packed_seq_params``,
    :class:`DocumentParams`), or ``None``."""
    params = layer_arguments.get("packed_seq_params")
    return params.documents if isinstance(params, DocumentParams) else None


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents: Documents, kernel: str, scale: float):
        bounds = documents.bounds()
        out, lse = blocks.segments_forward(kernel, q, k, v, bounds, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.kernel, ctx.scale = bounds, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = blocks.segments_backward(ctx.kernel, dout, q, k, v, out, lse, ctx.bounds, ctx.scale)
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
