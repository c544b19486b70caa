"""Object-store semantics on inode and handle numbers, free of FUSE.

``FileSystem`` turns a bucket/prefix into a read-only tree:

* A directory is a key prefix ending in ``/``; it exists when some key lies under it
  (zero-byte markers ``dir/`` included). A file is a key.
* Names come from one ``/``-delimited listing level. A name that POSIX cannot hold (empty,
  ``.``, ``..``, NUL, over 255 bytes) is skipped with a warning, once per key. A key and a
  prefix of the same name: the directory wins and the file is hidden, with one warning.
* Metadata (one listing per directory, and each file's size/ETag/mtime) is cached for
  ``metadata_ttl_s``; lookups of missing names are answered from the same listing.
* Inode numbers are assigned once per (kind, key) and never reused while mounted.
* An open handle is pinned to the ETag the object had at open; every read of that handle is
  conditional on it, so a replaced object yields StaleObjectError, never a mix of versions.

Reads go through three tiers: the memory :class:`~objfs.block_cache.BlockCache` (a read that
hits it returns without waiting on anything), the optional persistent
:class:`~objfs.disk_cache.DiskCache`, and ranged GETs of ``part_size`` bytes. Read-ahead
(:mod:`objfs.readahead`) decides what to fetch ahead of each sequential stream; files every
loader reads whole (``*.safetensors``) are fetched ahead from open. A random read of a block
that no tier holds fetches only the bytes it touches, rounded to ``RANDOM_READ_ALIGN``, and
leaves them to the kernel's page cache: a 4 KiB lookup does not wait for a whole block.

Concurrency: everything here runs on the trio thread. Listings are single-flight; a block is
fetched once however many handles and processes want it (see :mod:`objfs.block_cache`).
Read-ahead waits for memory budget *before* it claims blocks, so a reader never waits on a
prefetch that itself waits for the reader to consume something.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from objfs.backends.base import Backend, ObjectInfo
from objfs.block_cache import BlockCache, BlockKey
from objfs.config import MountConfig
from objfs.disk_cache import DiskCache
from objfs.errors import (
    BadFileHandleError,
    IsADirectoryFsError,
    NotADirectoryFsError,
    ObjectNotFoundError,
    ReadOnlyError,
    StaleObjectError,
)
from objfs.readahead import Readahead
from objfs.singleflight import SingleFlight

log = logging.getLogger(__name__)

# A random read that misses every tier fetches this much around what it touches (a multiple
# of the page size: the kernel caches the pages it asked for).
RANDOM_READ_ALIGN = 64 * 1024

ROOT_INODE = 1  # FUSE's fixed root inode number
NAME_MAX = 255  # bytes, the Linux limit for one path component


@dataclass
class Node:
    """A file or a directory. Files carry the attributes of the last version seen."""

    inode: int
    parent: int
    name: bytes
    key: str  # the object key for a file; the prefix ("" or ending in "/") for a directory
    is_dir: bool
    size: int = 0
    etag: str = ""
    mtime_ns: int = 0
    checked_at: float = -float("inf")  # monotonic time the attributes were last confirmed
    page_cache_etag: str | None = None  # version whose pages the kernel may hold


@dataclass
class Listing:
    """One directory level: name -> node, in the store's (sorted) order."""

    entries: dict[bytes, Node]
    fetched_at: float


@dataclass
class Handle:
    """An open file, pinned to one object version."""

    fh: int
    node: Node
    key: str
    etag: str
    size: int
    readahead: Readahead
    # Read-ahead tasks of this handle, cancelled when it is released.
    scopes: set[trio.CancelScope] = field(default_factory=set)


@dataclass
class _Job:
    """Read-ahead of blocks [first, stop) of one handle, waiting in the queue."""

    handle: Handle
    first: int
    stop: int
    claim: tuple[list[BlockKey], int] | None  # (claimed blocks, bytes reserved), or not yet
    scope: trio.CancelScope


