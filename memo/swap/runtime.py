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

The layer's layout in the buffer (:mod:`memo.swap.layout`) is found once, before training; what
happens while a layer runs is the capture of its pass (:mod:`memo.swap.capture`). The runtime is
split by pass: its forward (:mod:`memo.swap.unit_forward`) and its backward
(:mod:`memo.swap.unit_backward`); here are its set-up, its buffers' views and the contracts it
keeps with the layers (:class:`memo.model.placement.Placement`) and the training loop
(:class:`memo.model.placement.LayerRuntime`).

The same rules hold for *units* smaller than a layer: a walk in sequence tiles
(:mod:`memo.swap.tiled_layer`) makes each tile of each layer a unit, ``u = i·T + t``, with ``R``
rounding buffers (unit ``u`` in buffer ``u mod R``, the last ``R`` units resident, unit ``u − R + 1``
prefetched as unit ``u``'s backward begins) and its own ``k`` per tile; the tile's input is then
the walk's (:data:`memo.swap.layout.EXTERNAL`), not the buffer's. Whole layers are the case
``R = 2`` with one unit per layer and one ``k``.

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

from typing import Callable, Optional, Sequence, Union

import torch

from memo.model.placement import Accounting, Placed, RuntimeReport
from memo.swap.capture import Capture, Discover
from memo.swap.host_memory import host_memory, register, unregister
from memo.swap.layout import ALIAS, EXTERNAL, INPUT, TOKENS, LayerLayout, Slot, address, empty_in_layout, same_layout
from memo.swap.streams import Streams
from memo.swap.unit_backward import UnitBackward
from memo.swap.unit_forward import UnitForward, UnitState


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


class SwapRuntime(UnitForward, UnitBackward):
    """Token-wise swapping and recomputation for the layers of one model replica: the
    :class:`memo.model.placement.Placement` of every module of its layers, and (whole layers) their
    :class:`memo.model.placement.LayerRuntime`.

    Args:
        num_units: what swaps: the model's transformer layers (n), or its layers' tiles (n·T).
        streams: compute, D2H and H2D streams (:mod:`memo.swap.streams`).
        device: where the rounding buffers live.
        sequence_chunks: tp under sequence parallelism, else 1.
        segments: segments of a chunk that each keep their first ``k`` tokens: 2 when the layer
            input holds both of a context-parallel rank's chunks, else 1.
        buffers: ``R``, rounding buffers; the last ``R`` units never swap.
        units_per_layer: ``T``, units of one layer (its accounting rows are per layer).
    """

    def __init__(self, num_units: int, streams: Streams, device: torch.device, sequence_chunks: int = 1,
                 segments: int = 1, buffers: int = 2, units_per_layer: int = 1):
        if buffers < 1:
            raise ValueError(f"buffers={buffers}: at least one rounding buffer is needed")
        self.num_units = num_units
        self.buffer_count = buffers
        self.swapped_units = max(num_units - buffers, 0)
        self.units_per_layer = units_per_layer
        self.streams = streams
        self.device = device
        self.sequence_chunks = sequence_chunks
        self.segments = segments
        self.layout: Optional[LayerLayout] = None
        self.keeps: tuple[int, ...] = ()  # k of every unit
        self._region_starts: list[int] = []  # where each swapped unit's region of the slab begins
        self.roles: dict[str, int] = {}  # attention's "q", "k", "v", "out" -> slot
        self.born: dict[int, int] = {}  # request for output memory -> the slot it is made in
        self.buffers: list[torch.Tensor] = []
        self.slab: Optional[torch.Tensor] = None
        self._pinned = False  # the slab is registered with CUDA (cudaHostRegister)
        self.layers: list = []
        self._index: dict[int, int] = {}  # id(layer) -> its place in the model
        self._states: dict[int, UnitState] = {}
        self._buffer_owner: list[Optional[UnitState]] = [None] * buffers
        self._buffer_free: list[object] = [None] * buffers
        self._capture: Optional[Capture] = None
        self._accounting: dict[int, dict[str, int]] = {}
        # what getting it ready decided (memo.swap.prepare.ready_runtime), for the run's records
        self.swap_report = None

    @property
    def swapped_layers(self) -> int:
        """Layers that swap, when the units are whole layers."""
        return self.swapped_units

    @property
    def keep_tokens(self) -> int:
        """The one ``k`` of every unit (whole layers swap the same share)."""
        if len(set(self.keeps)) != 1:
            raise RuntimeError(f"the units keep different numbers of tokens: {sorted(set(self.keeps))}")
        return self.keeps[0]

    # ----------------------------------------------------------------- set-up

    def attach(self, layers: list) -> None:
        """Let ``layers`` (:class:`memo.model.layer.MemoTransformerLayer`, in order) swap here."""
        if len(layers) * self.units_per_layer != self.num_units:
            raise ValueError(f"{len(layers)} layers of {self.units_per_layer} unit(s) each, for {self.num_units} units")
        self.layers = list(layers)
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        for layer in self.layers:
            # every module of the layer that makes a saved tensor (norms, rotary, FC1, GeLU) or
            # runs attention asks this runtime for memory (memo.model.placement)
            for module in layer.modules():
                if isinstance(module, Placed):
                    module.place(self)

    def detach(self) -> None:
        """Give the layers back to Megatron's own forward."""
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Placed):
                    module.place(None)

    def discover(self, layer, kwargs: dict, external_input: bool = False) -> LayerLayout:
        """Run ``layer`` forward once on ``kwargs`` and return the layout of what it saves.

        The input (``kwargs["hidden_states"]``) must require grad, as in training.
        ``external_input``: the caller keeps the input (its slot is EXTERNAL).
        """
        hidden = kwargs["hidden_states"]
        capture = Discover(self, hidden.shape[0], hidden, self._params(layer))
        self._run_captured(layer, kwargs, capture)
        if capture.tokens % self.segments:
            raise ValueError(f"{capture.tokens} tokens cannot be cut into {self.segments} segments")
        if external_input:
            for slot in capture.slots:
                if slot.kind == INPUT:
                    slot.kind = EXTERNAL
        layout = LayerLayout(capture.slots, capture.tokens, self.segments)
        layout.place()
        return layout

    def allocate(self, layout: LayerLayout, keep_tokens: Union[int, Sequence[int]], pin: bool) -> None:
        """Allocate the host slab for ``keep_tokens`` tokens per segment (one ``k`` for every unit,
        or each unit's); the rounding buffers follow on the device at the first forward pass
        (:meth:`ready_buffers`), so that a trace of a step sees them requested.

        Args:
            pin: page-lock the slab (on a GPU); it is registered whole, at its exact size.
        """
        keeps = (keep_tokens,) * self.num_units if isinstance(keep_tokens, int) else tuple(keep_tokens)
        if len(keeps) != self.num_units:
            raise ValueError(f"{len(keeps)} numbers of tokens to keep for {self.num_units} units")
        for k in keeps:
            if not 0 <= k <= layout.segment_tokens:
                raise ValueError(f"keep_tokens={k} outside [0, {layout.segment_tokens}]")
        self.release()
        self.layout, self.keeps = layout, keeps
        starts, total = [], 0
        for u in range(self.swapped_units):
            starts.append(total)
            total += layout.host_bytes(keeps[u])
        self._region_starts = starts
        self.roles = {slot.role: j for j, slot in enumerate(layout.slots) if slot.role}
        self.born = {slot.born: j for j, slot in enumerate(layout.slots) if slot.born is not None}
        self.slab = host_memory(total, torch.uint8, pin)
        if pin and self.slab.numel():
            register(self.slab)
            self._pinned = True

    def release(self) -> None:
        """Give back the buffers and the slab, once the copies in flight are done, unregistering a
        pinned slab, so that a later job in this process can register a slab at the same
        address (idempotent)."""
        if self.buffers:
            self.streams.synchronize()
        if self._pinned:
            unregister(self.slab)
            self._pinned = False
        self.buffers, self.slab = [], None

    def token_order(self, micro_batch: dict) -> dict:
        """A micro-batch as the layers take it: swapping keeps the tokens where they are."""
        return micro_batch

    # ------------------------------------------------------------- accounting

    def ready_buffers(self) -> None:
        """Allocate the rounding buffers on the device, unless they are (idempotent)."""
        if not self.buffers:
            self.buffers = [torch.empty(self.layout.buffer_bytes, dtype=torch.uint8, device=self.device)
                            for _ in range(self.buffer_count)]

    @property
    def rounding_buffer_bytes(self) -> int:
        """Bytes of the rounding buffers, allocated or still to be."""
        return self.buffer_count * self.layout.buffer_bytes

    def accounting(self) -> Accounting:
        """:meth:`take_accounting`'s rows, and the rounding buffers that hold the device's part."""
        return Accounting(tuple(self.take_accounting()), self.rounding_buffer_bytes)

    def report(self) -> RuntimeReport:
        """What getting it ready decided and measured (nothing, before :func:`memo.swap.prepare.ready_runtime`)."""
        return self.swap_report.runtime_report() if self.swap_report is not None else RuntimeReport()

    def name_phases(self, on_phase) -> None:
        """Whole layers have no parts of a pass to name."""

    def device_buffers(self) -> list[torch.Tensor]:
        """The rounding buffers, once the first forward pass made them."""
        return list(self.buffers)

    def device_stores(self) -> list[torch.Tensor]:
        """None: whole layers keep their skeletal tensors in the rounding buffers only."""
        return []

    def take_accounting(self) -> list[dict]:
        """Per-layer bytes since the last call: ``device`` (skeletal bytes the last ``R`` units
        keep in their rounding buffer until their backward), ``host`` (sent to the host) and
        ``recomputed``. The device holds no skeletal bytes outside the buffers."""
        rows = [{"layer": i, **v} for i, v in sorted(self._accounting.items())]
        self._accounting = {}
        return rows

    def account(self, unit: int, key: str, nbytes: int) -> None:
        """Add ``nbytes`` to unit ``unit``'s layer's ``key`` ("device", "host", "recomputed") bytes."""
        entry = self._accounting.setdefault(unit // self.units_per_layer, {"device": 0, "host": 0, "recomputed": 0})
        entry[key] += nbytes

    # ------------------------------------------------- the Placement protocol

    def forward(self, layer, kwargs: dict):
        """Run ``layer``'s forward pass (keyword arguments as Megatron passes them) with swapping."""
        index = self._index[id(layer)]
        output, context = self.forward_unit(index, layer, kwargs)
        return _BackwardStart.apply(output, self, index), context

    def evaluate(self, layer, kwargs: dict):
        """The layer as Megatron runs it: without grad nothing is saved, so nothing is swapped."""
        return layer.run(**kwargs)

    @property
    def capturing(self) -> bool:
        """Whether a unit's pass runs under this runtime now (its forward, discovery or recomputation)."""
        return self._capture is not None

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a token-major tensor a layer's op is about to make (``shape``, ``dtype``):
        its slot of the layer's rounding buffer when the layout says the layer saves it there
        (the op writes it in place and nothing is copied), else new memory.

        The layer's ops ask in the same order in every forward pass; discovery finds which
        request becomes which saved tensor. A recomputation gets new memory: its tokens are
        copied into the dropped rows."""
        if self._capture is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self._capture.output(tuple(shape), dtype, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute: Callable,
                  scale: Optional[float] = None, backend: Optional[str] = None):
        """Core attention under swapping: ``q, k, v`` as the kernel takes them
        (``[b, heads, s, dim]``), ``compute()`` runs the kernel (of ``backend``, softmax scale
        ``scale``) and returns its output."""
        if self._capture is None:
            return compute()
        return self._capture.attention(q, k, v, compute)

    # ---------------------------------------------------------------- the capture

    @staticmethod
    def _params(layer) -> set:
        return {address(p) for p in layer.parameters()}

    def _run_captured(self, layer, kwargs: dict, capture: Capture):
        # Autograd keeps both hooks with every tensor saved under them, until its backward: they
        # are the runtime's, never the capture's, which holds the kernel's outputs only until
        # the pass ends.
        self._capture = capture
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, capture.unpacker()):
                return layer.run(**kwargs)
        finally:
            self._capture = None

    def _pack(self, t: torch.Tensor):
        return self._capture.pack(t)

    # ---------------------------------------------------------------- views

    def slot_tensor(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` of rounding buffer ``b``, token-major."""
        slot = self.layout.slots[j]
        raw = self.buffers[b][slot.offset: slot.offset + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def _saved_view(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` shaped as the tensor its layer saved."""
        slot = self.layout.slots[j]
        if slot.kind == ALIAS:
            flat = self.slot_tensor(b, slot.alias_of).view(-1)
            return flat.as_strided(slot.saved_shape, slot.alias_stride)
        return self.slot_tensor(b, j).movedim(0, slot.token_dim)

    def _saved_tensor(self, b: int, j: int) -> torch.Tensor:
        """Slot ``j`` as its layer saved it, strides included. The buffer keeps tokens first; a
        tensor saved in another layout (attention's log-sum-exp ``[b, heads, s]``, its output with
        a micro-batch of more than one) comes back as a copy in that layout: CUDA's fused attention
        backward kernels take the layout of their forward for granted."""
        view, slot = self._saved_view(b, j), self.layout.slots[j]
        if slot.saved_stride is None or same_layout(view, slot.saved_stride):
            return view
        return empty_in_layout(view, slot.saved_stride).copy_(view)

    def swapped_part(self, state: UnitState, j: int) -> torch.Tensor:
        """The rows of slot ``j`` in unit ``state``'s buffer that the host keeps,
        ``[chunks·segments, k, ...]`` for TOKENS."""
        slot, full = self.layout.slots[j], self.slot_tensor(self.buffer_of(state), j)
        return self.split(full, slot, state.keep)[0] if slot.kind == TOKENS else full

    def split(self, t: torch.Tensor, slot: Slot, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``k`` and the other rows of every segment of every chunk of token-major
        ``t``, as ``[chunks·segments, rows, ...]`` views."""
        runs = t.unflatten(0, (slot.chunks * self.segments, self.layout.segment_tokens))
        return runs[:, :k], runs[:, k:]

    def empty_like_slot(self, role: str) -> torch.Tensor:
        """New device memory shaped as the slot of attention's ``role`` ("out"), token-major."""
        slot = self.layout.slots[self.roles[role]]
        return torch.empty(slot.shape, dtype=slot.dtype, device=self.device)

    def kept_output(self, index: int, staging: torch.Tensor) -> torch.Tensor:
        """Attention's output as unit ``index``'s forward kept it (token-major), for compute: its
        buffer's for a resident unit, else its host copy brought into ``staging`` (after
        compute's earlier reads of it)."""
        j = self.roles["out"]
        if self.resident(index):
            return self.slot_tensor(index % self.buffer_count, j)
        s = self.streams
        s.wait(s.h2d, s.record(s.compute))
        s.copy(s.h2d, staging, self._host_view(index, self.layout.slots[j]))
        s.wait(s.compute, s.record(s.h2d))
        return staging

    def _host_view(self, index: int, slot: Slot) -> torch.Tensor:
        """Slot ``slot``'s part of unit ``index``'s host region."""
        tokens, k = self.layout.segment_tokens, self.keeps[index]
        start = self._region_starts[index] + self.layout.host_offset(slot, k)
        raw = self.slab[start: start + slot.swapped_bytes(k, tokens)]
        if slot.kind == TOKENS:
            return raw.view(slot.dtype).view(slot.chunks * self.segments, k, *slot.shape[1:])
        return raw.view(slot.dtype).view(slot.shape)
