"""The backward pass of a unit under MEMO's swapping (:class:`memo.swap.runtime.SwapRuntime`'s): as
unit ``u``'s backward begins, unit ``u − R + 1``'s swapped part comes back into its buffer on the
H2D stream; unit ``u`` waits for its own, and recomputes its dropped tokens from its input and
attention's kept output, filling the buffer's rows its backward then reads."""

import torch

from memo.swap.capture import Replay
from memo.swap.layout import ALIAS, BYTELESS, EXTERNAL, INPUT, tail_rows
from memo.swap.streams import copy_blocks
from memo.swap.unit_forward import UnitState


class _ReplayDone(Exception):
    """Raised inside a replay once every tensor the backward needs has been recomputed."""


class UnitBackward:
    """:class:`memo.swap.runtime.SwapRuntime`'s backward pass (its state is the runtime's)."""

    def saved(self, handle) -> torch.Tensor:
        """The tensor a forward's pack handle ``(state, slot)`` stands for, for the backward pass."""
        if isinstance(handle, torch.Tensor):
            return handle
        state, j = handle
        if not state.ready or self._buffer_owner[self.buffer_of(state)] is not state:
            raise RuntimeError(
                f"unit {state.index}'s activations were read before they were reloaded"
            )
        if self.layout.slots[j].kind == EXTERNAL:
            return state.external_input()
        return self._saved_tensor(self.buffer_of(state), j)

    def backward_started(self, index: int) -> None:
        """Called as unit ``index``'s backward pass begins (unit ``index + 1``'s is done, and its
        buffer free: unit ``index − R + 1``'s prefetch goes into it)."""
        s = self.streams
        released = s.record(s.compute)
        ahead = index - (self.buffer_count - 1)
        if 0 <= ahead < self.swapped_units and ahead != index:
            self._prefetch(self._states[ahead], released)
        state = self._states.pop(index)
        if not self.resident(index):
            if not state.prefetched:
                self._prefetch(state, released)
            s.wait(s.compute, state.arrived)
            if state.keep < self.layout.segment_tokens:
                self._recompute(state)
        state.ready = True

    def _prefetch(self, state: UnitState, released: object) -> None:
        s = self.streams
        b = self.buffer_of(state)
        # The buffer's previous unit finished its backward. This unit's own D2H needs no wait:
        # unit u + R waited for it before writing the same buffer, and compute, which ``released``
        # follows, waited for unit u + R (every swapped unit has one: the last R are resident).
        s.wait(s.h2d, released)
        self._buffer_owner[b] = state
        for j, slot in enumerate(self.layout.slots):
            if slot.kind not in BYTELESS:
                copy_blocks(s, s.h2d, self.swapped_part(state, j), self._host_view(state.index, slot))
        state.prefetched, state.arrived = True, s.record(s.h2d)

    def input_of(self, state: UnitState) -> torch.Tensor:
        """Unit ``state``'s input, as its backward pass reads it: its buffer's or its caller's."""
        j = next(j for j, slot in enumerate(self.layout.slots) if slot.kind in (INPUT, EXTERNAL))
        if self.layout.slots[j].kind == EXTERNAL:
            return state.external_input()
        return self.slot_tensor(self.buffer_of(state), j)

    def _recompute(self, state: UnitState) -> None:
        layout, k = self.layout, state.keep
        hidden = tail_rows(self.input_of(state), self.segments, k).detach().requires_grad_(True)
        kwargs = dict(state.kwargs, hidden_states=hidden)
        rope = kwargs.get("rotary_pos_emb")
        if rope is not None:
            kwargs["rotary_pos_emb"] = tail_rows(rope, self.sequence_chunks * self.segments, k)
        layer = state.layer
        outer = [j for j, s in enumerate(layout.slots) if s.role is None]
        capture = Replay(self, state, layout.tokens, hidden, self._params(layer), outer)

        def last_saved(_module, inputs) -> None:
            # The backward needs what the layer saves, the last of which is FC2's input: the
            # replay ends there, without FC2's GEMM, its reduce-scatter and the residual.
            if capture.last_saved(inputs[0]):
                raise _ReplayDone

        stop = layer.mlp.linear_fc2.register_forward_pre_hook(last_saved)
        try:
            with torch.enable_grad():
                self._run_captured(layer, kwargs, capture)
        except _ReplayDone:
            pass
        finally:
            stop.remove()
        if capture.cursor != len(outer):
            raise RuntimeError(f"recomputing unit {state.index} saved {capture.cursor} of {len(outer)} tensors")

    def fill(self, state: UnitState, j: int, t: torch.Tensor) -> None:
        """Write unit ``state``'s recomputed tokens ``t`` into the dropped rows of slot ``j``."""
        slot = self.layout.slots[j]
        if slot.kind in (INPUT, ALIAS, EXTERNAL):
            return  # kept whole on the host or by the caller, nothing to recompute
        token_major = t.movedim(slot.token_dim, 0)
        dropped = slot.chunks * self.segments * (self.layout.segment_tokens - state.keep)
        rest = slot.shape[1:]
        if tuple(token_major.shape) != (dropped, *rest) or token_major.dtype != slot.dtype:
            raise RuntimeError(
                f"recomputing unit {state.index} gave {tuple(token_major.shape)} for slot {j}, "
                f"expected {(dropped, *rest)}"
            )
        _, tail = self.split(self.slot_tensor(self.buffer_of(state), j), slot, state.keep)
        tail.copy_(token_major.reshape(tail.shape))
        self.account(state.index, "recomputed", token_major.numel() * token_major.element_size())
