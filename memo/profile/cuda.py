"""The ``cuda`` back-end: the caching allocator's own request stream, with phases.

PyTorch's allocator records every request when memory history is on
(``torch.cuda.memory._record_memory_history``): ``alloc`` (bytes asked for) and
``free_requested`` entries are the program's requests; segment and ``free_completed`` entries are
the allocator's own business and are left out. Phases are marked in that same stream: at every
phase change a one-byte tensor is made and dropped on a stream used for nothing else, so its
entries are recognised by their stream alone, wherever they fall, and cost no real memory.
"""

import itertools
from typing import Callable

import torch

from memo.profile.recorder import PhaseMarker
from memo.profile.trace import Event

MAX_ENTRIES = 10_000_000  # trace entries kept; one 65b iteration makes about 40 000


def events_from_allocator_trace(entries: list[dict], phases: list[str], marker_stream: int) -> list[Event]:
    """Events of a snapshot's device trace; marker allocations on ``marker_stream`` switch to the
    next of ``phases``. Blocks freed but made before recording began are not requests.

    Raises:
        ValueError: if the trace holds an out-of-memory entry or lost some markers (the history
            was too short).
    """
    events, ids, phase, k, new_id = [], {}, "setup", 0, itertools.count()
    for entry in entries:
        action = entry["action"]
        if action == "oom":
            raise ValueError(f"the traced iteration ran out of memory asking for {entry['size']} bytes")
        if entry.get("stream") == marker_stream:
            if action == "alloc":
                phase, k = phases[k], k + 1
            continue
        if action == "alloc":
            ids[entry["addr"]] = next(new_id)
            events.append(Event("malloc", ids[entry["addr"]], entry["size"], phase))
        elif action == "free_requested" and entry["addr"] in ids:
            events.append(Event("free", ids.pop(entry["addr"]), entry["size"], phase))
    if k != len(phases):
        raise ValueError(f"the allocator trace holds {k} of {len(phases)} phase markers; it was cut short")
    return events


def record_cuda_iteration(
    gpt: torch.nn.Module, run: Callable[[PhaseMarker], None]
) -> tuple[list[Event], dict]:
    """Run ``run(marker)`` (one iteration of ``gpt``) with memory history on.

    Returns:
        The events and the allocator's own figures for the iteration (bytes): peak allocated and
        reserved, and the number of allocation retries.
    """
    stream = torch.cuda.Stream()
    phases: list[str] = []

    def mark(phase: str) -> None:
        phases.append(phase)
        with torch.cuda.stream(stream):
            torch.empty(1, dtype=torch.uint8, device="cuda")

    marker = PhaseMarker(gpt, mark)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=MAX_ENTRIES,
                                             clear_history=True)
    try:
        run(marker)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
        marker.remove()
    after = torch.cuda.memory_stats()
    entries = snapshot["device_traces"][torch.cuda.current_device()]
    figures = {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "reserved_before": before.get("reserved_bytes.all.current", 0),
        "num_alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
    }
    return events_from_allocator_trace(entries, phases, stream.cuda_stream), figures
