"""Offline dynamic storage allocation (DSA): the problem, plans, their validation and bounds.

A buffer lives over the half-open interval of instants ``[lower, upper)`` and needs ``size``
bytes. A plan gives every buffer an offset so that two buffers alive at a common instant never
share a byte; its peak is ``max(offset + size)``. The files are the CSV format of MiniMalloc and
idealloc (``id,lower,upper,size``, plus ``offset`` for a plan), so other DSA tools read ours.

The validator here shares no code with any solver: every plan is checked against it.
"""

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from memo.results import create_file_atomic


class PlanError(ValueError):
    """A plan that places two live buffers on common bytes, or off the arena."""


@dataclass(frozen=True)
class Buffer:
    """One allocation: alive over instants ``[lower, upper)``, ``size`` bytes."""

    id: str
    lower: int
    upper: int
    size: int

    def overlaps(self, other: "Buffer") -> bool:
        """Whether both are alive at some common instant."""
        return self.lower < other.upper and other.lower < self.upper


def check_buffers(buffers: Sequence[Buffer]) -> None:
    """Raise ``ValueError`` naming the first buffer with an empty lifetime, a negative size or a
    repeated id."""
    seen = set()
    for b in buffers:
        if b.upper <= b.lower or b.size < 0:
            raise ValueError(f"buffer {b.id}: needs lower < upper and size >= 0, got {b}")
        if b.id in seen:
            raise ValueError(f"buffer id {b.id} appears twice")
        seen.add(b.id)


def read_buffers(path: Path) -> list[Buffer]:
    """Buffers of a CSV file with the header ``id,lower,upper,size`` (other columns ignored).

    Raises:
        ValueError: naming the file and line of the first row that is not a buffer.
    """
    return _read(path)[0]


def _read(path: Path, offsets: bool = False) -> tuple[list[Buffer], list[int]]:
    """The buffers of ``path`` and, if ``offsets``, its ``offset`` column (else an empty list)."""
    columns = {"id", "lower", "upper", "size", *(["offset"] if offsets else [])}
    buffers, placed = [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            missing = columns - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: the header lacks {', '.join(sorted(missing))}")
            for line, row in enumerate(reader, start=2):
                try:
                    buffers.append(Buffer(row["id"], int(row["lower"]), int(row["upper"]), int(row["size"])))
                    if offsets:
                        placed.append(int(row["offset"]))
                except (TypeError, ValueError) as error:
                    raise ValueError(f"{path}:{line}: not a buffer ({error})") from None
        except (csv.Error, UnicodeDecodeError) as error:
            raise ValueError(f"{path}:{reader.line_num + 1}: not CSV text ({error})") from None
    try:
        check_buffers(buffers)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return buffers, placed


def write_plan(path: Path, buffers: Sequence[Buffer], offsets: Sequence[int]) -> None:
    """Write ``id,lower,upper,size,offset`` rows atomically; an existing file is never replaced.

    Raises:
        FileExistsError: if ``path`` exists.
    """
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "lower", "upper", "size", "offset"])
    writer.writerows((b.id, b.lower, b.upper, b.size, o) for b, o in zip(buffers, offsets, strict=True))
    create_file_atomic(path, out.getvalue())


def read_plan(path: Path) -> tuple[list[Buffer], list[int]]:
    """Buffers and offsets of a file written by :func:`write_plan`, read once."""
    return _read(path, offsets=True)


def max_load(buffers: Sequence[Buffer]) -> int:
    """The largest number of bytes alive at one instant: a lower bound on any plan's peak."""
    events = sorted([(b.lower, b.size) for b in buffers] + [(b.upper, -b.size) for b in buffers])
    load = best = 0
    for _, delta in events:  # at equal instants frees (negative) sort first: [lower, upper)
        load += delta
        best = max(best, load)
    return best


def validate(buffers: Sequence[Buffer], offsets: Sequence[int], capacity: int | None = None) -> int:
    """Check a plan and return its peak in bytes.

    Raises:
        PlanError: naming two buffers that are alive together and share bytes, a negative
            offset, or a peak above ``capacity``.
    """
    if len(offsets) != len(buffers):
        raise PlanError(f"{len(offsets)} offsets for {len(buffers)} buffers")
    if not buffers:
        return 0
    lower = np.array([b.lower for b in buffers], dtype=np.int64)
    upper = np.array([b.upper for b in buffers], dtype=np.int64)
    size = np.array([b.size for b in buffers], dtype=np.int64)
    start = np.array(offsets, dtype=np.int64)
    if (start < 0).any():
        i = int(np.argmax(start < 0))
        raise PlanError(f"buffer {buffers[i].id} has a negative offset {offsets[i]}")
    end = start + size
    live = size > 0  # an empty buffer occupies no byte
    for i in range(len(buffers)):
        if not live[i]:
            continue
        clash = (
            live[i + 1:]
            & (lower[i] < upper[i + 1:]) & (lower[i + 1:] < upper[i])
            & (start[i] < end[i + 1:]) & (start[i + 1:] < end[i])
        )
        if clash.any():
            j = i + 1 + int(np.argmax(clash))
            raise PlanError(
                f"buffers {buffers[i].id} and {buffers[j].id} are alive together and share bytes "
                f"[{max(start[i], start[j])}, {min(end[i], end[j])})"
            )
    peak = int(end.max())
    if capacity is not None and peak > capacity:
        raise PlanError(f"the plan's peak {peak} exceeds the capacity {capacity}")
    return peak
