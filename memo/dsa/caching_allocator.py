"""A replay simulator of PyTorch's CUDA caching allocator: what ``torch.cuda`` would reserve for a trace.

MEMO's plans give every request of an iteration a fixed offset in one arena, so what they reserve
is the arena. The baseline is PyTorch's caching allocator serving the same requests online: this
module replays a trace of ``malloc``/``free`` events through a model of
``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) and reports its allocated and reserved bytes,
as ``torch.cuda.memory_stats()`` would.

Modelled as in the source:

* sizes are rounded up to multiples of 512 bytes; a 0-byte request gets a null pointer and no
  block (``allocate(0)`` skips the allocator), and its free is a no-op;
* requests of at most 1 MiB come from the small pool, cut from 2 MiB segments; larger ones from
  the large pool, cut from 20 MiB segments below 10 MiB, else from a segment of their own size
  rounded up to 2 MiB;
* best fit: the smallest free block of the pool by (size, address) that holds the request; with
  ``max_split_size`` set, a request below it never takes a block of at least that size, and a
  request of at least that size takes only a block less than 20 MiB larger than itself;
* a block larger than the request is split when the rest is at least 512 bytes (small pool, and
  every block with expandable segments), or more than 1 MiB and the request is below
  ``max_split_size`` (large pool); a freed block merges with free neighbours of its segment;
* no cached block fits: a new segment. If it would exceed ``capacity_bytes``: when
  ``max_split_size`` is set, release the smallest cached block of at least the request and
  ``max_split_size`` (else the largest such oversize blocks until as many bytes) and try again;
  then release every cached whole segment of both pools and try once more (``num_alloc_retries``
  counts this step, fruitful or not); then out of memory;
* ``expandable_segments=True``: one segment per pool whose virtual address space is mapped in
  pages (2 MiB small, 20 MiB large) as needed, at the lowest free address that gives room (an
  unmapped hole, or the free end of the mapped part plus fresh pages); best fit passes over a
  fitting block at the mapped end of a segment for the next larger one while that one could grow
  less (PyTorch ranks them by the size they could grow to); releasing the cache unmaps every whole
  free page. ``num_device_alloc``/``num_device_free`` then count page-range maps/unmaps.

Not modelled: streams (one stream, so no ``record_stream`` delays), CUDA graph pools,
``garbage_collection_threshold``, ``roundup_power2_divisions``, per-process memory fractions,
``empty_cache`` calls, and memory outside the allocator (CUDA context, cuBLAS workspaces, NCCL
buffers): ``capacity_bytes`` is what the allocator itself may hold.

Approximated:

* addresses: each new segment lies above every earlier one, whereas ``cudaMalloc`` may hand back
  a freed range. Only the choice among free blocks of equal size depends on it.
* expandable segments: the address space of a segment is 9/8 of ``capacity_bytes`` as in PyTorch
  (9/8 of the GPU's memory), or 256 TiB without a capacity, so one segment per pool suffices; it
  only weighs in the best-fit preference above. A page range is mapped whole or not at all
  against the capacity (PyTorch maps page by page and undoes a range that fails: same outcome).
  The release of oversize blocks is skipped in this mode (PyTorch asserts on an expandable block
  there).
"""

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Protocol

MiB = 1 << 20
MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segments, and expandable pages of the small pool
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segments for 1-10 MiB requests, expandable large-pool pages
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
_UNLIMITED = 1 << 64  # max_split_size's default, SIZE_MAX
_ADDRESS_SPACE = 1 << 48  # of an expandable segment when there is no capacity


