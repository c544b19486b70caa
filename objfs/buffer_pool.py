"""Page-aligned buffers for the memory tier's blocks, slots of one arena, reused
(``BufferPool``; see its docstring for the invariant).

A block's bytes live in one ``Buffer``: filled in place by a socket ``recv_into`` or an
O_DIRECT disk read, written to disk and handed to the kernel from there, so a byte is never
copied in user space between the store and the FUSE reply.
"""

from __future__ import annotations

import contextlib
import mmap
import threading

_RELEASED = -2  # Buffer.slot once the buffer went back to its pool


class Buffer:
    """One pooled buffer: ``view``, a writable, page-aligned memoryview of ``buffer_size``
    bytes, and ``slot``, its place in the pool's arena (-1: a mapping of its own)."""

    __slots__ = ("slot", "view")

    def __init__(self, slot: int, view: memoryview) -> None:
        self.slot = slot
        self.view = view


class BufferPool:
    """Page-aligned buffers of ``buffer_size`` bytes, slots of one arena, reused.

    The arena is one private anonymous mapping of ``max_mapped`` buffers, advised to use
    transparent huge pages. A fresh page costs a fault and zeroing on first touch (a fifth of
    the daemon's CPU in an early profile of a cold load); a slot's pages stay mapped once
    touched, so a reused slot costs nothing.

    Slots of one run are adjacent when the arena allows (``acquire_run``: next fit from
    where the last run ended), and sequential runs follow each other, so consecutive blocks
    of a file usually sit back to back in memory: a read that spans them is answered with
    one view (``span``) instead of being assembled by a copy (the kernel's requests are
    rarely block-aligned; tests/benchmarks/README.md says how often). Single buffers
    (reply buffers) come from the arena's far end, out of the runs' way. When the arena has
    no free slot, a buffer gets a mapping of its own, unmapped on release (counted in
    ``buffers_overflow``; the block cache's budget keeps that rare).

    The arena may be mapped larger than it is used (``reserve_mapped`` slots): only the first
    ``active`` slots are handed out (``set_active``, as the block cache's budget grows and
    shrinks). Slots past ``active`` give their memory back to the system
    (``MADV_DONTNEED``) when ``give_back`` is called after ``active`` shrank below them (the
    file system waits a moment first: a budget that shrinks for an instant and grows again
    would fault the same memory in again), and when they are released after that, so the
    memory of a grown budget goes back to the system with the budget.

    Invariant: a slot is either free (in ``_free``) or owned by exactly one ``Buffer`` handed
    out and not yet released; ``release`` of a buffer twice raises (arena slot or not).
    Thread-safe (the disk writer releases buffers from worker threads).
    """

    def __init__(self, buffer_size: int, max_mapped: int, reserve_mapped: int = 0) -> None:
        if buffer_size % mmap.PAGESIZE:
            raise ValueError(f"buffer size {buffer_size} is not a multiple of the page size")
        self.buffer_size = buffer_size
        self.max_mapped = max(max_mapped, reserve_mapped)
        self.active = max_mapped  # slots handed out: the first `active` of the arena
        # Private, not mmap's default shared mapping: shared anonymous memory is shmem, every
        # page of it faulted and zeroed through the shmem layer.
        self._arena = mmap.mmap(
            -1, buffer_size * self.max_mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        # Transparent huge pages where the kernel offers them on request (the usual
        # "madvise" setting): 2 MiB pages instead of 4 KiB ones. Every byte of a block is
        # pinned page by page twice, by the receive or the O_DIRECT disk read and by the FUSE
        # reply's copy, so huge pages save most page faults (figures in
        # tests/benchmarks/README.md). Without THP: no effect.
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._arena.madvise(mmap.MADV_HUGEPAGE)
        self._all = memoryview(self._arena)
        self._free = bytearray(b"\x01") * self.max_mapped  # 1: the slot is free
        self._cursor = 0  # where the next run's search starts
        # Slots past `active` were given back since it last shrank: so are those released.
        self._settled = True
        self._lock = threading.Lock()
        self.in_use = 0  # buffers handed out and not released (arena or own mapping)
        self.overflow = 0  # buffers that got a mapping of their own (arena full)

    def set_active(self, count: int) -> None:
        """Hand out the first ``count`` slots of the arena (at most its mapped slots). Slots
        past it keep their memory until ``give_back``."""
        count = max(1, min(count, self.max_mapped))
        with self._lock:
            old, self.active = self.active, count
            if count < old:
                self._cursor = min(self._cursor, count)
                self._settled = False

    def give_back(self) -> int:
        """Give the memory of the free slots past ``active`` back to the system, and of those
        past it released from now on (until ``active`` shrinks again); the slots given back."""
        with self._lock:
            self._settled = True
            given = 0
            first = None
            for slot in range(self.active, self.max_mapped + 1):
                if slot < self.max_mapped and self._free[slot]:
                    if first is None:
                        first = slot
                elif first is not None:
                    self._give_back(first, slot - first)
                    given += slot - first
                    first = None
            return given

    def past_active(self) -> int:
        """Buffers in use in slots past ``active`` (handed out before it shrank)."""
        with self._lock:
            return self.max_mapped - self.active - self._free.count(1, self.active)

    def _give_back(self, slot: int, count: int) -> None:
        size = self.buffer_size
        self._arena.madvise(mmap.MADV_DONTNEED, slot * size, count * size)

    def acquire(self) -> Buffer:
        """One buffer, from the arena's far end if a slot is free."""
        with self._lock:
            slot = self._free.rfind(1, 0, self.active)
            if slot >= 0:
                return self._take(slot)
            self.in_use += 1
            self.overflow += 1
        return self._own()

    def acquire_run(self, count: int) -> list[Buffer]:
        """``count`` buffers, in adjacent slots when the arena has such a run free."""
        with self._lock:
            pattern = b"\x01" * count
            slot = self._free.find(pattern, self._cursor, self.active)
            if slot < 0:
                slot = self._free.find(pattern, 0, self.active)
            if slot >= 0:
                self._cursor = slot + count
                return [self._take(s) for s in range(slot, slot + count)]
            out = []
            for _ in range(count):
                slot = self._free.find(1, 0, self.active)
                if slot < 0:
                    break
                out.append(self._take(slot))
            missing = count - len(out)
            self.in_use += missing
            self.overflow += missing
        return out + [self._own() for _ in range(missing)]

    def _take(self, slot: int) -> Buffer:
        self._free[slot] = 0
        self.in_use += 1
        size = self.buffer_size
        return Buffer(slot, self._all[slot * size : (slot + 1) * size])

    def _own(self) -> Buffer:
        buf = mmap.mmap(-1, self.buffer_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return Buffer(-1, memoryview(buf))

    def release(self, buf: Buffer) -> None:
        if buf.slot == _RELEASED:
            raise AssertionError("a buffer was released twice")
        view, buf.view = buf.view, memoryview(b"")
        # A stale use of this Buffer fails instead of reading reused bytes (slices taken of
        # it stay valid: their owners release them, as Block does).
        with contextlib.suppress(BufferError):
            view.release()
        with self._lock:
            if buf.slot >= 0:
                if self._free[buf.slot]:
                    raise AssertionError(f"buffer slot {buf.slot} released twice")
                self._free[buf.slot] = 1
                if buf.slot >= self.active and self._settled:
                    self._give_back(buf.slot, 1)
            self.in_use -= 1
        buf.slot = _RELEASED

    def span(self, buffers: list[Buffer]) -> memoryview | None:
        """One view over ``buffers`` when they are adjacent slots in this order, else None."""
        first = buffers[0].slot
        if first < 0:
            return None
        for n, buf in enumerate(buffers):
            if buf.slot != first + n:
                return None
        size = self.buffer_size
        return self._all[first * size : (first + len(buffers)) * size]

    def statistics(self) -> dict[str, int]:
        return {
            "buffers_in_use": self.in_use,
            "buffers_overflow": self.overflow,
            "buffers_capacity": self.active,
            "buffers_mapped": self.max_mapped,
        }
