"""Context parallelism in our own core attention, without Transformer Engine.

The sequence is cut into ``2·cp`` chunks of ``c`` tokens and context-parallel rank ``r`` holds
chunks ``r`` and ``2·cp − 1 − r``, one from each end, as Megatron-core's
``get_batch_on_this_cp_rank`` lays it out: under the causal mask every rank then does the same
work. Each rank computes attention for its own queries over every earlier key of the whole
sequence, exchanged as Megatron's ``cp_comm_type`` names it:

* ``all_gather``: the keys and values of all ranks are gathered before the layer's attention, and
  their gradients summed back to the ranks that own them (a reduce-scatter) in the backward pass;
* ``p2p``: a ring; each rank's keys and values pass from rank to rank in ``cp − 1`` point-to-point
  steps, the next block's transfer overlapping the current block's attention, and in the backward
  pass their gradients travel the ring with them back to their owner;
* ``a2a`` (Ulysses): all-to-all exchanges give each rank every token of ``heads/cp`` of the heads
  for attention, and then its own tokens of every head back.

A query chunk attends to the blocks of keys before it in full and to its own chunk causally; the
blocks' outputs are merged by their log-sum-exp (:mod:`memo.model.attention_blocks`). With
documents kept apart (:mod:`memo.model.documents`) every rank knows the whole sequence's
documents: a block is cut into the parts of it in one document (causal where they are the same
tokens) and skipped where its chunks share none, and Ulysses attends each document of the whole
sequence in its own causal block; the exchanges are those of the whole sequence.

What one layer keeps from its forward pass to its backward pass is what attention without context
parallelism keeps: this rank's query, key and value, its output and its log-sum-exp, all of its
own ``2·c`` tokens (so MEMO swaps and recomputes them as it does without context parallelism,
and never replays an exchange). The keys and values of other ranks (``all_gather``: all ``s``
tokens, ``2·s·b·h_kv/tp`` elements; ``p2p``: one other rank's at a time, plus the one in flight;
``a2a``: q, k, v and the output re-sharded by heads, as many elements as this rank's own) live
only while one layer's attention runs, forward or backward, and are exchanged again in the
backward pass, as Transformer Engine's context parallelism does.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from memo.config.validate import CP_COMM_TYPES
from memo.model import attention_blocks as blocks
from memo.model.documents import DocumentParams, Documents, block_kernel, chunk_blocks


# How a context-parallel attention lays the sequence out over the ranks: Megatron's load-balanced
# chunks (ours), or one contiguous part a rank (DeepSpeed-Ulysses')
SEQUENCE_LAYOUTS = ("load_balanced", "contiguous")


def exchange_bytes(comm_type: str, cp: int, b: int, s: int, h: int, e: int) -> int:
    """Bytes this module's attention of one layer holds beyond attention without context
    parallelism, at its peak (the backward pass), for ``b`` sequences of ``s`` tokens, ``h``
    channels per tensor-parallel rank, ``e``-byte elements; 0 without context parallelism
    (``cp = 1``). With ``t = s/cp`` tokens per rank:

    * ``all_gather``: all ``s`` tokens' keys and values and their gradients, ``4·b·s·h·e``, and
      ``b·t·h·(e + 4)`` for the query's gradient, summed in float32, and the kernels' gradients of
      one block;
    * ``p2p``: the held and the incoming keys and values, the gradient of the held ones and the one
      received (both float32), the query's gradient in float32 and the kernels' block gradients:
      ``b·t·h·(5·e + 28)``;
    * ``a2a``: q, k, v, the output and the incoming gradient re-sharded by heads, the gradients
      by heads and the all-to-alls' staging copies: at most ``7.5·b·t·h·e``.

    These are beyond the dq, dk, dv that attention without context parallelism allocates too (the
    incoming gradient arrives laid out as the output and is not copied), as the allocation recorder
    measures them in ``tests/context_parallel_worker.py`` (exactly for the first two; the third is a
    bound within 20% at cp = 2 and 4: gloo's all-to-all stages what it sends in copies of varying
    size). The fit counts them as held although they live only while one layer's attention runs.
    """
    if cp == 1:
        return 0
    t = s // cp
    if comm_type == "a2a":
        return 15 * b * t * h * e // 2
    if comm_type == "p2p":
        return b * t * h * (5 * e + 28)
    return 4 * b * s * h * e + b * t * h * (e + 4)


def part_for_rank(t: torch.Tensor, dim: int, rank: int, cp: int,
                  layout: str = "load_balanced") -> torch.Tensor:
    """This rank's part of ``t`` (a whole sequence along ``dim``) in ``layout``."""
    if layout == "contiguous":
        if t.shape[dim] % cp:
            raise ValueError(f"a sequence of {t.shape[dim]} tokens cannot be cut into cp = {cp} parts")
        return t.chunk(cp, dim=dim)[rank]
    return split_for_rank(t, dim, rank, cp)


