"""The three streams of MEMO's swapping: compute, device-to-host (D2H) and host-to-device (H2D).

Every hand-over between them goes through an event recorded on one stream and waited on by
another, with the stream named explicitly. Nothing here calls ``wait_stream`` or reads
``current_stream()`` inside a ``torch.cuda.stream`` block: the compute stream is captured once,
at construction, so a wait can never silently land on the wrong stream.

* :class:`CudaStreams`: real CUDA streams and events; copies are asynchronous.
* :class:`InlineStreams`: the host has one "stream"; every copy happens at once and events
  are already complete, so the same runtime code runs on the CPU.
* :class:`DeferredStreams`: copies on the side streams run as late as the events allow, only
  when someone waits for them. A missing wait then shows up as wrong data on the CPU, which is
  how the tests check the runtime's ordering.
"""

from typing import Optional, Protocol

import torch


class Streams(Protocol):
    """What the swap runtime needs: named streams, events between them, and copies on them."""

    compute: object
    d2h: object
    h2d: object

    def record(self, stream) -> object:
        """An event marking all work issued on ``stream`` so far."""
        ...

    def wait(self, stream, event: Optional[object]) -> None:
        """Make later work on ``stream`` wait for ``event`` (``None``: nothing to wait for)."""
        ...

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` as work of ``stream``."""
        ...

    def synchronize(self) -> None:
        """Block until every stream's work is done."""
        ...


class CudaStreams:
    """A compute, a D2H and an H2D stream on one GPU."""

    def __init__(self, device: torch.device):
        self.compute = torch.cuda.current_stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def record(self, stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The tensors on both ends are the pre-allocated rounding buffers and pinned slab,
        # alive for the whole run, so no record_stream bookkeeping is needed.
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        for stream in (self.compute, self.d2h, self.h2d):
            stream.synchronize()


class InlineStreams:
    """The CPU: one timeline, copies done when issued."""

    compute, d2h, h2d = "compute", "d2h", "h2d"

    def record(self, stream) -> None:
        return None

    def wait(self, stream, event) -> None:
        return None

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        return None


class DeferredStreams:
    """Side-stream copies postponed until an event covering them is waited on.

    Compute work runs immediately (it is the Python caller). A copy issued on the D2H or H2D
    stream is queued, and the queue runs up to an event only when a wait names that event, so
    any copy the runtime forgot to wait for reads or lands at the wrong moment.
    """

    compute, d2h, h2d = "compute", "d2h", "h2d"

    def __init__(self):
        self._queues = {self.d2h: [], self.h2d: []}
        self._done = {self.d2h: 0, self.h2d: 0}
        self.copies_run = 0

    def record(self, stream):
        if stream == self.compute:
            return None  # compute work is already done when recorded
        return (stream, self._done[stream] + len(self._queues[stream]))

    def wait(self, stream, event) -> None:
        # Waiting orders the waiter after the event; on the CPU that means running the
        # event's queued copies now (compute is always done, so waiting on it is free).
        if event is not None:
            self._run(*event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream == self.compute:
            dst.copy_(src)
        else:
            self._queues[stream].append((dst, src))

    def _run(self, stream, upto: int) -> None:
        queue = self._queues[stream]
        while self._done[stream] < upto:
            dst, src = queue.pop(0)
            dst.copy_(src)
            self._done[stream] += 1
            self.copies_run += 1

    def synchronize(self) -> None:
        for stream, queue in self._queues.items():
            self._run(stream, self._done[stream] + len(queue))


def streams_for(device: torch.device) -> Streams:
    """Real streams on a GPU, inline copies on the CPU."""
    return CudaStreams(device) if device.type == "cuda" else InlineStreams()
