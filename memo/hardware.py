"""The hardware a run is measured against: peak FLOP/s (the MFU denominator) and memory sizes.

GPU figures are the vendors' dense 16-bit tensor-core peaks (no sparsity), as used for MFU by the
MEMO paper (A800: 312 TFLOP/s) and by Megatron-LM; host memory and the host link follow the
paper's cluster for the A800 and NVIDIA's DGX systems otherwise. A CPU has no such table entry:
its peak is measured at start-up with a matrix multiply in the run's dtype, and the row says so.
"""

import dataclasses
import functools
import os
import resource
import time
from dataclasses import dataclass
from typing import Optional

import torch

from memo.config import ConfigError, HardwareConfig

GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """Resolved figures for one device kind. Bytes, FLOP/s and bytes/s throughout."""

    name: str
    device_type: str  # "cuda" or "cpu"
    peak_flops: Optional[float]  # per device; None until measured (CPU)
    device_memory_bytes: Optional[int]
    host_memory_bytes: Optional[int]  # per node
    devices_per_node: Optional[int]
    host_link_bytes_per_s: Optional[float]
    intra_node_bytes_per_s: Optional[float] = None  # per device, within a node (NVLink)
    inter_node_bytes_per_s: Optional[float] = None  # per node, all its network adapters
    peak_flops_source: str = "table"  # "table", "config" or "measured"


HARDWARE: dict[str, Hardware] = {
    # MEMO paper §5.1: 8× A800 80 GB per node, 2 TB host memory, 32 GB/s GPU-host, NVLink
    # 400 GB/s, InfiniBand 200 GB/s between nodes.
    "a800": Hardware("a800", "cuda", 312e12, 80 * GiB, 2048 * GiB, 8, 32e9, 400e9, 200e9),
    # DGX A100: 1 TB host memory, PCIe 4.0 x16 per GPU, NVLink 3 600 GB/s, 8× HDR 200 Gb/s.
    "a100": Hardware("a100", "cuda", 312e12, 80 * GiB, 1024 * GiB, 8, 32e9, 600e9, 200e9),
    # DGX H100 (SXM5): 2 TB host memory, PCIe 5.0 x16 per GPU, NVLink 4 900 GB/s, 8× NDR 400 Gb/s.
    "h100": Hardware("h100", "cuda", 989e12, 80 * GiB, 2048 * GiB, 8, 64e9, 900e9, 400e9),
    # DGX H200: 141 GB HBM3e (about 140 GiB visible), otherwise as the H100 system.
    "h200": Hardware("h200", "cuda", 989e12, 140 * GiB, 2048 * GiB, 8, 64e9, 900e9, 400e9),
    # The host itself: memory detected, peak measured.
    "cpu": Hardware("cpu", "cpu", None, None, None, 1, None),
}

# How torch.cuda.get_device_name() spells each table entry.
_GPU_NAMES = {"A800": "a800", "A100": "a100", "H100": "h100", "H200": "h200"}


def host_memory_bytes() -> int:
    """Physical memory of this machine, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinnable_memory_bytes() -> int:
    """Bytes this process can page-lock now: memory available, capped by ``ulimit -l``."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    limit, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return available if limit == resource.RLIM_INFINITY else min(available, limit)


def _this_host() -> Hardware:
    memory = host_memory_bytes()
    return dataclasses.replace(HARDWARE["cpu"], device_memory_bytes=memory, host_memory_bytes=memory)


def detect() -> Hardware:
    """The table entry for the visible device, with its memory sizes read off this machine.

    Raises:
        ConfigError: if the visible GPU is not in :data:`HARDWARE`.
    """
    if not torch.cuda.is_available():
        return _this_host()
    gpu = torch.cuda.get_device_name()
    key = next((k for spelling, k in _GPU_NAMES.items() if spelling in gpu), None)
    if key is None:
        raise ConfigError(
            f"hardware=auto found the GPU '{gpu}', which has no entry in memo/hardware.py; "
            f"pick one of {', '.join(HARDWARE)} or set hardware.name and hardware.peak_flops"
        )
    return dataclasses.replace(
        HARDWARE[key],
        device_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        host_memory_bytes=host_memory_bytes(),
        devices_per_node=torch.cuda.device_count(),
    )


def _bytes(value: Optional[float], unit: int) -> Optional[int]:
    return None if value is None else int(value * unit)


def resolve(cfg: HardwareConfig) -> Hardware:
    """Turn the ``hardware`` config into figures: table (or detected) values, then overrides.

    A CPU's ``peak_flops`` stays ``None`` unless set: measure it in the run's dtype with
    :func:`with_measured_peak`.

    Raises:
        ConfigError: for an unknown name whose figures are not all given.
    """
    given = {
        "peak_flops": cfg.peak_flops,
        "device_memory_bytes": _bytes(cfg.device_memory_gib, GiB),
        "host_memory_bytes": _bytes(cfg.host_memory_gib, GiB),
        "devices_per_node": cfg.devices_per_node,
        "host_link_bytes_per_s": _bytes(cfg.host_link_gbps, 10**9),
        "intra_node_bytes_per_s": _bytes(cfg.intra_node_gbps, 10**9),
        "inter_node_bytes_per_s": _bytes(cfg.inter_node_gbps, 10**9),
    }
    given = {key: value for key, value in given.items() if value is not None}
    if cfg.name == "auto":
        base = detect()
    elif cfg.name in HARDWARE:
        base = _this_host() if cfg.name == "cpu" else HARDWARE[cfg.name]
    else:
        required = ("peak_flops", "device_memory_gib", "host_memory_gib", "devices_per_node")
        missing = [key for key in required if getattr(cfg, key) is None]
        if missing:
            raise ConfigError(
                f"hardware.name={cfg.name} is not in memo/hardware.py ({', '.join(HARDWARE)}); "
                "for a new device also set " + ", ".join(f"hardware.{key}" for key in missing)
            )
        base = Hardware(cfg.name, "cuda", None, None, None, None, None)
    hw = dataclasses.replace(base, **given)
    return dataclasses.replace(hw, peak_flops_source="config") if "peak_flops" in given else hw


def with_measured_peak(hw: Hardware, dtype: torch.dtype) -> Hardware:
    """``hw`` with its peak measured on this CPU in ``dtype`` when no figure is known."""
    if hw.peak_flops is not None:
        return hw
    return dataclasses.replace(
        hw, peak_flops=measure_cpu_peak_flops(dtype), peak_flops_source="measured"
    )


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype: torch.dtype, n: int = 1536, repeats: int = 10) -> float:
    """Best FLOP/s of an ``n``×``n`` matrix multiply in ``dtype`` on this CPU (all its threads).

    The best of ``repeats`` timings, after one untimed run, so the figure is a peak and not an
    average. It is measured once per process, so every job of a sweep shares one denominator;
    other work on the machine at that moment lowers it (and raises MFU): to compare runs across
    processes or machines, give ``hardware.peak_flops`` instead.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
