"""What the swap runtime does while one layer runs: three captures, one per kind of pass.

* :class:`Discover`: once, before training; records which tensors the layer saves, in which
  order, and which of them its ops made in memory they asked for (the layer's layout).
* :class:`Forward`: every layer's forward pass; the ops write their saved tensors straight into
  the layer's rounding buffer, or they are copied there, and the saved-tensor hooks hand autograd
  a handle to the slot instead of the tensor.
* :class:`Replay`: a recomputation before a layer's backward pass; the layer runs again on the
  dropped tokens only, attention replayed from the buffer, and what it saves fills the dropped
  rows.

A capture answers the layer's three questions (memory for an output, a tensor to save, core
attention) for the pass it stands for; :class:`memo.swap.runtime.SwapRuntime` installs one for
the length of a pass.
"""

from typing import Callable, Optional

import torch

from memo.swap.layout import (ALIAS, ATTENTION, EXTERNAL, INPUT, TOKENS, Slot, address, canonical,
                              covers_exactly, same_layout, standalone)

_SMALL = 4096  # elements; attention's scalars (RNG seeds) stay where they are


class Capture:
    """One pass of one layer under the runtime (a layer's forward, its discovery or its replay).

    Args:
        runtime: the :class:`memo.swap.runtime.SwapRuntime` whose buffers the pass fills.
        state: the layer's swap state (``None`` in discovery).
        tokens: ``S``, tokens of the layer input on this rank.
        layer_input: the layer's ``hidden_states``.
        params: addresses of the layer's parameters, saved by reference and never placed.
    """

    def __init__(self, runtime, state, tokens: int, layer_input: torch.Tensor, params: set):
        self.runtime = runtime
        self.state = state
        self.tokens = tokens
        self.input = layer_input
        self.params = params
        self.cursor = 0  # the next slot

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a token-major tensor an op of the layer is about to make."""
        return torch.empty(shape, dtype=dtype, device=device)

    def pack(self, t: torch.Tensor):
        """The saved-tensor hook's pack: what autograd keeps in place of ``t``."""
        raise NotImplementedError

    def unpacker(self) -> Callable:
        """The saved-tensor hook's unpack (a handle from :meth:`pack` to the tensor again, for the
        backward pass). Every saved tensor holds it until its backward: it must not hold this
        capture, whose references to the kernel's outputs would keep them alive as long (nor may
        the pack hook: the runtime's dispatches to the capture of the pass)."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute: Callable) -> torch.Tensor:
        """Core attention on ``q, k, v`` (``[b, heads, s, dim]``); ``compute()`` runs the kernel."""
        raise NotImplementedError

    def is_parameter(self, t: torch.Tensor) -> bool:
        """Weights are saved by reference and left where they are, never swapped."""
        return isinstance(t, torch.nn.Parameter) or address(t) in self.params


class _Saving(Capture):
    """A pass whose saved tensors are the layer's own (discovery and forward): sorts each into
    its slot, and watches attention's kernel for the tensors it saves."""

    def __init__(self, runtime, state, tokens: int, layer_input: torch.Tensor, params: set):
        super().__init__(runtime, state, tokens, layer_input, params)
        self.products: dict[int, torch.Tensor] = {}  # slot -> what attention produced
        # slot -> attention product whose token-major form is contiguous, so that a tensor viewing
        # its memory can be rebuilt from the slot's buffer range (an ALIAS)
        self.sources: dict[int, torch.Tensor] = {}
        self.qkv: Optional[tuple] = None  # (q, k, v) while attention runs

    def classify(self, t: torch.Tensor) -> Optional[Slot]:
        """The slot a saved tensor belongs in, or ``None`` for one left where it is."""
        if self.is_parameter(t):
            return None
        S, chunks = self.tokens, self.runtime.sequence_chunks
        if self.qkv is not None:
            for role, x in zip(("q", "k", "v"), self.qkv, strict=True):
                if address(t) == address(x) and t.shape == x.shape and t.stride() == x.stride():
                    return Slot(TOKENS, tuple(canonical(t, 2).shape), t.dtype, 2, chunks, role)
            # the memory-efficient kernel pads its log-sum-exp to a multiple of 32 tokens
            if t.dim() >= 3 and t.shape[2] in (S * chunks, -(-S * chunks // 32) * 32):
                return Slot(ATTENTION, tuple(canonical(t, 2).shape), t.dtype, 2, chunks, "product")
            if t.numel() <= _SMALL:
                return None
            raise RuntimeError(f"memo cannot place a tensor of shape {tuple(t.shape)} saved by attention")
        x = self.input
        if address(t) == address(x) and t.shape == x.shape and t.stride() == x.stride():
            return Slot(INPUT, tuple(t.shape), t.dtype, 0, 1)
        for j, source in self.sources.items():
            if covers_exactly(t, source):
                return Slot(ALIAS, (), t.dtype, 0, 1, alias_of=j, alias_stride=t.stride(),
                            saved_shape=tuple(t.shape))
        if t.dim() >= 1 and t.shape[0] in (S, S * chunks):
            return Slot(TOKENS, tuple(t.shape), t.dtype, 0, t.shape[0] // S)
        raise RuntimeError(
            f"memo cannot find the tokens of a saved tensor of shape {tuple(t.shape)}: every "
            f"tensor a layer saves must have {S} or {S * chunks} tokens in its first dimension"
        )

    def remember_product(self, j: int, slot: Slot, t: torch.Tensor) -> None:
        # Held until the layer's forward ends, so no other tensor can reuse their addresses.
        if slot.kind == ATTENTION:
            self.products[j] = t
            token_major = canonical(t, slot.token_dim)
            if token_major.is_contiguous():
                self.sources[j] = token_major

    def run_kernel(self, q, k, v, compute: Callable) -> tuple[torch.Tensor, int]:
        """The kernel's output and the slot of the product it is."""
        self.qkv = (q, k, v)
        try:
            out = compute()
        finally:
            self.qkv = None
        for j, product in self.products.items():
            if address(product) == address(out):
                return out, j
        raise RuntimeError("memo could not find attention's output among its saved tensors")


class Discover(_Saving):
    """The layer's one pass before training that finds its layout (:attr:`slots`)."""

    def __init__(self, runtime, tokens: int, layer_input: torch.Tensor, params: set):
        super().__init__(runtime, None, tokens, layer_input, params)
        self.slots: list[Slot] = []
        self.requested: list[torch.Tensor] = []  # the memory each request for an output got

    def output(self, shape, dtype, device) -> torch.Tensor:
        memory = torch.empty(shape, dtype=dtype, device=device)
        self.requested.append(memory)  # held, so that its address names it until the end
        return memory

    def pack(self, t: torch.Tensor):
        slot = self.classify(t)
        if slot is None:
            return t.detach()  # (see below)
        slot.born = self._request_of(canonical(t, slot.token_dim)) if slot.kind != ALIAS else None
        slot.saved_stride = t.stride()
        self.slots.append(slot)
        self.remember_product(len(self.slots) - 1, slot, t)
        # detached: the pass's graph is never taken backward, and a node's own output packed as
        # itself would hold that node (and through these hooks the runtime, its layers and their
        # weights) in a cycle through C++ that no garbage collection frees
        return t.detach()

    def unpacker(self) -> Callable:
        return _as_saved

    def attention(self, q, k, v, compute):
        out, j = self.run_kernel(q, k, v, compute)
        self.slots[j].role = "out"
        return out

    def _request_of(self, t: torch.Tensor) -> Optional[int]:
        """The request for output memory (new, contiguous) that ``t``, token-major, is exactly."""
        for request, memory in enumerate(self.requested):
            if address(t) == address(memory) and t.shape == memory.shape and t.dtype == memory.dtype \
                    and t.is_contiguous():
                return request
        return None


class Forward(_Saving):
    """A layer's forward pass in training: every saved tensor kept in the layer's rounding buffer."""

    def __init__(self, runtime, state, tokens: int, layer_input: torch.Tensor, params: set):
        super().__init__(runtime, state, tokens, layer_input, params)
        self.requests = 0  # requests for output memory so far

    def output(self, shape, dtype, device) -> torch.Tensor:
        runtime, request = self.runtime, self.requests
        self.requests += 1
        j = runtime.born.get(request)
        if j is None:
            return torch.empty(shape, dtype=dtype, device=device)
        slot = runtime.layout.slots[j]
        if (slot.shape, slot.dtype) != (tuple(shape), dtype):
            raise RuntimeError(
                f"layer {self.state.index} asked for {tuple(shape)} {dtype} as its output #{request}, "
                f"its layout has {slot.shape} {slot.dtype}: memo needs every layer to save the same tensors"
            )
        return standalone(runtime.slot_tensor(runtime.buffer_of(self.state), j))

    def pack(self, t: torch.Tensor):
        runtime = self.runtime
        slot = self.classify(t)
        if slot is None:
            return t
        j = self.cursor
        layout = runtime.layout
        expected = layout.slots[j] if j < len(layout.slots) else None
        kind = EXTERNAL if slot.kind == INPUT and expected is not None and expected.kind == EXTERNAL else slot.kind
        if expected is None or (kind, slot.shape, slot.dtype, slot.alias_of) != (
            expected.kind, expected.shape, expected.dtype, expected.alias_of
        ):
            raise RuntimeError(
                f"layer {self.state.index} saved tensor #{j} ({slot.kind} {slot.shape}) unlike "
                "the layer layout: memo needs every layer to save the same tensors"
            )
        self.cursor += 1
        self.remember_product(j, slot, t)
        if slot.kind == ALIAS or expected.kind == EXTERNAL:
            return (self.state, j)
        b, source = runtime.buffer_of(self.state), canonical(t, expected.token_dim)
        target = runtime.slot_tensor(b, j)  # the last R units keep every token
        if address(source) == address(target):
            return (self.state, j)  # made in place (memo.model.placement)
        if not runtime.resident(self.state.index) and expected.kind == TOKENS:
            source = runtime.split(source, expected, self.state.keep)[0]
            target = runtime.swapped_part(self.state, j)
        runtime.streams.copy(runtime.streams.compute, target, source)
        return (self.state, j)

    def unpacker(self) -> Callable:
        return self.runtime.saved

    def attention(self, q, k, v, compute):
        out, j = self.run_kernel(q, k, v, compute)
        slot = self.runtime.layout.slots[j]
        if slot.role != "out":
            raise RuntimeError("attention's output moved between layers")
        # The kernel wrote its own memory, which the buffer now copies: the layer goes on from
        # the copy, so the kernel's output is freed here rather than when the layer ends.
        slot_tensor = self.runtime.slot_tensor(self.runtime.buffer_of(self.state), j)
        kept = slot_tensor.movedim(0, slot.token_dim)  # as the kernel saved it
        if not same_layout(kept, out.stride()):  # a dimension of one element has any stride
            return out
        del self.products[j]
        self.sources[j] = slot_tensor
        return _Relocated.apply(out, standalone(kept))


class Replay(Capture):
    """A recomputation of a layer's dropped tokens: what it saves fills the buffer's dropped rows.

    ``outer`` are the slots saved outside attention, in order: the replay's saved tensors are
    those, attention's are filled from its inputs.
    """

    def __init__(self, runtime, state, tokens: int, layer_input: torch.Tensor, params: set, outer: list[int]):
        super().__init__(runtime, state, tokens, layer_input, params)
        self.outer = outer

    def pack(self, t: torch.Tensor):
        if self.is_parameter(t):
            return None
        if self.cursor >= len(self.outer):
            raise RuntimeError(f"recomputing layer {self.state.index} saved more tensors than its forward")
        j = self.outer[self.cursor]
        self.cursor += 1
        self.runtime.fill(self.state, j, t)
        return None

    def unpacker(self) -> Callable:
        return _never

    def attention(self, q, k, v, compute):
        runtime = self.runtime
        for role, x in zip(("q", "k", "v"), (q, k, v), strict=True):
            j = runtime.roles.get(role)
            if j is not None:  # else the kernel saved its own copy, swapped whole
                runtime.fill(self.state, j, x)
        out = runtime.roles["out"]
        _, dropped = runtime.split(runtime.slot_tensor(runtime.buffer_of(self.state), out), runtime.layout.slots[out],
                                   self.state.keep)
        return dropped.flatten(0, 1).movedim(0, 2)

    def last_saved(self, x: torch.Tensor) -> bool:
        """Given FC2's input ``x``: whether it is the one slot left (then it is filled, and the
        replay may end)."""
        if self.cursor != len(self.outer) - 1:
            return False
        j = self.outer[-1]
        slot = self.runtime.layout.slots[j]
        if slot.kind != TOKENS or tuple(x.shape[1:]) != slot.shape[1:] or x.dtype != slot.dtype:
            return False  # not FC2's input after all: let the layer run on
        self.runtime.fill(self.state, j, x)
        self.cursor += 1
        return True


def _as_saved(t: torch.Tensor) -> torch.Tensor:
    return t


def _never(_handle):
    raise RuntimeError("a recomputation's saved tensors are never read")


class _Relocated(torch.autograd.Function):
    """``kept``, an exact copy of ``x``, standing in for it in the autograd graph."""

    @staticmethod
    def forward(ctx, x, kept):
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
