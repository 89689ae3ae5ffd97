"""The plan on a GPU: one arena, and every tensor request of a served phase placed by the plan.

Why the whole process allocator, not a ``MemPool`` scoped to the layers: a pool's custom
allocator is asked for *segments* only when the pool's own cache misses (2 MiB for small
requests, 20 MiB up to 10 MiB, else the size rounded to 2 MiB), and freed blocks stay cached in
the pool and serve later requests without asking it. Requests can then be neither matched to the
plan by order and size nor placed at planned offsets. ``CUDAPluggableAllocator`` installed with
``torch.cuda.memory.change_current_allocator`` sees every request and every free, at their
exact sizes; what the plan does not place goes to CUDA's stream-ordered ``cudaMallocAsync``
pool (kept cached: its release threshold is raised to the maximum).

It must be installed before this process makes its first CUDA tensor, and stays for the
process's life: run ``plan=true`` jobs each in their own process (every launcher but the basic
one does). The native side is ``plan_allocator.c``, built once per version with the system C
compiler into ``~/.cache/memo``; the matching is :class:`memo.plan.server.PlanServer`.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Optional

from memo.config import ConfigError
from memo.plan.server import PlanServer
from memo.profile.trace import Event

SOURCE = Path(__file__).with_name("plan_allocator.c")

_SERVE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_size_t)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_int64)
_RECORD_ALLOC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
_RECORD_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_FALLBACK_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_FALLBACK_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


def build_library(cache_dir: Optional[Path] = None) -> Path:
    """The compiled ``plan_allocator.c`` (built on first use; a file per source version).

    Raises:
        ConfigError: if there is no C compiler, or it fails (with its message).
    """
    source = SOURCE.read_bytes()
    cache = Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "memo"
    target = cache / f"plan_allocator-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise ConfigError("plan=true builds a small C allocator and finds no C compiler (cc); "
                          "install gcc or set CC")
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"{compiler} could not build {SOURCE.name}: {done.stderr.strip().splitlines()[-1]}")
    os.replace(partial, target)  # atomic: a concurrent build writes the same bytes
    return target


class ArenaAllocator:
    """The native allocator's configuration and the Python side of its callbacks.

    Args:
        library: the built ``plan_allocator.c``.
        arena: the arena's address and size in bytes (0, 0 until a plan gives its size).
        phase: the run's current phase, read when a request is recorded.
        fallback: host functions ``(size, stream) -> ptr`` and ``(ptr, stream)`` for the tests;
            None on a GPU, where :meth:`use_cuda_fallback` sets CUDA's.
    """

    def __init__(self, library: Path, phase: Callable[[], str],
                 fallback: Optional[tuple[Callable, Callable]] = None):
        self.lib = ctypes.CDLL(str(library))
        self.lib.memo_configure.argtypes = [_SERVE, _RELEASE, _RECORD_ALLOC, _RECORD_FREE, _FALLBACK_ALLOC,
                                            _FALLBACK_FREE] + [ctypes.c_void_p] * 4
        self.lib.memo_set_arena.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib.memo_set_serve_stream.argtypes = [ctypes.c_void_p]
        self.lib.memo_use_cuda_fallback.argtypes = [ctypes.c_void_p] * 6
        self.lib.memo_alloc.restype = ctypes.c_void_p
        self.lib.memo_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.memo_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.server: Optional[PlanServer] = None
        self.arena_bytes = 0
        self.fallback_pool = None  # (cudart, pool handle) of cudaMallocAsync's pool on a GPU
        self.events: list[Event] = []
        self.errors: list[str] = []  # a callback must never raise into C: failures land here
        self.phase = phase  # the run's current phase, read when a request is recorded
        self._ids: dict[int, int] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        # ctypes callbacks must outlive every call the native side makes through them.
        self._callbacks = [_SERVE(self._serve), _RELEASE(self._release), _RECORD_ALLOC(self._record_alloc),
                           _RECORD_FREE(self._record_free)]
        host = fallback or (lambda size, stream: None, lambda ptr, stream: None)
        self._fallback = [_FALLBACK_ALLOC(host[0]), _FALLBACK_FREE(host[1])]
        # what the native side needs to keep an exception pending across a callback
        python = [ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p) for name in
                  ("PyGILState_Ensure", "PyGILState_Release", "PyErr_Fetch", "PyErr_Restore")]
        self.lib.memo_configure(*self._callbacks, *self._fallback, *python)

    def set_arena(self, arena_address: int, arena_bytes: int) -> None:
        """Point the native side at the arena (``arena_bytes`` bytes at ``arena_address``); the
        fallback stays as it is."""
        self.arena_bytes = arena_bytes
        self.lib.memo_set_arena(arena_address, arena_bytes)

    def use_cuda_fallback(self, cudart, pool: ctypes.c_void_p) -> None:
        """Send unplanned requests to ``cudaMallocAsync`` / ``cudaFreeAsync`` of ``cudart`` (a
        request refused for want of memory is tried once more after ``cudaDeviceSynchronize`` and
        ``cudaMemPoolTrimTo(pool, 0)``, then counted as refused)."""
        functions = (cudart.cudaMallocAsync, cudart.cudaFreeAsync, cudart.cudaDeviceSynchronize,
                     cudart.cudaMemPoolTrimTo, cudart.cudaGetLastError)
        self.lib.memo_use_cuda_fallback(*(ctypes.cast(f, ctypes.c_void_p) for f in functions), pool)
        self.fallback_pool = (cudart, pool)

    def serve_stream(self, stream: Optional[int]) -> None:
        """Plan only the requests made on ``stream`` (a ``cudaStream_t`` as an int; ``None`` or 0:
        the default stream), the training step's compute stream."""
        self.lib.memo_set_serve_stream(stream or None)

    def set_modes(self, serve: bool, record: bool) -> None:
        """Serve planned requests from the arena; report fallback requests and frees as events."""
        self.lib.memo_set_modes(int(serve), int(record))

    def counters(self) -> dict:
        """Requests served and sent to the fallback, fallback frees, bytes allocated now and at
        most since :meth:`reset_peak`, fallback requests refused for want of memory and the size
        of the last one."""
        out = (ctypes.c_int64 * 7)()
        self.lib.memo_counters(out)
        names = ("served", "fallback_mallocs", "fallback_frees", "allocated_bytes", "peak_allocated_bytes",
                 "fallback_refused", "last_refused_bytes")
        return dict(zip(names, out, strict=True))

    def reset_peak(self) -> None:
        """Start a new window for the peaks of :meth:`counters` and :meth:`memory_figures`."""
        self.lib.memo_reset_peak()
        if self.fallback_pool is not None:
            cudart, pool = self.fallback_pool
            cudart.cudaMemPoolSetAttribute(pool, _RESERVED_MEM_HIGH, ctypes.byref(ctypes.c_uint64(0)))

    def memory_figures(self) -> dict:
        """The peak-memory columns a GPU row has, for this allocator: bytes allocated at most
        (placed and fallback), reserved at most (the arena and the fallback pool's high-water
        mark), and device allocations (the arena, and fallback requests: the pool serves most
        from its cache, but counts them all)."""
        counters = self.counters()
        reserved = 0
        if self.fallback_pool is not None:
            cudart, pool = self.fallback_pool
            high = ctypes.c_uint64()
            cudart.cudaMemPoolGetAttribute(pool, _RESERVED_MEM_HIGH, ctypes.byref(high))
            reserved = high.value
        return {"peak_allocated_bytes": counters["peak_allocated_bytes"],
                # Nothing here frees cached memory to retry a failed request: no retries, by design.
                "peak_reserved_bytes": self.arena_bytes + reserved, "alloc_retries": 0,
                "cuda_malloc_count": counters["fallback_mallocs"] + (self.arena_bytes > 0),
                "cuda_free_count": counters["fallback_frees"]}

    def _serve(self, size: int) -> int:
        try:
            with self._lock:  # requests come from the main thread and the autograd engine's
                offset = self.server.malloc(size) if self.server is not None else None
        except Exception as error:  # noqa: BLE001 - see self.errors
            self.errors.append(f"serve({size}): {type(error).__name__}: {error}")
            return -1
        return -1 if offset is None else offset

    def _release(self, offset: int) -> None:
        with self._lock:
            try:
                self.server.free(offset)
            except Exception as error:  # noqa: BLE001
                self.errors.append(f"release({offset}): {type(error).__name__}: {error}")

    def _record_alloc(self, ptr: int, size: int) -> None:
        self._ids[ptr] = request = self._next_id
        self._next_id += 1
        self.events.append(Event("malloc", request, size, self.phase()))

    def _record_free(self, ptr: int) -> None:
        request = self._ids.pop(ptr, None)
        if request is not None:
            self.events.append(Event("free", request, 0, self.phase()))

    def take_events(self) -> list[Event]:
        """The events recorded so far (frees carry their malloc's size), and forget them."""
        sizes = {e.id: e.size for e in self.events if e.op == "malloc"}
        events = [e if e.op == "malloc" else Event("free", e.id, sizes.get(e.id, 0), e.phase)
                  for e in self.events]
        self.events, self._ids = [], {}
        return events


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library PyTorch loaded."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in path:
            return ctypes.CDLL(path)
    import torch  # noqa: F401 - loads libcudart with the CUDA build
    return ctypes.CDLL("libcudart.so")


