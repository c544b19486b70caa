"""The read-ahead scheduler and the fetcher: what reaches the memory tier, and in what order.

:mod:`objfs.readahead` decides *what* each stream wants next; this module fetches it:

* **Jobs.** Read-ahead of whole aligned parts is queued as jobs, run in order by
  ``max_connections - 2`` workers (two connections stay free for the readers' own fetches, so a
  random read never queues behind a file). ``_queue`` is the one way into the queue, and wakes
  an idle worker per job. A job reserves its memory when queued if it can, otherwise when a
  worker takes it; a job that cannot get memory waits aside, holding no claim and no worker,
  until memory is released.
* **Demand.** A reader that needs a block fetches it at once. If a queued job holds the
  block, the reader takes it (and its share of the reservation) out of the job instead of
  waiting for a worker and a whole part. A reader alone on its file fetches that block
  alone (the least wait); while several handles have the version open (tensor-parallel
  ranks faulting one file at different offsets), it fetches the rest of the block's part
  with it, up to the first block cached or in flight, if the memory can be had at once
  within the budget: the others' read-ahead would otherwise fetch the part around it in
  pieces, one GET each.
* **One fetch per block.** A fetch reserves memory, then claims its blocks; readers of a
  claimed block wait for it. Order: reserve (may wait), claim, then take a connection, so a
  claim is never held while waiting for memory and readers cannot deadlock on read-ahead.
* **Ownership.** A job belongs to the handle that queued it: closing the handle cancels it and
  its claims end at once (a queued job) or when its fetch stops (a running one). Memory is
  accounted by :class:`~objfs.block_cache.Reservation` (see :mod:`objfs.block_cache`): a fetch
  that fails or is cancelled gives back exactly the bytes it did not turn into blocks.
* **Tiers.** A claimed run is filled from the disk tier where it has the blocks, the rest from
  the store with one ranged GET per run, received straight into the blocks' pooled buffers;
  those go on to the disk tier through :mod:`objfs.write_behind` (``Fetcher.writes``).

Everything here runs on the trio thread; disk and store I/O run in worker threads that fill
buffers the trio thread owns and never touch the cache.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from objfs.backends.base import Backend
from objfs.block_cache import Block, BlockCache, BlockKey, Reservation
from objfs.disk_cache import DiskCache
from objfs.disk_cache.layout import block_hash
from objfs.errors import StaleObjectError
from objfs.rawhttp import FilledViews
from objfs.readahead import Stream
from objfs.write_behind import WriteBehind

if TYPE_CHECKING:
    from objfs.inodes import Handle

log = logging.getLogger(__name__)

# Disk reads run in threads; a few keep one disk busy.
DISK_READ_THREADS = 4
# How long a fetch waits for blocks another process sharing the disk tier is fetching before
# it fetches them itself (the other is alive but slow: a failing store, a slow disk).
NODE_FETCH_WAIT_S = 10.0
# How often a waiting fetch looks at the others' locks: first, and at most.
_LOCK_POLL_S = 0.005
_LOCK_POLL_MAX_S = 0.1


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
        self.worker_wakeups = 0  # idle read-ahead workers woken
        # Fetched blocks on their way to the disk tier, and the backfill of those it lost.
        self.writes = WriteBehind(
            backend,
            cache,
            disk,
            block_size=block_size,
            part_blocks=part_blocks,
            disk_read_limiter=self.disk_read_limiter,
            busy=lambda: bool(self._jobs or self._starved),
        )

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.writes.touch()
        for _ in range(self.prefetch_workers):
            nursery.start_soon(self._prefetch_worker)
        self.writes.start(nursery)

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
                    for key in claim.keys if claim else ():
                        self._queued_job_of[key] = job
                    self._queue([job])
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

    def _queue(self, jobs: Iterable[_Job], *, taken: int = 0) -> None:
        """The one way into the job queue: append ``jobs`` and wake an idle worker for each,
        but ``taken`` that the calling worker runs itself."""
        before = len(self._jobs)
        self._jobs.extend(jobs)
        self._wake_workers(len(self._jobs) - before - taken)

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
                starved, self._starved = self._starved, []
                self._queue(starved, taken=1)  # this worker takes the first
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
        claim = self._claim_part(handle, index)
        if claim is not None:
            await self._fetch(handle, demand=True, claim=claim)
        else:
            await self.fetch_blocks(handle, index, index + 1, demand=True)
        if not self.cache.contains(key):  # claimed by another reader meanwhile: wait once more
            event = self.cache.pending(key)
            if event is not None:
                await event.wait()

    def _claim_part(self, handle: Handle, index: int) -> Claim | None:
        """While other handles read the version too: a claim of block ``index`` and the rest
        of its part, up to the first block cached or in flight, if memory for all of them can
        be had now as a reader's own fetch has it (evicting read-ahead furthest from its
        reader first), never waiting and never over the budget (as a demand that cannot fit
        may go); None otherwise, and for a reader alone (it fetches one block)."""
        if self.cache.open_versions[handle.key, handle.etag] < 2:
            return None
        part_end = min((index // self.part_blocks + 1) * self.part_blocks, self.block_count(handle))
        stop = index + 1
        while stop < part_end and not self.cache.is_cached_or_pending(self.key(handle, stop)):
            stop += 1
        if stop == index + 1:
            return None
        indexes = list(range(index, stop))
        total = sum(self.length(handle, i) for i in indexes)
        reservation = self.cache.try_reserve(total, demand=True)
        return None if reservation is None else self._claim_reserved(handle, indexes, reservation)

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
        on each block cached, each block fetched once per node: see ``_fill``."""
        indexes = range(first, stop)
        new = self.cache.new_blocks([self.length(handle, i) for i in indexes])
        blocks = dict(zip(indexes, new, strict=True))
        try:
            await self._fill(handle, blocks, reservation)
        finally:
            for block in blocks.values():
                block.discard()

    async def _fill(
        self, handle: Handle, blocks: dict[int, Block], reservation: Reservation
    ) -> None:
        """Fill ``blocks`` (taken out as they are cached) from the disk tier, else the store
        with one ranged GET per run, each block fetched once by the processes sharing the
        disk tier (``objfs.disk_cache.fetching``): the fetch locks of the blocks are taken
        before the disk is read, so a block is fetched only by the process that holds its
        lock and did not find it on disk; a block another process holds is left to it, and
        read from the disk once its lock is free (its holder wrote it, or gave up: then this
        process takes the lock, reads the disk and fetches it if still missing). The
        write-behind releases the locks of the blocks fetched here once they are on disk, or
        will not be. After ``NODE_FETCH_WAIT_S`` of waiting for another process's fetch, the
        disk is read once more and the rest fetched without locks."""
        disk = self.disk
        use_disk = disk is not None and disk.enabled
        locks = disk.fetch_locks if disk is not None and use_disk else None
        missing = list(blocks)
        waited_since: float | None = None
        delay = _LOCK_POLL_S
        while missing:
            timed_out = (
                waited_since is not None and trio.current_time() - waited_since > NODE_FETCH_WAIT_S
            )
            locked: list[int] = []
            if locks is not None and not timed_out:
                locked = locks.take(handle.key, handle.etag, missing)
            try:
                # Ours to fetch (unless on disk): the blocks locked, or all without locks.
                candidates = missing if locks is None or timed_out else locked
                if use_disk and (waited_since is None or candidates):
                    # The first round reads every missing block (another process's may have
                    # landed already); later ones what this process may now fetch.
                    wanted = missing if waited_since is None else candidates
                    left = await self._from_disk(handle, wanted, blocks, reservation)
                    if locks is not None and locked:
                        found = [i for i in locked if i not in left]
                        locks.release(handle.key, handle.etag, found)
                        locked = [i for i in locked if i in left]
                    candidates = [i for i in candidates if i in left]
                    missing = [i for i in missing if i in left]
                for run in _runs(candidates):
                    await self._get_run(handle, run, blocks, reservation)
                    locked = [i for i in locked if i not in run]  # the write-behind's now
            except BaseException:
                if locks is not None and locked:
                    locks.release(handle.key, handle.etag, locked)  # not fetched
                raise
            done = set(candidates)
            theirs = [i for i in missing if i not in done]
            if theirs and locks is not None and waited_since is None:
                locks.waits += len(theirs)  # blocks another process was fetching
            missing = theirs
            if missing:
                # Fetched by another process now: wait for its locks, then read the disk.
                if waited_since is None:
                    waited_since = trio.current_time()
                await trio.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX_S)

    async def _from_disk(
        self,
        handle: Handle,
        wanted: list[int],
        blocks: dict[int, Block],
        reservation: Reservation,
    ) -> list[int]:
        """Cache the blocks among ``wanted`` that the disk tier holds (taken out of
        ``blocks``); returns the others."""
        if not wanted:
            return wanted
        assert self.disk is not None
        listed = self.disk.listed_now(handle.key, handle.etag, wanted)
        # Told without waiting which the table lists: no thread to read the others.
        reading = wanted if listed is None else [i for i in wanted if i in listed]
        if not reading:
            return wanted
        found = await trio.to_thread.run_sync(
            self.read_disk_blocks_into,
            handle,
            [(i, blocks[i].view) for i in reading],
            limiter=self.disk_read_limiter,
        )
        for index in found:
            block = blocks.pop(index)
            key = self.key(handle, index)
            self.writes.on_disk(key, block)
            self.cache.put(key, block, reservation)
        return [i for i in wanted if i not in found]

    async def _get_run(
        self, handle: Handle, run: list[int], blocks: dict[int, Block], reservation: Reservation
    ) -> None:
        """One ranged GET of consecutive blocks ``run`` into their buffers, then cached and
        offered to the disk tier (taken out of ``blocks``)."""
        start = run[0] * self.block_size
        views: list[memoryview] = [blocks[i].view for i in run]
        if self.disk is not None and self.disk.enabled:
            # Hashed for the disk tier as each block lands, while it is in the CPU's caches.
            def hashed(n: int, view: memoryview) -> None:
                blocks[run[n]].digest = block_hash(view)

            views = FilledViews(views, hashed)
        try:
            await self.backend.read_into(handle.key, handle.etag, start, views)
        except StaleObjectError:
            self._on_stale(handle)
            raise
        written = [(self.key(handle, i), blocks.pop(i)) for i in run]
        for key, block in written:
            self.cache.put(key, block, reservation)
        self.writes.offer(written)

    def read_disk_blocks_into(
        self, handle: Handle, wanted: list[tuple[int, memoryview]]
    ) -> set[int]:
        """(Worker thread) Fill the views (each its block's length) of the blocks the disk
        tier holds; their indexes."""
        assert self.disk is not None
        return self.disk.read_blocks_into(
            handle.key, handle.etag, [i for i, _ in wanted], [v for _, v in wanted]
        )

    def statistics(self) -> dict[str, int]:
        return {
            "queued_jobs": len(self._jobs),
            "starved_jobs": len(self._starved),
            "readahead_wakeups": self.worker_wakeups,
            **self.writes.statistics(),
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
