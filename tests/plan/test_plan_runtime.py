"""``plan=true`` in a training run on the CPU, and the native allocator the GPU uses, driven on
host memory."""

import ctypes
import functools
import os
import subprocess

import pytest
from conftest import compose_config, run_in_process, trace_of
from requirements import c_compiler_missing, require

from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, PlannerConfig, validate, Workload
from memo.plan.cuda_arena import ArenaAllocator, build_library
from memo.plan.runtime import CPU_SERVING, PlanRuntime, measured_allocator_row
from memo.plan.server import PlanServer
from memo.plan.bilevel import addresses, plan_iteration
from memo.profile.trace import Event, Trace


@pytest.fixture
def library(tmp_path):
    """The plan's native allocator, built into ``tmp_path`` (needs a C compiler)."""
    require(c_compiler_missing())
    return build_library(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["memo", "full_recompute"])
def test_a_planned_cpu_run_matches_every_request_of_its_steps(tmp_path, method):
    row = run_in_process(tmp_path / method, f"method={method}", "plan=true", "model=tiny", "seq=512",
                         "train.steps=4", "train.warmup_steps=2")
    assert row["status"] == "ok", row["error"]
    assert row["plan.serving"] == CPU_SERVING and row["plan.recorded_step"] == 2
    assert row["plan.iterations"] == 2 and row["plan.served"] > 0
    # The same requests in the same order, every step: nothing falls back, nothing is missing.
    assert (row["plan.divergences"], row["plan.fallback"], row["plan.missing"]) == (0, 0, 0)
    assert row["plan.served"] == 2 * row["plan.recorded_requests"]
    assert 0 < row["plan.peak_live_bytes"] <= row["plan.arena_bytes"] == row["plan.planned_peak_bytes"]
    # Everything is in the arena: one device allocation, reserved no more than the arena.
    assert row["allocator.peak_reserved_bytes"] == row["plan.arena_bytes"]
    assert row["allocator.cuda_malloc_count"] == 1 and row["allocator.num_alloc_retries"] == 0


@pytest.mark.slow
def test_an_unplanned_cpu_run_reports_the_caching_allocators_figures(tmp_path):
    row = run_in_process(tmp_path / "none", "method=full_recompute", "model=tiny", "model.vocab_size=1000",
                         "seq=512", "train.steps=3")
    assert row["status"] == "ok", row["error"]
    assert row["allocator.source"] == "simulated caching allocator" and row["plan.serving"] is None
    assert row["allocator.peak_reserved_bytes"] >= row["allocator.peak_allocated_bytes"] > 0
    assert row["allocator.cuda_malloc_count"] > 1 and row["plan.served"] is None


def test_a_gpu_rows_measured_figures_become_its_allocator_columns():
    figures = {"peak_allocated_bytes": 7, "peak_reserved_bytes": 11, "alloc_retries": 2,
               "cuda_malloc_count": 5, "cuda_free_count": 3}
    assert measured_allocator_row(figures, planned=False) == {
        "allocator.source": "caching allocator", "allocator.peak_allocated_bytes": 7,
        "allocator.peak_reserved_bytes": 11, "allocator.num_alloc_retries": 2,
        "allocator.cuda_malloc_count": 5, "allocator.cuda_free_count": 3}
    planned = measured_allocator_row(figures, planned=True)
    assert planned["allocator.source"] == "plan arena and cudaMallocAsync"


def test_plan_needs_a_warm_up_step_and_one_micro_batch():
    with pytest.raises(ConfigError, match="set train.warmup_steps=1 or more"):
        validate(compose_config("plan=true", "train.warmup_steps=0"))
    with pytest.raises(ConfigError, match="set train.micro_batches=1"):
        validate(compose_config("plan=true", "train.micro_batches=2"))
    assert validate(compose_config("plan=true")).seq == 1024


