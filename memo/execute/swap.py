"""MEMO's token-wise swapping and recomputation of skeletal activations.

A transformer layer's forward pass saves tensors for its backward pass (its *skeletal*
activations). :class:`SwapRuntime` intercepts them with saved-tensor hooks and keeps them in
rounding buffer ``i % 2`` of layer ``i``. The last two layers keep every token there (buffers
``(n − 2) % 2`` and ``(n − 1) % 2``) and are neither sent out, brought back nor recomputed, since
their backward follows at once: the device holds two layers of skeletal bytes whatever ``n`` is.
Every other layer:

* copies the layer input and what attention produced (its output and log-sum-exp) whole, and the
  first ``k = ⌊α·S⌋`` tokens of every other saved tensor, into its buffer; the other tokens are
  dropped;
* sends that buffer to its region of one host slab on the D2H stream once the layer's forward is
  done; layer ``i + 2`` waits for that copy before it writes the same buffer;
* at the start of layer ``i + 1``'s backward pass (layer ``i + 2``'s is then finished and its
  buffer free) brings layer ``i``'s region back on the H2D stream, after the D2H copy of it;
* at the start of layer ``i``'s backward pass waits for that copy and recomputes tokens
  ``k .. S`` from the layer input and the attention output of those tokens only, by running the
  layer again on them with attention replayed from the buffer; the saved tensors it produces
  fill the dropped rows of the buffer, which backward then reads. The replay ends at FC2's input,
  the last tensor the layer saves: FC2, its reduce-scatter and the residual are not run again.

Every layer saves the same sequence of tensors (all layers have one shape), so their layout in
the buffer (:class:`LayerLayout`) is found once, before training, by :meth:`SwapRuntime.discover`.
Tensors keep Megatron's ``[s, b, ...]`` layout (tokens first, attention's ``[b, heads, s, ...]``
is turned around), so a token prefix is one contiguous block, copied to and from the host
without a staging temporary.

Under sequence parallelism each rank holds ``S = s / tp`` tokens of the layer input, while the
tensors between the gather and the reduce-scatter have all ``tp·S`` tokens, as ``tp`` chunks of
``S``; the first ``k`` tokens of every chunk are kept, each chunk's one contiguous block copied
on its own. Recomputation runs the same collectives on the dropped tokens of every rank, which
are exactly those chunks' tails.

Under context parallelism a rank's tokens are two chunks of the sequence, one from each end
(:mod:`memo.model.context_parallel`): without sequence parallelism the layer input holds both, and
its ``S`` tokens are taken as two *segments* of ``S/2``, ``k`` kept of each, so that the prefix is
taken per load-balanced chunk. Attention is not run again in recomputation (its output is kept
whole), so no context-parallel exchange is replayed.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from memo.execute.streams import Streams
from memo.plan.alpha import HostMemoryError

INPUT, ATTENTION, TOKENS, ALIAS = "input", "attention", "tokens", "alias"
_ALIGN = 256  # bytes; each rounding-buffer slot starts at a multiple, as allocator blocks do
_SMALL = 4096  # elements; attention's scalars (RNG seeds) stay where they are


@dataclass
class Slot:
    """One saved tensor of a layer: how to find its tokens and where it is kept.

    ``shape`` is token-major: the saved tensor with its token dimension moved to the front.
    """

    kind: str  # INPUT, ATTENTION, TOKENS or ALIAS
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
    host_offset: int = 0  # bytes into a layer's host region

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def rows_swapped(self, k: int, tokens: int) -> int:
        """Rows of each run of ``tokens`` that go to the host: all unless the slot is TOKENS."""
        if self.kind == ALIAS:
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
        return max((s.offset + s.nbytes for s in self.slots), default=0)

    def host_bytes(self, k: int) -> int:
        """Bytes one layer sends to the host keeping ``k`` tokens per segment of every chunk."""
        return sum(s.swapped_bytes(k, self.segment_tokens) for s in self.slots)

    @property
    def bytes_kept(self) -> int:
        """Bytes of every slot whole (aliases view another slot): one layer's skeletal tensors."""
        return sum(s.nbytes for s in self.slots if s.kind != ALIAS)

    def bytes_of(self, kind: str) -> int:
        return sum(s.nbytes for s in self.slots if s.kind == kind)


