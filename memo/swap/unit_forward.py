"""The forward pass of a unit under MEMO's swapping (:class:`memo.swap.runtime.SwapRuntime`'s):
its saved tensors made in its rounding buffer, its swapped part sent to the host once its forward
is done, on the D2H stream after compute; the buffer's next unit waits for that copy."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from memo.model.placement import check_layer_arguments
from memo.swap.capture import Forward
from memo.swap.layout import BYTELESS
from memo.swap.streams import copy_blocks


@dataclass
class UnitState:
    """One unit's swap (a layer, or a tile of one) in one forward/backward pass."""

    index: int  # the unit: a layer, or i·T + t
    layer: object  # the layer it runs
    keep: int  # k: tokens of each segment of each chunk swapped; the others are recomputed
    kwargs: dict  # the forward's arguments but ``hidden_states``, for recomputation
    # an EXTERNAL input: the unit's input rows, where its caller keeps them for the backward pass
    external_input: Optional[Callable[[], torch.Tensor]] = None
    prefetched: bool = False  # its H2D copy issued (once: an inline stream's event is None)
    arrived: object = None  # event: that copy finished
    ready: bool = False  # prefetched and recomputed: its backward may read the buffer


class UnitForward:
    """:class:`memo.swap.runtime.SwapRuntime`'s forward pass (its state is the runtime's)."""

    def resident(self, index: int) -> bool:
        """Whether unit ``index`` is one of the last ``R``: kept whole in its rounding buffer, never
        sent to the host, brought back or recomputed (its backward follows right after)."""
        return index >= self.swapped_units

    def buffer_of(self, state: UnitState) -> int:
        """The rounding buffer unit ``state`` uses: ``u mod R``."""
        return state.index % self.buffer_count

    def forward_unit(self, index: int, layer, kwargs: dict,
                     external_input: Optional[Callable[[], torch.Tensor]] = None):
        """Run unit ``index``'s forward pass (``layer`` on Megatron's keyword arguments, the unit's
        tokens) with its saved tensors in its rounding buffer, and send its swapped part to the
        host. ``external_input``: where the caller keeps the input rows for the backward pass,
        when the layout's input is EXTERNAL."""
        if self.layout is None:
            raise RuntimeError("SwapRuntime.allocate must run before training")
        self.ready_buffers()
        hidden = kwargs["hidden_states"]
        check_layer_arguments(kwargs, "memo's swapping")
        state = UnitState(index, layer, self.keeps[index], {k: v for k, v in kwargs.items() if k != "hidden_states"},
                          external_input)
        b = self.buffer_of(state)
        # The D2H copy of the buffer's previous unit must be done before it is overwritten.
        self.streams.wait(self.streams.compute, self._buffer_free[b])
        self._buffer_owner[b] = state
        capture = Forward(self, state, hidden.shape[0], hidden, self._params(layer))
        result = self._run_captured(layer, kwargs, capture)
        if capture.cursor != len(self.layout.slots):
            raise RuntimeError(
                f"unit {index} saved {capture.cursor} tensors, its layout has {len(self.layout.slots)}"
            )
        if self.resident(index):
            self.account(index, "device", self.layout.bytes_kept)
        else:
            self._offload(state)
        self._states[index] = state
        return result

    def _offload(self, state: UnitState) -> None:
        s = self.streams
        b = self.buffer_of(state)
        s.wait(s.d2h, s.record(s.compute))
        for j, slot in enumerate(self.layout.slots):
            if slot.kind not in BYTELESS:
                copy_blocks(s, s.d2h, self._host_view(state.index, slot), self.swapped_part(state, j))
        self._buffer_free[b] = s.record(s.d2h)
        self.account(state.index, "host", self.layout.host_bytes(state.keep))
