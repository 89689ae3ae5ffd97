"""Where one layer's saved tensors live: their slots in a rounding buffer and in a host region.

Every layer saves the same sequence of tensors (all layers have one shape), so their layout is
found once, before training (:class:`memo.swap.capture.Discover`). Tensors keep Megatron's
``[s, b, ...]`` layout (tokens first, attention's ``[b, heads, s, ...]`` is turned around), so a
token prefix is one contiguous block, copied to and from the host without a staging temporary.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

INPUT, ATTENTION, TOKENS, ALIAS = "input", "attention", "tokens", "alias"
# the layer input where the caller keeps it (a walk in tiles keeps the whole layer's input once,
# not per tile): in neither a rounding buffer nor a host region, given back by the caller
EXTERNAL = "external"
BYTELESS = (ALIAS, EXTERNAL)  # slots that hold no bytes of their own
ALIGN = 256  # bytes; each rounding-buffer slot starts at a multiple, as allocator blocks do


@dataclass
class Slot:
    """One saved tensor of a layer: how to find its tokens and where it is kept.

    ``shape`` is token-major: the saved tensor with its token dimension moved to the front.
    """

    kind: str  # INPUT, ATTENTION, TOKENS, ALIAS or EXTERNAL
    shape: tuple[int, ...]
    dtype: torch.dtype
    token_dim: int  # where tokens sit in the tensor as saved
    chunks: int  # shape[0] // S: tp for tensors gathered over sequence parallelism, else 1
    role: Optional[str] = None  # inside attention: "q", "k", "v", "out" or "product"
    alias_of: Optional[int] = None  # ALIAS: the slot whose memory this tensor views
    alias_stride: Optional[tuple[int, ...]] = None
    saved_shape: Optional[tuple[int, ...]] = None  # ALIAS: shape as saved
    saved_stride: Optional[tuple[int, ...]] = None  # strides of the tensor as saved
    born: Optional[int] = None  # the layer's request for output memory whose tensor this is
    offset: int = 0  # bytes into a rounding buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def rows_swapped(self, k: int, tokens: int) -> int:
        """Rows of each run of ``tokens`` that go to the host: all unless the slot is TOKENS."""
        if self.kind in BYTELESS:
            return 0
        return k if self.kind == TOKENS else tokens

    def swapped_bytes(self, k: int, tokens: int) -> int:
        return self.nbytes * self.rows_swapped(k, tokens) // tokens


@dataclass
class LayerLayout:
    """The saved tensors of one layer, in the order its forward pass saves them."""

    slots: list[Slot]
    tokens: int  # S: tokens of the layer input on this rank
    segments: int = 1  # equal runs of the S tokens that each keep their first k

    @property
    def segment_tokens(self) -> int:
        """Tokens of one segment, ``S / segments``: ``k`` is at most this."""
        return self.tokens // self.segments

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one rounding buffer: every slot whole."""
        return max((s.offset + s.nbytes for s in self.slots if s.kind not in BYTELESS), default=0)

    def host_bytes(self, k: int) -> int:
        """Bytes one layer sends to the host keeping ``k`` tokens per segment of every chunk."""
        return sum(s.swapped_bytes(k, self.segment_tokens) for s in self.slots)

    @property
    def bytes_kept(self) -> int:
        """Bytes of every slot whole (aliases view another slot): one layer's skeletal tensors."""
        return sum(s.nbytes for s in self.slots if s.kind not in BYTELESS)

    def bytes_of(self, kind: str) -> int:
        return sum(s.nbytes for s in self.slots if s.kind == kind)

    def place(self) -> None:
        """Give every slot that holds bytes its own aligned range of a rounding buffer."""
        offset = 0
        for slot in self.slots:
            if slot.kind not in BYTELESS:
                slot.offset = offset
                offset += -(-slot.nbytes // ALIGN) * ALIGN

    def host_offset(self, slot: Slot, k: int) -> int:
        """Bytes into a host region of ``k`` tokens per segment where ``slot``'s swapped part
        begins: the parts back to back, widest element type first, so every part stays aligned
        without padding and a region is exactly ``host_bytes(k)``."""
        offset = 0
        for other in sorted((s for s in self.slots if s.kind not in BYTELESS), key=lambda s: -s.dtype.itemsize):
            if other is slot:
                return offset
            offset += other.swapped_bytes(k, self.segment_tokens)
        raise ValueError(f"a {slot.kind} slot has no part on the host")


def address(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s first element lives: its storage and the byte offset into it. Unlike
    ``data_ptr()`` it tells fake tensors' memory apart too (their data pointers are all 0), so
    the swap runtime runs under a fake-tensor trace as it runs on real memory."""
    return t.untyped_storage()._cdata, t.storage_offset() * t.element_size()


def canonical(t: torch.Tensor, token_dim: int) -> torch.Tensor:
    """``t`` token-major: its token dimension moved to the front (a view)."""
    return t.movedim(token_dim, 0)


def covers_exactly(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t`` views exactly the memory of contiguous ``base`` (a reshape of it)."""
    if address(t) != address(base) or t.numel() != base.numel() or t.dtype != base.dtype:
        return False
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return last == t.numel() - 1


def same_layout(t: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``t`` has ``stride`` in every dimension of more than one element."""
    return all(a == b for n, a, b in zip(t.shape, t.stride(), stride, strict=True) if n > 1)


def empty_in_layout(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A new dense tensor shaped as ``t`` whose dimensions lie in memory in the order ``stride``
    gives (outermost first): exactly ``stride`` when that layout was dense."""
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    dense = torch.empty([t.shape[d] for d in order], dtype=t.dtype, device=t.device)
    return dense.permute([order.index(d) for d in range(t.dim())])


def standalone(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory that autograd does not take for a view of the rounding buffer:
    an op's output made there must not share the buffer's version counter, which every copy into
    another slot moves."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def tail_rows(t: torch.Tensor, chunks: int, k: int) -> torch.Tensor:
    """Rows ``k ..`` of every one of ``chunks`` equal chunks of ``t`` (token-major), joined."""
    return t.unflatten(0, (chunks, t.shape[0] // chunks))[:, k:].flatten(0, 1)
