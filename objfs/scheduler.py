"""The read-ahead scheduler and the fetcher: what reaches the memory tier, and in what order.

:mod:`objfs.readahead` decides *what* each stream wants next; this module fetches it:

* **Jobs.** Read-ahead of whole aligned parts is queued as jobs, run in order by
  ``max_connections - 2`` workers (two connections stay free for the readers' own fetches, so a
  random read never queues behind a file). A job reserves its memory when queued if it can,
  otherwise when a worker takes it; a job that cannot get memory waits aside, holding no claim
  and no worker, until memory is released.
* **Demand.** A reader that needs a block fetches it at once. If a queued job holds the
  block, the reader takes it (and its share of the reservation) out of the job instead of
  waiting for a worker and a whole part.
* **One fetch per block.** A fetch reserves memory, then claims its blocks; readers of a
  claimed block wait for it. Order: reserve (may wait), claim, then take a connection, so a
  claim is never held while waiting for memory and readers cannot deadlock on read-ahead.
* **Ownership.** A job belongs to the handle that queued it: closing the handle cancels it and
  its claims end at once (a queued job) or when its fetch stops (a running one). Memory is
  accounted by :class:`~objfs.block_cache.Reservation` (see :mod:`objfs.block_cache`): a fetch
  that fails or is cancelled gives back exactly the bytes it did not turn into blocks.
* **Tiers.** A claimed run is filled from the disk tier where it has the blocks, the rest from
  the store with one ranged GET per run, received straight into the blocks' pooled buffers.
  Blocks fetched from the store are queued for the disk tier behind the reader (write-behind: a
  reply never waits for a disk write), in runs that ``DISK_WRITE_THREADS`` writers take from
  one channel: while a run waits, no writer is idle. The blocks waiting for the disk are pinned
  (and stay in the memory budget while pinned), and the bytes so pinned are bounded (a quarter
  of the budget). A run that finds the queue full is deferred, not waited for: its keys are
  noted, and once the queue has drained to half the bound the blocks of deferred runs that are
  still in memory are queued; those evicted meanwhile are not cached on disk (counted) but
  remembered until a later fetch reads or writes them on disk, and the *backfill* fetches the
  rest again and writes them once the mount has been idle for ``BACKFILL_IDLE_S`` (no read, no
  read-ahead, nothing waiting for the disk), with memory only if it is free: after a cold load
  and a second of idleness the disk tier holds every block it was offered. A warm
  (``store_lost_now``) does the same for one version at once, then reads the disk tier's
  table (``check_on_disk``): it succeeds only if every block of the version is listed
  there, else NotStoredError (ENOSPC), as the tier may refuse blocks (``write_blocks``
  stores fewer than given: its cap, its free-space floor) or lose them to a failing disk.

Everything here runs on the trio thread; disk and store I/O run in worker threads that fill
buffers the trio thread owns and never touch the cache.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from objfs.backends.base import Backend
from objfs.block_cache import Block, BlockCache, BlockKey, Reservation
from objfs.disk_cache import DiskCache
from objfs.errors import ObjfsError, StaleObjectError
from objfs.readahead import Stream

if TYPE_CHECKING:
    from objfs.inodes import Handle

log = logging.getLogger(__name__)

# Disk reads run in threads; a few keep one disk busy. Writes go through at most two threads:
# they are behind the reader, and more would only compete with it for the CPU.
DISK_READ_THREADS = 4
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


@dataclass
class Claim:
    """Blocks one fetch will fill and the memory reserved for them."""

    keys: list[BlockKey]
    reservation: Reservation


@dataclass(eq=False)  # hashed by identity: jobs are kept in sets
class _Job:
    """Read-ahead of blocks [first, stop) of one handle, waiting in the queue."""

    handle: Handle
    first: int
    stop: int
    claim: Claim | None  # claimed when queued, or not yet
    stream: Stream | None  # the read-ahead stream that asked for it
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class Fetcher:
    """Fills the memory tier for the handles of one file system."""

    def __init__(
        self,
        backend: Backend,
        cache: BlockCache,
        disk: DiskCache | None,
        *,
        block_size: int,
        part_blocks: int,
        prefetch_workers: int,
        on_stale: Callable[[Handle], None],
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.disk = disk
        self.block_size = block_size
        self.part_blocks = part_blocks
        self.prefetch_workers = prefetch_workers
        self._on_stale = on_stale
        self._nursery: trio.Nursery | None = None
        self.disk_read_limiter = trio.CapacityLimiter(DISK_READ_THREADS)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._starved: list[_Job] = []  # jobs waiting for memory
        self._memory_generation = 0  # counts releases of memory
        self._starved_at = 0  # the generation at which a job last failed to get memory
        # Idle read-ahead workers, each waiting on its own event: a queued job wakes one of
        # them, a release of memory wakes one only while jobs wait for memory. (One shared
        # event woke all 32 workers for every block a reader consumed: a third of the trio
        # thread's time in a cold load.)
        self._idle: collections.deque[trio.Event] = collections.deque()
        self._queued_job_of: dict[BlockKey, _Job] = {}
        self._jobs_of: dict[int, set[_Job]] = {}  # fh -> its cancellable jobs
        cache.on_space = self._memory_released
        # Write-behind: runs of pinned blocks waiting for the disk, in one channel that every
        # idle writer receives from (each run goes to one writer, and no writer idles while a
        # run waits), and the bytes queued or being written.
        self._disk_runs_in, self._disk_runs = trio.open_memory_channel[
            list[tuple[BlockKey, Block]]
        ](math.inf)
        self._disk_write_bytes = 0
        self._disk_written = trio.Event()  # set whenever a queued disk write finishes
        self._deferred: collections.deque[list[tuple[BlockKey, int]]] = collections.deque(
            maxlen=DEFERRED_RUNS
        )
        # Blocks the disk tier lost (key -> length), fetched again when the mount is idle.
        self._lost: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
        self._lost_noted = trio.Event()
        self.last_activity = 0.0  # trio time of the last read or fetch (see touch)
        self.disk_backfilled = 0  # lost blocks fetched again and written when idle
        self.disk_deferred = 0  # runs that found the write queue full
        self.disk_not_cached = 0  # blocks of deferred runs evicted before they were written
        self.worker_wakeups = 0  # idle read-ahead workers woken

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.touch()
        for _ in range(self.prefetch_workers):
            nursery.start_soon(self._prefetch_worker)
        if self.disk is not None:
            for _ in range(DISK_WRITE_THREADS):
                nursery.start_soon(self._disk_writer)
            nursery.start_soon(self._backfill)

    # -- geometry --------------------------------------------------------------------------

    def key(self, handle: Handle, index: int) -> BlockKey:
        return BlockKey(handle.key, handle.etag, index)

    def length(self, handle: Handle, index: int) -> int:
        return min(self.block_size, handle.size - index * self.block_size)

    def block_count(self, handle: Handle) -> int:
        return ceil_div(handle.size, self.block_size)

    # -- read-ahead ------------------------------------------------------------------------

    def prefetch(
        self,
        handle: Handle,
        window: tuple[int, int],
        *,
        cancellable: bool,
        stream: Stream | None = None,
    ) -> None:
        """Queue the blocks of byte range ``window`` for read-ahead, in whole aligned parts.

        ``stream``: the stream that asked. A job that waits for memory is trimmed to what its
        stream has not read yet when it runs (dropped if nothing is left, or if the stream is
        gone): with many readers on one file, a late job would otherwise fetch again blocks
        its readers already read and the cache already evicted."""
        if self._nursery is None:
            return
        bs, part = self.block_size, self.part_blocks
        count = self.block_count(handle)
        first = window[0] // bs
        # Round the end up to a part boundary: every GET is a whole part, and every stream and
        # handle asks for the same parts.
        stop = min(count, ceil_div(ceil_div(window[1], bs), part) * part)
        index = first
        while index < stop:
            part_end = min(stop, (index // part + 1) * part)
            keys = [self.key(handle, i) for i in range(index, part_end) if not handle.served[i]]
            if not all(self.cache.is_cached_or_pending(k) for k in keys):
                # Claim now if memory allows, so a reader arriving next waits for this fetch
                # instead of sending its own; otherwise the job waits for memory first.
                claim = self._try_claim(handle, index, part_end, demand=False)
                if claim is None or claim.keys:
                    job = _Job(handle, index, part_end, claim, stream)
                    if cancellable:
                        self._jobs_of.setdefault(handle.fh, set()).add(job)
                    self._jobs.append(job)
                    for key in claim.keys if claim else ():
                        self._queued_job_of[key] = job
                    self._wake_workers()
            index = part_end

    def cancel(self, handle: Handle) -> None:
        """The handle closed: cancel its read-ahead, queued and in flight."""
        for job in self._jobs_of.pop(handle.fh, ()):
            job.scope.cancel()
        self._starved = [j for j in self._starved if not j.scope.cancel_called]
        # Queued jobs never start: end their claims now so readers do not wait on them.
        for job in [j for j in self._jobs if j.scope.cancel_called]:
            self._jobs.remove(job)
            if job.claim is not None:
                for key in job.claim.keys:
                    self._queued_job_of.pop(key, None)
                self.cache.finish(job.claim.keys)
                job.claim.reservation.release()

    def _steal(self, key: BlockKey) -> Claim | None:
        """Take ``key`` (and its reserved bytes) out of the claim of the queued read-ahead job
        that will fetch it; None if no queued job holds it (its fetch is under way)."""
        job = self._queued_job_of.pop(key, None)
        if job is None or job.claim is None or key not in job.claim.keys:
            return None
        job.claim.keys.remove(key)
        length = self.length(job.handle, key.block)
        return Claim([key], job.claim.reservation.split(length))

    def _wake_workers(self, count: int = 1) -> None:
        """Wake up to ``count`` idle read-ahead workers."""
        while count > 0 and self._idle:
            self._idle.popleft().set()
            self.worker_wakeups += 1
            count -= 1

    def _memory_released(self) -> None:
        self._memory_generation += 1
        if self._starved:
            self._wake_workers()  # it requeues the starved jobs and wakes more workers

    async def _next_job(self) -> _Job:
        """The oldest runnable job: queued first, then those that waited for memory.

        No job is left queued while a worker idles: a queued job woke one idle worker, or
        every worker was busy and takes it when it comes back here. A woken worker that
        finds the job taken by another simply waits again."""
        while True:
            if self._jobs:
                return self._jobs.popleft()
            # Retry jobs that waited for memory once memory was released since they failed.
            if self._starved and self._memory_generation != self._starved_at:
                self._jobs.extend(self._starved)
                self._starved.clear()
                self._wake_workers(len(self._jobs) - 1)  # this worker takes the first
                continue
            event = trio.Event()
            self._idle.append(event)
            try:
                await event.wait()
            finally:
                if not event.is_set():  # cancelled while idle: no wake may go to it
                    self._idle.remove(event)

    async def _prefetch_worker(self) -> None:
        """Run queued read-ahead jobs in order; one worker per read-ahead connection."""
        while True:
            job = await self._next_job()
            if job.scope.cancel_called:
                continue
            if job.claim is None:
                if job.stream is not None:
                    start = job.handle.readahead.overtaken(job.stream, job.first * self.block_size)
                    job.first = max(job.first, start // self.block_size)
                if job.first >= job.stop:
                    self._forget_job(job)
                    continue  # the readers got there first (their own fetches did the work)
                job.claim = self._try_claim(job.handle, job.first, job.stop, demand=False)
                if job.claim is None:
                    self._starved.append(job)
                    self._starved_at = self._memory_generation
                    continue
            else:
                for key in job.claim.keys:
                    self._queued_job_of.pop(key, None)
            try:
                with job.scope:
                    await self._fetch(job.handle, demand=False, claim=job.claim)
            except Exception as exc:
                # The reader that needs these blocks fetches them again and sees the error.
                log.debug("read-ahead of %s block %d failed: %s", job.handle.key, job.first, exc)
            finally:
                self._forget_job(job)

    def _forget_job(self, job: _Job) -> None:
        jobs = self._jobs_of.get(job.handle.fh)
        if jobs is not None:
            jobs.discard(job)

    # -- demand ----------------------------------------------------------------------------

    async def demand(self, handle: Handle, index: int) -> None:
        """A reader needs block ``index`` now: wait for its fetch in flight, or fetch it.

        On return the block is usually cached; if it is not (the fetch failed for another
        reader, or it was evicted at once under a tiny budget) the caller reads around it.
        Raises the store's error when this reader's own fetch fails.
        """
        key = self.key(handle, index)
        event = self.cache.pending(key)
        if event is not None:
            stolen = self._steal(key)
            if stolen is not None:
                # Its read-ahead has not started: fetch this block now, alone, instead of
                # waiting for a worker and then for a whole part.
                await self._fetch(handle, demand=True, claim=stolen)
            else:
                await event.wait()
            if self.cache.contains(key):
                return
            # The fetch failed, was cancelled or its block was evicted already: fetch it here.
        await self.fetch_blocks(handle, index, index + 1, demand=True)
        if not self.cache.contains(key):  # claimed by another reader meanwhile: wait once more
            event = self.cache.pending(key)
            if event is not None:
                await event.wait()

    # -- fetching --------------------------------------------------------------------------

    def _try_claim(self, handle: Handle, first: int, stop: int, *, demand: bool) -> Claim | None:
        """Read-ahead's claim: reserve memory for [first, stop) now or return None, then
        claim the blocks nobody has, is fetching, or has served to the kernel already."""
        wanted = [i for i in range(first, stop) if not handle.served[i]]
        total = sum(self.length(handle, i) for i in wanted)
        reservation = self.cache.try_reserve(total, demand=demand)
        if reservation is None:
            return None
        return self._claim_reserved(handle, wanted, reservation)

    def _claim_reserved(
        self, handle: Handle, indexes: list[int], reservation: Reservation
    ) -> Claim:
        """With memory reserved for the blocks ``indexes``: claim those nobody has or is
        fetching, give back the bytes of the others."""
        claimed = self.cache.claim([self.key(handle, i) for i in indexes])
        needed = sum(self.length(handle, k.block) for k in claimed)
        reservation.give_back(reservation.remaining - needed)
        return Claim(claimed, reservation)

    async def fetch_blocks(self, handle: Handle, first: int, stop: int, *, demand: bool) -> None:
        """Fetch blocks [first, stop) that nobody else has or is fetching into the cache."""
        indexes = list(range(first, stop))
        reservation = await self.cache.reserve(
            sum(self.length(handle, i) for i in indexes), demand=demand
        )
        await self._fetch(
            handle, demand=demand, claim=self._claim_reserved(handle, indexes, reservation)
        )

    async def _fetch(self, handle: Handle, *, demand: bool, claim: Claim) -> None:
        """Fill the claimed blocks; always ends the claim and releases what is left of its
        reservation, whatever happens."""
        try:
            for run in _runs(sorted(k.block for k in claim.keys)):
                await self._fetch_run(handle, run[0], run[-1] + 1, claim.reservation)
        finally:
            self.cache.finish(claim.keys)
            claim.reservation.release()

    async def _fetch_run(
        self, handle: Handle, first: int, stop: int, reservation: Reservation
    ) -> None:
        """Fill claimed blocks [first, stop) from disk or the store, spending ``reservation``
        on each block cached."""
        indexes = range(first, stop)
        new = self.cache.new_blocks([self.length(handle, i) for i in indexes])
        blocks = dict(zip(indexes, new, strict=True))
        try:
            missing = list(blocks)
            disk = self.disk
            if disk is not None and disk.enabled:
                found = await trio.to_thread.run_sync(
                    self.read_disk_blocks_into,
                    handle,
                    [(i, blocks[i].view) for i in missing],
                    limiter=self.disk_read_limiter,
                )
                for index in found:
                    block = blocks.pop(index)
                    key = self.key(handle, index)
                    self._on_disk(key, block)
                    self.cache.put(key, block, reservation)
                missing = [i for i in missing if i not in found]
            for run in _runs(missing):
                start = run[0] * self.block_size
                try:
                    await self.backend.read_into(
                        handle.key, handle.etag, start, [blocks[i].view for i in run]
                    )
                except StaleObjectError:
                    self._on_stale(handle)
                    raise
                written = [(self.key(handle, i), blocks.pop(i)) for i in run]
                for key, block in written:
                    self.cache.put(key, block, reservation)
                self._write_behind(written)
        finally:
            for block in blocks.values():
                block.discard()

    # -- the disk tier ---------------------------------------------------------------------

    def read_disk_blocks_into(
        self, handle: Handle, wanted: list[tuple[int, memoryview]]
    ) -> set[int]:
        """(Worker thread) Fill the views (each its block's length) of the blocks the disk
        tier holds; their indexes."""
        assert self.disk is not None
        return self.disk.read_blocks_into(
            handle.key, handle.etag, [i for i, _ in wanted], [v for _, v in wanted]
        )

    def _write_behind(self, blocks: list[tuple[BlockKey, Block]]) -> None:
        """Queue freshly fetched blocks (consecutive ones of one version) for the disk tier,
        pinned until written, in pieces that fit half the queue; a piece that finds the queue
        full is deferred."""
        disk = self.disk
        if disk is None or not disk.enabled or self._nursery is None:
            return
        step = self._piece_blocks()
        for at in range(0, len(blocks), step):
            piece = blocks[at : at + step]
            if not self._enqueue_write(piece):
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

    def _note_lost(self, entries: list[tuple[BlockKey, int]]) -> None:
        """Blocks evicted before the disk writer got to them: counted, and remembered (the
        newest ``BACKFILL_BLOCKS``) for the backfill."""
        self.disk_not_cached += len(entries)
        for key, length in entries:
            self._lost[key] = length
            self._lost.move_to_end(key)
        while len(self._lost) > BACKFILL_BLOCKS:
            self._lost.popitem(last=False)
        self._lost_noted.set()

    def _idle_for(self) -> float:
        """Seconds the mount has been idle, 0 while anything is queued, fetched or written."""
        if self._jobs or self._starved or self._disk_write_bytes:
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

    def _on_disk(self, key: BlockKey, block: Block) -> None:
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
                self._lost_noted = trio.Event()
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
        lengths = [self.length(handle, i) for i in range(self.block_count(handle))]
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
                    )
                    # ``stored`` counts from the run's first block; the others are not on
                    # disk (refused, or the write failed): a warm finds them missing.
                    for key, block in run[:stored]:
                        self._on_disk(key, block)
            except Exception:
                log.exception("disk cache write failed")
            finally:
                for _, block in run:
                    block.unpin()
                self._disk_write_bytes -= nbytes
                self._requeue_deferred()
                self._disk_written.set()
                self._disk_written = trio.Event()

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
            "queued_jobs": len(self._jobs),
            "starved_jobs": len(self._starved),
            "readahead_wakeups": self.worker_wakeups,
            "disk_write_queue_bytes": self._disk_write_bytes,
            "disk_writes_deferred": self.disk_deferred,
            "disk_blocks_backfilled": self.disk_backfilled,
            "disk_blocks_not_cached": self.disk_not_cached,
        }


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up (for non-negative ``a`` and positive ``b``)."""
    return -(-a // b)


def _runs(indexes: list[int]) -> Iterator[list[int]]:
    """Split sorted block numbers into runs of consecutive numbers."""
    run: list[int] = []
    for index in indexes:
        if run and index != run[-1] + 1:
            yield run
            run = []
        run.append(index)
    if run:
        yield run
