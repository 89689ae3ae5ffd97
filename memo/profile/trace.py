"""One training iteration's allocation requests: ``malloc id size`` / ``free id`` events.

An event's position in the trace is its instant; a request lives over ``[malloc, free)``, so a
trace is also a DSA instance (:meth:`Trace.buffers`). Every event carries the phase of the
iteration it happened in: ``embedding.fwd``, ``layer.<i>.fwd``, ``head.fwd`` (final norm and
output layer; empty under the tiled loss, which does both in its tiles), ``loss.fwd``, then
``loss.bwd``, ``head.bwd``, ``layer.<i>.bwd`` from the last layer to the first, ``embedding.bwd``
and ``optimizer``. A layer walked in tiles (:mod:`memo.swap.tiled_layer`) names its parts:
``layer.<i>.fwd.t<t>`` per tile, then in the backward pass ``layer.<i>.rebuild`` and
``layer.<i>.bwd.t<t>`` from the last tile to the first; within a tile, each block of its attention
is ``<tile phase>.b<j>`` (forward kernels) or ``.db<j>`` (backward kernels), back to the tile's
phase once its blocks are done. A request still alive at the end of the
iteration (gradients, say) lives until the trace's last instant.

On disk a trace is a CSV with one row per request, ``id,lower,upper,size,malloc_phase,free_phase``
(``free_phase`` empty when it outlives the iteration), so DSA tools that read MiniMalloc's
``id,lower,upper,size`` read it as is; a JSON file beside it keeps what was traced.
"""

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from memo.dsa.buffers import Buffer
from memo.results import create_file_atomic

@dataclass(frozen=True)
class Event:
    """A request (``op="malloc"``) or its release (``op="free"``, same ``size``), in bytes."""

    op: str
    id: int
    size: int
    phase: str


@dataclass(frozen=True)
class Request:
    """One allocation of a trace: alive over event positions ``[lower, upper)``, ``size`` bytes."""

    id: int
    lower: int
    upper: int
    size: int
    malloc_phase: str
    free_phase: Optional[str]  # None: alive at the end of the iteration


@dataclass
class Trace:
    """The events of one iteration and what produced them (model, tokens, ranks, back-end)."""

    events: list[Event]
    meta: dict = field(default_factory=dict)

    @property
    def phases(self) -> list[str]:
        """Phase names in the order they first occur."""
        return list(dict.fromkeys(e.phase for e in self.events))

    def requests(self) -> list[Request]:
        """Every malloc with the position of its free (or the end of the trace).

        Raises:
            ValueError: on a free without its malloc or a malloc of a live id, naming the event.
        """
        open_: dict[int, tuple[int, Event]] = {}
        done = []
        for position, event in enumerate(self.events):
            if event.op == "malloc":
                if event.id in open_:
                    raise ValueError(f"event {position}: malloc of id {event.id}, which is already live")
                open_[event.id] = (position, event)
            elif event.op == "free":
                if event.id not in open_:
                    raise ValueError(f"event {position}: free of id {event.id}, which is not live")
                start, malloc = open_.pop(event.id)
                done.append(Request(event.id, start, position, malloc.size, malloc.phase, event.phase))
            else:
                raise ValueError(f"event {position}: op {event.op!r} is neither malloc nor free")
        end = max(len(self.events), 1)
        done.extend(Request(e.id, start, end, e.size, e.phase, None) for start, e in open_.values())
        return sorted(done, key=lambda r: r.lower)

    def buffers(self) -> list[Buffer]:
        """The requests as a DSA instance (ids as strings)."""
        return [Buffer(str(r.id), r.lower, r.upper, r.size) for r in self.requests()]

    def phase_spans(self) -> dict[str, tuple[int, int]]:
        """Event positions ``[first, last + 1)`` of every phase."""
        spans: dict[str, tuple[int, int]] = {}
        for position, event in enumerate(self.events):
            first = spans.get(event.phase, (position, position))[0]
            spans[event.phase] = (first, position + 1)
        return spans

    def malloc_ranks(self) -> dict[int, int]:
        """Each request's rank among the mallocs of its phase (0 for the first), by request id:
        how a plan names a request, and how the runtime will recognise it."""
        ranks, counts = {}, {}
        for event in self.events:
            if event.op == "malloc":
                ranks[event.id] = counts.get(event.phase, 0)
                counts[event.phase] = ranks[event.id] + 1
        return ranks