def batch_for_rank(batch: dict, rank: int, cp: int, layout: str = "load_balanced") -> dict:
    """This rank's tokens of a micro-batch (``[b, s]`` tensors, sequence on dim 1); in the
    load-balanced layout exactly what Megatron-core's ``get_batch_on_this_cp_rank`` gives.
    Documents kept apart (:class:`~memo.model.documents.DocumentParams`) keep the whole
    sequence's documents and take the positions of this rank's tokens."""
    return {key: _part_of(value, rank, cp, layout) for key, value in batch.items()}


def _part_of(value, rank: int, cp: int, layout: str):
    if isinstance(value, torch.Tensor):
        return part_for_rank(value, 1, rank, cp, layout)
    if isinstance(value, DocumentParams):
        return value.on_tokens(part_for_rank(value.position_ids, 0, rank, cp, layout))
    return value


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp``) that context-parallel rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


def split_for_rank(t: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """This rank's part of ``t`` (a whole sequence along ``dim``): its two chunks, concatenated."""
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {t.shape[dim]} tokens cannot be cut into 2·cp = {2 * cp} chunks")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in rank_chunks(rank, cp)], dim=dim)


def _rank_order(cp: int) -> list[int]:
    """The sequence chunks as the ranks hold them, one rank after another: entry ``p`` is the
    chunk at position ``p`` of ``[rank 0's two, rank 1's two, ...]``."""
    return [chunk for r in range(cp) for chunk in rank_chunks(r, cp)]


def _sequence_order(cp: int) -> list[int]:
    """The inverse of :func:`_rank_order`: entry ``k`` is the position of sequence chunk ``k`` in
    the ranks' order."""
    return [_rank_order(cp).index(k) for k in range(2 * cp)]


def _in_order(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``t``'s chunks along dim 0 (``len(order)`` of them) taken in ``order``."""
    chunks = t.chunk(len(order))
    return torch.cat([chunks[i] for i in order])


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(2, 0)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(0, 2)


def _gather_tokens(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``[b, n, 2·c, d]`` part gathered into ``[b, n, s, d]``, rank after rank (chunk
    ``p`` of it is sequence chunk ``_rank_order(cp)[p]``)."""
    cp = dist.get_world_size(group)
    part = _tokens_first(local).contiguous()
    gathered = part.new_empty((cp * part.shape[0], *part.shape[1:]))
    dist.all_gather_into_tensor(gathered, part, group=group)
    return _heads_first(gathered)


def _reduce_scatter_tokens(whole: torch.Tensor, group) -> torch.Tensor:
    """``[b, n, s, d]`` in the ranks' order summed over the ranks, each rank's ``[b, n, 2·c, d]``
    part returned to it."""
    cp = dist.get_world_size(group)
    ordered = _tokens_first(whole).contiguous()
    local = ordered.new_empty((ordered.shape[0] // cp, *ordered.shape[1:]))
    dist.reduce_scatter_tensor(local, ordered, group=group)
    return _heads_first(local)


def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """``x`` cut into cp parts along ``scatter``, part ``i`` sent to rank ``i``, the parts received
    joined along ``gather``."""
    cp = dist.get_world_size(group)
    sent = [part.contiguous() for part in x.chunk(cp, dim=scatter)]
    received = [torch.empty_like(sent[0]) for _ in range(cp)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather)


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses: ``[b, n, 2·c, d]`` (this rank's tokens) -> ``[b, n/cp, s, d]`` (every token)."""
    cp = dist.get_world_size(group)
    by_rank = _all_to_all(_tokens_first(x), group, scatter=2, gather=0)
    return _heads_first(_in_order(by_rank, _sequence_order(cp)))


def _to_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_to_heads`; the result is token-major in memory."""
    cp = dist.get_world_size(group)
    by_rank = _in_order(_tokens_first(y), _rank_order(cp))
    return _heads_first(_all_to_all(by_rank, group, scatter=0, gather=2))


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[b, n, s, d]``) laid out ``[s, b, n, d]`` in memory, as the output it is the
    gradient of: itself if so already, else a copy. A chunk of its tokens is then laid out as the
    kernels lay out their outputs (with one sequence a micro-batch), and NCCL gets contiguous parts."""
    return t if _tokens_first(t).is_contiguous() else _heads_first(_tokens_first(t).contiguous())


def _token_major_like(q: torch.Tensor) -> torch.Tensor:
    """An empty ``[b, n, s, d]`` tensor laid out ``[s, b, n, d]`` in memory, as Megatron's."""
    return _heads_first(q.new_empty(_tokens_first(q).shape))


class _Ring:
    """Point-to-point exchanges around the context-parallel ranks: send to the next, receive from
    the previous, asynchronously."""

    def __init__(self, group):
        self.group = group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.previous = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Send ``tensor`` on, receive its like from behind; wait on the returned works before
        reading what was received or writing what was sent."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.previous, self.group, tag),
        ])
        return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Attention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel: str, scale: float, comm_type: str, documents: Optional[Documents]):
        ctx.group, ctx.kernel, ctx.scale, ctx.comm_type = group, kernel, scale, comm_type
        ctx.documents, ctx.chunk = documents, q.shape[2] // 2
        out, lse = _FORWARD[comm_type](ctx, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _BACKWARD[ctx.comm_type](ctx, _token_major(dout), q, k, v, out, lse)
        return dq, dk, dv, None, None, None, None, None


def _chunk(t: torch.Tensor, half: int, c: int) -> torch.Tensor:
    """Tokens ``[half·c, (half + 1)·c)`` of a ``[b, n, tokens, ...]`` tensor."""
    return t.narrow(2, half * c, c)


def _part(t: torch.Tensor, half: int, c: int, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of chunk ``half`` (:func:`_chunk`) of a ``[b, n, tokens, ...]`` tensor."""
    return blocks.rows(_chunk(t, half, c), rows)


def _blocks(ctx, held: Sequence[int]):
    """``(query half, key position, query rows, key rows, causal)`` for every block of this
    rank's queries that sees keys of the sequence chunks ``held`` (position ``p`` holds chunk
    ``held[p]``), rows counted within the chunks: a chunk sees the chunks before it whole and
    itself causally, or with documents the parts of them in its documents
    (:func:`memo.model.documents.chunk_blocks`)."""
    rank, cp, c = dist.get_rank(ctx.group), dist.get_world_size(ctx.group), ctx.chunk
    for qh, a in enumerate(rank_chunks(rank, cp)):
        for p, b in enumerate(held):
            for rows, cols, causal in chunk_blocks(ctx.documents, a, b, c):
                yield qh, p, rows, cols, causal


def _merge_into(ctx, merged: list, qh: int, rows: slice, block: tuple) -> None:
    """Merge one block's ``(out, lse)`` of query half ``qh``'s ``rows`` into ``merged[qh]``. A
    block of whole chunks starts a half's merge; documents' blocks (parts of chunks) merge into
    a float32 output of zeros and a log-sum-exp of −∞ made before the first, which a row's first
    block replaces bit for bit."""
    if ctx.documents is None:
        merged[qh] = block if merged[qh] is None else blocks.merge(*merged[qh], *block)
        return
    if merged[qh] is None:
        out, lse = block
        shape = (*out.shape[:2], ctx.chunk, out.shape[3])
        merged[qh] = (torch.zeros(shape, dtype=blocks.wide(out.dtype), device=out.device),
                      torch.full(shape[:3], -torch.inf, dtype=lse.dtype, device=lse.device))
    blocks.merge_into(blocks.rows(merged[qh][0], rows), merged[qh][1][..., rows], *block)


def _ring_forward(ctx, q, k, v):
    cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    ring, c = _Ring(ctx.group), ctx.chunk
    held = torch.stack([_tokens_first(k), _tokens_first(v)])  # [2, 2·c, b, n_kv, d]
    merged: list[Optional[tuple]] = [None, None]
    for step in range(cp):
        owner = (rank - step) % cp
        if step < cp - 1:
            incoming, works = ring.start(held, tag=1)
        keys, values = (_heads_first(t) for t in held)
        for qh, kh, rows, cols, causal in _blocks(ctx, rank_chunks(owner, cp)):
            block = blocks.forward(ctx.kernel, _part(q, qh, c, rows), _part(keys, kh, c, cols),
                                   _part(values, kh, c, cols), causal, ctx.scale)
            _merge_into(ctx, merged, qh, rows, block)
        if step < cp - 1:
            _wait(works)
            held = incoming
    return _joined(q, merged, c)


def _ring_backward(ctx, dout, q, k, v, out, lse):
    cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    ring, c = _Ring(ctx.group), ctx.chunk
    held = torch.stack([_tokens_first(k), _tokens_first(v)])
    dq = torch.zeros(q.shape, dtype=blocks.wide(q.dtype), device=q.device)
    passing = None  # (received gradient, works) of the keys and values held next
    for step in range(cp):
        owner = (rank - step) % cp
        if step < cp - 1:
            incoming, works = ring.start(held, tag=1)
        keys, values = (_heads_first(t) for t in held)
        # the gradient of the held keys and values
        grads = torch.zeros(held.shape, dtype=blocks.wide(k.dtype), device=q.device)
        for qh, kh, rows, cols, causal in _blocks(ctx, rank_chunks(owner, cp)):
            dqb, dkb, dvb = blocks.backward(
                ctx.kernel, _part(dout, qh, c, rows), _part(q, qh, c, rows), _part(keys, kh, c, cols),
                _part(values, kh, c, cols), _part(out, qh, c, rows), _part(lse, qh, c, rows), causal, ctx.scale)
            _part(dq, qh, c, rows).add_(dqb)
            for i, d in enumerate((dkb, dvb)):
                _part(_heads_first(grads[i]), kh, c, cols).add_(d)
        if passing is not None:  # what the ranks before added to these keys' and values' gradient
            _wait(passing[1])
            grads += passing[0]
            passing = None
        # on to the next rank; after the last step, to the owner (here, when there is no other)
        passing = ring.start(grads, tag=2) if cp > 1 else (grads, [])
        if step < cp - 1:
            _wait(works)
            held = incoming
    _wait(passing[1])
    dkv = passing[0].to(k.dtype)
    return dq.to(q.dtype), _heads_first(dkv[0]), _heads_first(dkv[1])


def _gather_forward(ctx, q, k, v):
    cp, c = dist.get_world_size(ctx.group), ctx.chunk
    keys, values = (_gather_tokens(t, ctx.group) for t in (k, v))
    merged: list[Optional[tuple]] = [None, None]
    for qh, p, rows, cols, causal in _blocks(ctx, _rank_order(cp)):
        block = blocks.forward(ctx.kernel, _part(q, qh, c, rows), _part(keys, p, c, cols), _part(values, p, c, cols),
                               causal, ctx.scale)
        _merge_into(ctx, merged, qh, rows, block)
    return _joined(q, merged, c)


def _joined(q, merged: list[tuple], c: int):
    """This rank's output (token-major, in ``q``'s dtype: merged outputs are rounded here, once)
    and log-sum-exp from its two query chunks'."""
    out = _token_major_like(q)
    for qh, (o, _) in enumerate(merged):
        _chunk(out, qh, c).copy_(o)
    return out, torch.cat([lse for _, lse in merged], dim=2)


def _gather_backward(ctx, dout, q, k, v, out, lse):
    cp, c = dist.get_world_size(ctx.group), ctx.chunk
    keys, values = (_gather_tokens(t, ctx.group) for t in (k, v))
    dq = torch.zeros(q.shape, dtype=blocks.wide(q.dtype), device=q.device)
    # in the keys' dtype: each key's gradient sums at most two blocks here, then cp ranks'
    dkeys, dvalues = torch.zeros_like(keys), torch.zeros_like(values)
    for qh, p, rows, cols, causal in _blocks(ctx, _rank_order(cp)):
        dqb, dkb, dvb = blocks.backward(
            ctx.kernel, _part(dout, qh, c, rows), _part(q, qh, c, rows), _part(keys, p, c, cols),
            _part(values, p, c, cols), _part(out, qh, c, rows), _part(lse, qh, c, rows), causal, ctx.scale)
        _part(dq, qh, c, rows).add_(dqb)
        _part(dkeys, p, c, cols).add_(dkb)
        _part(dvalues, p, c, cols).add_(dvb)
    del keys, values
    dk, dv = (_reduce_scatter_tokens(d, ctx.group) for d in (dkeys, dvalues))
    return dq.to(q.dtype), dk, dv


def _ulysses_forward(ctx, q, k, v):
    cp = dist.get_world_size(ctx.group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"Ulysses splits the heads over cp={cp} ranks: {q.shape[1]} query and "
                         f"{k.shape[1]} key heads per rank do not divide")
    qh, kh, vh = (_to_heads(t, ctx.group) for t in (q, k, v))
    if ctx.documents is None:
        o, lse = blocks.forward(ctx.kernel, qh, kh, vh, True, ctx.scale)
    else:  # every document of the whole sequence in a causal block of its own
        o, lse = blocks.segments_forward(ctx.kernel, qh, kh, vh, ctx.documents.bounds(), ctx.scale)
    return _to_tokens(o, ctx.group), _to_tokens(lse.unsqueeze(-1), ctx.group).squeeze(-1)


def _ulysses_backward(ctx, dout, q, k, v, out, lse):
    qh, kh, vh, oh, dh = (_to_heads(t, ctx.group) for t in (q, k, v, out, dout))
    lh = _to_heads(lse.unsqueeze(-1), ctx.group).squeeze(-1)
    if ctx.documents is None:
        dq, dk, dv = blocks.backward(ctx.kernel, dh, qh, kh, vh, oh, lh, True, ctx.scale, kh.dtype)
    else:
        dq, dk, dv = blocks.segments_backward(ctx.kernel, dh, qh, kh, vh, oh, lh, ctx.documents.bounds(), ctx.scale)
    return (_to_tokens(d, ctx.group) for d in (dq, dk, dv))


_FORWARD = {"all_gather": _gather_forward, "p2p": _ring_forward, "a2a": _ulysses_forward}
_BACKWARD = {"all_gather": _gather_backward, "p2p": _ring_backward, "a2a": _ulysses_backward}


def context_parallel_attention(q, k, v, group, backend: str, scale: float, comm_type: str = "all_gather",
                               documents: Optional[Documents] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    Args:
        q, k, v: this rank's ``[b, heads, 2·c, dim]`` (its two chunks, in its order); ``k`` and
            ``v`` may have fewer heads than ``q`` (grouped-query attention).
        group: the context-parallel process group.
        backend: the run's attention kernel (:func:`memo.model.attention.select_backend`); the
            blocks run :func:`memo.model.attention_blocks.kernel_for` it.
        scale: the softmax scale.
        comm_type: ``all_gather``, ``p2p`` or ``a2a`` (Ulysses).
        documents: the whole sequence's documents, each query attending within its own only:
            blocks wholly of other documents are skipped, those that documents cut are cut into
            each document's part (:func:`memo.model.documents.chunk_blocks`), on the block kernel
            :func:`memo.model.documents.block_kernel` picks.

    Returns:
        ``[b, heads, 2·c, dim]``, this rank's tokens in its order, laid out ``[2·c, b, heads, dim]``
        in memory.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm_type} is not one of {', '.join(CP_COMM_TYPES)}")
    if documents is not None and documents.tokens != q.shape[2] * dist.get_world_size(group):
        raise ValueError(f"documents of {documents.tokens} tokens for a sequence of {q.shape[2]} tokens on each of "
                         f"{dist.get_world_size(group)} context-parallel ranks")
    return _Attention.apply(q, k, v, group, block_kernel(backend, q, documents), scale, comm_type, documents)
