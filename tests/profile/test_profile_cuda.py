"""The cuda back-end's reading of the caching allocator's trace (the GPU run itself needs a GPU)."""

import pytest

from memo.profile.cuda import events_from_allocator_trace
from memo.profile.trace import Event

MARK = 77  # the marker stream


def _entry(action, addr, size, stream=1):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def test_requests_phases_and_allocator_internals():
    entries = [
        _entry("free_requested", 0x10, 512),  # made before recording: not a request
        _entry("alloc", 0x900, 1, MARK), _entry("free_requested", 0x900, 1, MARK),
        _entry("segment_alloc", 0x1000, 2 << 20),
        _entry("alloc", 0x1000, 1000),
        _entry("alloc", 0x1400, 3000),
        _entry("alloc", 0x900, 1, MARK),
        _entry("free_requested", 0x1000, 1000),
        _entry("free_completed", 0x1000, 1000),
        _entry("alloc", 0x1000, 1000),  # the same address again: a new request
        _entry("free_requested", 0x900, 1, MARK),
        _entry("free_requested", 0x1000, 1000),
    ]
    events = events_from_allocator_trace(entries, ["a", "b"], MARK)
    assert events == [
        Event("malloc", 0, 1000, "a"), Event("malloc", 1, 3000, "a"),
        Event("free", 0, 1000, "b"), Event("malloc", 2, 1000, "b"), Event("free", 2, 1000, "b"),
    ]


def test_a_cut_trace_or_an_oom_is_refused():
    with pytest.raises(ValueError, match="1 of 2 phase markers"):
        events_from_allocator_trace([_entry("alloc", 1, 1, MARK)], ["a", "b"], MARK)
    with pytest.raises(ValueError, match="ran out of memory asking for 4096 bytes"):
        events_from_allocator_trace([{"action": "oom", "size": 4096, "stream": 1}], [], MARK)


def test_the_cuda_back_end_runs_on_a_gpu_and_is_refused_in_one_line_without():
    import torch

    from memo.config import ConfigError, Method, ModelConfig, ParallelConfig, Workload
    from conftest import trace_of

    tiny = ModelConfig(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=1024,
                       num_attention_heads=4)
    args = (Workload(tiny, Method(name="none"), ParallelConfig(), 256, dtype="bf16"), "cuda")
    if torch.cuda.is_available():
        trace = trace_of(*args)
        assert trace.phases[0] == "embedding.fwd.lookup" and trace.meta["cuda.max_memory_reserved"] > 0
    else:
        with pytest.raises(ConfigError, match="needs a GPU and none is visible here"):
            trace_of(*args)