def write_trace(path: Path, trace: Trace) -> None:
    """Write ``path`` (the request CSV) and ``path`` with suffix ``.json`` (meta), atomically.

    Raises:
        FileExistsError: if either file exists; nothing is replaced.
    """
    path = Path(path)
    meta_path = path.with_suffix(".json")
    if meta_path.exists():
        raise FileExistsError(f"{meta_path} exists and is kept; choose another path")
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "lower", "upper", "size", "malloc_phase", "free_phase"])
    for r in trace.requests():
        writer.writerow([r.id, r.lower, r.upper, r.size, r.malloc_phase, r.free_phase or ""])
    create_file_atomic(path, out.getvalue())
    create_file_atomic(meta_path, json.dumps({**trace.meta, "events": len(trace.events)}, indent=1) + "\n")


def read_trace(path: Path) -> Trace:
    """The trace written by :func:`write_trace` (events rebuilt from the requests).

    Raises:
        ValueError: naming the file and line of a row that is not a request.
    """
    path = Path(path)
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            columns = {"id", "lower", "upper", "size", "malloc_phase", "free_phase"}
            missing = columns - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: not a trace, the header lacks {', '.join(sorted(missing))}")
            for line, row in enumerate(reader, start=2):
                try:
                    rows.append(Request(int(row["id"]), int(row["lower"]), int(row["upper"]),
                                        int(row["size"]), row["malloc_phase"], row["free_phase"] or None))
                except (TypeError, ValueError) as error:
                    raise ValueError(f"{path}:{line}: not a request ({error})") from None
        except (csv.Error, UnicodeDecodeError) as error:
            raise ValueError(f"{path}:{reader.line_num + 1}: not CSV text ({error})") from None
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        return Trace(events_of(rows, meta.pop("events", None)), meta)
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{path}: {error}") from None


def events_of(requests: Iterable[Request], length: Optional[int] = None) -> list[Event]:
    """The event sequence of ``requests`` (positions must be distinct, as in a real trace).

    Raises:
        ValueError: if two events claim the same position or a request ends before it starts.
    """
    slots: dict[int, Event] = {}
    end = 0
    for r in requests:
        if r.upper <= r.lower:
            raise ValueError(f"request {r.id}: upper {r.upper} is not after lower {r.lower}")
        places = [(r.lower, Event("malloc", r.id, r.size, r.malloc_phase))]
        if r.free_phase is not None:
            places.append((r.upper, Event("free", r.id, r.size, r.free_phase)))
        for position, event in places:
            if position in slots:
                raise ValueError(f"request {r.id}: position {position} is taken by request "
                                 f"{slots[position].id}")
            slots[position] = event
        end = max(end, r.upper)
    if length is not None and end > length:
        raise ValueError(f"a request ends at {end}, past the trace's {length} events")
    return [slots[p] for p in sorted(slots)]


def layer_phase(layer: int, direction: str) -> str:
    """The phase name of one layer's forward (``"fwd"``) or backward (``"bwd"``) pass."""
    return f"layer.{layer}.{direction}"


EMBEDDING_LOOKUP = "embedding.fwd.lookup"  # the word embedding's lookup, within embedding.fwd


def forward_block_phase(phase: str) -> bool:
    """Whether ``phase`` is a block's own forward (``embedding.fwd``, ``layer.<i>.fwd``, the
    embedding's lookup), where what a layer keeps for its backward is made."""
    return phase.endswith(".fwd") or phase == EMBEDDING_LOOKUP


def phase_layers(phases: Sequence[str]) -> list[int]:
    """Layer numbers that have a forward phase, ascending."""
    return sorted({int(p.split(".")[1]) for p in phases if p.startswith("layer.") and p.endswith(".fwd")})