def _canonical(t: torch.Tensor, token_dim: int) -> torch.Tensor:
    return t.movedim(token_dim, 0)


def _is_parameter(t: torch.Tensor, capture: "_Capture") -> bool:
    """Weights are saved by reference and left where they are, never swapped."""
    return isinstance(t, torch.nn.Parameter) or t.data_ptr() in capture.params


def _covers_exactly(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t`` views exactly the memory of contiguous ``base`` (a reshape of it)."""
    if t.data_ptr() != base.data_ptr() or t.numel() != base.numel() or t.dtype != base.dtype:
        return False
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return last == t.numel() - 1


@dataclass
class _LayerState:
    """One layer's swap in one forward/backward pass."""

    index: int
    kwargs: dict  # the forward's arguments but ``hidden_states``, for recomputation
    offloaded: object = None  # event: D2H of this layer finished
    prefetched: object = None  # event: H2D of this layer finished
    ready: bool = False  # prefetched and recomputed: its backward may read the buffer


@dataclass
class _Capture:
    """What the hooks need while one layer's forward (or its recomputation) runs."""

    mode: str  # "discover", "forward" or "replay"
    state: Optional[_LayerState]
    tokens: int
    input: Optional[torch.Tensor] = None
    params: set = field(default_factory=set)
    slots: list = field(default_factory=list)  # discover: slots found so far
    products: dict = field(default_factory=dict)  # slot -> what attention produced
    # slot -> attention product whose token-major form is contiguous, so that a tensor viewing
    # its memory can be rebuilt from the slot's buffer range (an ALIAS)
    sources: dict = field(default_factory=dict)
    cursor: int = 0  # forward/replay: next slot
    requests: int = 0  # requests for output memory so far (:meth:`SwapRuntime.output`)
    requested: list = field(default_factory=list)  # discover: the memory each request got
    attention: Optional[tuple] = None  # (q, k, v) while attention runs
    outer: list = field(default_factory=list)  # replay: slot indices outside attention


class _BackwardStart(torch.autograd.Function):
    """Identity on a layer's output whose backward marks the start of that layer's backward."""

    @staticmethod
    def forward(ctx, hidden, runtime, index):
        ctx.runtime, ctx.index = runtime, index
        return hidden.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.runtime.backward_started(ctx.index)
        return grad, None, None


class SwapRuntime:
    """Token-wise swapping and recomputation for the layers of one model replica.

    Args:
        num_layers: transformer layers of the model (n); the last two never swap.
        streams: compute, D2H and H2D streams (:mod:`memo.execute.streams`).
        device: where the rounding buffers live.
        sequence_chunks: tp under sequence parallelism, else 1.
        segments: segments of a chunk that each keep their first ``k`` tokens: 2 when the layer
            input holds both of a context-parallel rank's chunks, else 1.
    """

    def __init__(self, num_layers: int, streams: Streams, device: torch.device, sequence_chunks: int = 1,
                 segments: int = 1):
        self.num_layers = num_layers
        self.swapped_layers = max(num_layers - 2, 0)
        self.streams = streams
        self.device = device
        self.sequence_chunks = sequence_chunks
        self.segments = segments
        self.layout: Optional[LayerLayout] = None
        self.keep_tokens: Optional[int] = None  # k
        self._region_bytes = 0  # one layer's share of the slab
        self._roles: dict[str, int] = {}  # attention's "q", "k", "v", "out" -> slot
        self._born: dict[int, int] = {}  # request for output memory -> the slot it is made in
        self.buffers: list[torch.Tensor] = []
        self.slab: Optional[torch.Tensor] = None
        self._pinned = False  # the slab is registered with CUDA (cudaHostRegister)
        self.layers: list = []
        self._index: dict[int, int] = {}  # id(layer) -> its place in the model
        self._states: dict[int, _LayerState] = {}
        self._buffer_owner: list[Optional[_LayerState]] = [None, None]
        self._buffer_free: list[object] = [None, None]
        self._capture: Optional[_Capture] = None
        self._accounting: dict[int, dict[str, int]] = {}

    # ----------------------------------------------------------------- set-up

    def attach(self, layers: list) -> None:
        """Let ``layers`` (:class:`memo.model.layer.MemoTransformerLayer`, in order) swap here."""
        if len(layers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers, got {len(layers)}")
        self.layers = list(layers)
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        for layer in self.layers:
            # every module of the layer that makes a saved tensor (norms, rotary, FC1, GeLU) or
            # runs attention asks this runtime for memory (memo.model.placement)
            for module in layer.modules():
                if hasattr(module, "runtime"):
                    module.runtime = self

    def discover(self, layer, kwargs: dict) -> LayerLayout:
        """Run ``layer`` forward once on ``kwargs`` and return the layout of what it saves.

        The input (``kwargs["hidden_states"]``) must require grad, as in training.
        """
        capture = _Capture("discover", None, kwargs["hidden_states"].shape[0])
        self._run_captured(layer, kwargs, capture, self._pack, lambda t: t)
        if capture.tokens % self.segments:
            raise ValueError(f"{capture.tokens} tokens cannot be cut into {self.segments} segments")
        layout = LayerLayout(capture.slots, capture.tokens, self.segments)
        _place(layout)
        return layout

    def allocate(self, layout: LayerLayout, keep_tokens: int, pin: bool) -> None:
        """Allocate the two rounding buffers and the host slab for ``keep_tokens`` tokens per segment.

        Args:
            pin: page-lock the slab (on a GPU); it is registered whole, at its exact size.
        """
        if not 0 <= keep_tokens <= layout.segment_tokens:
            raise ValueError(f"keep_tokens={keep_tokens} outside [0, {layout.segment_tokens}]")
        self.release()
        self.layout, self.keep_tokens = layout, keep_tokens
        self._region_bytes = layout.host_bytes(keep_tokens)
        self._roles = {slot.role: j for j, slot in enumerate(layout.slots) if slot.role}
        self._born = {slot.born: j for j, slot in enumerate(layout.slots) if slot.born is not None}
        self.buffers = [
            torch.empty(layout.buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        _place_host(layout, keep_tokens)
        self.slab = torch.empty(self.swapped_layers * self._region_bytes, dtype=torch.uint8)
        if pin and self.slab.numel():
            _register(self.slab)
            self._pinned = True

    def release(self) -> None:
        """Give back the buffers and the slab, unregistering a pinned slab (idempotent). Copies
        in flight must be done (``streams.synchronize()``)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
            self._pinned = False
        self.buffers, self.slab = [], None

    # ------------------------------------------------------------- accounting

    @property
    def rounding_buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def take_accounting(self) -> list[dict]:
        """Per-layer bytes since the last call: ``device`` (skeletal bytes the last two layers
        keep in their rounding buffer until their backward), ``host`` (sent to the host) and
        ``recomputed``. The device holds no skeletal bytes outside the two buffers."""
        rows = [{"layer": i, **v} for i, v in sorted(self._accounting.items())]
        self._accounting = {}
        return rows

    def _account(self, index: int, key: str, nbytes: int) -> None:
        entry = self._accounting.setdefault(index, {"device": 0, "host": 0, "recomputed": 0})
        entry[key] += nbytes

    # ---------------------------------------------------------------- forward

    def forward(self, layer, kwargs: dict):
        """Run ``layer``'s forward pass (keyword arguments as Megatron passes them) with swapping."""
        index = self._index[id(layer)]
        output, context = self._buffered_forward(layer, index, kwargs)
        return _BackwardStart.apply(output, self, index), context

    def resident(self, index: int) -> bool:
        """Whether layer ``index`` is one of the last two: kept whole in its rounding buffer, never
        sent to the host, brought back or recomputed (its backward follows right after)."""
        return index >= self.swapped_layers

    def _buffered_forward(self, layer, index: int, kwargs: dict):
        if self.layout is None:
            raise RuntimeError("SwapRuntime.allocate must run before training")
        hidden = kwargs["hidden_states"]
        for key in ("context", "packed_seq_params", "sequence_len_offset", "inference_context",
                    "attention_bias", "rotary_pos_cos", "rotary_pos_sin", "padding_mask"):
            if kwargs.get(key) is not None:
                raise ValueError(f"memo's swapping does not support the layer argument {key}")
        state = _LayerState(index, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        b = index % 2
        # The D2H copy of the buffer's previous layer must be done before it is overwritten.
        self.streams.wait(self.streams.compute, self._buffer_free[b])
        self._buffer_owner[b] = state
        capture = _Capture("forward", state, hidden.shape[0])
        result = self._run_captured(layer, kwargs, capture, self._pack, self._unpack)
        if capture.cursor != len(self.layout.slots):
            raise RuntimeError(
                f"layer {index} saved {capture.cursor} tensors, its layout has {len(self.layout.slots)}"
            )
        if self.resident(index):
            self._account(index, "device", self.layout.bytes_kept)
        else:
            self._offload(state)
        self._states[index] = state
        return result

    def _run_captured(self, layer, kwargs: dict, capture: _Capture, pack, unpack):
        capture.input = kwargs["hidden_states"]
        capture.params = {p.data_ptr() for p in layer.parameters()}
        self._capture = capture
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return layer.run(**kwargs)
        finally:
            self._capture = None

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a token-major tensor a layer's op is about to make (``shape``, ``dtype``):
        its slot of the layer's rounding buffer when the layout says the layer saves it there
        (the op writes it in place and nothing is copied), else new memory.

        The layer's ops ask in the same order in every forward pass; :meth:`discover` finds
        which request becomes which saved tensor. A recomputation gets new memory: its tokens
        are copied into the dropped rows."""
        capture = self._capture
        if capture is None or capture.mode == "replay":
            return torch.empty(shape, dtype=dtype, device=device)
        request = capture.requests
        capture.requests += 1
        j = self._born.get(request) if capture.mode == "forward" else None
        if j is None:
            memory = torch.empty(shape, dtype=dtype, device=device)
            if capture.mode == "discover":
                capture.requested.append(memory)  # held, so that its address names it until the end
            return memory
        slot = self.layout.slots[j]
        if (slot.shape, slot.dtype) != (tuple(shape), dtype):
            raise RuntimeError(
                f"layer {capture.state.index} asked for {tuple(shape)} {dtype} as its output #{request}, "
                f"its layout has {slot.shape} {slot.dtype}: memo needs every layer to save the same tensors"
            )
        return _standalone(self._slot_tensor(capture.state.index % 2, j))

    def _offload(self, state: _LayerState) -> None:
        s = self.streams
        b = state.index % 2
        s.wait(s.d2h, s.record(s.compute))
        for j, slot in enumerate(self.layout.slots):
            if slot.kind != ALIAS:
                _copy_blocks(s, s.d2h, self._host_view(state.index, slot), self._swapped_part(b, j))
        state.offloaded = self._buffer_free[b] = s.record(s.d2h)
        self._account(state.index, "host", self._region_bytes)

    # ------------------------------------------------------------------ hooks

    def _classify(self, t: torch.Tensor, capture: _Capture) -> Optional[Slot]:
        """The slot a saved tensor belongs in, or ``None`` for one left where it is."""
        if _is_parameter(t, capture):
            return None
        S, chunks = capture.tokens, self.sequence_chunks
        if capture.attention is not None:
            q, k, v = capture.attention
            for role, x in (("q", q), ("k", k), ("v", v)):
                if t.data_ptr() == x.data_ptr() and t.shape == x.shape and t.stride() == x.stride():
                    return Slot(TOKENS, tuple(_canonical(t, 2).shape), t.dtype, 2, chunks, role)
            # the memory-efficient kernel pads its log-sum-exp to a multiple of 32 tokens
            if t.dim() >= 3 and t.shape[2] in (S * chunks, -(-S * chunks // 32) * 32):
                return Slot(ATTENTION, tuple(_canonical(t, 2).shape), t.dtype, 2, chunks, "product")
            if t.numel() <= _SMALL:
                return None
            raise RuntimeError(f"memo cannot place a tensor of shape {tuple(t.shape)} saved by attention")
        x = capture.input
        if t.data_ptr() == x.data_ptr() and t.shape == x.shape and t.stride() == x.stride():
            return Slot(INPUT, tuple(t.shape), t.dtype, 0, 1)
        for j, source in capture.sources.items():
            if _covers_exactly(t, source):
                return Slot(ALIAS, (), t.dtype, 0, 1, alias_of=j, alias_stride=t.stride(),
                            saved_shape=tuple(t.shape))
        if t.dim() >= 1 and t.shape[0] in (S, S * chunks):
            return Slot(TOKENS, tuple(t.shape), t.dtype, 0, t.shape[0] // S)
        raise RuntimeError(
            f"memo cannot find the tokens of a saved tensor of shape {tuple(t.shape)}: every "
            f"tensor a layer saves must have {S} or {S * chunks} tokens in its first dimension"
        )

    def _pack(self, t: torch.Tensor):
        capture = self._capture
        slot = self._classify(t, capture)
        if slot is None:
            return t
        if capture.mode == "discover":
            slot.born = _request_of(_canonical(t, slot.token_dim), capture) if slot.kind != ALIAS else None
            slot.saved_stride = t.stride()
            capture.slots.append(slot)
            self._remember_product(capture, len(capture.slots) - 1, slot, t)
            return t
        j = capture.cursor
        expected = self.layout.slots[j] if j < len(self.layout.slots) else None
        if expected is None or (slot.kind, slot.shape, slot.dtype, slot.alias_of) != (
            expected.kind, expected.shape, expected.dtype, expected.alias_of
        ):
            raise RuntimeError(
                f"layer {capture.state.index} saved tensor #{j} ({slot.kind} {slot.shape}) unlike "
                "the layer layout: memo needs every layer to save the same tensors"
            )
        capture.cursor += 1
        self._remember_product(capture, j, slot, t)
        if slot.kind == ALIAS:
            return (capture.state, j)
        b, source = capture.state.index % 2, _canonical(t, expected.token_dim)
        target = self._slot_tensor(b, j)  # the last two layers keep every token
        if source.data_ptr() == target.data_ptr():
            return (capture.state, j)  # made in place (memo.model.placement)
        if not self.resident(capture.state.index) and expected.kind == TOKENS:
            source = self._split(source, expected)[0]
            target = self._swapped_part(b, j)
        self.streams.copy(self.streams.compute, target, source)
        return (capture.state, j)

    @staticmethod
    def _remember_product(capture: _Capture, j: int, slot: Slot, t: torch.Tensor) -> None:
        # Held until the layer's forward ends, so no other tensor can reuse their addresses.
        if slot.kind == ATTENTION:
            capture.products[j] = t
            canonical = _canonical(t, slot.token_dim)
            if canonical.is_contiguous():
                capture.sources[j] = canonical

    def _unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        state, j = handle
        if not state.ready or self._buffer_owner[state.index % 2] is not state:
            raise RuntimeError(
                f"layer {state.index}'s activations were read before they were reloaded"
            )
        return self._saved_tensor(state.index % 2, j)

    # --------------------------------------------------------------- attention

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute: Callable,
                  scale: Optional[float] = None, backend: Optional[str] = None):
        """Core attention under swapping: ``q, k, v`` as the kernel takes them
        (``[b, heads, s, dim]``), ``compute()`` runs the kernel (of ``backend``, softmax scale
        ``scale``) and returns its output."""
        capture = self._capture
        if capture is None:
            return compute()
        if capture.mode == "replay":
            for role, x in (("q", q), ("k", k), ("v", v)):
                j = self._roles.get(role)
                if j is not None:  # else the kernel saved its own copy, swapped whole
                    self._fill(capture, j, x)
            out = self._roles["out"]
            _, dropped = self._split(self._slot_tensor(capture.state.index % 2, out), self.layout.slots[out])
            return dropped.flatten(0, 1).movedim(0, 2)
        capture.attention = (q, k, v)
        try:
            out = compute()
        finally:
            capture.attention = None
        for j, product in capture.products.items():
            if product.data_ptr() == out.data_ptr():
                if capture.mode == "discover":
                    capture.slots[j].role = "out"
                elif self.layout.slots[j].role != "out":
                    raise RuntimeError("attention's output moved between layers")
                break
        else:
            raise RuntimeError("memo could not find attention's output among its saved tensors")
        if capture.mode == "discover":
            return out
        # The kernel wrote its own memory, which the buffer now copies: the layer goes on from
        # the copy, so the kernel's output is freed here rather than when the layer ends.
        slot_tensor = self._slot_tensor(capture.state.index % 2, j)
        kept = slot_tensor.movedim(0, self.layout.slots[j].token_dim)  # as the kernel saved it
        if not _same_layout(kept, out.stride()):  # a dimension of one element has any stride
            return out
        del capture.products[j]
        capture.sources[j] = slot_tensor
        return _Relocated.apply(out, _standalone(kept))

    # ---------------------------------------------------------------- backward

    def backward_started(self, index: int) -> None:
        """Called as layer ``index``'s backward pass begins (layer ``index + 1``'s is done)."""
        s = self.streams
        released = s.record(s.compute)
        below = index - 1
        if 0 <= below < self.swapped_layers:
            self._prefetch(self._states[below], released)
        state = self._states.pop(index)
        if not self.resident(index):
            if state.prefetched is None:
                self._prefetch(state, released)
            s.wait(s.compute, state.prefetched)
            if self.keep_tokens < self.layout.segment_tokens:
                self._recompute(state)
        state.ready = True

    def _prefetch(self, state: _LayerState, released: object) -> None:
        s = self.streams
        b = state.index % 2
        s.wait(s.h2d, released)  # the buffer's previous layer finished its backward
        s.wait(s.h2d, state.offloaded)  # and this layer's own D2H is complete
        self._buffer_owner[b] = state
        for j, slot in enumerate(self.layout.slots):
            if slot.kind != ALIAS:
                _copy_blocks(s, s.h2d, self._swapped_part(b, j), self._host_view(state.index, slot))
        state.prefetched = s.record(s.h2d)

    def _recompute(self, state: _LayerState) -> None:
        layout, k = self.layout, self.keep_tokens
        b = state.index % 2
        inputs = [j for j, s in enumerate(layout.slots) if s.kind == INPUT]
        hidden = _tail_rows(self._slot_tensor(b, inputs[0]), self.segments, k).detach().requires_grad_(True)
        kwargs = dict(state.kwargs, hidden_states=hidden)
        rope = kwargs.get("rotary_pos_emb")
        if rope is not None:
            kwargs["rotary_pos_emb"] = _tail_rows(rope, self.sequence_chunks * self.segments, k)
        capture = _Capture("replay", state, layout.tokens)
        capture.outer = [j for j, s in enumerate(layout.slots) if s.role is None]
        layer = self.layers[state.index]
        # The backward needs what the layer saves, the last of which is FC2's input: the replay
        # ends there, without FC2's GEMM, its reduce-scatter and the residual.
        stop = layer.mlp.linear_fc2.register_forward_pre_hook(self._last_saved)
        try:
            with torch.enable_grad():
                self._run_captured(layer, kwargs, capture, self._collect, _never)
        except _ReplayDone:
            pass
        finally:
            stop.remove()
        if capture.cursor != len(capture.outer):
            raise RuntimeError(
                f"recomputing layer {state.index} saved {capture.cursor} of {len(capture.outer)} tensors"
            )

    def _last_saved(self, _module, inputs) -> None:
        """FC2's forward pre-hook, set only while replaying: if the one slot left is what FC2
        saves (its input), fill it and end the replay."""
        capture = self._capture
        if capture.cursor != len(capture.outer) - 1:
            return
        j = capture.outer[-1]
        slot = self.layout.slots[j]
        (x,) = inputs
        if slot.kind != TOKENS or tuple(x.shape[1:]) != slot.shape[1:] or x.dtype != slot.dtype:
            return  # not FC2's input after all: let the layer run on
        self._fill(capture, j, x)
        capture.cursor += 1
        raise _ReplayDone

    def _collect(self, t: torch.Tensor):
        capture = self._capture
        if _is_parameter(t, capture):
            return None
        if capture.cursor >= len(capture.outer):
            raise RuntimeError(
                f"recomputing layer {capture.state.index} saved more tensors than its forward"
            )
        j = capture.outer[capture.cursor]
        capture.cursor += 1
        self._fill(capture, j, t)
        return None

    def _fill(self, capture: _Capture, j: int, t: torch.Tensor) -> None:
        """Write recomputed tokens ``t`` into the dropped rows of slot ``j``."""
        slot = self.layout.slots[j]
        if slot.kind in (INPUT, ALIAS):
            return  # kept whole on the host, nothing to recompute
        canonical = _canonical(t, slot.token_dim)
        dropped = slot.chunks * self.segments * (self.layout.segment_tokens - self.keep_tokens)
        rest = slot.shape[1:]
        if tuple(canonical.shape) != (dropped, *rest) or canonical.dtype != slot.dtype:
            raise RuntimeError(
                f"recomputing layer {capture.state.index} gave {tuple(canonical.shape)} for slot {j}, "
                f"expected {(dropped, *rest)}"
            )
        full = self._slot_tensor(capture.state.index % 2, j)
        _, tail = self._split(full, slot)
        tail.copy_(canonical.reshape(tail.shape))
        self._account(capture.state.index, "recomputed", canonical.numel() * canonical.element_size())

    # ---------------------------------------------------------------- views

    def _slot_tensor(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` of rounding buffer ``b``, token-major."""
        slot = self.layout.slots[j]
        raw = self.buffers[b][slot.offset: slot.offset + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def _saved_view(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` shaped as the tensor its layer saved."""
        slot = self.layout.slots[j]
        if slot.kind == ALIAS:
            flat = self._slot_tensor(b, slot.alias_of).view(-1)
            return flat.as_strided(slot.saved_shape, slot.alias_stride)
        return self._slot_tensor(b, j).movedim(0, slot.token_dim)

    def _saved_tensor(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` as its layer saved it, strides included. The buffer keeps tokens first; a
        tensor saved in another layout (attention's log-sum-exp ``[b, heads, s]``, its output with
        a micro-batch of more than one) comes back as a copy in that layout: CUDA's fused attention
        backward kernels take the layout of their forward for granted."""
        view, slot = self._saved_view(b, j), self.layout.slots[j]
        if slot.saved_stride is None or _same_layout(view, slot.saved_stride):
            return view
        return _empty_in_layout(view, slot.saved_stride).copy_(view)

    def _swapped_part(self, b: int, j: int) -> torch.Tensor:
        """The rows of slot ``j`` in buffer ``b`` that the host keeps, ``[chunks·segments, k, ...]``
        for TOKENS."""
        slot, full = self.layout.slots[j], self._slot_tensor(b, j)
        return self._split(full, slot)[0] if slot.kind == TOKENS else full

    def _split(self, t: torch.Tensor, slot: Slot) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``k`` and the other rows of every segment of every chunk of token-major
        ``t``, as ``[chunks·segments, rows, ...]`` views."""
        runs = t.unflatten(0, (slot.chunks * self.segments, self.layout.segment_tokens))
        return runs[:, : self.keep_tokens], runs[:, self.keep_tokens:]

    def _host_view(self, index: int, slot: Slot) -> torch.Tensor:
        tokens, k = self.layout.segment_tokens, self.keep_tokens
        start = index * self._region_bytes + slot.host_offset
        raw = self.slab[start: start + slot.swapped_bytes(k, tokens)]
        if slot.kind == TOKENS:
            return raw.view(slot.dtype).view(slot.chunks * self.segments, k, *slot.shape[1:])
        return raw.view(slot.dtype).view(slot.shape)


def _copy_blocks(streams: Streams, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` on ``stream`` as contiguous blocks: whole if both are contiguous,
    else one copy per index of the first dimension (a chunk's token prefix). A non-contiguous
    copy between device and host would stage through a temporary on the device."""
    if dst.is_contiguous() and src.is_contiguous():
        streams.copy(stream, dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        if not (d.is_contiguous() and s.is_contiguous()):
            raise RuntimeError(f"a swap copy of shape {tuple(s.shape)} is not contiguous per chunk")
        streams.copy(stream, d, s)


def _tail_rows(t: torch.Tensor, chunks: int, k: int) -> torch.Tensor:
    """Rows ``k ..`` of every one of ``chunks`` equal chunks of ``t`` (token-major), joined."""
    return t.unflatten(0, (chunks, t.shape[0] // chunks))[:, k:].flatten(0, 1)


class _Relocated(torch.autograd.Function):
    """``kept``, an exact copy of ``x``, standing in for it in the autograd graph."""

    @staticmethod
    def forward(ctx, x, kept):
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _same_layout(t: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``t`` has ``stride`` in every dimension of more than one element."""
    return all(a == b for n, a, b in zip(t.shape, t.stride(), stride, strict=True) if n > 1)


def _empty_in_layout(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """A new dense tensor shaped as ``t`` whose dimensions lie in memory in the order ``stride``
    gives (outermost first): exactly ``stride`` when that layout was dense."""
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    dense = torch.empty([t.shape[d] for d in order], dtype=t.dtype, device=t.device)
    return dense.permute([order.index(d) for d in range(t.dim())])


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory that autograd does not take for a view of the rounding buffer:
    an op's output made there must not share the buffer's version counter, which every copy into
    another slot moves."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _request_of(t: torch.Tensor, capture: _Capture) -> Optional[int]:
    """The request for output memory (discover; new, contiguous memory) that ``t``, token-major,
    is exactly, if any."""
    for request, memory in enumerate(capture.requested):
        if t.data_ptr() == memory.data_ptr() and t.shape == memory.shape and t.dtype == memory.dtype \
                and t.is_contiguous():
            return request
    return None


class _ReplayDone(Exception):
    """Raised inside a replay once every tensor the backward needs has been recomputed."""


def _never(_handle):
    raise RuntimeError("a recomputation's saved tensors are never read")


def _place(layout: LayerLayout) -> None:
    """Give every slot but aliases its own aligned range of a rounding buffer."""
    offset = 0
    for slot in layout.slots:
        if slot.kind != ALIAS:
            slot.offset = offset
            offset += -(-slot.nbytes // _ALIGN) * _ALIGN


def _place_host(layout: LayerLayout, k: int) -> None:
    """Pack the swapped parts of a layer's slots back to back, widest element type first so
    every part stays aligned without padding: a host region is exactly ``host_bytes(k)``."""
    offset = 0
    for slot in sorted((s for s in layout.slots if s.kind != ALIAS), key=lambda s: -s.dtype.itemsize):
        slot.host_offset = offset
        offset += slot.swapped_bytes(k, layout.segment_tokens)


def _register(slab: torch.Tensor) -> None:
    """Page-lock ``slab`` in place: one registration of the exact size, where the pinned
    allocator would round a request up to a power of two."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(slab.data_ptr(), slab.numel(), 0)
    if int(error) != 0:
        if hasattr(cudart, "cudaGetLastError"):
            cudart.cudaGetLastError()  # the failure must not surface at the next CUDA call
        raise HostMemoryError(
            f"cudaHostRegister of {slab.numel() / 2**30:.2f} GiB failed (error {int(error)}): "
            "raise the locked-memory limit (ulimit -l) or lower hardware.host_memory_gib"
        )
