"""Peak memory of the current process over a window of a run.

On CUDA: the caching allocator's peak allocated and reserved bytes and its retries (each retry
is a cudaFree of cached blocks followed by a new cudaMalloc: the fragmentation the memory plan
removes). On the CPU: the peak resident set size (VmHWM), which Linux lets a process reset.
"""

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm_bytes() -> int:
    match = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    return int(match.group(1)) * 1024


class PeakMemory:
    """Peak memory since the last :meth:`reset`, for ``device_type`` "cuda" or "cpu"; on a GPU
    whose allocator is the plan's (``arena``, a :class:`memo.plan.cuda_arena.ArenaAllocator`),
    that allocator's figures."""

    def __init__(self, device_type: str, arena=None):
        self.device_type = device_type
        self.arena = arena
        self.resettable = True

    def reset(self) -> None:
        """Start a new window (e.g. after start-up, so a sweep's earlier jobs do not count)."""
        if self.arena is not None:
            self.arena.reset_peak()
            return
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            _CLEAR_REFS.write_text("5")  # "5" resets the peak RSS (Linux >= 4.0)
        except OSError:
            self.resettable = False  # the peak then covers the whole process

    def read(self) -> dict:
        """Peaks in bytes (and the allocator's retry count on CUDA) as result-row fields."""
        if self.arena is not None:
            return self.arena.memory_figures()
        if self.device_type == "cuda":
            stats = torch.cuda.memory_stats()
            return {
                "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
                "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
                "alloc_retries": stats.get("num_alloc_retries", 0),
                "cuda_malloc_count": stats.get("segment.all.allocated", 0),
                "cuda_free_count": stats.get("segment.all.freed", 0),
            }
        return {"peak_rss_bytes": _vm_hwm_bytes(), "peak_rss_reset": self.resettable}
