"""Write-behind and backfill: fetched blocks to the disk tier, never in a reader's way.

* **Queue.** Blocks fetched from the store (:meth:`WriteBehind.offer`) are queued for the disk
  tier behind the reader (a reply never waits for a disk write), in runs that
  ``DISK_WRITE_THREADS`` writers take from one channel: while a run waits, no writer is idle.
  ``_enqueue_write`` is the one way in: it pins the blocks, counts their bytes and sends the
  run (the send is the writers' wake-up). Blocks waiting for the disk stay pinned, in the
  memory budget, and the bytes so pinned are bounded (a quarter of the budget).
* **Deferral.** A run that finds the queue full is deferred, not waited for: its keys are
  noted, and once the queue has drained to half the bound the deferred blocks still in memory
  are queued; those evicted meanwhile are not cached on disk (counted) but remembered as
  *lost*.
* **Fetch locks.** Blocks a fetch took the node's fetch locks for (``Fetcher._fill``) are
  released here once written, or once they will not be (evicted before the writer got to them,
  the tier off; a deferred block keeps its lock): another mount sharing the disk tier then
  reads them from the disk, or fetches them itself. The backfill takes no locks (it fetches
  again, when idle, blocks this mount lost).
* **Backfill.** Lost blocks are fetched again and written once the mount has been idle for
  ``BACKFILL_IDLE_S`` (no read, no read-ahead, nothing waiting for the disk), with memory only
  if it is free. A warm does the same for one version at once (``store_lost_now``), then checks
  the disk tier's table (``check_on_disk``): every block listed, or NotStoredError (ENOSPC).

Trio thread only; disk and store I/O run in worker threads on buffers the trio thread owns.
Waiters are woken through :class:`~objfs.wakeup.Signal`, whose event is replaced only once set.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from objfs.backends.base import Backend
from objfs.block_cache import Block, BlockCache, BlockKey, Reservation
from objfs.disk_cache import DiskCache
from objfs.errors import ObjfsError
from objfs.wakeup import Signal

if TYPE_CHECKING:
    from objfs.inodes import Handle

log = logging.getLogger("objfs.scheduler")  # the name it logged under

# Writes go through at most two threads: they are behind the reader, and more would only
# compete with it for the CPU.
DISK_WRITE_THREADS = 2
# Blocks per queued disk write (the disk tier writes runs of up to 8 blocks per pwritev).
WRITE_RUN_BLOCKS = 8
# Deferred write-behind runs remembered (keys only); older ones are forgotten.
DEFERRED_RUNS = 4096
# Blocks lost to the disk tier (evicted before the writer got to them) remembered for the
# backfill (16 GiB of 1 MiB blocks); older ones are forgotten.
BACKFILL_BLOCKS = 16384
# The backfill runs once the mount has been idle this long: no read, no read-ahead, nothing
# waiting for the disk.
BACKFILL_IDLE_S = 1.0


class NotStoredError(ObjfsError):
    """A warm into the caches (``objfs warm --cache-only``, through fsync) could not leave
    the whole version in the disk tier: ``objfs warm`` reports the bytes not stored."""

    errno = errno.ENOSPC
    log_level = logging.WARNING


class WriteBehind:
    """Carries the blocks one file system fetched into its disk tier."""

    def __init__(
        self,
        backend: Backend,
        cache: BlockCache,
        disk: DiskCache | None,
        *,
        block_size: int,
        part_blocks: int,
        disk_read_limiter: trio.CapacityLimiter,
        busy: Callable[[], bool],
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.disk = disk
        self.block_size = block_size
        self.part_blocks = part_blocks
        self.disk_read_limiter = disk_read_limiter
        self._busy = busy  # read-ahead is queued or waits for memory: the mount is not idle
        self._nursery: trio.Nursery | None = None
        # Runs of pinned blocks waiting for the disk, in one channel that every idle writer
        # receives from (each run goes to one writer, and no writer idles while a run waits),
        # and the bytes queued or being written.
        self._disk_runs_in, self._disk_runs = trio.open_memory_channel[
            list[tuple[BlockKey, Block]]
        ](math.inf)
        self._disk_write_bytes = 0
        self._disk_written = Signal()  # fired whenever a queued disk write finishes
        self._deferred: collections.deque[list[tuple[BlockKey, int]]] = collections.deque(
            maxlen=DEFERRED_RUNS
        )
        # Blocks the disk tier lost (key -> length), fetched again when the mount is idle.
        self._lost: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
        self._lost_noted = Signal()
        self.last_activity = 0.0  # trio time of the last read or fetch (see touch)
        self.disk_backfilled = 0  # lost blocks fetched again and written when idle
        self.disk_deferred = 0  # runs that found the write queue full
        self.disk_not_cached = 0  # blocks of deferred runs evicted before they were written

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.touch()
        if self.disk is not None:
            for _ in range(DISK_WRITE_THREADS):
                nursery.start_soon(self._disk_writer)
            nursery.start_soon(self._backfill)

    def offer(self, blocks: list[tuple[BlockKey, Block]]) -> None:
        """Queue freshly fetched blocks (consecutive ones of one version) for the disk tier,
        pinned until written, in pieces that fit half the queue; a piece that finds the queue
        full is deferred."""
        disk = self.disk
        if disk is None or not disk.enabled or self._nursery is None:
            self._unlock(key for key, _ in blocks)
            return
        step = self._piece_blocks()
        for at in range(0, len(blocks), step):
            piece = blocks[at : at + step]
            if not self._enqueue_write(piece):
                # Their locks stay: another mount waiting for them would fetch them again
                # (the disk is behind the store now; it catches up within seconds).
                self.disk_deferred += 1
                if len(self._deferred) == self._deferred.maxlen:
                    self._note_lost(self._deferred[0])
                self._deferred.append([(key, len(block)) for key, block in piece])

    def write_now(self, key: BlockKey) -> None:
        """If block ``key`` waits in a deferred run, or is in memory but neither on disk nor
        queued for it (its write was refused or failed earlier), queue it for the disk now,
        past the queue's bound (by one block): a reader that must leave its blocks on disk
        (a warm) calls this for each block it has read, since read blocks are the first
        evicted."""
        for entries in self._deferred:
            for n, (deferred, _) in enumerate(entries):
                if deferred == key:
                    del entries[n]
                    block = self.cache.peek(key)
                    if block is not None:
                        self._enqueue_write([(key, block)], force=True)
                    else:
                        self._unlock([key])
                    if not entries:
                        self._deferred.remove(entries)
                    return
        disk = self.disk
        if disk is None or not disk.enabled or self._nursery is None:
            return
        block = self.cache.peek(key)
        if block is not None and not block.saved and not block.pins:  # (only the queue pins)
            self._enqueue_write([(key, block)], force=True)

    def _enqueue_write(self, piece: list[tuple[BlockKey, Block]], *, force: bool = False) -> bool:
        """The one way into the write queue: pin the run, count its bytes and send it (the
        send wakes an idle writer). False, and nothing changed, if the queue is full (unless
        ``force``)."""
        nbytes = sum(len(b) for _, b in piece)
        # Pinned blocks stay in the budget: bound them, so read-ahead keeps most of it.
        if not force and self._disk_write_bytes + nbytes > self._disk_queue_limit():
            return False
        for _, block in piece:
            block.pin()
        self._disk_write_bytes += nbytes
        self._disk_runs_in.send_nowait(piece)  # unbounded: never raises WouldBlock
        return True

    def _disk_queue_limit(self) -> int:
        return max(2 * self.block_size, self.cache.capacity_bytes // 4)

    def _piece_blocks(self) -> int:
        return max(1, min(WRITE_RUN_BLOCKS, self._disk_queue_limit() // 2 // self.block_size))

    def _requeue_deferred(self) -> None:
        """Once the queue is half empty, queue the deferred blocks still in memory."""
        disk = self.disk
        if disk is None or not disk.enabled:
            for entries in self._deferred:
                self._unlock(key for key, _ in entries)
            self._deferred.clear()
            return
        while self._deferred and self._disk_write_bytes <= self._disk_queue_limit() // 2:
            entries = self._deferred.popleft()
            pieces: list[list[tuple[BlockKey, Block]]] = []
            for key, length in entries:
                block = self.cache.peek(key)
                if block is None:
                    self._note_lost([(key, length)])
                elif pieces and key.block == pieces[-1][-1][0].block + 1:
                    pieces[-1].append((key, block))
                else:
                    pieces.append([(key, block)])
            for piece in pieces:  # each fits: at most half the queue, which is half empty
                self._enqueue_write(piece)

    # -- the backfill: blocks the disk tier lost, fetched again when idle --------------------

    def touch(self) -> None:
        """A read arrived or a fetch started: the mount is not idle."""
        self.last_activity = trio.current_time()

    def _unlock(self, keys: Iterable[BlockKey]) -> None:
        """These blocks are on disk, or will not be: other processes sharing the disk tier
        need not wait for them (see ``objfs.disk_cache.fetching``)."""
        if self.disk is not None:
            self.disk.fetch_locks.release_keys(keys)

    def _note_lost(self, entries: list[tuple[BlockKey, int]]) -> None:
        """Blocks evicted before the disk writer got to them: counted, and remembered (the
        newest ``BACKFILL_BLOCKS``) for the backfill."""
        self._unlock(key for key, _ in entries)
        self.disk_not_cached += len(entries)
        for key, length in entries:
            self._lost[key] = length
            self._lost.move_to_end(key)
        while len(self._lost) > BACKFILL_BLOCKS:
            self._lost.popitem(last=False)
        self._lost_noted.fire()

    def _idle_for(self) -> float:
        """Seconds the mount has been idle, 0 while anything is queued, fetched or written."""
        if self._busy() or self._disk_write_bytes:
            return 0.0
        return trio.current_time() - self.last_activity

    def _next_lost_run(
        self, version: tuple[str, str] | None = None
    ) -> tuple[BlockKey, list[int]] | None:
        """The oldest lost block (``version``: that version's first lost block) and the lost
        blocks that follow it (one version, up to a part), taken off the list: the first key
        and their lengths. Blocks back in memory are skipped: their fetch read them from the
        disk tier, or queued them for it."""
        while True:
            if version is None:
                if not self._lost:
                    return None
                first, length = self._lost.popitem(last=False)
            else:
                mine = [k for k in self._lost if (k.key, k.etag) == version]
                if not mine:
                    return None
                first = min(mine, key=lambda k: k.block)
                length = self._lost.pop(first)
            if self.cache.is_cached_or_pending(first):
                continue  # fetched again meanwhile: from the disk, or queued for it then
            lengths = [length]
            while len(lengths) < self.part_blocks:
                nxt = BlockKey(first.key, first.etag, first.block + len(lengths))
                if nxt not in self._lost or self.cache.is_cached_or_pending(nxt):
                    break
                lengths.append(self._lost.pop(nxt))
            return first, lengths

    def on_disk(self, key: BlockKey, block: Block) -> None:
        """Block ``key`` is known to be in the disk tier (read from it, or written whole):
        marked saved, and no longer lost (neither the backfill nor a warm fetches it again)."""
        block.saved = True
        self._lost.pop(key, None)

    def _put_back_lost(self, first: BlockKey, lengths: list[int]) -> None:
        """Return a run taken by ``_next_lost_run`` to the list (not stored after all)."""
        for n, length in enumerate(lengths):
            self._lost[BlockKey(first.key, first.etag, first.block + n)] = length

    async def _backfill(self) -> None:
        """Fetch again, when the mount is idle, the blocks the disk tier lost during a burst
        (evicted from memory before the writer got to them), and write them: after one cold
        load and a second of idleness the disk tier holds the whole file, so the next start
        needs no GET for it. Never competes with a reader: it waits for
        ``BACKFILL_IDLE_S`` of idleness before each run, takes memory only if free
        (``try_reserve``, evicting only used blocks), and its buffers never enter the cache."""
        disk = self.disk
        assert disk is not None
        while True:
            if not self._lost:
                await self._lost_noted.wait()
            idle = self._idle_for()
            if idle < BACKFILL_IDLE_S:
                await trio.sleep(BACKFILL_IDLE_S - idle)
                continue
            if not disk.enabled:
                self._lost.clear()
                continue
            run = self._next_lost_run()
            if run is None:
                continue
            first, lengths = run
            reservation = self.cache.try_reserve(sum(lengths), demand=False)
            if reservation is None:  # memory is busy: this is not idle after all
                self._put_back_lost(first, lengths)
                self.touch()
                continue
            try:
                await self._store_run(first, lengths, reservation)
            except Exception as exc:
                # A newer version replaced it (StaleObjectError), or the store or the disk
                # failed: no more of this version (its next read fetches what it needs).
                log.debug("disk cache backfill of %s stopped: %s", first.key, exc)
                self._forget_lost(first.key, first.etag)

    async def _store_run(
        self, first: BlockKey, lengths: list[int], reservation: Reservation
    ) -> None:
        """Fetch blocks ``first``... (``lengths``) into buffers that never enter the memory
        tier and write them to the disk tier; gives the buffers and ``reservation`` back."""
        disk = self.disk
        assert disk is not None
        blocks = self.cache.new_blocks(lengths)
        try:
            await self.backend.read_into(
                first.key, first.etag, first.block * self.block_size, [b.view for b in blocks]
            )
            stored = await trio.to_thread.run_sync(
                disk.write_blocks, first.key, first.etag, first.block, [b.view for b in blocks]
            )
            self.disk_backfilled += stored
        finally:
            for block in blocks:
                block.discard()
            reservation.release()

    async def check_on_disk(self, handle: Handle) -> None:
        """Raise NotStoredError (ENOSPC for the caller's fsync) unless the disk tier's table
        lists every block of the handle's version now: the last step of a warm into the
        caches, which must not report bytes as kept that the tier refused (the cap, the
        free-space floor), lost to a failing disk, or evicted again meanwhile."""
        disk = self.disk
        assert disk is not None
        bs = self.block_size
        lengths = [min(bs, handle.size - start) for start in range(0, handle.size, bs)]
        missing = await trio.to_thread.run_sync(
            disk.missing_bytes, handle.key, handle.etag, lengths, limiter=self.disk_read_limiter
        )
        if missing:
            raise NotStoredError(
                f"{handle.key}: {missing} of {handle.size} bytes could not be stored in the disk "
                f"cache (cap {disk.size_limit_bytes} bytes, --cache-size)"
            )

    def _forget_lost(self, key: str, etag: str) -> None:
        """Drop one version's lost blocks from the backfill's list."""
        for lost in [k for k in self._lost if (k.key, k.etag) == (key, etag)]:
            del self._lost[lost]

    async def store_lost_now(self, key: str, etag: str) -> int:
        """What the backfill would do for one version once the mount is idle, now: fetch
        again the blocks of ``key``/``etag`` the disk tier lost, a run of consecutive blocks
        (up to a part) per GET, and write them. For a warm into the caches, which must leave
        the whole version on disk when it returns. Raises what the store raises (the blocks
        not stored then stay on the backfill's list). Returns the blocks stored."""
        stored_before = self.disk_backfilled
        while self.disk is not None and self.disk.enabled:
            run = self._next_lost_run((key, etag))
            if run is None:
                break
            first, lengths = run
            try:
                reservation = await self.cache.reserve(sum(lengths), demand=True)
                await self._store_run(first, lengths, reservation)  # releases it
            except BaseException:
                self._put_back_lost(first, lengths)
                raise
        return self.disk_backfilled - stored_before

    async def _disk_writer(self) -> None:
        """One of ``DISK_WRITE_THREADS`` writers: takes the next queued run from the channel
        (any idle writer may get it, so all write at once when runs wait) and writes it."""
        disk = self.disk
        assert disk is not None
        while True:
            run = await self._disk_runs.receive()
            nbytes = sum(len(b) for _, b in run)
            try:
                if disk.enabled:
                    first = run[0][0]
                    stored = await trio.to_thread.run_sync(
                        disk.write_blocks,
                        first.key,
                        first.etag,
                        first.block,
                        [b.view for _, b in run],
                        [b.digest for _, b in run],
                    )
                    # ``stored`` counts from the run's first block; the others are not on
                    # disk (refused, or the write failed): a warm finds them missing.
                    for key, block in run[:stored]:
                        self.on_disk(key, block)
            except Exception:
                log.exception("disk cache write failed")
            finally:
                for _, block in run:
                    block.unpin()
                self._unlock(key for key, _ in run)
                self._disk_write_bytes -= nbytes
                self._requeue_deferred()
                self._disk_written.fire()

    async def flush_disk_writes(self) -> None:
        """Wait until every block queued for the disk cache is written."""
        while self._disk_write_bytes:
            await self._disk_written.wait()

    async def disk_room(self, *, settled: bool = False) -> None:
        """Wait while the disk tier is behind: writes deferred, or the write queue over half
        its bound (``settled``: any write queued). A reader that waits here before each block
        (a warm into the caches, with no kernel waiting for the bytes), and for ``settled``
        before it closes, never outruns the disk, so no block it reads is lost to the disk
        tier. Cannot wait forever: while runs are deferred a write is queued (each write's end
        queues the deferred runs once the queue is half empty, or drops those evicted)."""
        disk = self.disk
        limit = 0 if settled else self._disk_queue_limit() // 2
        while (
            disk is not None and disk.enabled and (self._deferred or self._disk_write_bytes > limit)
        ):
            await self._disk_written.wait()

    def statistics(self) -> dict[str, int]:
        return {
            "disk_write_queue_bytes": self._disk_write_bytes,
            "disk_writes_deferred": self.disk_deferred,
            "disk_blocks_backfilled": self.disk_backfilled,
            "disk_blocks_not_cached": self.disk_not_cached,
        }