@dataclass
class DirHandle:
    fh: int
    node: Node
    entries: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class Attributes:
    """What ``stat`` shows; the FUSE layer copies it into ``EntryAttributes``."""

    inode: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    blksize: int


def posix_name(name: str) -> bytes | None:
    """Return the file name for a key segment, or None if POSIX cannot hold it."""
    if name in ("", ".", "..") or "\0" in name or "/" in name:
        return None
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > NAME_MAX:
        return None
    return encoded


class FileSystem:
    """Read-only tree over one backend. Call :meth:`start` with a nursery before reading."""

    def __init__(
        self, backend: Backend, config: MountConfig, disk: DiskCache | None = None
    ) -> None:
        self.backend = backend
        self.config = config
        self.block_size = config.block_size_bytes
        self.part_blocks = max(1, config.part_size_bytes // config.block_size_bytes)
        # Blocks already read are mostly in the kernel's page cache too (keep_cache): keep a
        # few of them (for reads that straddle requests and for re-reads after the kernel
        # dropped pages); the rest of the budget is for read-ahead.
        used_limit = max(2 * config.part_size_bytes, min(config.memory_limit_bytes // 4, 256 << 20))
        self.cache = BlockCache(config.memory_limit_bytes, used_limit)
        self.disk = disk
        # Disk reads and writes run in threads; a few suffice to keep one disk busy.
        self._disk_limiter = trio.CapacityLimiter(4)
        # Read-ahead runs queued jobs in order on all connections but two, which stay free
        # for the readers' own (demand) fetches: a random read never queues behind a file.
        self._prefetch_workers = max(1, config.s3.max_connections - 2)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._starved: list[_Job] = []  # jobs waiting for memory
        self._memory_generation = 0  # counts releases of memory
        self._starved_at = 0  # the generation at which a job last failed to get memory
        self._work = trio.Event()  # set when a job is queued or memory is released
        self._queued_job_of: dict[BlockKey, _Job] = {}
        self.cache.on_space = self._work_available
        self._disk_write_bytes = 0  # queued for the disk tier, bounded below
        self._disk_written = trio.Event()  # set whenever a queued disk write finishes
        self.uid = os.getuid() if config.uid is None else config.uid
        self.gid = os.getgid() if config.gid is None else config.gid
        self.mount_time_ns = time.time_ns()
        self._nursery: trio.Nursery | None = None
        self._inode_of: dict[tuple[bool, str], int] = {}
        self._nodes: dict[int, Node] = {}
        self._listings: dict[int, Listing] = {}
        self._list_flight: SingleFlight[int, Listing] = SingleFlight()
        self._range_flight: SingleFlight[tuple[str, str, int, int], bytes] = SingleFlight()
        self._handles: dict[int, Handle] = {}
        self._dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._warned: set[str] = set()
        root = Node(ROOT_INODE, ROOT_INODE, b"", config.source.prefix, True)
        self._nodes[ROOT_INODE] = root
        self._inode_of[(True, root.key)] = ROOT_INODE
        self._next_inode = ROOT_INODE + 1

    def start(self, nursery: trio.Nursery) -> None:
        """Give the file system a nursery for read-ahead and disk-cache tasks."""
        self._nursery = nursery
        for _ in range(self._prefetch_workers):
            nursery.start_soon(self._prefetch_worker)

    # -- nodes -----------------------------------------------------------------------------

    def node(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise ObjectNotFoundError(f"inode {inode} is unknown") from None

    def _node_for(self, parent: int, name: bytes, key: str, is_dir: bool) -> Node:
        ident = (is_dir, key)
        inode = self._inode_of.get(ident)
        if inode is None:
            inode = self._next_inode
            self._next_inode += 1
            self._inode_of[ident] = inode
            self._nodes[inode] = Node(inode, parent, name, key, is_dir)
        return self._nodes[inode]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _fresh(self, checked_at: float) -> bool:
        return time.monotonic() - checked_at < self.config.metadata_ttl_s

    # -- listings --------------------------------------------------------------------------

    async def listing(self, dir_node: Node) -> Listing:
        """Return the directory's entries, from the cache while it is fresh."""
        if not dir_node.is_dir:
            raise NotADirectoryFsError(f"{dir_node.key!r} is not a directory")
        cached = self._listings.get(dir_node.inode)
        if cached is not None and self._fresh(cached.fetched_at):
            return cached
        return await self._list_flight.run(dir_node.inode, lambda: self._fetch_listing(dir_node))

    async def _fetch_listing(self, dir_node: Node) -> Listing:
        prefix = dir_node.key
        started = time.monotonic()
        files: dict[bytes, ObjectInfo] = {}
        dirs: dict[bytes, str] = {}
        async for page in self.backend.list_prefix(prefix):
            for info in page.objects:
                rest = info.key[len(prefix) :]
                if rest == "":
                    continue  # the directory's own marker object
                name = posix_name(rest)
                if name is None:
                    self._warn_once(
                        info.key, f"skipping key {info.key!r}: {rest!r} cannot be a file name"
                    )
                    continue
                files[name] = info
            for common in page.prefixes:
                rest = common[len(prefix) : -1]
                name = posix_name(rest)
                if name is None:
                    self._warn_once(
                        common, f"skipping prefix {common!r}: {rest!r} cannot be a directory name"
                    )
                    continue
                dirs[name] = common
        entries: dict[bytes, Node] = {}
        for name in sorted(files.keys() | dirs.keys()):
            if name in dirs:
                if name in files:
                    self._warn_once(
                        files[name].key,
                        f"key {files[name].key!r} is hidden by the directory {dirs[name]!r} "
                        "of the same name",
                    )
                node = self._node_for(dir_node.inode, name, dirs[name], True)
            else:
                info = files[name]
                node = self._node_for(dir_node.inode, name, info.key, False)
                self._update(node, info, started)
            entries[name] = node
        listing = Listing(entries, started)
        self._listings[dir_node.inode] = listing
        return listing

    def _update(self, node: Node, info: ObjectInfo, checked_at: float) -> None:
        node.size, node.etag, node.mtime_ns = info.size, info.etag, info.mtime_ns
        node.checked_at = checked_at

    async def _refresh_file(self, node: Node) -> None:
        """Re-read a file's attributes when they are older than the metadata TTL."""
        if self._fresh(node.checked_at):
            return
        started = time.monotonic()
        try:
            info = await self.backend.head(node.key)
        except ObjectNotFoundError:
            self._listings.pop(node.parent, None)  # the parent listing is wrong now
            raise
        self._update(node, info, started)

    # -- metadata operations ---------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes) -> Node:
        parent = self.node(parent_inode)
        if name == b".":
            return parent
        if name == b"..":
            return self.node(parent.parent)
        entries = (await self.listing(parent)).entries
        node = entries.get(name)
        if node is None:
            raise ObjectNotFoundError(f"{name!r} not found in {parent.key!r}")
        return node

    async def getattr(self, inode: int) -> Attributes:
        node = self.node(inode)
        if not node.is_dir:
            await self._refresh_file(node)
        return self.attributes(node)

    def attributes(self, node: Node) -> Attributes:
        if node.is_dir:
            return Attributes(
                inode=node.inode,
                mode=stat.S_IFDIR | 0o555,
                nlink=2,
                uid=self.uid,
                gid=self.gid,
                size=0,
                mtime_ns=self.mount_time_ns,
                blksize=self.block_size,
            )
        return Attributes(
            inode=node.inode,
            mode=stat.S_IFREG | 0o444,
            nlink=1,
            uid=self.uid,
            gid=self.gid,
            size=node.size,
            mtime_ns=node.mtime_ns,
            blksize=self.block_size,
        )

    # -- directories -----------------------------------------------------------------------

    async def opendir(self, inode: int) -> int:
        node = self.node(inode)
        listing = await self.listing(node)
        fh = self._new_fh()
        self._dir_handles[fh] = DirHandle(fh, node, list(listing.entries.values()))
        return fh

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, Node]]:
        """Yield (next_id, node) from position ``start``; next_id resumes after node."""
        handle = self._dir_handles.get(fh)
        if handle is None:
            raise BadFileHandleError(f"directory handle {fh} is not open")
        for index in range(start, len(handle.entries)):
            yield index + 1, handle.entries[index]

    def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- files -----------------------------------------------------------------------------

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    async def open(self, inode: int, flags: int) -> tuple[int, bool]:
        """Open for reading; returns (fh, keep_cache).

        ``keep_cache`` is True when the kernel's page cache can only hold this same version
        (the last open saw the same ETag), so re-opens are served from the page cache.
        """
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise ReadOnlyError("the file system is read-only")
        node = self.node(inode)
        if node.is_dir:
            raise IsADirectoryFsError(f"{node.key!r} is a directory")
        await self._refresh_file(node)
        keep_cache = node.page_cache_etag == node.etag
        node.page_cache_etag = node.etag
        fh = self._new_fh()
        readahead = Readahead(
            node.size,
            initial_window=self.config.readahead_initial_bytes,
            max_window=self.config.readahead_max(),
        )
        handle = Handle(fh, node, node.key, node.etag, node.size, readahead)
        self._handles[fh] = handle
        self._share_windows()
        if node.key.endswith(self.config.prefetch_on_open_suffixes):
            whole = readahead.start_whole_file()
            if whole is not None:
                # Not tied to this handle: loaders often open a shard once for its header and
                # again for its data, and the prefetch should outlive the first open.
                self._prefetch(handle, whole, cancellable=False)
        return fh, keep_cache

    def _share_windows(self) -> None:
        """Split the read-ahead share of the budget (half) among the open files that can use
        it, so concurrent streams do not evict each other's unread blocks."""
        big = [h for h in self._handles.values() if h.size > self.config.part_size_bytes]
        share = self.config.readahead_max() // max(1, len(big))
        window = max(self.config.part_size_bytes, share)
        for h in big:
            h.readahead.max_window = window
            for stream in h.readahead.streams:
                stream.window = min(stream.window, window)

    def release(self, fh: int) -> None:
        """Close a handle and cancel its read-ahead: queued jobs and fetches in flight."""
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        self._share_windows()
        for scope in handle.scopes:
            scope.cancel()
        # Queued jobs never start: end their claims now so readers do not wait on them.
        self._starved = [j for j in self._starved if not j.scope.cancel_called]
        for job in [j for j in self._jobs if j.scope.cancel_called]:
            self._jobs.remove(job)
            if job.claim is not None:
                for key in job.claim[0]:
                    self._queued_job_of.pop(key, None)
                self.cache.finish(job.claim[0])
                self.cache.unreserve(job.claim[1])

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise BadFileHandleError(f"file handle {fh} is not open") from None

    def _block_key(self, handle: Handle, index: int) -> BlockKey:
        return BlockKey(handle.key, handle.etag, index)

    def _block_count(self, handle: Handle) -> int:
        return _ceil_div(handle.size, self.block_size)

    def _block_length(self, handle: Handle, index: int) -> int:
        return min(self.block_size, handle.size - index * self.block_size)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        """Return ``size`` bytes from ``offset``, fewer only at end of file."""
        handle = self._handle(fh)
        if handle.node.etag != handle.etag:
            # A listing or HEAD has seen a newer version: the kernel may already show its size,
            # so stop serving this handle rather than mix sizes and bytes of two versions.
            raise StaleObjectError(f"{handle.key!r} changed while open")
        end = min(offset + size, handle.size)
        if offset >= end:
            return b""
        window = handle.readahead.on_read(offset, end - offset)
        if window is not None:
            self._prefetch(handle, window, cancellable=True)
        elif handle.readahead.last_random:
            data = await self._read_random(handle, offset, end)
            if data is not None:
                return data
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            block = self.cache.get_nowait(self._block_key(handle, first))
            if block is None:
                block = await self._demand(handle, first)
            base = first * bs
            if offset == base and end - base == len(block):
                return block
            return memoryview(block)[offset - base : end - base]
        pieces: list[memoryview] = []
        for index in range(first, last + 1):
            block = self.cache.get_nowait(self._block_key(handle, index))
            if block is None:
                block = await self._demand(handle, index)
            base = index * bs
            pieces.append(memoryview(block)[max(offset, base) - base : min(end, base + bs) - base])
        return b"".join(pieces)

    async def _read_random(self, handle: Handle, offset: int, end: int) -> bytes | None:
        """Bytes [offset, end) for a random read, or None to read through the block cache
        (some of its blocks are cached or on their way there)."""
        bs = self.block_size
        indexes = list(range(offset // bs, (end - 1) // bs + 1))
        keys = [self._block_key(handle, i) for i in indexes]
        if any(self.cache.is_cached_or_pending(k) for k in keys):
            return None
        if self.disk is not None and self.disk.enabled:
            found = await trio.to_thread.run_sync(
                self._disk_read_many, handle, indexes, limiter=self._disk_limiter
            )
            if len(found) == len(indexes):
                joined = b"".join(found[i] for i in indexes)
                base = indexes[0] * bs
                return joined[offset - base : end - base]
        start = offset // RANDOM_READ_ALIGN * RANDOM_READ_ALIGN
        stop = min(handle.size, _ceil_div(end, RANDOM_READ_ALIGN) * RANDOM_READ_ALIGN)

        async def fetch() -> bytes:
            return await self._read_range(handle, start, stop - start)

        # Readers of the same range (other handles, other processes) share one GET.
        data = await self._range_flight.run((handle.key, handle.etag, start, stop), fetch)
        return data[offset - start : end - start]

    async def _demand(self, handle: Handle, index: int) -> bytes:
        """A reader needs block ``index`` now: wait for its fetch in flight, or fetch it."""
        key = self._block_key(handle, index)
        event = self.cache.pending(key)
        if event is not None:
            stolen = self._steal(key)
            if stolen is not None:
                # Its read-ahead has not started: fetch this block now, alone, instead of
                # waiting for a worker and then for a whole part.
                await self._fetch(handle, index, index + 1, demand=True, claim=stolen)
            else:
                await event.wait()
            data = self.cache.get_nowait(key)
            if data is not None:
                return data
            # The fetch failed, was cancelled or its block was evicted already: fetch it here.
        await self._fetch(handle, index, index + 1, demand=True)
        data = self.cache.get_nowait(key)
        if data is None:  # claimed by another reader meanwhile: wait for it once more
            event = self.cache.pending(key)
            if event is not None:
                await event.wait()
            data = self.cache.get_nowait(key)
        if data is None:  # budget smaller than a block, or repeated eviction: read around it
            data = await self._read_range(
                handle, index * self.block_size, self._block_length(handle, index)
            )
        return data

    async def _read_range(self, handle: Handle, start: int, length: int) -> bytes:
        """One GET outside the block cache, with the same stale-version handling."""
        try:
            return await self.backend.read_range(handle.key, handle.etag, start, length)
        except StaleObjectError:
            self._forget_version(handle)
            raise

    def _forget_version(self, handle: Handle) -> None:
        """The store has a newer version: the next open must see it, not our metadata."""
        handle.node.checked_at = -float("inf")
        self._listings.pop(handle.node.parent, None)

    def _prefetch(self, handle: Handle, window: tuple[int, int], *, cancellable: bool) -> None:
        """Queue the blocks of byte range ``window`` for read-ahead, in whole aligned parts."""
        if self._nursery is None:
            return
        bs, part = self.block_size, self.part_blocks
        count = self._block_count(handle)
        first = window[0] // bs
        # Round the end up to a part boundary: every GET is a whole part, and every stream and
        # handle asks for the same parts.
        stop = min(count, _ceil_div(_ceil_div(window[1], bs), part) * part)
        index = first
        while index < stop:
            part_end = min(stop, (index // part + 1) * part)
            keys = [self._block_key(handle, i) for i in range(index, part_end)]
            if not all(self.cache.is_cached_or_pending(k) for k in keys):
                # Claim now if memory allows, so a reader arriving next waits for this fetch
                # instead of sending its own; otherwise the job waits for memory first.
                claim = self._try_claim(handle, index, part_end, demand=False)
                if claim is None or claim[0]:
                    job = _Job(handle, index, part_end, claim, trio.CancelScope())
                    if cancellable:
                        handle.scopes.add(job.scope)
                    self._jobs.append(job)
                    for key in claim[0] if claim else ():
                        self._queued_job_of[key] = job
                    self._wake_workers()
            index = part_end

    def _steal(self, key: BlockKey) -> tuple[list[BlockKey], int] | None:
        """Take ``key`` (and its reserved bytes) out of the claim of the queued read-ahead job
        that will fetch it; None if no queued job holds it (its fetch is under way)."""
        job = self._queued_job_of.pop(key, None)
        if job is None or job.claim is None or key not in job.claim[0]:
            return None
        keys, reserved = job.claim
        length = self._block_length(job.handle, key.block)
        job.claim = ([k for k in keys if k != key], reserved - length)
        return [key], length

    def _wake_workers(self) -> None:
        """Wake every idle read-ahead worker (they all wait on the same event)."""
        self._work.set()
        self._work = trio.Event()

    def _work_available(self) -> None:
        self._memory_generation += 1
        self._wake_workers()

    async def _next_job(self) -> _Job:
        """The oldest runnable job: queued first, then those that waited for memory."""
        while True:
            if self._jobs:
                return self._jobs.popleft()
            # Retry jobs that waited for memory once memory was released since they failed.
            if self._starved and self._memory_generation != self._starved_at:
                self._jobs.extend(self._starved)
                self._starved.clear()
                continue
            await self._work.wait()

    async def _prefetch_worker(self) -> None:
        """Run queued read-ahead jobs in order; one worker per read-ahead connection.

        A job that could not reserve memory when queued tries again here; if memory is still
        short it waits aside (holding no claim and no worker) until memory is released.
        """
        while True:
            job = await self._next_job()
            if job.scope.cancel_called:
                continue
            if job.claim is None:
                if job.handle.readahead.passed(job.stop * self.block_size):
                    continue  # the readers got there first (their own fetches did the work)
                job.claim = self._try_claim(job.handle, job.first, job.stop, demand=False)
                if job.claim is None:
                    self._starved.append(job)
                    self._starved_at = self._memory_generation
                    continue
            else:
                for key in job.claim[0]:
                    self._queued_job_of.pop(key, None)
            try:
                with job.scope:
                    await self._fetch(
                        job.handle, job.first, job.stop, demand=False, claim=job.claim
                    )
            except Exception as exc:
                # The reader that needs these blocks fetches them again and sees the error.
                log.debug("read-ahead of %s block %d failed: %s", job.handle.key, job.first, exc)
            finally:
                job.handle.scopes.discard(job.scope)

    def _claim_reserved(
        self, handle: Handle, first: int, stop: int, total: int
    ) -> tuple[list[BlockKey], int]:
        """With ``total`` bytes reserved for [first, stop): claim the blocks nobody has or is
        fetching, give back the bytes of the others; returns (claimed, bytes reserved)."""
        claimed = self.cache.claim([self._block_key(handle, i) for i in range(first, stop)])
        reserved = sum(self._block_length(handle, k.block) for k in claimed)
        self.cache.unreserve(total - reserved)
        return claimed, reserved

    def _try_claim(
        self, handle: Handle, first: int, stop: int, *, demand: bool
    ) -> tuple[list[BlockKey], int] | None:
        total = sum(self._block_length(handle, i) for i in range(first, stop))
        if not self.cache.try_reserve(total, demand=demand):
            return None
        return self._claim_reserved(handle, first, stop, total)

    async def _fetch(
        self,
        handle: Handle,
        first: int,
        stop: int,
        *,
        demand: bool,
        claim: tuple[list[BlockKey], int] | None = None,
    ) -> None:
        """Fetch blocks [first, stop) that nobody else has or is fetching into the cache.

        Order: reserve memory (may wait), claim the blocks, then take a connection. A claim is
        never held while waiting for memory, so readers cannot deadlock on read-ahead.
        """
        if claim is None:
            total = sum(self._block_length(handle, i) for i in range(first, stop))
            await self.cache.reserve(total, demand=demand)
            claim = self._claim_reserved(handle, first, stop, total)
        claimed, reserved = claim
        try:
            for run in _runs([k.block for k in claimed]):
                reserved -= await self._fetch_run(handle, run[0], run[-1] + 1, demand=demand)
        finally:
            self.cache.finish(claimed)
            self.cache.unreserve(reserved)

    async def _fetch_run(self, handle: Handle, first: int, stop: int, *, demand: bool) -> int:
        """Fill claimed blocks [first, stop) from disk or the store; returns bytes cached."""
        stored = 0
        missing = list(range(first, stop))
        if self.disk is not None and self.disk.enabled:
            found = await trio.to_thread.run_sync(
                self._disk_read_many, handle, missing, limiter=self._disk_limiter
            )
            for index, data in found.items():
                self.cache.put(self._block_key(handle, index), data)
                stored += len(data)
            missing = [i for i in missing if i not in found]
        for run in _runs(missing):
            start = run[0] * self.block_size
            length = sum(self._block_length(handle, i) for i in run)
            try:
                blocks = await self.backend.read_blocks(
                    handle.key, handle.etag, start, length, self.block_size
                )
            except StaleObjectError:
                self._forget_version(handle)
                raise
            for index, data in zip(run, blocks, strict=True):
                self.cache.put(self._block_key(handle, index), data)
                stored += len(data)
            self._write_to_disk(handle, list(zip(run, blocks, strict=True)))
        return stored

    async def flush_disk_writes(self) -> None:
        """Wait until every block queued for the disk cache is written."""
        while self._disk_write_bytes:
            self._disk_written = trio.Event()
            await self._disk_written.wait()

    def _disk_read_many(self, handle: Handle, indexes: list[int]) -> dict[int, bytes]:
        assert self.disk is not None
        found: dict[int, bytes] = {}
        for index in indexes:
            data = self.disk.read(self._block_key(handle, index), self._block_length(handle, index))
            if data is not None:
                found[index] = data
        return found

    def _write_to_disk(self, handle: Handle, blocks: list[tuple[int, bytes]]) -> None:
        disk = self.disk
        if disk is None or not disk.enabled or self._nursery is None:
            return
        nbytes = sum(len(b) for _, b in blocks)
        # The blocks waiting for the disk are memory outside the budget: bound them.
        if self._disk_write_bytes + nbytes > self.cache.capacity_bytes // 4:
            log.debug("disk cache behind; not caching %s blocks %d+", handle.key, blocks[0][0])
            return
        self._disk_write_bytes += nbytes
        keys = [(self._block_key(handle, i), b) for i, b in blocks]

        def write_all() -> None:
            for key, data in keys:
                disk.write(key, data)

        async def write() -> None:
            try:
                await trio.to_thread.run_sync(write_all, limiter=self._disk_limiter)
            except Exception:
                log.exception("disk cache write failed")
            finally:
                self._disk_write_bytes -= nbytes
                self._disk_written.set()

        self._nursery.start_soon(write)

    def statistics(self) -> dict[str, int]:
        return {
            "inodes": len(self._nodes),
            "open_files": len(self._handles),
            "open_dirs": len(self._dir_handles),
            **self.cache.statistics(),
            **(self.disk.statistics() if self.disk is not None else {}),
        }


def _ceil_div(a: int, b: int) -> int:
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