@functools.lru_cache
def _tiny_plan():
    model = ModelConfig(name="tiny", num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                        vocab_size=512)
    trace = trace_of(Workload(model, Method(name="none"), ParallelConfig(), 256, dtype="fp32"),
                            "fake")
    return trace, plan_iteration(trace, time_limit_s=5, mip="none", alignment=512)


def test_the_native_allocator_places_planned_requests_in_the_arena_and_the_rest_elsewhere(library):
    trace, memory_plan = _tiny_plan()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    phase = ["setup"]
    allocator = ArenaAllocator(library, lambda: phase[0],
                               (lambda size, stream: libc.malloc(size), lambda ptr, stream: libc.free(ptr)))
    server = PlanServer(memory_plan)
    arena = ctypes.create_string_buffer(server.arena_bytes)
    base = ctypes.addressof(arena)
    allocator.set_arena(base, server.arena_bytes)
    allocator.server = server
    planned = addresses(memory_plan, trace)

    # One iteration as PyTorch would call the allocator, with one request the plan never made.
    allocator.set_modes(serve=True, record=False)
    server.start_iteration()
    pointers, sizes = {}, {}
    for event in trace.events:
        if event.phase != phase[0]:
            phase[0] = event.phase
            server.begin(event.phase)
        if event.op == "malloc":
            pointers[event.id] = allocator.lib.memo_alloc(event.size, 0, None)
            sizes[event.id] = event.size
            if event.phase == "layer.2.fwd" and not any(s < 0 for s in sizes):
                sizes[-1] = 12345  # an extra request: this phase falls back from here on
                pointers[-1] = allocator.lib.memo_alloc(12345, 0, None)
        elif event.id in pointers:
            allocator.lib.memo_free(pointers.pop(event.id), sizes[event.id], 0, None)
    allocator.set_modes(serve=False, record=False)
    assert allocator.errors == []
    stats = server.finish()
    counters = allocator.counters()
    assert counters["served"] == stats.served > 0 and counters["fallback_mallocs"] == stats.fallback > 0
    assert stats.divergences == 1 and stats.first_divergence.startswith("layer.2.fwd")

    # Serve the same iteration again without the extra request: every request at its offset.
    allocator.set_modes(serve=True, record=False)
    for pointer, size in [(p, sizes[i]) for i, p in pointers.items()]:
        allocator.lib.memo_free(pointer, size, 0, None)  # what outlived the iteration
    server.start_iteration()
    for event in trace.events:
        if event.phase != phase[0]:
            phase[0] = event.phase
            server.begin(event.phase)
        if event.op == "malloc":
            pointer = allocator.lib.memo_alloc(event.size, 0, None)
            if event.size:
                assert pointer == base + planned[event.id], event
            pointers[event.id] = pointer
        elif event.id in pointers:
            allocator.lib.memo_free(pointers.pop(event.id), event.size, 0, None)
    assert server.finish().divergences == 1 and allocator.errors == []

    # Recording: fallback requests and frees come back as events of the current phase.
    allocator.set_modes(serve=False, record=True)
    phase[0] = "optimizer"
    a = allocator.lib.memo_alloc(1000, 0, None)
    assert not base <= a < base + server.arena_bytes
    allocator.lib.memo_free(a, 1000, 0, None)
    events = allocator.take_events()
    assert [(e.op, e.size, e.phase) for e in events] == [("malloc", 1000, "optimizer"),
                                                         ("free", 1000, "optimizer")]


_RAISE_THEN_FREE = """
#include <stddef.h>
typedef void (*set_string_fn)(void *type, const char *message);
typedef void (*free_fn)(void *ptr, size_t size, int device, void *stream);
/* As PyTorch's C++ code frees a tensor while an exception it raised propagates. */
void raise_then_free(set_string_fn set_string, void *type, free_fn memo_free, void *ptr, size_t size) {
    set_string(type, "stop the recomputation");
    memo_free(ptr, size, 0, NULL);
}
"""


