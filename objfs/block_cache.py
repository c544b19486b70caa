"""Memory tier of fixed-size blocks keyed by object version, under a global byte budget.

Concurrency invariants (trio, one thread):

* The LRU, the in-flight table and the budget are touched only from the trio thread;
  backends and the disk tier run their blocking work in worker threads and hand back bytes,
  so no locking is needed.
* A fetch first *claims* the blocks it will fill (``claim``): later readers of a claimed block
  wait on its event instead of sending another GET, across handles and processes. The
  fetcher always ``finish``-es its claim (in ``finally``), so waiters wake on failure and on
  cancellation too; a waiter that then finds no block fetches it itself.
* The budget counts cached blocks plus reserved (in-flight) bytes. Blocks that were
  prefetched but not read yet are *fresh*; blocks read at least once are *used*. A prefetch
  may evict only used blocks (least recently used first) and otherwise waits until a reader
  consumes a block or a fetch finishes: that wait is the backpressure that keeps the daemon
  inside ``--memory-limit`` without prefetches evicting each other's unread data. A reader's
  own fetch (demand) may evict fresh blocks too, newest first (the furthest ahead of its
  reader), so it never waits on read-ahead.

Used blocks are also capped on their own (``used_limit_bytes``): the kernel's page cache holds
what a reader got (objfs opens files with ``keep_cache``), so a used block is mostly a second
copy, and keeping few of them lets the allocator reuse their memory instead of faulting in
fresh pages for every block.

Blocks are keyed by (key, ETag, block number): a new object version never meets an old block,
so the cache never needs invalidation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import trio


class BlockKey(NamedTuple):
    key: str
    etag: str
    block: int  # block number: the block starts at block * block_size


class BlockCache:
    """Fresh and used blocks plus the in-flight table, bounded together by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, used_limit_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_limit_bytes = capacity_bytes if used_limit_bytes is None else used_limit_bytes
        self._used: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._used_bytes = 0
        self._fresh: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._reserved_bytes = 0  # claimed by fetches in flight
        self._inflight: dict[BlockKey, trio.Event] = {}
        self._space = trio.Event()  # set (and replaced) whenever bytes are released
        # Called whenever memory may have become available (set by the read-ahead queue).
        self.on_space: Callable[[], None] | None = None
        self.hits = 0
        self.inserts = 0
        self.evictions = 0
        self.peak_bytes = 0

    # -- lookups ---------------------------------------------------------------------------

    def get_nowait(self, key: BlockKey) -> bytes | None:
        """Return a cached block (marking it used and recent), or None."""
        data = self._used.get(key)
        if data is not None:
            self._used.move_to_end(key)
        else:
            data = self._fresh.pop(key, None)
            if data is None:
                return None
            self._used[key] = data
            self._used_bytes += len(data)
            # Over the used cap: drop the least recently used (never the block just read).
            while self._used_bytes > self.used_limit_bytes and len(self._used) > 1:
                self._evict_one(demand=False)
            self._wake()  # a consumed block is evictable by prefetches now
        self.hits += 1
        return data

    def contains(self, key: BlockKey) -> bool:
        return key in self._used or key in self._fresh

    def pending(self, key: BlockKey) -> trio.Event | None:
        """The event of a fetch in flight for ``key``, if any."""
        return self._inflight.get(key)

    def is_cached_or_pending(self, key: BlockKey) -> bool:
        return self.contains(key) or key in self._inflight

    # -- budget ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._cached_bytes + self._reserved_bytes

    def _wake(self) -> None:
        self._space.set()
        self._space = trio.Event()
        if self.on_space is not None:
            self.on_space()

    def _evict_one(self, *, demand: bool) -> bool:
        if self._used:
            _, data = self._used.popitem(last=False)
            self._used_bytes -= len(data)
        elif demand and self._fresh:
            # The newest unread block is the furthest ahead of its reader: the cheapest loss.
            _, data = self._fresh.popitem(last=True)
        else:
            return False
        self._cached_bytes -= len(data)
        self.evictions += 1
        return True

    def try_reserve(self, nbytes: int, *, demand: bool) -> bool:
        """Reserve ``nbytes`` now, evicting blocks if needed; False if it cannot."""
        while self.used_bytes + nbytes > self.capacity_bytes:
            if not self._evict_one(demand=demand):
                return False
        self._reserved_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    async def reserve(self, nbytes: int, *, demand: bool) -> None:
        """Reserve ``nbytes``, waiting while the budget is full.

        A demand request that cannot fit while nothing else is reserved is let through, so a
        budget smaller than one fetch slows objfs down but never deadlocks it.
        """
        while not self.try_reserve(nbytes, demand=demand):
            if demand and self._reserved_bytes == 0:
                self._reserved_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                return
            await self._space.wait()

    def unreserve(self, nbytes: int) -> None:
        if nbytes:
            self._reserved_bytes -= nbytes
            self._wake()

    # -- claims ----------------------------------------------------------------------------

    def claim(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Mark the keys that are neither cached nor in flight as in flight; return them."""
        mine = [k for k in keys if not self.contains(k) and k not in self._inflight]
        for k in mine:
            # One event per block: a claim may be split (a reader takes one block of a queued
            # read-ahead), and each block's waiters must wake when that block is done.
            self._inflight[k] = trio.Event()
        return mine

    def finish(self, keys: list[BlockKey]) -> None:
        """End a claim (fetched or not) and wake everyone waiting on it."""
        events = {self._inflight.pop(k) for k in keys if k in self._inflight}
        for event in events:
            event.set()
        self._wake()  # the blocks it cached are evictable by readers' own fetches

    def put(self, key: BlockKey, data: bytes) -> None:
        """Insert a fetched block (fresh, not read yet) whose bytes were reserved: they move
        from reserved to cached."""
        old = self._used.pop(key, None)
        if old is not None:
            self._used_bytes -= len(old)
            self._cached_bytes -= len(old)
        old = self._fresh.pop(key, None)
        if old is not None:
            self._cached_bytes -= len(old)
        self._fresh[key] = data
        self._cached_bytes += len(data)
        self._reserved_bytes -= len(data)
        self.inserts += 1

    def statistics(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "cached_bytes": self._cached_bytes,
            "inflight_bytes": self._reserved_bytes,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
        }
