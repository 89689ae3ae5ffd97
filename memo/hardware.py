"""The hardware a run is measured against: peak FLOP/s (the MFU denominator) and memory sizes.

GPU figures are the vendors' dense 16-bit tensor-core peaks (no sparsity), as used for MFU by the
MEMO paper (A800: 312 TFLOP/s) and by Megatron-LM; host memory and the host link follow the
paper's cluster for the A800 and NVIDIA's DGX systems otherwise. A CPU has no such table entry:
its peak is measured at start-up with a matrix multiply in the run's dtype, and the row says so.
"""

import dataclasses
import functools
import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from memo.config import ConfigError, HardwareConfig
from memo.results import read_cache, write_cache

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
    # Device memory as the device reports it (torch.cuda.get_device_properties(0).total_memory in
    # results/gpu/*-nvidia-h100-80gb-hbm3/), 79.18 GiB, not the "80 GB" of its name.
    "h100": Hardware("h100", "cuda", 989e12, 85_017_493_504, 2048 * GiB, 8, 64e9, 900e9, 400e9),
    # DGX H200: 141 GB HBM3e, of which the device reports 139.80 GiB (results/gpu/*-nvidia-h200/);
    # otherwise as the H100 system.
    "h200": Hardware("h200", "cuda", 989e12, 150_109_880_320, 2048 * GiB, 8, 64e9, 900e9, 400e9),
    # The host itself: memory detected, peak measured.
    "cpu": Hardware("cpu", "cpu", None, None, None, 1, None),
}

# How torch.cuda.get_device_name() spells each table entry.
_GPU_NAMES = {"A800": "a800", "A100": "a100", "H100": "h100", "H200": "h200"}
# Variants of an entry with another dense bf16 peak (the entry's is the SXM part's), by a word of
# their device name: H100 PCIe 756 TFLOP/s, H100 NVL 835 TFLOP/s.
_VARIANT_PEAKS = {("h100", "PCIe"): 756e12, ("h100", "NVL"): 835e12}


def host_memory_bytes() -> int:
    """Physical memory of this machine, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinnable_memory_bytes(meminfo: Path = Path("/proc/meminfo"),
                          cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process can page-lock now: the kernel's ``MemAvailable`` (free memory plus what
    the page cache would give back), within what this process's memory cgroup still allows (v2
    ``memory.max − memory.current``, or v1's limit and usage). ``cudaHostRegister`` does not
    obey ``ulimit -l``, so the lock limit does not bound it (see :func:`memlock_limit_bytes`)."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = cgroup / limit_file, cgroup / usage_file
        if limit.exists() and usage.exists():
            text = limit.read_text().strip()
            if text != "max" and int(text) < 2**62:  # v1 writes a huge number for "no limit"
                return min(available, max(int(text) - int(usage.read_text()), 0))
            break
    return available


def memlock_limit_bytes() -> Optional[int]:
    """``ulimit -l`` in bytes, ``None`` when unlimited: some container runtimes enforce it on
    page-locked memory although ``cudaHostRegister`` does not ask for it."""
    limit, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if limit == resource.RLIM_INFINITY else limit


def available_now(hw: Hardware, cfg: HardwareConfig, allocator_held: int = 0) -> Hardware:
    """``hw`` with the memory a run on this machine can still fill, where ``hardware=auto`` and
    no size is set: the current GPU's free memory plus ``allocator_held``, what this process's
    allocator holds and can give the run (the CUDA context, what other processes and libraries
    hold stay out), the host's memory that can be page-locked now (:func:`pinnable_memory_bytes`);
    on a CPU, whose tensors are host memory, that for both. Bytes."""
    if cfg.name != "auto":
        return hw
    host = pinnable_memory_bytes()
    device = host
    if hw.device_type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        device = free + allocator_held
    return dataclasses.replace(
        hw,
        device_memory_bytes=hw.device_memory_bytes if cfg.device_memory_gib is not None else device,
        host_memory_bytes=hw.host_memory_bytes if cfg.host_memory_gib is not None else host,
    )


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
    return dataclasses.replace(
        table_entry(gpu),
        device_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        host_memory_bytes=host_memory_bytes(),
        devices_per_node=torch.cuda.device_count(),
    )


def table_entry(gpu: str) -> Hardware:
    """The :data:`HARDWARE` entry of a GPU named ``gpu`` (as ``torch.cuda.get_device_name()`` spells
    it), with the peak of its variant where that differs.

    Raises:
        ConfigError: if the GPU is not in the table.
    """
    key = next((k for spelling, k in _GPU_NAMES.items() if spelling in gpu), None)
    if key is None:
        raise ConfigError(
            f"hardware=auto found the GPU '{gpu}', which has no entry in memo/hardware.py; "
            f"pick one of {', '.join(HARDWARE)} or set hardware.name and hardware.peak_flops"
        )
    entry = HARDWARE[key]
    for (variant_of, word), peak in _VARIANT_PEAKS.items():
        if variant_of == key and word.lower() in gpu.lower():
            return dataclasses.replace(entry, peak_flops=peak)
    return entry


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


PEAK_CACHE = Path.home() / ".cache" / "memo" / "cpu_peak_flops.json"


def with_measured_peak(hw: Hardware, dtype: torch.dtype, cache: Optional[Path] = PEAK_CACHE) -> Hardware:
    """``hw`` with its peak measured on this CPU in ``dtype`` when no figure is known.

    The figure is the best this machine has shown: this process's measurement or a better one
    recorded in ``cache`` by an earlier process (None: this process's only). A measurement
    taken while other work loads the machine comes out low, and MFU against it high (above
    100% once the load goes); the best of many measurements approaches the true peak, so MFU
    stays below 100% on a busy machine too. ``hardware.peak_flops`` fixes it instead.
    """
    if hw.peak_flops is not None:
        return hw
    peak = measure_cpu_peak_flops(dtype)
    if cache is not None:
        peak = _best_recorded(cache, _cpu_key(dtype), peak)
    return dataclasses.replace(hw, peak_flops=peak, peak_flops_source="measured")


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype: torch.dtype, n: int = 1536, repeats: int = 10) -> float:
    """Best FLOP/s of an ``n``×``n`` matrix multiply in ``dtype`` on this CPU (all its threads).

    The best of ``repeats`` timings, after one untimed run, so the figure is a peak and not an
    average; measured once per process, so every job of a sweep shares one denominator.
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


def _cpu_key(dtype: torch.dtype) -> str:
    """What the peak depends on: the processor, the threads used, the dtype, the PyTorch build."""
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor() or platform.machine())
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{model}|threads={torch.get_num_threads()}|{dtype_name}|torch={torch.__version__}"


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _best_recorded(cache: Path, key: str, measured: float) -> float:
    """The larger of ``measured`` and ``cache``'s figure for ``key``; records the larger.

    A cache that cannot be read or written is passed over (the measurement stands alone).
    """
    recorded = read_cache(cache)
    best = recorded.get(key)
    if isinstance(best, (int, float)) and best >= measured:
        return float(best)
    write_cache(cache, recorded | {key: measured})
    return measured
