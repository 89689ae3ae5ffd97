"""The three streams of MEMO's swapping: compute, device-to-host (D2H) and host-to-device (H2D).

Every hand-over between them goes through an event recorded on one stream and waited on by
another, with the stream named explicitly. Nothing here calls ``wait_stream`` or reads
``current_stream()`` inside a ``torch.cuda.stream`` block: the compute stream is captured once,
at construction, so a wait can never silently land on the wrong stream.

* :class:`CudaStreams`: real CUDA streams and events; copies are asynchronous.
* :class:`InlineStreams`: the host has one "stream"; every copy happens at once and events
  are already complete, so the same runtime code runs on the CPU.
* :class:`DeferredStreams`: copies on the side streams run as late as the events allow, only
  when someone waits for them, and must be ordered after the compute work before them. A
  missing wait then shows up as wrong data or an :class:`OrderingError` on the CPU, which is how
  the tests check the runtime's ordering.
* :class:`CountedStreams`: any of them, with the bytes copied each way counted.
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
        # A device tensor on either end may be freed by its owner before the copy has run (a
        # layer input sent to the host, which the next layer drops): the allocator must not hand
        # its memory to compute until this stream is past the copy.
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)
        with torch.cuda.stream(stream), torch.no_grad():  # a copy is never part of a graph
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
        with torch.no_grad():
            dst.copy_(src)

    def synchronize(self) -> None:
        return None


class OrderingError(RuntimeError):
    """A copy on a side stream that nothing orders after the compute work it depends on."""


class DeferredStreams:
    """Side-stream copies postponed until an event covering them is waited on, and checked to be
    ordered after compute.

    Compute work runs immediately (it is the Python caller). A copy issued on the D2H or H2D
    stream is queued, and the queue runs up to an event only when a wait names that event, so
    any copy the runtime forgot to wait for reads or lands at the wrong moment.

    On a GPU a side stream's copy may also run *before* compute work issued earlier on the
    compute stream (reading a buffer not yet written, or overwriting one still being read),
    unless the side stream waits for an event recorded on compute after that work. On the CPU
    that work is already done, so no data can show the mistake; instead every side-stream copy
    must be issued after its stream waited for the compute event recorded last, or
    :class:`OrderingError` is raised. A wait on another side stream's event passes on what
    that stream had waited for by then.
    """

    compute, d2h, h2d = "compute", "d2h", "h2d"

    def __init__(self):
        self._queues = {self.d2h: [], self.h2d: []}
        self._done = {self.d2h: 0, self.h2d: 0}
        self._records = 0  # events recorded on compute so far
        self._ordered = {self.d2h: 0, self.h2d: 0}  # the latest compute event each side stream waited for
        self.copies_run = 0

    def record(self, stream):
        if stream == self.compute:
            self._records += 1
            return (self.compute, self._records)
        return (stream, self._done[stream] + len(self._queues[stream]), self._ordered[stream])

    def wait(self, stream, event) -> None:
        if event is None:
            return
        if event[0] == self.compute:
            if stream != self.compute:
                self._ordered[stream] = max(self._ordered[stream], event[1])
            return
        # Waiting orders the waiter after the event; on the CPU that means running the event's
        # queued copies now.
        self._run(*event[:2])
        if stream != self.compute:
            self._ordered[stream] = max(self._ordered[stream], event[2])

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream == self.compute:
            with torch.no_grad():
                dst.copy_(src)
            return
        if self._records == 0 or self._ordered[stream] < self._records:
            raise OrderingError(f"a copy on the {stream} stream was issued without waiting for the compute "
                                "work before it (an event recorded on compute after that work)")
        self._queues[stream].append((dst, src))

    def _run(self, stream, upto: int) -> None:
        queue = self._queues[stream]
        while self._done[stream] < upto:
            dst, src = queue.pop(0)
            with torch.no_grad():
                dst.copy_(src)
            self._done[stream] += 1
            self.copies_run += 1

    def synchronize(self) -> None:
        for stream, queue in self._queues.items():
            self._run(stream, self._done[stream] + len(queue))


class CountedStreams:
    """Another :class:`Streams`, with the bytes it copies each way counted (``copied[d2h]``,
    ``copied[h2d]``; copies on compute, within the device, under ``copied[compute]``)."""

    def __init__(self, streams: Streams):
        self.inner = streams
        self.compute, self.d2h, self.h2d = streams.compute, streams.d2h, streams.h2d
        self.copied = {self.compute: 0, self.d2h: 0, self.h2d: 0}

    def record(self, stream):
        return self.inner.record(stream)

    def wait(self, stream, event) -> None:
        self.inner.wait(stream, event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copied[stream] += src.numel() * src.element_size()
        self.inner.copy(stream, dst, src)

    def synchronize(self) -> None:
        self.inner.synchronize()


def streams_for(device: torch.device) -> Streams:
    """Real streams on a GPU, inline copies on the CPU."""
    return CudaStreams(device) if device.type == "cuda" else InlineStreams()


def copy_blocks(streams: Streams, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
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