def test_a_free_while_an_exception_propagates_keeps_the_exception(library, tmp_path):
    # torch.utils.checkpoint ends a recomputation by raising from a saved-tensor hook inside a
    # Function's apply; the tensors dropped on the way out reach the plan server's Python callback
    # with the exception pending. Run as is, that callback cleared it: full_recompute with
    # plan=true stopped on an H200 with "apply ... returned NULL without setting an exception".
    source = tmp_path / "raise_then_free.c"
    source.write_text(_RAISE_THEN_FREE)
    compiler = os.environ.get("CC", "cc")  # the one the library fixture found
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "helper.so"), str(source)], check=True)
    helper = ctypes.PyDLL(str(tmp_path / "helper.so")).raise_then_free  # PyDLL raises what is pending
    helper.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    class OneBlock:  # the plan server's part: every request at offset 0
        freed = []

        def malloc(self, size):
            return 0

        def free(self, offset):
            self.freed.append(offset)

    allocator = ArenaAllocator(library, lambda: "layer.0.bwd")
    arena = ctypes.create_string_buffer(4096)
    allocator.set_arena(ctypes.addressof(arena), 4096)
    allocator.server = OneBlock()
    allocator.set_modes(serve=True, record=False)
    pointer = allocator.lib.memo_alloc(1024, 0, None)
    assert pointer == ctypes.addressof(arena)
    with pytest.raises(ValueError, match="stop the recomputation"):
        helper(ctypes.cast(ctypes.pythonapi.PyErr_SetString, ctypes.c_void_p), ValueError,
               ctypes.cast(allocator.lib.memo_free, ctypes.c_void_p), pointer, 1024)
    assert OneBlock.freed == [0] and allocator.errors == []  # the callback ran, and ran cleanly


def test_without_a_c_compiler_plan_true_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="finds no C compiler"):
        build_library(tmp_path / "empty-cache")


