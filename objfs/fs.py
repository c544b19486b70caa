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
(:mod:`objfs.readahead`) decides what to fetch ahead of each sequential stream and
:mod:`objfs.scheduler` fetches it; files every loader reads whole (``*.safetensors``) are
fetched ahead from open. A block served whole to the kernel is marked in its node's
``served`` map and never prefetched again for that version. A random read of a block
that no tier holds fetches only the bytes it touches, rounded to ``RANDOM_READ_ALIGN``, and
leaves them to the kernel's page cache: a 4 KiB lookup does not wait for a whole block.

Concurrency: everything here runs on the trio thread. Listings are single-flight; a block is
fetched once however many handles and processes want it (see :mod:`objfs.block_cache` and
:mod:`objfs.scheduler`). A reply is a view of a cached block's buffer, or a pooled buffer for a
read across blocks; both are consumed by the kernel before the trio thread runs anything else.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from objfs.backends.base import Backend, ObjectInfo
from objfs.block_cache import BlockCache
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
from objfs.scheduler import Fetcher, ceil_div
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
    # One byte per block of that version: 1 once the block was served whole to the kernel
    # (its page cache holds it now, so read-ahead need not fetch it again).
    served: bytearray = field(default_factory=bytearray)


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
    served: bytearray  # the node's, for this version (see Node.served)


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
        self.cache = BlockCache(
            config.memory_limit_bytes, used_limit, block_size=config.block_size_bytes
        )
        self.disk = disk
        # Read-ahead runs queued jobs in order on all connections but two, which stay free
        # for the readers' own (demand) fetches: a random read never queues behind a file.
        self.fetcher = Fetcher(
            backend,
            self.cache,
            disk,
            block_size=self.block_size,
            part_blocks=self.part_blocks,
            prefetch_workers=max(1, config.s3.max_connections - 2),
            on_stale=self._forget_version,
        )
        self.uid = os.getuid() if config.uid is None else config.uid
        self.gid = os.getgid() if config.gid is None else config.gid
        self.mount_time_ns = time.time_ns()
        self._inode_of: dict[tuple[bool, str], int] = {}
        self._nodes: dict[int, Node] = {}
        self._listings: dict[int, Listing] = {}
        self._list_flight: SingleFlight[int, Listing] = SingleFlight()
        self._range_flight: SingleFlight[tuple[str, str, int, int], bytes] = SingleFlight()
        self._handles: dict[int, Handle] = {}
        self._reply_buffers: list[mmap.mmap] = []  # answered reads' pooled buffers (see read)
        self._dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._warned: set[str] = set()
        root = Node(ROOT_INODE, ROOT_INODE, b"", config.source.prefix, True)
        self._nodes[ROOT_INODE] = root
        self._inode_of[(True, root.key)] = ROOT_INODE
        self._next_inode = ROOT_INODE + 1

    def start(self, nursery: trio.Nursery) -> None:
        """Give the file system a nursery for read-ahead and disk-cache tasks."""
        self.fetcher.start(nursery)

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
        if not keep_cache:  # the kernel drops the inode's pages on this open
            node.served = bytearray(ceil_div(node.size, self.block_size))
        node.page_cache_etag = node.etag
        fh = self._new_fh()
        readahead = Readahead(
            node.size,
            initial_window=self.config.readahead_initial_bytes,
            max_window=self.config.readahead_max(),
        )
        handle = Handle(fh, node, node.key, node.etag, node.size, readahead, node.served)
        self._handles[fh] = handle
        self.cache.open_version(handle.key, handle.etag)
        self._share_windows()
        if node.key.endswith(self.config.prefetch_on_open_suffixes):
            whole = readahead.start_whole_file()
            if whole is not None:
                # Not tied to this handle: loaders often open a shard once for its header and
                # again for its data, and the prefetch should outlive the first open. Its
                # blocks still belong to the version's handles: if they all close first, the
                # blocks go first when memory is short (see objfs.block_cache).
                self.fetcher.prefetch(
                    handle, whole, cancellable=False, stream=readahead.last_stream
                )
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
        """Close a handle: cancel its read-ahead (queued jobs and fetches in flight); after the
        last handle of a version, its unread blocks are the first to go."""
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        self._share_windows()
        self.fetcher.cancel(handle)
        self.cache.close_version(handle.key, handle.etag)

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise BadFileHandleError(f"file handle {fh} is not open") from None

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Return ``size`` bytes from ``offset``, fewer only at end of file."""
        while self._reply_buffers:
            self.cache.pool.release(self._reply_buffers.pop())
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
            self.fetcher.prefetch(
                handle, window, cancellable=True, stream=handle.readahead.last_stream
            )
        elif handle.readahead.last_random:
            data = await self._read_random(handle, offset, end)
            if data is not None:
                return data
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            # The usual case: one block, answered with a view of its buffer (the kernel copies
            # it before the trio thread runs anything else, so nothing can recycle it first).
            base = first * bs
            block = await self._block(handle, first, to_end=end == base + bs or end == handle.size)
            return block[offset - base : end - base]
        # A read across blocks (the kernel's requests are rarely block-aligned) is assembled
        # in a pooled buffer: no zero-filling, no fresh pages. Each piece is copied at once
        # (the next block's fetch may wait, and this one may be evicted meanwhile).
        pooled = end - offset <= self.cache.pool.buffer_size
        buf = self.cache.pool.acquire() if pooled else bytearray(end - offset)
        try:
            out = memoryview(buf)[: end - offset]
            for index in range(first, last + 1):
                base = index * bs
                lo, hi = max(offset, base), min(end, base + bs)
                block = await self._block(
                    handle, index, to_end=hi == base + bs or hi == handle.size
                )
                out[lo - offset : hi - offset] = block[lo - base : hi - base]
        except BaseException:
            if isinstance(buf, mmap.mmap):
                self.cache.pool.release(buf)
            raise
        if isinstance(buf, mmap.mmap):
            # The kernel copies the reply before the trio thread runs anything else: the
            # buffer goes back to the pool when the next read starts.
            self._reply_buffers.append(buf)
        return out

    async def _block(self, handle: Handle, index: int, *, to_end: bool) -> memoryview | bytes:
        """Block ``index`` of the handle's version, from the memory tier or fetched now."""
        key = self.fetcher.key(handle, index)
        if to_end:
            handle.served[index] = 1
        data = self.cache.get_nowait(key, to_end=to_end)
        if data is not None:
            return data
        await self.fetcher.demand(handle, index)
        data = self.cache.get_nowait(key, to_end=to_end)
        if data is not None:
            return data
        # Budget smaller than a block, or repeated eviction: read around the memory tier.
        return await self._read_range(
            handle, index * self.block_size, self.fetcher.length(handle, index)
        )

    async def _read_random(self, handle: Handle, offset: int, end: int) -> bytes | None:
        """Bytes [offset, end) for a random read, or None to read through the block cache
        (some of its blocks are cached or on their way there)."""
        bs = self.block_size
        indexes = list(range(offset // bs, (end - 1) // bs + 1))
        keys = [self.fetcher.key(handle, i) for i in indexes]
        if any(self.cache.is_cached_or_pending(k) for k in keys):
            return None
        if self.disk is not None and self.disk.enabled:
            found = await trio.to_thread.run_sync(
                self.fetcher.read_disk_blocks,
                handle,
                indexes,
                limiter=self.fetcher.disk_read_limiter,
            )
            if len(found) == len(indexes):
                joined = b"".join(found[i] for i in indexes)
                base = indexes[0] * bs
                return joined[offset - base : end - base]
        start = offset // RANDOM_READ_ALIGN * RANDOM_READ_ALIGN
        stop = min(handle.size, ceil_div(end, RANDOM_READ_ALIGN) * RANDOM_READ_ALIGN)

        async def fetch() -> bytes:
            return await self._read_range(handle, start, stop - start)

        # Readers of the same range (other handles, other processes) share one GET.
        data = await self._range_flight.run((handle.key, handle.etag, start, stop), fetch)
        return data[offset - start : end - start]

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

    async def flush_disk_writes(self) -> None:
        """Wait until every block queued for the disk cache is written."""
        await self.fetcher.flush_disk_writes()

    def statistics(self) -> dict[str, int]:
        return {
            "inodes": len(self._nodes),
            "open_files": len(self._handles),
            "open_dirs": len(self._dir_handles),
            **self.cache.statistics(),
            **self.fetcher.statistics(),
            **(self.disk.statistics() if self.disk is not None else {}),
        }
