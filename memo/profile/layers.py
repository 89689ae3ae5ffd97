"""What a trace says about each transformer layer: skeletal and transient bytes, and whether
all layers allocate alike.

For layer i, a request is

* *skeletal* if it is created in a forward phase and freed in layer i's backward: it was kept
  for that backward (the layer's input, made by the layer before, is one of them);
* *transient* if it is created and freed within layer i's forward, or within its backward.

Everything else crosses phases (a gradient handed to the layer below, say) and is planned at
the level of the whole iteration.
"""

from dataclasses import dataclass
from typing import Optional

from memo.dsa.buffers import Buffer, max_load
from memo.profile.trace import Event, Request, Trace, forward_block_phase, layer_phase, phase_layers


class LayerMismatchError(ValueError):
    """Two transformer layers of one trace allocate differently."""


@dataclass(frozen=True)
class LayerBytes:
    """One layer's activation requests, in bytes."""

    layer: int
    skeletal: int  # created in a forward phase, freed in this layer's backward
    skeletal_requests: int
    transient_forward: int  # all bytes requested and freed within the forward
    transient_backward: int
    transient_forward_peak: int  # most of them alive at once (the level-1 lower bound)
    transient_backward_peak: int


def transient_events(trace: Trace, phase: str) -> list[Event]:
    """The events of the requests made and freed within ``phase``, in trace order."""
    made = {e.id for e in trace.events if e.op == "malloc" and e.phase == phase}
    freed = {e.id for e in trace.events if e.op == "free" and e.phase == phase}
    return [e for e in trace.events if e.id in made & freed]


def transient_buffers(trace: Trace, phase: str, requests: Optional[list[Request]] = None) -> list[Buffer]:
    """Requests made and freed within ``phase``, as DSA buffers in trace positions."""
    requests = trace.requests() if requests is None else requests
    return [Buffer(str(r.id), r.lower, r.upper, r.size) for r in requests
            if r.malloc_phase == phase and r.free_phase == phase]


def layer_bytes(trace: Trace, layer: int, requests: Optional[list[Request]] = None) -> LayerBytes:
    """Skeletal and transient bytes of ``layer`` in ``trace``."""
    requests = trace.requests() if requests is None else requests
    backward = layer_phase(layer, "bwd")
    skeletal = [r for r in requests if r.free_phase == backward and forward_block_phase(r.malloc_phase)]
    forward_buffers = transient_buffers(trace, layer_phase(layer, "fwd"), requests)
    backward_buffers = transient_buffers(trace, backward, requests)
    return LayerBytes(
        layer=layer,
        skeletal=sum(r.size for r in skeletal),
        skeletal_requests=len(skeletal),
        transient_forward=sum(b.size for b in forward_buffers),
        transient_backward=sum(b.size for b in backward_buffers),
        transient_forward_peak=max_load(forward_buffers),
        transient_backward_peak=max_load(backward_buffers),
    )


def _relative(phase: str, layer: int) -> str:
    """``phase`` named relative to ``layer``: ``layer.+1.bwd`` is the next layer's backward."""
    parts = phase.split(".")
    if parts[0] != "layer":
        return phase
    return f"layer.{int(parts[1]) - layer:+d}.{parts[2]}"


def layer_signature(trace: Trace, layer: int, direction: str, requests: list[Request],
                    ranks: dict[int, int]) -> list[tuple]:
    """The events of one layer's phase with request ids replaced by where they come from:
    (op, bytes, phase of the malloc relative to ``layer``, its rank among that phase's mallocs);
    ``ranks`` is :meth:`Trace.malloc_ranks`."""
    by_id = {r.id: r for r in requests}
    phase = layer_phase(layer, direction)
    return [(e.op, e.size, _relative(by_id[e.id].malloc_phase, layer), ranks[e.id])
            for e in trace.events if e.phase == phase]


def check_identical_layers(trace: Trace, requests: Optional[list[Request]] = None) -> list[int]:
    """Prove that every inner layer (all but the first and last, whose neighbours are the
    embedding and the head) has the same forward and backward event sequence as the second.

    Returns:
        The layers compared.

    Raises:
        LayerMismatchError: naming the first layer and event that differ, or if the trace has
            fewer than four layers (no two inner layers to compare).
    """
    requests = trace.requests() if requests is None else requests
    layers = phase_layers(trace.phases)
    inner = layers[1:-1]
    if len(inner) < 2:
        raise LayerMismatchError(f"the trace has {len(layers)} layer(s); four or more are needed "
                                 "to compare two inner layers")
    ranks = trace.malloc_ranks()
    for direction in ("fwd", "bwd"):
        reference = layer_signature(trace, inner[0], direction, requests, ranks)
        for layer in inner[1:]:
            other = layer_signature(trace, layer, direction, requests, ranks)
            if other != reference:
                at = next((k for k, (a, b) in enumerate(zip(reference, other)) if a != b),
                          min(len(reference), len(other)))
                seen = other[at] if at < len(other) else "nothing"
                wanted = reference[at] if at < len(reference) else "nothing"
                raise LayerMismatchError(
                    f"{layer_phase(layer, direction)} differs from {layer_phase(inner[0], direction)} "
                    f"at event {at}: {seen} instead of {wanted}"
                )
    return inner