def round_size(size: int) -> int:
    """Bytes of the block a request of ``size`` bytes needs: a multiple of 512 (0 for 0)."""
    return -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def segment_size(rounded: int) -> int:
    """Bytes of the segment ("cudaMalloc") made when no cached block holds ``rounded`` bytes."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class AllocatorStats:
    """What ``torch.cuda.memory_stats()`` would say after a replay, in bytes and counts."""

    peak_allocated: int  # bytes: max over time of the bytes in blocks handed out (rounded sizes)
    peak_requested: int  # bytes: max over time of the bytes requested (unrounded)
    peak_reserved: int  # bytes: max over time of the bytes in segments (mapped pages if expandable)
    allocated_at_peak: int  # bytes allocated at the end of the event in which reserved first peaked
    fragmentation: float  # 1 - allocated_at_peak / peak_reserved (0.0 when nothing was reserved)
    num_alloc_retries: int  # cache flushes followed by a retry, as torch.cuda.memory_stats() counts
    num_device_alloc: int  # segments allocated (page ranges mapped when expandable)
    num_device_free: int  # segments freed (page ranges unmapped when expandable)
    allocated: int  # bytes allocated after the last event
    reserved: int  # bytes reserved after the last event

    @property
    def reserved_over_allocated(self) -> float:
        """Peak reserved over peak allocated, minus one: what the cache costs beyond the most
        bytes ever in use at once. Unlike ``fragmentation`` it does not depend on when the last
        segment happened to be added (with no capacity limit, reserved never shrinks)."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0


class OutOfMemoryError(MemoryError):
    """A request that neither the cache nor the device could serve, even after releasing the cache.

    ``size`` is the request in bytes, ``stats`` the allocator's state when it failed; ``event_index``
    and ``id`` name the event when raised by :func:`simulate`.
    """

    def __init__(self, message: str, size: int, stats: AllocatorStats,
                 event_index: Optional[int] = None, id: Hashable = None):
        super().__init__(message)
        self.size = size
        self.stats = stats
        self.event_index = event_index
        self.id = id


class AllocEvent(Protocol):
    op: str  # "malloc" or "free"
    id: Hashable  # unique among live allocations
    size: int  # bytes; ignored for a free


class _Block:
    """A range of a segment: handed out, cached free, or (expandable) not backed by memory."""

    __slots__ = ("addr", "size", "pool", "segment", "prev", "next", "allocated", "mapped", "requested")

    def __init__(self, addr: int, size: int, pool: "_Pool", segment: Optional["_Expandable"] = None,
                 mapped: bool = True):
        self.addr, self.size, self.pool, self.segment, self.mapped = addr, size, pool, segment, mapped
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None
        self.allocated = False
        self.requested = 0


class _Pool:
    """The free blocks of a pool ordered by (size, address); its unmapped ranges by address."""

    __slots__ = ("small", "free", "unmapped")

    def __init__(self, small: bool):
        self.small = small
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []

    def add(self, block: _Block) -> None:
        insort(self.free, (block.size, block.addr, block))

    def take(self, block: _Block) -> None:
        # (size, addr) sorts just before its own entry, and addresses are unique.
        i = bisect_left(self.free, (block.size, block.addr))
        assert self.free[i][2] is block
        del self.free[i]

    def add_unmapped(self, block: _Block) -> None:
        insort(self.unmapped, (block.addr, block))

    def take_unmapped(self, block: _Block) -> None:
        del self.unmapped[bisect_left(self.unmapped, (block.addr,))]


@dataclass(frozen=True)
class _Expandable:
    addr: int
    size: int  # bytes of address space
    page: int  # bytes mapped at a time


def _splice(block: _Block, prev: Optional[_Block], next_: Optional[_Block]) -> None:
    block.prev, block.next = prev, next_
    if prev is not None:
        prev.next = block
    if next_ is not None:
        next_.prev = block