class _HostCudart:
    """The CUDA runtime functions the plan's allocator calls, on host memory: ``refuse`` makes the
    next that many ``cudaMallocAsync`` calls fail for want of memory; ``calls`` logs the others."""

    def __init__(self, arena_bytes: int = 0):
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        self.refuse, self.calls = 0, []
        self.arena = ctypes.create_string_buffer(max(arena_bytes, 1))
        status = ctypes.c_int

        def malloc_async(ptr, size, stream):
            if self.refuse:
                self.refuse -= 1
                return 2  # cudaErrorMemoryAllocation
            ptr[0] = libc.malloc(size)
            return 0

        def log(name, result=0):
            return lambda *args: self.calls.append(name) or result

        def cuda_malloc(ptr, size):
            self.calls.append("cudaMalloc")
            ptr[0] = ctypes.addressof(self.arena)
            return 0

        self.cudaMallocAsync = ctypes.CFUNCTYPE(status, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                                ctypes.c_void_p)(malloc_async)
        self.cudaFreeAsync = ctypes.CFUNCTYPE(status, ctypes.c_void_p, ctypes.c_void_p)(
            lambda ptr, stream: libc.free(ptr) or 0)
        self.cudaDeviceSynchronize = ctypes.CFUNCTYPE(status)(log("synchronize"))
        self.cudaMemPoolTrimTo = ctypes.CFUNCTYPE(status, ctypes.c_void_p, ctypes.c_size_t)(log("trim"))
        self.cudaGetLastError = ctypes.CFUNCTYPE(status)(log("get_last_error"))
        pointer = ctypes.POINTER(ctypes.c_void_p)
        self.cudaMalloc = ctypes.CFUNCTYPE(status, pointer, ctypes.c_size_t)(cuda_malloc)
        set_attribute = ctypes.CFUNCTYPE(status, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        self.cudaMemPoolSetAttribute = set_attribute(log("reset_high_water_mark"))


def test_unplanned_requests_still_reach_cudas_allocator_once_the_arena_is_set(library):
    from memo.plan.cuda_arena import allocate_arena

    cudart = _HostCudart(arena_bytes=4096)
    allocator = ArenaAllocator(library, lambda: "setup")
    allocator.use_cuda_fallback(cudart, ctypes.c_void_p(1))
    allocator.set_modes(serve=True, record=False)  # no server: every request is unplanned
    before = allocator.lib.memo_alloc(1000, 0, None)
    allocate_arena(allocator, 4096)
    # the recorded step's cache is given back before the arena is reserved; then the peaks restart
    assert cudart.calls == ["synchronize", "trim", "cudaMalloc", "reset_high_water_mark"]
    after = allocator.lib.memo_alloc(1000, 0, None)
    assert before and after and after != before  # before the fix the arena's set-up dropped the fallback
    assert allocator.counters()["peak_allocated_bytes"] == 2000
    for ptr in (before, after):
        allocator.lib.memo_free(ptr, 1000, 0, None)


def test_a_refused_request_is_retried_once_on_a_trimmed_pool_then_counted(library):
    cudart = _HostCudart()
    allocator = ArenaAllocator(library, lambda: "setup")
    allocator.use_cuda_fallback(cudart, ctypes.c_void_p(1))
    cudart.refuse = 1
    ptr = allocator.lib.memo_alloc(512, 0, None)
    assert ptr and cudart.calls == ["get_last_error", "synchronize", "trim"]
    allocator.lib.memo_free(ptr, 512, 0, None)
    cudart.refuse = 2
    assert allocator.lib.memo_alloc(777, 0, None) is None
    counters = allocator.counters()
    assert (counters["fallback_refused"], counters["last_refused_bytes"]) == (1, 777)


def test_only_the_compute_streams_requests_are_planned_or_recorded(library):
    trace, memory_plan = _tiny_plan()
    allocator = ArenaAllocator(library, lambda: "setup",
                               (lambda size, stream: 4096, lambda ptr, stream: None))  # a fixed fallback
    server = PlanServer(memory_plan)
    arena = ctypes.create_string_buffer(server.arena_bytes)
    allocator.set_arena(ctypes.addressof(arena), server.arena_bytes)
    allocator.server = server
    first = next(e for e in trace.events if e.op == "malloc" and e.size)
    side = ctypes.c_void_p(0x5)  # a D2H or NCCL stream
    allocator.set_modes(serve=True, record=False)
    server.start_iteration()
    server.begin(first.phase)
    assert allocator.lib.memo_alloc(first.size, 0, side) == 4096  # not given arena bytes
    served = allocator.lib.memo_alloc(first.size, 0, None)  # the compute (default) stream
    assert ctypes.addressof(arena) <= served < ctypes.addressof(arena) + server.arena_bytes
    assert allocator.counters()["served"] == 1 and allocator.counters()["fallback_mallocs"] == 1
    allocator.set_modes(serve=False, record=True)
    allocator.lib.memo_alloc(100, 0, side)
    allocator.lib.memo_alloc(200, 0, None)
    assert [e.size for e in allocator.take_events()] == [200]


def test_a_recorded_step_the_planner_cannot_serve_leaves_the_run_unplanned_and_says_why():
    """A block of a tile's attention must free what it makes; a step where one does not (a tensor
    of a reference cycle freed inside a later block, say) is not served, and the run goes on."""
    runtime = PlanRuntime(None, True, PlannerConfig(time_limit_s=1, mip="none"), 1, "cpu")
    events = [Event("malloc", 1, 512, "layer.0.fwd.t1.b0"), Event("free", 1, 512, "layer.0.fwd.t1.b1")]
    runtime._planned(Trace(events, {"step": 1}))
    row = runtime.finish()
    assert runtime.server is None and row["plan.serving"].startswith("not served: a request made in")
    assert row["allocator.source"] == "simulated caching allocator"
