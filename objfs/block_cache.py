"""Memory tier of fixed-size blocks keyed by object version, under one byte budget.

Ownership, in one sentence: **every byte in the budget belongs either to a Reservation (a
fetch in flight) or to a live Block (cached, or evicted but still pinned by the disk writer),
and only a Reservation's or a Block's own methods move bytes into or out of the one counter**
(``_charged``: reserved plus cached plus held bytes). So every pooled buffer in use is inside
``capacity_bytes``, the disk tier's write queue included (the capacity when the bytes were
reserved: a budget that shrinks can leave them over it for a while, see ``set_budget``).

* A fetch reserves bytes first (``reserve``/``try_reserve`` return a :class:`Reservation`),
  then claims the blocks it will fill. ``put`` moves one block's bytes from the reservation to
  the cache; ``Reservation.release`` gives back what was not used, once (a second call gives
  back nothing). So a fetch that fails halfway, after some blocks were cached, returns exactly
  the bytes it still holds, and the counter can neither drift nor go negative.
* Blocks are *fresh* (fetched, not read to their end), or *used* (read to their end, or
  orphaned). A prefetch may evict only used blocks (least recently used first, but never
  one the disk writer pins, and one already on disk before an older one that is not) and
  otherwise waits: that wait is the backpressure that keeps the daemon inside
  ``--memory-limit`` without prefetches evicting each other's unread data, and a block a
  reader has read only half of is still fresh, so read-ahead never evicts it. A reader's own
  fetch (demand) may evict fresh blocks too, so it never waits on read-ahead: newest first
  (the furthest ahead of its reader), those already on disk before the others (they come
  back as a disk read, not a GET), and never one the disk writer pins (evicting it would free
  nothing and lose it): if every evictable block is pinned, the fetch waits for the writer
  to let one go.
* Fresh blocks belong to the open handles of their object version (``open_version`` /
  ``close_version`` count them). When the last handle of a version closes, its fresh blocks
  become *orphans*, and so does any block of that version that a fetch still in flight brings
  in later. Orphans are evicted before anything else (oldest first) by any fetch, so a block
  nobody will read never blocks read-ahead; until then a reopen of the version finds them
  (loaders open a shard for its header, close it, and open it again for its data).
* Used blocks are also capped on their own (``used_limit_bytes``): the kernel's page cache
  holds what a reader got (objfs opens files with ``keep_cache``), so a used block is mostly a
  second copy. The cap is soft: used blocks the disk writer pins stay over it until unpinned.

Buffers: a block's bytes live in a page-aligned buffer from ``buffer_pool.BufferPool``, filled in
place by the backend (a socket ``recv_into``) or the disk tier, written to disk from the same
buffer and handed to the kernel as a memoryview: no copy in user space. A fetch takes its
run's buffers in adjacent slots of the pool's arena when it can (``new_blocks``), so a read
that spans two blocks is one view of both (``span``), not a copy. A buffer goes back to
the pool when its block has left the cache *and* nobody pins it (``Block.pin``: the disk
writer does, while it writes); an evicted block that is still pinned is *held*: its bytes stay
charged until the last pin goes, so eviction of a pinned block makes no room. A reader's
memoryview is safe without a pin because it is handed to the kernel before the trio thread
runs anything else.

Concurrency invariants (trio, one thread): the LRU, the in-flight table and the budget are
touched only from the trio thread. A fetch first *claims* the blocks it will fill (``claim``):
later readers of a claimed block wait on its event instead of sending another GET. The fetcher
always ``finish``-es its claim (in ``finally``), so waiters wake on failure and cancellation
too; a waiter that then finds no block fetches it itself. Blocks are keyed by (key, ETag, block
number): a new object version never meets an old block, so nothing needs invalidation.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import trio

from objfs.buffer_pool import Buffer, BufferPool


class BlockKey(NamedTuple):
    key: str
    etag: str
    block: int  # block number: the block starts at block * block_size


# How many used blocks not yet on disk a victim search passes over to find one that is.
SAVED_SCAN = 16


class Block:
    """One cached block: ``view`` (its bytes) over a pooled buffer; ``digest``, their XXH3-64
    where the fetcher hashed them as they arrived (for the disk tier), else None."""

    __slots__ = (
        "_cache",
        "buffer",
        "cached",
        "digest",
        "held",
        "length",
        "pins",
        "saved",
        "used",
        "view",
    )

    def __init__(self, cache: BlockCache, buffer: Buffer, length: int) -> None:
        self._cache = cache
        self.buffer: Buffer | None = buffer
        self.length = length  # still known once the buffer went back to the pool
        self.view = buffer.view[:length]
        self.digest: int | None = None
        self.pins = 0  # holders that need the bytes beyond the current trio step
        self.cached = False  # in the LRU now
        self.held = False  # evicted while pinned: still charged to the budget
        self.used = False  # in the cache's used LRU (read to its end)
        # Written to the disk tier, or read from it: a hint (the disk tier may evict its copy
        # later), used only to choose which block to evict (_used_victim, _unread_victim).
        self.saved = False

    def __len__(self) -> int:
        return self.length

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        """Drop a pin (from any thread only through trio's run_sync_soon; see fs)."""
        self.pins -= 1
        if self.pins == 0 and self.cached:
            self._cache._unpinned(self)
        self._maybe_free()

    def _maybe_free(self) -> None:
        if self.pins == 0 and not self.cached and self.buffer is not None:
            self.view.release()
            self._cache.pool.release(self.buffer)
            self.buffer = None
            if self.held:
                self.held = False
                self._cache._unhold(self.length)

    def discard(self) -> None:
        """A block that never entered the cache (its fetch failed): free its buffer."""
        self._maybe_free()


def _slot(block: Block) -> int:
    """The pool slot of ``block``'s buffer (-1: none, or a mapping of its own)."""
    return -1 if block.buffer is None else block.buffer.slot


class Reservation:
    """Bytes of the budget held by one fetch. ``put`` spends them on blocks; ``release``
    gives back what is left, exactly once."""

    __slots__ = ("_cache", "remaining")

    def __init__(self, cache: BlockCache, nbytes: int) -> None:
        self._cache = cache
        self.remaining = nbytes

    def spend(self, nbytes: int) -> None:
        if nbytes > self.remaining:
            raise AssertionError(f"spending {nbytes} bytes of a {self.remaining}-byte reservation")
        self.remaining -= nbytes  # stays charged: now as a cached block

    def split(self, nbytes: int) -> Reservation:
        """Move ``nbytes`` into a new reservation (a reader takes a block out of a job)."""
        self.spend(nbytes)
        return Reservation(self._cache, nbytes)

    def give_back(self, nbytes: int) -> None:
        """Return ``nbytes`` of what is left to the budget."""
        if nbytes > self.remaining:
            raise AssertionError(f"giving back {nbytes} bytes of {self.remaining} reserved")
        if nbytes:
            self.remaining -= nbytes
            self._cache._charge(-nbytes)

    def release(self) -> None:
        """Return everything left (a second call returns nothing)."""
        self.give_back(self.remaining)


class ReplyGate:
    """The share of the budget for short-lived reply buffers: reads assembled across blocks,
    random reads fetched around the block tier, disk-cache blocks read for a random read.

    ``acquire(n)`` waits while ``used + n`` would exceed ``capacity_bytes``; a request larger
    than the whole share passes only when nothing else holds any (so it cannot deadlock, and
    the share is exceeded by at most that one request). Every ``acquire`` is matched by one
    ``release`` of the same size, by its caller, once the reply is handed to the kernel (a
    pooled reply buffer is given back lazily: at its owner's next read, or by ``reclaim``
    when an ``acquire`` would wait, since any task that runs comes after that reply). A
    holder never waits on the gate again before it releases, and never waits on the block
    tier's budget for its own bytes, so the two shares cannot wait on each other in a cycle.
    Trio thread only.
    """

    def __init__(self, capacity_bytes: int, cache: BlockCache) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.waits = 0
        # Set by the owner: gives back buffers whose replies were answered (see acquire).
        self.reclaim: Callable[[], None] | None = None
        self._waiting = 0
        self._cache = cache
        self._space = trio.Event()

    async def acquire(self, nbytes: int) -> None:
        while self.used_bytes and self.used_bytes + nbytes > self.capacity_bytes:
            if self.reclaim is not None:
                # Buffers of replies already handed to the kernel, given back lazily.
                self.reclaim()
                if not self.used_bytes or self.used_bytes + nbytes <= self.capacity_bytes:
                    break
            self.waits += 1
            self._waiting += 1
            try:
                await self._space.wait()
            finally:
                self._waiting -= 1
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self._cache.note_peak()

    def release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        if self.used_bytes < 0:
            raise AssertionError(f"reply gate released {-self.used_bytes} bytes too many")
        self._space.set()
        self._space = trio.Event()

    def poke(self) -> None:
        """A lazily given-back buffer was just answered: waiters wake and ``reclaim`` it
        (they run after the reply was handed to the kernel)."""
        if self._waiting:
            self._space.set()
            self._space = trio.Event()


class BlockCache:
    """Fresh and used blocks plus reservations, bounded together by ``capacity_bytes``; with
    the reply buffers' share (:class:`ReplyGate`), by ``budget_bytes`` (``--memory-limit``).

    The budget may move between its base and ``ceiling_bytes`` (:meth:`set_budget`). After it
    shrank, the bytes charged may stay over the new capacity in fresh blocks of open handles,
    pinned ones and orphans of fetches still in flight (the rest goes at once, see
    :meth:`set_budget`); reservations then wait as at any budget."""

    def __init__(
        self,
        budget_bytes: int,
        used_limit_bytes: int | None = None,
        *,
        block_size: int = 1 << 20,
        reply_bytes: int = 0,
        ceiling_bytes: int | None = None,
    ) -> None:
        if not 0 <= reply_bytes < budget_bytes:
            raise ValueError(f"reply share {reply_bytes} does not fit a {budget_bytes}-byte budget")
        self.budget_bytes = self.base_budget_bytes = budget_bytes
        self.ceiling_bytes = max(budget_bytes, ceiling_bytes or 0)
        self.capacity_bytes = budget_bytes - reply_bytes
        self.used_limit_bytes = self.base_used_limit_bytes = (
            self.capacity_bytes if used_limit_bytes is None else used_limit_bytes
        )
        self.block_size = block_size
        # Free buffers plus cached blocks stay within the budget's worth of buffers; the
        # arena is mapped for the ceiling, and only the budget's share of it is handed out.
        self.pool = BufferPool(
            block_size,
            max(1, budget_bytes // block_size),
            reserve_mapped=self.ceiling_bytes // block_size,
        )
        self.replies = ReplyGate(reply_bytes, self)
        self._used: OrderedDict[BlockKey, Block] = OrderedDict()
        self._used_bytes = 0
        self._fresh: OrderedDict[BlockKey, Block] = OrderedDict()
        self._orphans: OrderedDict[BlockKey, Block] = OrderedDict()
        self._charged = 0  # THE counter: reserved + cached bytes
        self._cached_bytes = 0
        self._held_bytes = 0  # evicted blocks still pinned (being written to disk)
        self._inflight: dict[BlockKey, trio.Event] = {}
        self.open_versions: Counter[tuple[str, str]] = Counter()  # handles per version
        self._space = trio.Event()  # set (and replaced) whenever bytes are released
        # Called whenever memory may have become available (set by the read-ahead queue).
        self.on_space: Callable[[], None] | None = None
        self.hits = 0
        self.inserts = 0
        self.evictions = 0
        self.orphaned = 0  # fresh blocks whose last handle closed before they were read
        self.evicted_unread = 0  # fresh blocks a reader's own fetch evicted (refetched later)
        self.peak_bytes = 0

    # -- the budget ------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._charged

    @property
    def reserved_bytes(self) -> int:
        return self._charged - self._cached_bytes - self._held_bytes

    def _charge(self, delta: int, *, wake: bool = True) -> None:
        """The one place the budget changes."""
        self._charged += delta
        if delta > 0:
            self.note_peak()
        elif wake:
            self._wake()

    def note_peak(self) -> None:
        """Track the highest use of the whole budget (blocks, reservations, reply buffers)."""
        self.peak_bytes = max(self.peak_bytes, self._charged + self.replies.used_bytes)

    def _wake(self) -> None:
        self._wake_waiters()
        if self.on_space is not None:
            self.on_space()

    def _unpinned(self, block: Block) -> None:
        """A cached block its last holder let go of (the disk writer, a reply written) is
        evictable now: a used one by any fetch (see ``_used_victim``), so the read-ahead
        queue is woken too; a fresh one only by a reader's own fetch (see
        ``_unread_victim``). What was kept only because it was pinned goes now: used blocks
        over their cap and, after the budget shrank, a used block or an orphan whose buffer
        lies past the budget's slots; the room that makes wakes the read-ahead queue too."""
        used = block.used
        evictions = self.evictions
        if _slot(block) >= self.pool.active:
            self._fit()
        elif used and self._used_bytes > self.used_limit_bytes:
            self._trim_used()
        if used or self.evictions != evictions:
            self._wake()
        else:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        self._space.set()
        self._space = trio.Event()

    def set_budget(self, budget_bytes: int) -> None:
        """Move the budget to ``budget_bytes``, kept between the base budget and the ceiling;
        the capacity, the used blocks' cap and the buffers handed out follow it, the reply
        share stays. A larger budget wakes the fetches waiting for memory.

        At a smaller or the same budget, orphans and used blocks are evicted at once down to
        the capacity and the used blocks' cap, and so are those whose buffers lie in slots
        past the budget's (their memory goes back to the system once the budget stays
        shrunk a moment, ``FileSystem._give_back_later``): an idle daemon does not keep them
        until its next fetch (this runs at every open and release, so the last
        close of a shared version counts too). What stays of a grown budget: fresh blocks
        that open handles will read (they go as any block, once read), blocks the disk
        writer pins (they go when it lets them go, ``_unpinned``), and orphans of fetches
        still in flight (they go first at the next fetch, open or release). Until the bytes
        charged fit, reservations wait as at any budget (a reader's own fetch passes when
        nothing else is reserved)."""
        budget = min(max(budget_bytes, self.base_budget_bytes), self.ceiling_bytes)
        if budget != self.budget_bytes:
            grew = budget > self.budget_bytes
            self.budget_bytes = budget
            self.capacity_bytes = budget - self.replies.capacity_bytes
            self.used_limit_bytes = self.base_used_limit_bytes * budget // self.base_budget_bytes
            self.pool.set_active(budget // self.block_size)
            if grew:
                self._wake()
                return
        self._fit()

    def _fit(self) -> None:
        """Evict orphans and used blocks down to the capacity and the used blocks' cap, and
        those whose buffers lie in slots past the budget's; never a pinned one."""
        if (
            self._charged <= self.capacity_bytes
            and self._used_bytes <= self.used_limit_bytes
            and not self.pool.past_active()
        ):
            return
        evicted = self.evictions
        while self._charged > self.capacity_bytes and self._evict_one(demand=False):
            pass
        self._trim_used()
        active = self.pool.active
        for blocks in (self._orphans, self._used):
            for key in [k for k, b in blocks.items() if not b.pins and _slot(b) >= active]:
                self._evict_from(blocks, key)
        if self.evictions != evicted:
            self._wake()

    def try_reserve(self, nbytes: int, *, demand: bool) -> Reservation | None:
        """Reserve ``nbytes`` now, evicting blocks if needed; None if it cannot."""
        while self._charged + nbytes > self.capacity_bytes:
            if not self._evict_one(demand=demand):
                return None
        self._charge(nbytes)
        return Reservation(self, nbytes)

    async def reserve(self, nbytes: int, *, demand: bool) -> Reservation:
        """Reserve ``nbytes``, waiting while the budget is full.

        A demand request that cannot fit while nothing else is reserved is let through, so a
        budget smaller than one fetch slows objfs down but never deadlocks it.
        """
        while True:
            reservation = self.try_reserve(nbytes, demand=demand)
            if reservation is not None:
                return reservation
            if demand and self.reserved_bytes == 0:
                self._charge(nbytes)
                return Reservation(self, nbytes)
            await self._space.wait()

    # -- lookups ---------------------------------------------------------------------------

    def get_nowait(self, key: BlockKey, *, to_end: bool = True) -> memoryview | None:
        """Return a cached block's bytes, or None. ``to_end``: the read reaches the block's
        last byte, so the block is used (evictable) now; otherwise it stays fresh."""
        block = self._used.get(key)
        if block is not None:
            self._used.move_to_end(key)
        else:
            block = self._fresh.get(key)
            if block is None:
                block = self._orphans.pop(key, None)
                if block is None:
                    return None
                self._fresh[key] = block  # its version is open again
            if to_end:
                del self._fresh[key]
                self._insert_used(key, block)
                self._wake()  # a consumed block is evictable by prefetches now
        self.hits += 1
        return block.view

    def quiet_view(self, key: BlockKey, *, to_end: bool) -> memoryview | None:
        """A block's bytes if reading them wakes nobody (used, or fresh and not read to its
        end); no change, no trio object: see ``objfs.kernel.memory_reads``."""
        block = self._used.get(key)
        block = self._fresh.get(key) if block is None and not to_end else block
        return None if block is None or block.buffer is None else block.view

    def read_quietly(self, key: BlockKey) -> None:
        """Count a read of a block :meth:`quiet_view` gave (a hit; a used one moves up)."""
        self.hits += 1
        with contextlib.suppress(KeyError):
            self._used.move_to_end(key)

    def contains(self, key: BlockKey) -> bool:
        return key in self._used or key in self._fresh or key in self._orphans

    def pending(self, key: BlockKey) -> trio.Event | None:
        """The event of a fetch in flight for ``key``, if any."""
        return self._inflight.get(key)

    def is_cached_or_pending(self, key: BlockKey) -> bool:
        return self.contains(key) or key in self._inflight

    # -- versions and their handles --------------------------------------------------------

    def open_version(self, key: str, etag: str) -> None:
        self.open_versions[(key, etag)] += 1

    def close_version(self, key: str, etag: str) -> None:
        """A handle closed; after the version's last one, its unread blocks go first."""
        version = (key, etag)
        self.open_versions[version] -= 1
        if self.open_versions[version] > 0:
            return
        del self.open_versions[version]
        orphans = [k for k in self._fresh if (k.key, k.etag) == version]
        for k in orphans:
            self._orphans[k] = self._fresh.pop(k)
        self.orphaned += len(orphans)
        if orphans:
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
        for k in keys:
            event = self._inflight.pop(k, None)
            if event is not None:
                event.set()
        self._wake()  # the blocks it cached are evictable by readers' own fetches

    def new_blocks(self, lengths: list[int]) -> list[Block]:
        """Blocks with empty pooled buffers for a fetch to fill: a run of consecutive blocks,
        in adjacent buffers when the pool can."""
        buffers = self.pool.acquire_run(len(lengths))
        return [Block(self, buf, n) for buf, n in zip(buffers, lengths, strict=True)]

    def span(self, keys: list[BlockKey]) -> memoryview | None:
        """One view over the cached blocks ``keys`` (consecutive blocks of one version, all
        but the last whole) when their buffers are adjacent; None otherwise. No hit counted,
        no LRU change: the caller marks the reads (``get_nowait``)."""
        buffers = []
        for key in keys:
            block = self.peek(key)
            if block is None or block.buffer is None:
                return None
            buffers.append(block.buffer)
        return self.pool.span(buffers)

    def put(self, key: BlockKey, block: Block, reservation: Reservation) -> None:
        """Insert a filled block; its bytes move from ``reservation`` to the cache."""
        reservation.spend(len(block))
        self._remove(key)
        self._cached_bytes += len(block)
        block.cached = True
        if (key.key, key.etag) in self.open_versions:
            self._fresh[key] = block
        else:  # its handles closed while it was on its way: nobody is waiting for it
            self._orphans[key] = block
            self.orphaned += 1
        self.inserts += 1

    # -- eviction --------------------------------------------------------------------------

    def _insert_used(self, key: BlockKey, block: Block) -> None:
        self._used[key] = block
        block.used = True
        self._used_bytes += len(block)
        self._trim_used(spare=key)  # never the block just read

    def _trim_used(self, spare: BlockKey | None = None) -> None:
        """Over the used cap: drop the least recently used (see ``_used_victim``). The cap
        is soft: blocks the disk writer pins stay until it lets them go."""
        while self._used_bytes > self.used_limit_bytes:
            victim = self._used_victim(spare)
            if victim is None:
                break
            self._evict_from(self._used, victim)

    def _remove(self, key: BlockKey) -> None:
        old = self._used.pop(key, None)
        if old is not None:
            old.used = False
            self._used_bytes -= len(old)
        else:
            old = self._fresh.pop(key, None) or self._orphans.pop(key, None)
        if old is not None:
            self._drop(old)

    def _drop(self, block: Block, *, wake: bool = True) -> None:
        self._cached_bytes -= len(block)
        block.cached = False
        if block.pins:  # its buffer lives on until unpinned: so do its bytes in the budget
            block.held = True
            self._held_bytes += len(block)
            return
        self._charge(-len(block), wake=wake)
        block._maybe_free()

    def _unhold(self, nbytes: int) -> None:
        """A held block's last pin went: its bytes leave the budget."""
        self._held_bytes -= nbytes
        self._charge(-nbytes)

    def peek(self, key: BlockKey) -> Block | None:
        """The cached block for ``key``, or None; no hit counted, no LRU change."""
        return self._used.get(key) or self._fresh.get(key) or self._orphans.get(key)

    def _evict_one(self, *, demand: bool) -> bool:
        """Evict one block: an orphan, else a used block (see ``_used_victim``), else (only
        for a reader's own fetch) a fresh block (see ``_unread_victim``). False if none may
        go: every used and fresh block is pinned by the disk writer, whose unpin wakes the
        waiters."""
        if self._orphans:
            self._evict_from(self._orphans)
            return True
        victim = self._used_victim()
        if victim is not None:
            self._evict_from(self._used, victim)
            return True
        if demand and self._fresh:
            key = self._unread_victim()
            if key is None:
                return False  # every unread block is pinned: evicting one would free nothing
            self.evicted_unread += 1
            self._evict_from(self._fresh, key)
            return True
        return False

    def _used_victim(self, spare: BlockKey | None = None) -> BlockKey | None:
        """The used block to evict (never ``spare``), oldest first, skipping the blocks the
        disk writer pins, and preferring one already on disk: the first unpinned one on
        disk, unless ``SAVED_SCAN`` unpinned ones not on disk come before it (then the
        oldest of those). None if every used block is pinned.

        A pinned block would free no memory, and it would leave the cache before it is on
        disk: a reader who needs it again meanwhile fetches it from the store (figures in
        tests/benchmarks/README.md). A block not on disk may be lost to the disk tier
        (a deferred write); one on disk comes back as a disk read."""
        fallback = None
        scan = SAVED_SCAN
        for key, block in self._used.items():
            if block.pins or key == spare:
                continue
            if block.saved:
                return key
            if fallback is None:
                fallback = key
            scan -= 1
            if scan == 0:
                break
        return fallback

    def _unread_victim(self) -> BlockKey | None:
        """The fresh block a reader's own fetch should evict: the newest (the furthest ahead
        of its reader) whose copy is on disk (it comes back as a disk read, not a GET), else
        the newest unpinned one; None if every fresh block is pinned (waiting for the disk
        writer: evicting it would free no memory and lose the block)."""
        fallback = None
        for key in reversed(self._fresh):
            block = self._fresh[key]
            if block.pins:
                continue
            if block.saved:
                return key
            if fallback is None:
                fallback = key
        return fallback

    def _evict_from(
        self, blocks: OrderedDict[BlockKey, Block], key: BlockKey | None = None
    ) -> None:
        """Evict ``key`` from ``blocks``, or their oldest."""
        block = blocks.popitem(last=False)[1] if key is None else blocks.pop(key)
        if blocks is self._used:
            block.used = False
            self._used_bytes -= len(block)
        self.evictions += 1
        self._drop(block, wake=False)  # the caller takes the room it made

    def statistics(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "orphaned": self.orphaned,
            "evicted_unread": self.evicted_unread,
            "cached_bytes": self._cached_bytes,
            "inflight_bytes": self.reserved_bytes,
            "held_bytes": self._held_bytes,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "budget_bytes": self.budget_bytes,
            "ceiling_bytes": self.ceiling_bytes,
            "reply_bytes": self.replies.used_bytes,
            "reply_peak_bytes": self.replies.peak_bytes,
            "reply_capacity_bytes": self.replies.capacity_bytes,
            "reply_waits": self.replies.waits,
            **self.pool.statistics(),
        }
