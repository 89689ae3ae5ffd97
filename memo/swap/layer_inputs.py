"""Under a walk in tiles that swaps, the checkpoint layers' inputs on the host and the device store
a layer's input comes back into for its backward pass."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from memo.swap.host_memory import host_memory, register, unregister
from memo.swap.runtime import SwapRuntime
from memo.swap.streams import Streams


@dataclass
class LayerInputs:
    """Under swapping, the checkpoint layers' inputs on the host (``[layers, rows, b, hidden]``,
    pinned on a GPU) and one device store into which a layer's input comes back for its backward
    pass."""

    host: torch.Tensor
    pinned: bool = False
    store: Optional[torch.Tensor] = None  # made at the first forward pass (:meth:`ready_store`)
    kept: dict = dataclasses.field(default_factory=dict)  # inputs of the resident layers, on the device
    current: Optional[torch.Tensor] = None  # the input of the layer whose backward runs
    staging: Optional[torch.Tensor] = None  # a tile's kept attention output on its way to a chain
    # the input being sent to the host, and the end of its copy: held until compute has waited for
    # that end (at the end of the layer's forward), since an allocator that ignores record_stream
    # (the plan's arena) would hand its memory to compute as soon as the caller frees it
    sending: Optional[tuple[torch.Tensor, object]] = None
    # a checkpoint's input coming into the store ahead of its layer's backward, rows by rows as the
    # layer above frees them: (its index, rows copied so far, the end of the last copy)
    coming: Optional[tuple[int, int, object]] = None

    @classmethod
    def empty(cls, layers: int, x: torch.Tensor, pin: bool) -> "LayerInputs":
        host = host_memory(layers * x.numel(), x.dtype, pin).view(layers, *x.shape)
        if pin and host.numel():
            register(host)
        return cls(host, pin and bool(host.numel()))

    def ready_store(self, x: torch.Tensor) -> None:
        """The device's input store, shaped as layer input ``x``, unless it is (idempotent)."""
        if self.store is None:
            self.store = torch.empty_like(x)

    def ready_staging(self, runtime: SwapRuntime) -> torch.Tensor:
        """Device memory for one tile's kept attention output, made at the first chain."""
        if self.staging is None:
            self.staging = runtime.empty_like_slot("out")
        return self.staging

    def offload(self, index: int, x: torch.Tensor, streams: Streams) -> None:
        """Send checkpoint ``index``'s input ``x`` to the host once compute has made it; ``x`` is
        held until :meth:`sent`, which the layer's forward calls at its end."""
        streams.wait(streams.d2h, streams.record(streams.compute))
        streams.copy(streams.d2h, self.host[index], x)
        self.sending = (x, streams.record(streams.d2h))

    def sent(self, streams: Streams) -> None:
        """Let compute wait for the last input sent to the host, then let that input go."""
        if self.sending is not None:
            streams.wait(streams.compute, self.sending[1])
            self.sending = None

    def prefetch_rows(self, index: int, rows: slice, streams: Streams) -> None:
        """Bring ``rows`` of checkpoint ``index``'s input into the store once compute is done with
        them: the layer above's tile that read them has finished its backward (its tiles go from
        the last, so the rows come in from the end of the sequence). Its copy to the host needs no
        wait (:meth:`reload`)."""
        streams.wait(streams.h2d, streams.record(streams.compute))
        streams.copy(streams.h2d, self.store[rows], self.host[index][rows])
        done = self.coming[1] if self.coming is not None and self.coming[0] == index else 0
        self.coming = (index, done + rows.stop - rows.start, streams.record(streams.h2d))

    def reload(self, index: int, streams: Streams) -> torch.Tensor:
        """Checkpoint ``index``'s input in the store, for compute, once the store's previous
        layer's backward is done: compute waits for its copy, made now or already on its way
        (:meth:`prefetch_rows`). Its copy to the host needs no wait: the layer's first tile swaps
        (else the input would have stayed on the device), and the tile that reused that tile's
        buffer waited for its copy out, which the D2H stream ran after the input's."""
        coming, self.coming = self.coming, None
        if coming is None or coming[:2] != (index, self.store.shape[0]):  # (the H2D stream runs any part after)
            streams.wait(streams.h2d, streams.record(streams.compute))
            streams.copy(streams.h2d, self.store, self.host[index])
            coming = (index, self.store.shape[0], streams.record(streams.h2d))
        streams.wait(streams.compute, coming[2])
        self.current = self.store
        return self.store

    def release(self) -> None:
        self.kept.clear()
        self.current = self.sending = self.coming = None
        if self.pinned:
            unregister(self.host)
            self.pinned = False