def install(phase: Callable[[], str], device: int) -> ArenaAllocator:
    """Make the plan's allocator this process's CUDA allocator (see the module docstring), its
    fallback pool that of GPU ``device`` (the one the process will select).

    Raises:
        ConfigError: if this process has already used the CUDA allocator.
    """
    import torch

    if torch.cuda.is_initialized():
        raise ConfigError("plan=true installs its own CUDA allocator before the process's first CUDA "
                          "tensor, and this process has made some; run it in a process of its own "
                          "(e.g. python run.py ... plan=true without -m, or hydra/launcher=slurm)")
    allocator = ArenaAllocator(build_library(), phase)
    cudart = _cudart()
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(allocator.lib._name), "memo_alloc", "memo_free")
    torch.cuda.memory.change_current_allocator(pluggable)
    # no tensor is made before the fallback is set
    pool = _cache_fallback_pool(cudart, device)
    allocator.use_cuda_fallback(cudart, pool)
    return allocator


# cudaMemPoolAttr values (CUDA runtime API)
_RELEASE_THRESHOLD, _RESERVED_MEM_HIGH = 4, 6


def _cache_fallback_pool(cudart: ctypes.CDLL, device: int) -> ctypes.c_void_p:
    """Keep freed fallback memory in CUDA's pool (its default release threshold is 0 bytes)."""
    pool = ctypes.c_void_p()
    if cudart.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), device) != 0:
        raise RuntimeError("cudaDeviceGetDefaultMemPool failed")
    threshold = ctypes.c_uint64(2**64 - 1)
    if cudart.cudaMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(threshold)) != 0:
        raise RuntimeError("cudaMemPoolSetAttribute(release threshold) failed")
    return pool


def allocate_arena(allocator: ArenaAllocator, arena_bytes: int) -> None:
    """Reserve the arena with one ``cudaMalloc`` (outside the fallback pool), point the allocator at
    it and start its peaks afresh.

    The fallback pool still caches the recorded step's peak; it gives that back first (after the
    device is idle), or the arena would need a second copy of it.

    Raises:
        torch.cuda.OutOfMemoryError: if the device has no room for it.
    """
    import torch

    cudart, pool = allocator.fallback_pool  # the runtime library found at install
    cudart.cudaDeviceSynchronize()
    cudart.cudaMemPoolTrimTo(pool, ctypes.c_size_t(0))
    address = ctypes.c_void_p()
    if cudart.cudaMalloc(ctypes.byref(address), ctypes.c_size_t(arena_bytes)) != 0:
        cudart.cudaGetLastError()  # the failure must not surface at the next, unrelated CUDA call
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: the plan's arena of {arena_bytes} bytes")
    allocator.set_arena(address.value, arena_bytes)
    # the recorded step ran before the arena: its peak is not the served steps'
    allocator.reset_peak()
