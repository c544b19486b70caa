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

Concurrency: everything here runs on the trio thread. Listings and block fetches are
single-flight (see :mod:`objfs.block_cache`).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from objfs.backends.base import Backend, ObjectInfo
from objfs.block_cache import BlockCache, BlockKey, SingleFlight
from objfs.config import MountConfig
from objfs.errors import (
    BadFileHandleError,
    IsADirectoryFsError,
    NotADirectoryFsError,
    ObjectNotFoundError,
    ReadOnlyError,
    StaleObjectError,
)

log = logging.getLogger(__name__)

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
    next_offset: int = 0  # where a sequential reader will read next


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

    def __init__(self, backend: Backend, config: MountConfig) -> None:
        self.backend = backend
        self.config = config
        self.block_size = config.block_size_bytes
        self.cache = BlockCache(config.memory_cache_blocks * config.block_size_bytes)
        self.uid = os.getuid() if config.uid is None else config.uid
        self.gid = os.getgid() if config.gid is None else config.gid
        self.mount_time_ns = time.time_ns()
        self._nursery: trio.Nursery | None = None
        self._inode_of: dict[tuple[bool, str], int] = {}
        self._nodes: dict[int, Node] = {}
        self._listings: dict[int, Listing] = {}
        self._list_flight: SingleFlight[int, Listing] = SingleFlight()
        self._handles: dict[int, Handle] = {}
        self._dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._warned: set[str] = set()
        root = Node(ROOT_INODE, ROOT_INODE, b"", config.source.prefix, True)
        self._nodes[ROOT_INODE] = root
        self._inode_of[(True, root.key)] = ROOT_INODE
        self._next_inode = ROOT_INODE + 1

    def start(self, nursery: trio.Nursery) -> None:
        """Give the file system a nursery for read-ahead tasks."""
        self._nursery = nursery

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
        self._handles[fh] = Handle(fh, node, node.key, node.etag, node.size)
        return fh, keep_cache

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise BadFileHandleError(f"file handle {fh} is not open") from None

    def _block_count(self, handle: Handle) -> int:
        return -(-handle.size // self.block_size)

    def _block_key(self, handle: Handle, index: int) -> BlockKey:
        return BlockKey(handle.key, handle.etag, index)

    async def _block(self, handle: Handle, index: int) -> bytes:
        start = index * self.block_size
        length = min(self.block_size, handle.size - start)

        async def fetch() -> bytes:
            try:
                return await self.backend.read_range(handle.key, handle.etag, start, length)
            except StaleObjectError:
                # The next open must see the new version: forget what we knew.
                handle.node.checked_at = -float("inf")
                self._listings.pop(handle.node.parent, None)
                raise

        return await self.cache.get(self._block_key(handle, index), fetch)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        """Return ``size`` bytes from ``offset``, fewer only at end of file."""
        handle = self._handle(fh)
        if handle.node.etag != handle.etag:
            # A listing or HEAD has seen a newer version: the kernel may already show its size,
            # so stop serving this handle rather than mix sizes and bytes of two versions.
            raise StaleObjectError(f"{handle.key!r} changed while open")
        end = min(offset + size, handle.size)
        if offset >= end:
            return b""
        first, last = offset // self.block_size, (end - 1) // self.block_size
        sequential = offset == handle.next_offset
        handle.next_offset = end
        if sequential:
            self._schedule_readahead(handle, last + 1)
        base = first * self.block_size
        if first == last:
            block = await self._block(handle, first)
            return block[offset - base : end - base]
        # A kernel request spans at most a few blocks, and read-ahead has usually started
        # them already, so fetching them in order costs little.
        blocks = [await self._block(handle, i) for i in range(first, last + 1)]
        return b"".join(blocks)[offset - base : end - base]

    def _schedule_readahead(self, handle: Handle, from_index: int) -> None:
        if self._nursery is None:
            return
        last_index = (handle.size - 1) // self.block_size
        for index in range(
            from_index, min(from_index + self.config.readahead_blocks, last_index + 1)
        ):
            if not self.cache.is_cached_or_loading(self._block_key(handle, index)):
                self._nursery.start_soon(self._prefetch, handle, index)

    async def _prefetch(self, handle: Handle, index: int) -> None:
        try:
            await self._block(handle, index)
        except Exception as exc:
            # The reader that needs this block will fetch it again and see the error itself.
            log.debug("read-ahead of %s block %d failed: %s", handle.key, index, exc)

    def statistics(self) -> dict[str, int]:
        return {
            "inodes": len(self._nodes),
            "open_files": len(self._handles),
            "open_dirs": len(self._dir_handles),
            **self.cache.statistics(),
        }
