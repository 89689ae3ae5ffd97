"""The caching-allocator simulator against figures computed by hand from PyTorch's rules."""

import random
import time
from typing import Hashable, NamedTuple

import pytest

from memo.dsa.caching_allocator import (
    CachingAllocator,
    MiB,
    OutOfMemoryError,
    round_size,
    segment_size,
    simulate,
)


class Ev(NamedTuple):
    op: str
    id: Hashable
    size: int = 0


def alloc(i, size):
    return Ev("malloc", i, size)


def free(i):
    return Ev("free", i)


def test_sizes_round_to_512_bytes_and_segments_to_pool_rules():
    assert [round_size(s) for s in (0, 1, 512, 513, 1000)] == [0, 512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # small pool
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(29 * MiB + 512) == 30 * MiB
    assert segment_size(31 * MiB) == 32 * MiB


def test_one_byte_takes_512_bytes_of_a_2_mib_segment():
    # As on a GPU: after torch.empty(1, dtype=torch.uint8, device="cuda"),
    # torch.cuda.memory_allocated() == 512 and torch.cuda.memory_reserved() == 2 MiB.
    s = simulate([alloc("a", 1)])
    assert (s.peak_requested, s.peak_allocated, s.peak_reserved) == (1, 512, 2 * MiB)
    assert s.num_device_alloc == 1


def test_zero_bytes_allocate_nothing_but_ids_are_still_checked():
    s = simulate([alloc("a", 0), free("a"), alloc("a", 0)])
    assert (s.peak_allocated, s.peak_reserved, s.num_device_alloc, s.fragmentation) == (0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="event 1: malloc of id 'a', which is already live"):
        simulate([alloc("a", 0), alloc("a", 0)])


def test_two_1_mib_requests_share_one_small_segment():
    a = CachingAllocator()
    a.malloc(1 * MiB)
    a.malloc(1 * MiB)
    assert a.segments() == [[(1 * MiB, True), (1 * MiB, True)]]
    a.malloc(512)  # the segment is full: a second one
    assert a.reserved == 4 * MiB and a.stats().num_device_alloc == 2


def test_small_pool_splits_off_a_rest_of_exactly_512_bytes():
    # should_split in the source: remaining >= kMinBlockSize in the small pool.
    a = CachingAllocator()
    a.malloc(1 * MiB)
    a.malloc(1 * MiB - 512)
    assert a.segments() == [[(1 * MiB, True), (1 * MiB - 512, True), (512, False)]]


def test_5_mib_request_creates_a_20_mib_segment_that_a_12_mib_request_splits():
    a = CachingAllocator()
    a.malloc(5 * MiB)
    assert a.segments() == [[(5 * MiB, True), (15 * MiB, False)]]
    a.malloc(12 * MiB)
    assert a.segments() == [[(5 * MiB, True), (12 * MiB, True), (3 * MiB, False)]]
    # 2.5 MiB leaves 0.5 MiB, not more than 1 MiB: the whole 3 MiB block is handed out.
    a.malloc(5 * MiB // 2)
    assert a.segments() == [[(5 * MiB, True), (12 * MiB, True), (3 * MiB, True)]]
    s = a.stats()
    assert (s.peak_reserved, s.peak_allocated, s.peak_requested) == (20 * MiB, 20 * MiB, 39 * MiB // 2)
    assert s.num_device_alloc == 1 and s.fragmentation == 0.75  # 5 of 20 MiB when reserved peaked


def test_30_mib_request_gets_a_segment_of_its_size_rounded_to_2_mib():
    s = simulate([alloc("a", 29 * MiB + 1)])
    # 29 MiB + 512 leaves 1 MiB - 512 of the 30 MiB segment: not split, so allocated counts 30 MiB.
    assert (s.peak_reserved, s.peak_allocated, s.peak_requested) == (30 * MiB, 30 * MiB, 29 * MiB + 1)
    assert simulate([alloc("a", 30 * MiB)]).peak_reserved == 30 * MiB


@pytest.mark.parametrize("size", [700, 3 * MiB, 30 * MiB])
def test_free_then_malloc_of_the_same_size_reuses_the_cached_block(size):
    s = simulate([alloc("a", size), free("a"), alloc("b", size), free("b"), alloc("c", size)])
    assert s.num_device_alloc == 1 and s.reserved == segment_size(round_size(size))


def test_freed_neighbours_merge_so_a_larger_request_fits():
    a = CachingAllocator()
    x, y, z = (a.malloc(6 * MiB) for _ in range(3))
    assert a.segments() == [[(6 * MiB, True)] * 3 + [(2 * MiB, False)]]
    a.free(x)
    a.free(y)  # merges with the free block before it
    assert a.segments() == [[(12 * MiB, False), (6 * MiB, True), (2 * MiB, False)]]
    w = a.malloc(11 * MiB)  # fits only the merged 12 MiB; a 1 MiB rest is not split off
    assert a.segments() == [[(12 * MiB, True), (6 * MiB, True), (2 * MiB, False)]]
    a.free(w)
    a.free(z)  # merges on both sides: the segment is whole again
    assert a.segments() == [[(20 * MiB, False)]]
    a.malloc(18 * MiB)
    assert a.segments() == [[(18 * MiB, True), (2 * MiB, False)]]
    assert a.stats().num_device_alloc == 1 and a.reserved == 20 * MiB


def test_holes_left_by_small_frees_fragment_the_reserved_memory():
    # Three 6 MiB blocks in a 20 MiB segment; freeing the outer two leaves holes of 6 and 8 MiB,
    # so a 10 MiB request gets a 10 MiB segment of its own: 16 of 30 MiB allocated at the peak.
    events = [alloc(i, 6 * MiB) for i in "abc"] + [free("a"), free("c"), alloc("d", 10 * MiB)]
    s = simulate(events)
    assert (s.peak_reserved, s.allocated_at_peak, s.peak_allocated) == (30 * MiB, 16 * MiB, 18 * MiB)
    assert s.fragmentation == pytest.approx(1 - 16 / 30)
    assert s.num_device_alloc == 2


TWO_THEN_LARGER = [alloc("a", 10 * MiB), alloc("b", 10 * MiB), free("a"), free("b"), alloc("c", 12 * MiB)]


def test_cache_is_released_and_the_malloc_retried_once_when_capacity_is_reached():
    unlimited = simulate(TWO_THEN_LARGER)
    assert (unlimited.peak_reserved, unlimited.num_alloc_retries) == (32 * MiB, 0)
    # 20 MiB cached + 12 MiB > 30 MiB: both cached 10 MiB segments go back, then the 12 MiB one fits.
    # torch.cuda.memory_stats() documents num_alloc_retries as "failed cudaMalloc calls that result
    # in a cache flush and retry": one here.
    s = simulate(TWO_THEN_LARGER, capacity_bytes=30 * MiB)
    assert (s.num_alloc_retries, s.num_device_free, s.num_device_alloc) == (1, 2, 3)
    assert (s.peak_reserved, s.reserved) == (20 * MiB, 12 * MiB)


def test_out_of_memory_when_even_releasing_the_cache_does_not_help():
    events = [alloc("a", 10 * MiB), alloc("b", 10 * MiB), free("a"), alloc("c", 12 * MiB)]
    with pytest.raises(OutOfMemoryError, match="event 3: malloc of id 'c'") as info:
        simulate(events, capacity_bytes=20 * MiB)  # b's 10 MiB stays; 10 + 12 > 20
    error = info.value
    assert (error.event_index, error.id, error.size) == (3, "c", 12 * MiB)
    assert error.stats.num_alloc_retries == 1
    assert (error.stats.reserved, error.stats.allocated) == (10 * MiB, 10 * MiB)


def test_max_split_size_keeps_oversize_blocks_for_oversize_requests():
    # By default a 12 MiB request is cut from a cached 50 MiB segment.
    events = [alloc("a", 50 * MiB), free("a"), alloc("b", 12 * MiB)]
    assert simulate(events).num_device_alloc == 1
    # With max_split_size 40 MiB it is not, nor is a 45 MiB request (50 >= 45 + 20 is false, so that
    # one may take it, whole: it is not split because 45 MiB >= max_split_size).
    assert simulate(events, max_split_size=40 * MiB).num_device_alloc == 2
    s = simulate([alloc("a", 50 * MiB), free("a"), alloc("b", 45 * MiB)], max_split_size=40 * MiB)
    assert (s.num_device_alloc, s.peak_allocated) == (1, 50 * MiB)
    s = simulate([alloc("a", 70 * MiB), free("a"), alloc("b", 45 * MiB)], max_split_size=40 * MiB)
    assert (s.num_device_alloc, s.peak_reserved) == (2, 70 * MiB + 46 * MiB)
    with pytest.raises(ValueError, match="max_split_size must exceed"):
        simulate([], max_split_size=20 * MiB)


def test_an_oversize_cached_segment_is_released_before_the_whole_cache():
    a = CachingAllocator(capacity_bytes=100 * MiB, max_split_size=40 * MiB)
    a.free(a.malloc(70 * MiB))
    a.free(a.malloc(5 * MiB))  # a cached 20 MiB segment, which must survive
    a.malloc(45 * MiB)  # 90 + 46 > 100: the 70 MiB segment goes back, no retry is counted
    s = a.stats()
    assert (s.num_device_free, s.num_alloc_retries, s.reserved) == (1, 0, 66 * MiB)
    assert a.segments() == [[(20 * MiB, False)], [(46 * MiB, True)]]


def test_expandable_segments_reserve_less_when_sizes_creep_up():
    # Iteration 1 allocates four 10 MiB blocks, iteration 2 four 11 MiB ones. Classic: four 10 MiB
    # segments stay cached and useless, four 12 MiB segments (with 1 MiB unsplit each) are added.
    events = [alloc(i, 10 * MiB) for i in range(4)] + [free(i) for i in range(4)]
    events += [alloc(4 + i, 11 * MiB) for i in range(4)]
    classic = simulate(events)
    assert (classic.peak_reserved, classic.allocated_at_peak) == (88 * MiB, 48 * MiB)
    assert classic.num_device_alloc == 8
    # Expandable: two 20 MiB pages hold iteration 1 and merge into one free 40 MiB block once it is
    # freed; three 11 MiB blocks are cut from it and the fourth maps a third page after the 7 MiB rest.
    expandable = simulate(events, expandable_segments=True)
    assert (expandable.peak_reserved, expandable.allocated_at_peak) == (60 * MiB, 44 * MiB)
    assert expandable.num_device_alloc == 3
    assert expandable.fragmentation == pytest.approx(1 - 44 / 60)
    assert classic.fragmentation == pytest.approx(1 - 48 / 88)


def test_expandable_segment_grows_in_place_and_merges_its_freed_blocks():
    a = CachingAllocator(expandable_segments=True)
    x, y = a.malloc(10 * MiB), a.malloc(10 * MiB)
    assert a.segments() == [[(10 * MiB, True), (10 * MiB, True)]]
    a.free(x)
    a.free(y)
    a.malloc(12 * MiB)  # classic mode would cudaMalloc a 12 MiB segment here
    assert a.segments() == [[(12 * MiB, True), (8 * MiB, False)]]
    assert a.reserved == 20 * MiB and a.stats().num_device_alloc == 1
    a.malloc(700)  # the small pool expands by 2 MiB pages
    assert a.segments()[1] == [(1024, True), (2 * MiB - 1024, False)]


def test_expandable_segments_unmap_free_pages_and_retry_at_capacity():
    # a and b map a 20 MiB page each; a is freed; c (30 MiB) needs two more pages: 40 + 40 > 60,
    # so a's page is unmapped (retry) and c maps pages after b: 60 MiB reserved at the end.
    events = [alloc("a", 20 * MiB), alloc("b", 20 * MiB), free("a"), alloc("c", 30 * MiB)]
    s = simulate(events, capacity_bytes=60 * MiB, expandable_segments=True)
    assert (s.num_alloc_retries, s.num_device_free, s.num_device_alloc) == (1, 1, 3)
    assert (s.peak_reserved, s.reserved) == (60 * MiB, 60 * MiB)
    a = CachingAllocator(capacity_bytes=60 * MiB, expandable_segments=True)
    x = a.malloc(20 * MiB)
    a.malloc(20 * MiB)
    a.free(x)
    a.malloc(30 * MiB)
    assert a.segments() == [[(20 * MiB, True), (30 * MiB, True), (10 * MiB, False)]]
    with pytest.raises(OutOfMemoryError):
        simulate(events, capacity_bytes=40 * MiB, expandable_segments=True)


@pytest.mark.parametrize(
    "events, message",
    [
        ([alloc("a", 8), free("b")], "event 1: free of id 'b', which is not live"),
        ([alloc("a", 8), free("a"), free("a")], "event 2: free of id 'a', which is not live"),
        ([alloc(3, 8), alloc(3, 8)], "event 1: malloc of id 3, which is already live"),
        ([Ev("realloc", 1, 8)], "event 0: op 'realloc' is neither malloc nor free"),
        ([alloc(1, -1)], "event 0: malloc of id 1 with negative size -1"),
    ],
)
def test_bad_traces_name_the_event(events, message):
    with pytest.raises(ValueError, match=message):
        simulate(events)


def _random_trace(rng, n):
    events, live = [], []
    for i in range(n):
        if live and rng.random() < 0.5:
            events.append(free(live.pop(rng.randrange(len(live)))))
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(1, 64 * MiB)])
            events.append(alloc(i, size))
            live.append(i)
    return events


@pytest.mark.parametrize(
    "options",
    [{}, {"max_split_size": 30 * MiB}, {"expandable_segments": True}, {"capacity_bytes": 900 * MiB},
     {"capacity_bytes": 900 * MiB, "expandable_segments": True}],
)
def test_random_traces_keep_the_books_straight(options):
    rng = random.Random(0)
    a = CachingAllocator(**options)
    live = {}
    for event in _random_trace(rng, 3000):
        if event.op == "malloc":
            try:
                live[event.id] = a.malloc(event.size)
            except OutOfMemoryError:
                continue
        else:
            a.free(live.pop(event.id, None))
        segments = a.segments()
        assert sum(size for seg in segments for size, _ in seg) == a.reserved
        assert sum(size for seg in segments for size, used in seg if used) == a.allocated
        # Free neighbours always merge.
        assert all(used or next_used for seg in segments for (_, used), (_, next_used) in zip(seg, seg[1:]))
        if "capacity_bytes" in options:
            assert a.reserved <= options["capacity_bytes"]
    s = a.stats()
    assert s.peak_requested <= s.peak_allocated <= s.peak_reserved


def test_100k_events_replay_in_seconds():
    events = _random_trace(random.Random(1), 100_000)
    for options in ({}, {"expandable_segments": True}):
        start = time.perf_counter()
        simulate(events, **options)
        assert time.perf_counter() - start < 10


def test_reserved_over_allocated_compares_the_two_peaks():
    s = simulate([alloc("a", 5 * MiB), free("a")])
    assert (s.peak_allocated, s.peak_reserved) == (5 * MiB, 20 * MiB)
    assert s.reserved_over_allocated == 3.0
