"""Context parallelism in our own core attention, without Transformer Engine.

The sequence is cut into ``2·cp`` chunks of ``c`` tokens and context-parallel rank ``r`` holds
chunks ``r`` and ``2·cp − 1 − r``, one from each end, as Megatron-core's
``get_batch_on_this_cp_rank`` lays it out: under the causal mask every rank then does the same
work. Each rank computes attention for its own queries over every earlier key of the whole
sequence, exchanged as Megatron's ``cp_comm_type`` names it:

* ``all_gather``: the keys and values of all ranks are gathered before the layer's attention, in
  sequence order, and their gradients are summed back to the ranks that own them (a
  reduce-scatter) in the backward pass;
* ``a2a`` (Ulysses): all-to-all exchanges give each rank every token of ``heads/cp`` of the heads
  for attention, and then its own tokens of every head back.

A query chunk ``j`` attends to keys ``[0, (j + 1)·c)`` with the causal mask aligned at the lower
right (its last query sees every one of those keys), which SDPA takes as
:func:`torch.nn.attention.bias.causal_lower_right` without building a ``c × (j + 1)·c`` mask on
kernels that support it.

Memory: the gathered keys and values (``2·s·b·h/tp`` elements, all ``s`` tokens) live while one
layer's attention runs, forward or backward, and are not kept in between: the backward pass is
given the views it saved of them by gathering them again from this rank's own parts
(saved-tensor hooks), one more all-gather per layer, as Transformer Engine's ``all_gather`` does.
"""

import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes


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


def _gather_in_order(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's part (dim 0) gathered, in sequence order; not differentiable."""
    cp = dist.get_world_size(group)
    gathered = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    return _in_order(gathered, _sequence_order(cp))


class _GatherSequence(torch.autograd.Function):
    """All ranks' parts (dim 0) as the whole sequence in order; backward: each rank's part of the
    summed gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather_in_order(local, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        local = grad.new_empty((grad.shape[0] // cp, *grad.shape[1:]))
        dist.reduce_scatter_tensor(local, _in_order(grad, _rank_order(cp)), group=ctx.group)
        return local, None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence (dim 0) from every context-parallel rank's part, differentiably."""
    return _GatherSequence.apply(local, group)


@functools.lru_cache(maxsize=None)
def _lower_right(queries: int, keys: int) -> CausalBias:
    """The causal mask aligned at the lower right. It holds no data, only the two lengths, but it is
    a tensor subclass, which cannot be made while a dispatch mode (the CPU allocation recorder of
    :mod:`memo.execute.plan_runtime`) wraps every new tensor: it is made outside any."""
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


class _GatheredSaved:
    """Saved-tensor hooks for one attention call: views of the gathered keys and values are saved
    as where they lie in them, and gathered again (once) when the backward pass asks for them."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, group):
        # this rank's own parts, kept in place of the gathered ones, as much as attention keeps
        # without context parallelism
        self.local = (key.detach(), value.detach())
        self.group = group
        self.storages: dict[int, int] = {}  # data pointer of a gathered tensor's storage -> 0 (keys), 1
        self.regathered: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def gather(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = gather_sequence(key, self.group), gather_sequence(value, self.group)
        self.storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate((keys, values))}
        return keys, values

    def pack(self, t: torch.Tensor):
        which = self.storages.get(t.untyped_storage().data_ptr())
        return t if which is None else (which, t.storage_offset(), t.shape, t.stride())

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        which, offset, shape, stride = saved
        if self.regathered is None:
            self.regathered = tuple(_gather_in_order(t, self.group) for t in self.local)
        return self.regathered[which].as_strided(shape, stride, offset)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    backend,
    scale: float,
    grouped: bool = False,
    comm_type: str = "all_gather",
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    Args:
        query, key, value: this rank's ``[2·c, b, heads, dim]`` (its two chunks, in its order).
        group: the context-parallel process group.
        backend: the SDPA kernel (a :class:`torch.nn.attention.SDPBackend`).
        scale: the softmax scale.
        comm_type: ``all_gather`` or ``a2a`` (Ulysses).

    Returns:
        ``[2·c, b, heads·dim]``, this rank's tokens in its order.
    """
    if comm_type == "a2a":
        return _ulysses_attention(query, key, value, group, backend, scale, grouped)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    saved = _GatheredSaved(key, value, group)
    c = query.shape[0] // 2
    masks = [_lower_right(c, (chunk + 1) * c) for chunk in rank_chunks(rank, cp)]
    outs = []
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        keys, values = saved.gather(key, value)
        for part, mask in zip(query.split(c), masks):
            end = mask.seq_len_kv
            q, k, v = (t.permute(1, 2, 0, 3) for t in (part, keys[:end], values[:end]))
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)
            b, n, _, d = out.shape
            outs.append(out.permute(2, 0, 1, 3).reshape(c, b, n * d))
    return torch.cat(outs)


class _AllToAll(torch.autograd.Function):
    """``x`` cut into cp parts along ``scatter``, part ``i`` sent to rank ``i``, and the parts
    received joined along ``gather``; the backward pass sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    cp = dist.get_world_size(group)
    sent = [part.contiguous() for part in x.chunk(cp, dim=scatter)]
    received = [torch.empty_like(sent[0]) for _ in range(cp)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather)


def _ulysses_attention(query, key, value, group, backend, scale: float, grouped: bool) -> torch.Tensor:
    """Ulysses (``cp_comm_type=a2a``): an all-to-all gives each rank every token of ``heads/cp``
    heads, attention runs over the whole sequence on them, and a second all-to-all gives each rank
    its own tokens of every head back. Nothing is gathered beyond this rank's share: the
    re-sharded q, k, v hold as many elements as its own."""
    cp = dist.get_world_size(group)
    if query.shape[2] % cp or key.shape[2] % cp:
        raise ValueError(f"Ulysses splits the heads over cp={cp} ranks: {query.shape[2]} query and "
                         f"{key.shape[2]} key heads per rank do not divide")
    # [2·c, b, n, d] by rank -> [s, b, n/cp, d] in sequence order
    q, k, v = (_in_order(_AllToAll.apply(t, group, 2, 0), _sequence_order(cp)).permute(1, 2, 0, 3)
               for t in (query, key, value))
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
    out = _in_order(out.permute(2, 0, 1, 3), _rank_order(cp))  # [s, b, n/cp, d] by rank
    out = _AllToAll.apply(out, group, 0, 2)  # [2·c, b, n, d]
    return out.reshape(out.shape[0], out.shape[1], -1)