def _reach(block: _Block) -> int:
    """Bytes a free block could grow to by mapping the unmapped range after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


class CachingAllocator:
    """PyTorch's caching allocator for one device and one stream, step by step (sizes in bytes).

    Args:
        capacity_bytes: what the device lets the allocator hold; None for no limit.
        expandable_segments: the ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` mode.
        max_split_size: ``max_split_size_mb`` in bytes; None (the default) for no limit. PyTorch
            rejects values up to 20 MiB.
    """

    def __init__(self, capacity_bytes: Optional[int] = None, expandable_segments: bool = False,
                 max_split_size: Optional[int] = None):
        if max_split_size is not None and max_split_size <= LARGE_BUFFER:
            raise ValueError(f"max_split_size must exceed 20 MiB, got {max_split_size} bytes")
        self.capacity = capacity_bytes
        self.expandable = expandable_segments
        self.max_split = _UNLIMITED if max_split_size is None else max_split_size
        self._small, self._large = _Pool(small=True), _Pool(small=False)
        self._active: set[_Block] = set()
        self._next_addr = 0
        self.allocated = self.requested = self.reserved = 0
        self._peak_allocated = self._peak_requested = self._peak_reserved = self._allocated_at_peak = 0
        self._peak_pending = False
        self._retries = self._device_alloc = self._device_free = 0

    def malloc(self, size: int) -> Optional[_Block]:
        """A block of at least ``size`` bytes, or None for 0 bytes.

        Raises:
            OutOfMemoryError: when no cached block fits and no segment can be had within the capacity.
        """
        if size < 0:
            raise ValueError(f"negative request size {size}")
        if size == 0:
            return None
        rounded = round_size(size)
        pool = self._small if rounded <= SMALL_SIZE else self._large
        block = self._cached_block(pool, rounded)
        if block is None:
            block = self._new_block(pool, rounded)
        if block is None:
            self._settle_peak()
            raise OutOfMemoryError(
                f"out of memory: tried to allocate {size / MiB:.2f} MiB with {self.reserved / MiB:.2f} MiB"
                f" reserved ({self.allocated / MiB:.2f} MiB allocated) of a {self.capacity / MiB:.2f} MiB"
                " capacity",
                size, self.stats())
        if self._should_split(block, rounded):
            rest = _Block(block.addr + rounded, block.size - rounded, pool, block.segment)
            _splice(rest, block, block.next)
            block.size = rounded
            pool.add(rest)
        block.allocated, block.requested = True, size
        self._active.add(block)
        self.allocated += block.size
        self.requested += size
        self._peak_allocated = max(self._peak_allocated, self.allocated)
        self._peak_requested = max(self._peak_requested, self.requested)
        self._settle_peak()
        return block

    def free(self, block: Optional[_Block]) -> None:
        """Return ``block`` to the cache, merged with its free neighbours; None is a no-op."""
        if block is None:
            return
        if block not in self._active:
            raise ValueError("free of a block that is not allocated")
        self._active.remove(block)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self._merge(block, block.prev)
        self._merge(block, block.next)
        block.pool.add(block)

    def stats(self) -> AllocatorStats:
        """Peaks and counters so far (bytes)."""
        peak = self._peak_reserved
        return AllocatorStats(
            peak_allocated=self._peak_allocated,
            peak_requested=self._peak_requested,
            peak_reserved=peak,
            allocated_at_peak=self._allocated_at_peak,
            fragmentation=1.0 - self._allocated_at_peak / peak if peak else 0.0,
            num_alloc_retries=self._retries,
            num_device_alloc=self._device_alloc,
            num_device_free=self._device_free,
            allocated=self.allocated,
            reserved=self.reserved,
        )

    def segments(self) -> list[list[tuple[int, bool]]]:
        """Each segment (each mapped range of an expandable one) in address order, as the
        (bytes, allocated) of its blocks in address order: ``torch.cuda.memory_snapshot()`` in short."""
        blocks = [b for pool in (self._small, self._large) for _, _, b in pool.free] + list(self._active)
        heads = sorted((b for b in blocks if b.prev is None or not b.prev.mapped), key=lambda b: b.addr)
        result = []
        for block in heads:
            segment = []
            while block is not None and block.mapped:
                segment.append((block.size, block.allocated))
                block = block.next
            result.append(segment)
        return result

    # The steps of DeviceCachingAllocator::malloc, in its order.

    def _cached_block(self, pool: _Pool, size: int) -> Optional[_Block]:
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        if self.expandable:
            # Among fitting blocks, prefer one that cannot grow into unmapped space: the free end
            # of a segment is kept for requests that need to grow it.
            while i + 1 < len(free) and _reach(free[i + 1][2]) < _reach(free[i][2]):
                i += 1
        block = free[i][2]
        if size < self.max_split <= block.size:
            return None  # an oversize block is kept whole for an oversize request
        if size >= self.max_split and block.size >= size + LARGE_BUFFER:
            return None
        del free[i]
        return block

    def _new_block(self, pool: _Pool, size: int) -> Optional[_Block]:
        block = self._device_block(pool, size)
        if block is None and self._release_oversize(pool, size):
            block = self._device_block(pool, size)
        if block is None:
            self._release_cache()
            self._retries += 1
            block = self._device_block(pool, size)
        return block

    def _device_block(self, pool: _Pool, size: int) -> Optional[_Block]:
        if self.expandable:
            return self._expand(pool, size)
        nbytes = segment_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        block = _Block(self._next_addr, nbytes, pool)
        self._next_addr += nbytes
        self._grow(nbytes)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        rest = block.size - size
        if block.pool.small or self.expandable:
            return rest >= MIN_BLOCK_SIZE
        return size < self.max_split and rest > SMALL_SIZE

    def _merge(self, dst: _Block, src: Optional[_Block]) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            src.pool.take(src)
        else:
            src.pool.take_unmapped(src)
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self._device_alloc += 1
        if self.reserved > self._peak_reserved:
            self._peak_reserved = self.reserved
            self._peak_pending = True

    def _settle_peak(self) -> None:
        # Reserved grows inside a malloc before the block is handed out: fragmentation at the peak
        # is measured once the request is served.
        if self._peak_pending:
            self._allocated_at_peak = self.allocated
            self._peak_pending = False

    # Releasing the cache.

    def _release_segment(self, block: _Block) -> None:
        assert block.prev is None and block.next is None, "only whole segments go back to the device"
        block.pool.take(block)
        self.reserved -= block.size
        self._device_free += 1

    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: free the smallest cached segment of at least
        max(size, max_split_size) bytes, or else the largest oversize ones until that many bytes."""
        if self.max_split == _UNLIMITED or self.expandable:
            return False
        need = max(size, self.max_split)
        free = pool.free
        i = bisect_left(free, (need,))
        if i < len(free):
            self._release_segment(free[i][2])
            return True
        released = 0
        i -= 1
        while released < need and i >= 0 and free[i][0] >= self.max_split:
            released += free[i][0]
            self._release_segment(free[i][2])
            i -= 1
        return released >= need

    def _release_cache(self) -> None:
        """release_cached_blocks: every cached whole segment goes back; expandable segments unmap
        their free pages (and vanish when nothing of them stays mapped)."""
        for pool in (self._large, self._small):
            expandable = []
            for _, _, block in list(pool.free):
                if block.segment is not None:
                    expandable.append(block)
                elif block.prev is None and block.next is None:
                    self._release_segment(block)
            for block in expandable:
                self._unmap(block)
                if not block.mapped and block.prev is None and block.next is None:
                    pool.take_unmapped(block)

    # Expandable segments.

    def _expand(self, pool: _Pool, size: int) -> Optional[_Block]:
        """try_allocate_expandable_block: map pages until a free block of ``size`` bytes is there."""
        block = self._expandable_room(pool, size)
        if not block.mapped and not self._map(block, min(block.size, size)):
            return None
        while block.size < size:
            # A free mapped block is followed by unmapped room: map it and merge.
            after = block.next
            if not self._map(after, min(size - block.size, after.size)):
                return None
            block = after
        pool.take(block)
        return block

    def _expandable_room(self, pool: _Pool, size: int) -> _Block:
        """The lowest free or unmapped block from which ``size`` bytes of free or unmapped room
        follow (a new segment if none)."""
        for _, block in pool.unmapped:
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, cursor = 0, block
            while room < size and cursor is not None and not cursor.allocated:
                room += cursor.size
                cursor = cursor.next
            if room >= size:
                return block
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        space = _ADDRESS_SPACE if self.capacity is None else self.capacity + self.capacity // 8
        segment = _Expandable(self._next_addr, -(-space // page) * page, page)
        self._next_addr += segment.size
        block = _Block(segment.addr, segment.size, pool, segment, mapped=False)
        pool.add_unmapped(block)
        return block

    def _map(self, block: _Block, size: int) -> bool:
        """Back the first ``size`` bytes (whole pages) of an unmapped block with memory."""
        page = block.segment.page
        nbytes = -(-size // page) * page
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        pool = block.pool
        pool.take_unmapped(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, pool, block.segment, mapped=False)
            _splice(rest, block, block.next)
            pool.add_unmapped(rest)
            block.size = nbytes
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.add(block)
        self._grow(nbytes)
        return True

    def _unmap(self, block: _Block) -> None:
        """Give back the whole pages inside a free mapped block; the partial pages at its ends stay."""
        segment, pool = block.segment, block.pool
        low, high = block.addr - segment.addr, block.addr - segment.addr + block.size
        begin, end = -(-low // segment.page) * segment.page, high // segment.page * segment.page
        if begin >= end:
            return
        pool.take(block)
        if begin > low:
            before = _Block(block.addr, begin - low, pool, segment)
            _splice(before, block.prev, block)
            pool.add(before)
        if high > end:
            after = _Block(segment.addr + end, high - end, pool, segment)
            _splice(after, block, block.next)
            pool.add(after)
        block.addr, block.size, block.mapped = segment.addr + begin, end - begin, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.add_unmapped(block)
        self.reserved -= end - begin
        self._device_free += 1


def simulate(events: Iterable[AllocEvent], capacity_bytes: Optional[int] = None,
             expandable_segments: bool = False, max_split_size: Optional[int] = None) -> AllocatorStats:
    """Replay ``events`` (``op`` "malloc"/"free", ``id``, ``size`` in bytes) through the caching allocator.

    Args:
        capacity_bytes: what the allocator may hold on the device (bytes); None for no limit.
        expandable_segments: model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        max_split_size: ``max_split_size_mb`` in bytes (more than 20 MiB); None for PyTorch's default.

    Returns:
        The peaks (bytes) and counters after the last event.

    Raises:
        ValueError: on a free of an id that is not live, a malloc of a live id, a negative size or an
            unknown op, naming the event.
        OutOfMemoryError: when a request cannot be served within ``capacity_bytes``; it carries the
            event's index and id, the request's size and the allocator's stats at that point.
    """
    allocator = CachingAllocator(capacity_bytes, expandable_segments, max_split_size)
    live: dict[Hashable, Optional[_Block]] = {}
    for index, event in enumerate(events):
        if event.op == "malloc":
            if event.id in live:
                raise ValueError(f"event {index}: malloc of id {event.id!r}, which is already live")
            if event.size < 0:
                raise ValueError(f"event {index}: malloc of id {event.id!r} with negative size {event.size}")
            try:
                live[event.id] = allocator.malloc(event.size)
            except OutOfMemoryError as error:
                raise OutOfMemoryError(f"event {index}: malloc of id {event.id!r}: {error}", error.size,
                                       error.stats, index, event.id) from None
        elif event.op == "free":
            if event.id not in live:
                raise ValueError(f"event {index}: free of id {event.id!r}, which is not live")
            allocator.free(live.pop(event.id))
        else:
            raise ValueError(f"event {index}: op {event.op!r} is neither malloc nor free")
    return allocator.stats()
