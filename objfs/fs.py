"""Object-store semantics on inode and handle numbers, free of FUSE.

``FileSystem`` turns a bucket/prefix into a read-only tree:

* A directory is a key prefix ending in ``/``; it exists when some key lies under it
  (zero-byte markers ``dir/`` included). A file is a key.
* Names come from one ``/``-delimited listing level. A name that POSIX cannot hold (empty,
  ``.``, ``..``, NUL, over 255 bytes) is skipped with a warning, once per key. A key and a
  prefix of the same name: the directory wins and the file is hidden, with one warning.
* **One inode per object version.** A file's inode stands for one (key, ETag): its size and
  mtime never change, so the kernel's page cache of an inode can only hold that version's
  bytes. When a HEAD, a probe or a listing sees a new ETag, the name points at a new inode and
  the old one is *superseded*: its open handles keep reading their version (cached bytes, or
  StaleObjectError once the store has only the new one), and opening it answers ESTALE, on
  which the kernel looks the path up again and opens the new inode. Inode numbers are never
  reused while mounted; a file's node is freed once the kernel forgot it (``forget``), no
  handle has it open and no cached listing or probe names it (directories are few and kept).
* Metadata is cached for ``metadata_ttl_s``: a directory's listing, each name looked up
  without a fresh listing (a *probe*), and each file's attributes (a single-flight HEAD,
  shared by every handle and process that asks). ``readdir`` lists the whole directory. A
  lookup without a fresh listing asks for the listing's first page only: if that is the whole
  directory (the usual model directory) it is cached and answers every name; if not, the
  directory is marked big and the name is probed instead (a HEAD of the key and a one-page
  listing under ``key/`` at once), as every later lookup in it is: a lookup never lists a
  huge parent. A listing never overrides a version that a request which started later saw.
* **Stale but available.** When refreshing a listing, a probe or a file's attributes fails
  because the store is unreachable (connection refused, timeout, 5xx after retries), what is
  known is served for up to ``max_stale_s`` past its TTL (0: strict, fail instead). One
  warning per outage; during an outage the store is tried again at most every
  ``OUTAGE_RETRY_S`` and other requests get the known answer at once instead of waiting.
* An open handle is pinned to the ETag the object had at open; every read of that handle is
  conditional on it, so a replaced object yields StaleObjectError, never a mix of versions.

Reads go through three tiers: the memory :class:`~objfs.block_cache.BlockCache` (a read that
hits it returns without waiting on anything), the optional persistent
:class:`~objfs.disk_cache.DiskCache`, and ranged GETs of ``part_size`` bytes. Read-ahead
(:mod:`objfs.readahead`) decides what to fetch ahead of each sequential stream and
:mod:`objfs.scheduler` fetches it; the open handles of one version share one read-ahead
state, so readers of one file side by side (tensor-parallel ranks, each reading its part of
every tensor) continue each other's streams; files every loader reads whole
(``*.safetensors``) are fetched ahead from the first open. A block served whole to the
kernel is marked in its node's ``served`` map and never prefetched again for that version.
A random read of a block that no tier holds fetches only the bytes it touches, rounded to
``RANDOM_READ_ALIGN``, and leaves them to the kernel's page cache: a 4 KiB lookup does not
wait for a whole block.

Concurrency: everything here runs on the trio thread. Listings are single-flight; a block is
fetched once however many handles and processes want it (see :mod:`objfs.block_cache` and
:mod:`objfs.scheduler`). A reply is a view of a cached block's buffer, or a pooled buffer for a
read across blocks; both are consumed by the kernel before the trio thread runs anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar, overload

import trio

from objfs.backends.base import Backend, ObjectInfo
from objfs.block_cache import BlockCache, BlockKey, Buffer
from objfs.config import MountConfig
from objfs.disk_cache import DiskCache
from objfs.errors import (
    BadFileHandleError,
    EndpointUnreachableError,
    IsADirectoryFsError,
    NoDiskCacheError,
    NotADirectoryFsError,
    ObjectNotFoundError,
    ReadOnlyError,
    StaleObjectError,
    TransientStoreError,
)
from objfs.inodes import (
    ROOT_INODE,
    Attributes,
    DirHandle,
    Handle,
    Listing,
    Node,
    Probe,
    posix_name,
)
from objfs.nursery import open_nursery
from objfs.readahead import Readahead
from objfs.scheduler import Fetcher, ceil_div
from objfs.singleflight import SingleFlight

log = logging.getLogger(__name__)

T = TypeVar("T")

# A random read that misses every tier fetches this much around what it touches (a multiple
# of the page size: the kernel caches the pages it asked for).
RANDOM_READ_ALIGN = 64 * 1024

# During an outage, the store is tried again at most this often; meanwhile known metadata is
# served at once (within --max-stale).
OUTAGE_RETRY_S = 5.0


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
        # Reply buffers (reads assembled across blocks, random reads around the block tier)
        # get their own share of the same budget: enough for 16 concurrent 1 MiB replies at
        # the default, a sixteenth of smaller budgets, at least one part.
        reply_bytes = min(
            max(config.part_size_bytes, config.memory_limit_bytes // 16),
            16 * config.block_size_bytes,
            config.memory_limit_bytes // 2,
        )
        self.cache = BlockCache(
            config.memory_limit_bytes,
            used_limit,
            block_size=config.block_size_bytes,
            reply_bytes=reply_bytes,
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
        self._inode_of: dict[tuple[bool, str, str], int] = {}  # (is_dir, key, etag) -> inode
        self._nodes: dict[int, Node] = {}
        self._current: dict[str, Node] = {}  # file key -> its newest known version
        self._listings: dict[int, Listing] = {}
        self._probes: dict[tuple[int, bytes], Probe] = {}
        self._list_flight: SingleFlight[tuple[int, bool], Listing | None] = SingleFlight()
        self._probe_flight: SingleFlight[tuple[int, bytes], Node | None] = SingleFlight()
        self._head_flight: SingleFlight[str, tuple[ObjectInfo, float]] = SingleFlight()
        self._range_flight: SingleFlight[tuple[str, str, int, int], bytes] = SingleFlight()
        self._handles: dict[int, Handle] = {}
        # Answered reads' pooled buffers, still charged to the reply share (see read).
        self._reply_buffers: list[Buffer] = []
        self.reads_spanned = 0  # reads across blocks answered with one view (no copy)
        self.reads_assembled = 0  # reads across blocks assembled by a copy
        self.reads_scattered = 0  # reads across blocks answered with a view per block
        self.cache.replies.reclaim = self._release_reply_buffers
        self._dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        self._warned: set[str] = set()
        self._swept_at = time.monotonic()
        # Store outages seen by metadata requests (see "Stale but available" above).
        self._outage_since: float | None = None
        self._outage_tried_at = 0.0
        self.outages = 0
        self.stale_answers = 0
        self.metadata_requests = 0
        self.empty_source = False  # SOURCE held no object at mount (see mount.serve_async)
        root = Node(ROOT_INODE, ROOT_INODE, b"", config.source.prefix, True)
        self._nodes[ROOT_INODE] = root
        self._inode_of[(True, root.key, "")] = ROOT_INODE
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

    def _new_node(self, ident: tuple[bool, str, str], node: Node) -> Node:
        self._inode_of[ident] = node.inode
        self._nodes[node.inode] = node
        self._next_inode += 1
        return node

    def _dir_node(self, parent: int, name: bytes, prefix: str, checked_at: float) -> Node:
        inode = self._inode_of.get((True, prefix, ""))
        node = (
            self._nodes[inode]
            if inode is not None
            else self._new_node(
                (True, prefix, ""), Node(self._next_inode, parent, name, prefix, True)
            )
        )
        node.checked_at = max(node.checked_at, checked_at)
        return node

    def _file_node(self, parent: int, name: bytes, info: ObjectInfo, checked_at: float) -> Node:
        """The node of the version ``info`` describes, seen current by a request that started
        at ``checked_at``; if a request that started later saw another version, that one."""
        current = self._current.get(info.key)
        if current is not None and current.etag != info.etag and current.checked_at > checked_at:
            return current  # a newer fact: an older listing must not undo it
        ident = (False, info.key, info.etag)
        inode = self._inode_of.get(ident)
        if inode is None:
            node = self._new_node(
                ident,
                Node(
                    self._next_inode,
                    parent,
                    name,
                    info.key,
                    False,
                    size=info.size,
                    etag=info.etag,
                    mtime_ns=info.mtime_ns,
                ),
            )
        else:
            node = self._nodes[inode]
        node.checked_at = max(node.checked_at, checked_at)
        node.superseded = False
        if current is not None and current is not node:
            current.superseded = True
            self._maybe_free(current)
        self._current[info.key] = node
        return node

    def _gone(self, node: Node) -> None:
        """The store says ``node``'s key no longer exists."""
        node.superseded = True
        if self._current.get(node.key) is node:
            del self._current[node.key]
        self._listings.pop(node.parent, None)  # the parent listing is wrong now
        self._probes.pop((node.parent, node.name), None)
        self._maybe_free(node)

    def remember(self, node: Node) -> None:
        """The kernel got an entry for ``node`` (a lookup or a readdir entry)."""
        node.lookups += 1

    def forget(self, inode: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``inode``."""
        node = self._nodes.get(inode)
        if node is None:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self._maybe_free(node)

    def _named(self, node: Node) -> bool:
        """A cached listing or probe still answers with ``node``."""
        listing = self._listings.get(node.parent)
        if listing is not None and listing.entries.get(node.name) is node:
            return True
        probe = self._probes.get((node.parent, node.name))
        return probe is not None and probe.node is node

    def _maybe_free(self, node: Node) -> None:
        """Free a file node nobody can reach any more (directories are few and kept)."""
        if node.is_dir or node.lookups > 0 or node.opens > 0:
            return
        if not node.superseded and self._named(node):
            return
        if self._nodes.get(node.inode) is not node:
            return
        del self._nodes[node.inode]
        del self._inode_of[(False, node.key, node.etag)]
        if self._current.get(node.key) is node:
            del self._current[node.key]

    def _sweep(self) -> None:
        """Drop listings and probes too old to be served even stale, and the nodes only they
        named (at most once per TTL: O(cached names))."""
        now = time.monotonic()
        keep_s = max(self.config.metadata_ttl_s, 1.0) + self.config.max_stale_s
        if now - self._swept_at < min(keep_s, max(self.config.metadata_ttl_s, 1.0)):
            return
        self._swept_at = now
        orphans: list[Node] = []
        for inode, listing in list(self._listings.items()):
            if now - listing.fetched_at > keep_s:
                del self._listings[inode]
                orphans.extend(listing.entries.values())
        for ident, probe in list(self._probes.items()):
            if now - probe.checked_at > keep_s:
                del self._probes[ident]
                if probe.node is not None:
                    orphans.append(probe.node)
        for node in orphans:
            self._maybe_free(node)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _fresh(self, checked_at: float) -> bool:
        return time.monotonic() - checked_at < self.config.metadata_ttl_s

    # -- the store's availability ----------------------------------------------------------

    def _servable(self, checked_at: float) -> bool:
        """Known metadata this old may still be served while the store is unreachable."""
        age = time.monotonic() - checked_at
        return self.config.max_stale_s > 0 and age < (
            self.config.metadata_ttl_s + self.config.max_stale_s
        )

    def _skip_store(self, checked_at: float) -> bool:
        """During an outage, answer from what is known without waiting on the store (it is
        tried again every OUTAGE_RETRY_S)."""
        return (
            self._outage_since is not None
            and time.monotonic() - self._outage_tried_at < OUTAGE_RETRY_S
            and self._servable(checked_at)
        )

    def _store_call(self) -> None:
        self.metadata_requests += 1
        self._outage_tried_at = time.monotonic()

    def _store_answered(self) -> None:
        if self._outage_since is not None:
            log.warning(
                "the store answers again after %.0f s; %d answers were served from cached "
                "metadata meanwhile",
                time.monotonic() - self._outage_since,
                self.stale_answers,
            )
            self._outage_since = None

    def _store_failed(self, exc: Exception) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.outages += 1
            if self.config.max_stale_s > 0:
                log.warning(
                    "the store is unreachable (%s): serving cached metadata for up to %.0f s "
                    "past its TTL (--max-stale) until it answers again",
                    exc,
                    self.config.max_stale_s,
                )
            else:
                log.warning("the store is unreachable (%s); --max-stale 0: failing", exc)

    def _served_stale(self) -> None:
        self.stale_answers += 1

    async def _from_store(
        self, ask: Callable[[], Awaitable[T]], known_at: Callable[[], float | None]
    ) -> tuple[T] | None:
        """The store's answer to ``ask()`` (in a 1-tuple), or None when the caller should
        serve what it knows instead: the store is unreachable (or was a moment ago, see
        _skip_store) and what is known, confirmed at ``known_at()`` (None: nothing), may
        still be served. The one place the stale-but-available rule is applied."""
        at = known_at()
        if at is not None and self._skip_store(at):
            self._served_stale()
            return None
        try:
            return (await ask(),)
        except (EndpointUnreachableError, TransientStoreError) as exc:
            self._store_failed(exc)
            at = known_at()
            if at is not None and self._servable(at):
                self._served_stale()
                return None
            raise

    def store_state(self) -> dict[str, float | int | None]:
        return {
            "outages": self.outages,
            "stale_answers": self.stale_answers,
            "unreachable_for_s": None
            if self._outage_since is None
            else time.monotonic() - self._outage_since,
        }

    # -- listings --------------------------------------------------------------------------

    async def listing(self, dir_node: Node) -> Listing:
        """Return the directory's entries, from the cache while it is fresh."""
        if not dir_node.is_dir:
            raise NotADirectoryFsError(f"{dir_node.key!r} is not a directory")
        cached = self._listings.get(dir_node.inode)
        if cached is not None and self._fresh(cached.fetched_at):
            return cached

        def known_at() -> float | None:
            known = self._listings.get(dir_node.inode)
            return None if known is None else known.fetched_at

        answer = await self._from_store(
            lambda: self._list_flight.run(
                (dir_node.inode, False), lambda: self._fetch_listing(dir_node)
            ),
            known_at,
        )
        listing = self._listings[dir_node.inode] if answer is None else answer[0]
        assert listing is not None  # a whole listing is never cut short
        return listing

    async def _fetch_listing(self, dir_node: Node, *, first_page: bool = False) -> Listing | None:
        """List the directory and cache the listing. ``first_page``: stop after the first
        page; if more follow, mark the directory big and return None."""
        prefix = dir_node.key
        started = time.monotonic()
        files: dict[bytes, ObjectInfo] = {}
        dirs: dict[bytes, str] = {}
        self._store_call()
        pages = self.backend.list_prefix(prefix)
        async for page in pages:
            if first_page and page.more:
                dir_node.big = True
                await pages.aclose()  # type: ignore[attr-defined]
                self._store_answered()
                return None
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
        self._store_answered()
        entries: dict[bytes, Node] = {}
        for name in sorted(files.keys() | dirs.keys()):
            if name in dirs:
                if name in files:
                    self._warn_once(
                        files[name].key,
                        f"key {files[name].key!r} is hidden by the directory {dirs[name]!r} "
                        "of the same name",
                    )
                node = self._dir_node(dir_node.inode, name, dirs[name], started)
            else:
                node = self._file_node(dir_node.inode, name, files[name], started)
            entries[name] = node
        old = self._listings.get(dir_node.inode)
        listing = Listing(entries, started)
        self._listings[dir_node.inode] = listing
        if old is not None:  # nodes only the old listing named may be freed now
            for name, node in old.entries.items():
                if entries.get(name) is not node:
                    self._maybe_free(node)
        return listing

    async def _head(self, key: str) -> tuple[ObjectInfo, float]:
        """HEAD ``key`` (single-flight: concurrent askers share one request); the version and
        the time the request started."""

        async def head() -> tuple[ObjectInfo, float]:
            started = time.monotonic()
            self._store_call()
            info = await self.backend.head(key)
            self._store_answered()
            return info, started

        return await self._head_flight.run(key, head)

    async def _refresh_file(self, node: Node) -> None:
        """Re-check a file's version when it is older than the metadata TTL. The node's own
        attributes never change: a new version becomes a new node (``node`` is superseded)."""
        if node.superseded or self._fresh(node.checked_at):
            return

        async def head() -> tuple[ObjectInfo, float]:
            try:
                return await self._head(node.key)
            except ObjectNotFoundError:
                self._store_answered()
                self._gone(node)
                raise

        answer = await self._from_store(head, lambda: node.checked_at)
        if answer is None:
            return  # the known version, served stale
        info, started = answer[0]
        if info.etag == node.etag:
            node.checked_at = max(node.checked_at, started)
        else:
            newer = self._file_node(node.parent, node.name, info, started)
            self._renamed(node.parent, node.name, newer)

    def _renamed(self, parent: int, name: bytes, node: Node) -> None:
        """Point cached answers for (parent, name) at ``node``, the newest version."""
        listing = self._listings.get(parent)
        if listing is not None and name in listing.entries:
            old = listing.entries[name]
            if not old.is_dir:
                listing.entries[name] = node
        probe = self._probes.get((parent, name))
        if probe is not None and (probe.node is None or not probe.node.is_dir):
            probe.node = node

    async def _probe(self, parent: Node, name: bytes) -> Node | None:
        """Look one name up in the store: a HEAD of the key and a one-page listing under
        ``key/`` at once (a directory wins over a file of the same name)."""
        key = parent.key + name.decode("utf-8", "surrogateescape")
        started = time.monotonic()
        info: ObjectInfo | None = None
        is_dir = False

        async def head() -> None:
            nonlocal info
            with contextlib.suppress(ObjectNotFoundError):
                info, _ = await self._head(key)

        async def under() -> None:
            nonlocal is_dir
            self._store_call()
            is_dir = await self.backend.has_keys_under(key + "/")

        async with open_nursery() as nursery:
            nursery.start_soon(head)
            nursery.start_soon(under)
        self._store_answered()
        node: Node | None
        if is_dir:
            node = self._dir_node(parent.inode, name, key + "/", started)
        elif info is not None:
            node = self._file_node(parent.inode, name, info, started)
        else:
            node = None
            current = self._current.get(key)
            if current is not None and current.checked_at < started:
                self._gone(current)
        self._probes[(parent.inode, name)] = Probe(node, started)
        return node

    # -- metadata operations ---------------------------------------------------------------

    def _newest(self, node: Node | None) -> Node | None:
        if node is not None and node.superseded and not node.is_dir:
            return self._current.get(node.key)
        return node

    async def lookup(self, parent_inode: int, name: bytes) -> Node:
        parent = self.node(parent_inode)
        if name == b".":
            return parent
        if name == b"..":
            return self.node(parent.parent)
        if not parent.is_dir:
            raise NotADirectoryFsError(f"{parent.key!r} is not a directory")
        self._sweep()
        node = await self._lookup(parent, name)
        if node is None:
            raise ObjectNotFoundError(f"{name!r} not found in {parent.key!r}")
        return node

    async def _lookup(self, parent: Node, name: bytes) -> Node | None:
        listing = self._listings.get(parent.inode)
        if listing is not None and self._fresh(listing.fetched_at):
            return self._newest(listing.entries.get(name))
        probe = self._probes.get((parent.inode, name))
        if probe is not None and self._fresh(probe.checked_at):
            return self._newest(probe.node)
        # What is known, however old: a stale listing's or probe's answer, the newer one.
        known: tuple[Node | None, float] | None = None
        if listing is not None:
            known = (listing.entries.get(name), listing.fetched_at)
        if probe is not None and (known is None or probe.checked_at > known[1]):
            known = (probe.node, probe.checked_at)

        async def ask() -> Node | None:
            if not parent.big:
                listing = await self._list_flight.run(
                    (parent.inode, True), lambda: self._fetch_listing(parent, first_page=True)
                )
                if listing is not None:
                    return self._newest(listing.entries.get(name))
            return await self._probe_flight.run(
                (parent.inode, name), lambda: self._probe(parent, name)
            )

        answer = await self._from_store(ask, lambda: None if known is None else known[1])
        if answer is None:
            assert known is not None  # served stale only when something is known
            return self._newest(known[0])
        return answer[0]

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

    async def whole_on_disk(self, inode: int) -> str | None:
        """The disk tier's file that holds exactly this file version's bytes, verified, for
        the kernel to read itself (FUSE passthrough); None when there is none (see
        :meth:`objfs.disk_cache.DiskCache.whole_version_file`)."""
        node = self.node(inode)
        if node.is_dir or node.size == 0 or self.disk is None or not self.disk.enabled:
            return None
        if 1 in node.served:
            # Served in cached mode on this mount: the kernel's page cache of this inode
            # holds those bytes, and a passthrough open would read them from disk again (a
            # warm reload took 3.6 s instead of 0.3 s).
            return None
        return await trio.to_thread.run_sync(
            self.disk.whole_version_file,
            node.key,
            node.etag,
            node.size,
            limiter=self.fetcher.disk_read_limiter,
        )

    async def open(self, inode: int, flags: int, *, prefetch: bool = True) -> tuple[int, bool]:
        """Open for reading; returns (fh, keep_cache). ``prefetch=False``: the kernel reads
        the file elsewhere (passthrough), so nothing is fetched ahead for this open.

        ``keep_cache`` is always True: an inode is one version, so its pages in the kernel's
        page cache are this version's and re-opens are served from there. Opening a version
        that a newer one superseded raises StaleObjectError (ESTALE): the kernel then looks the
        path up again (LOOKUP_REVAL) and opens the new version's inode.
        """
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise ReadOnlyError("the file system is read-only")
        node = self.node(inode)
        if node.is_dir:
            raise IsADirectoryFsError(f"{node.key!r} is a directory")
        await self._refresh_file(node)
        if node.superseded:
            raise StaleObjectError(f"{node.key!r} was replaced or removed; look it up again")
        keep_cache = True
        if len(node.served) != ceil_div(node.size, self.block_size):
            node.served = bytearray(ceil_div(node.size, self.block_size))
        node.opens += 1
        fh = self._new_fh()
        readahead = node.readahead
        first_open = readahead is None
        if readahead is None:
            readahead = node.readahead = Readahead(
                node.size,
                initial_window=self.config.readahead_initial_bytes,
                max_window=self.config.readahead_max(),
            )
        handle = Handle(fh, node, node.key, node.etag, node.size, readahead, node.served)
        self._handles[fh] = handle
        self.cache.open_version(handle.key, handle.etag)
        self._share_windows()
        if prefetch and first_open and node.key.endswith(self.config.prefetch_on_open_suffixes):
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
        """Split the read-ahead share of the budget (``readahead_max``, about half) among the
        open handles that can use it, so concurrent streams do not evict each other's unread
        blocks. Handles of one version share one read-ahead state, whose streams each get
        this share: a wider window per version (a share per version) doubled the GETs in
        flight of four tensor-parallel ranks but filled the budget with blocks the slower
        ranks had not read, and fetched 1.015-1.047x the model in 5 of 6 runs."""
        big = [h for h in self._handles.values() if h.size > self.config.part_size_bytes]
        share = self.config.readahead_max() // max(1, len(big))
        window = max(self.config.part_size_bytes, share)
        for readahead in {id(h.readahead): h.readahead for h in big}.values():
            readahead.max_window = window
            for stream in readahead.streams:
                stream.window = min(stream.window, window)

    def release(self, fh: int) -> None:
        """Close a handle: cancel its read-ahead (queued jobs and fetches in flight); after the
        last handle of a version, its unread blocks are the first to go."""
        self._release_reply_buffers()
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        handle.node.opens -= 1
        if handle.node.opens == 0:
            handle.node.readahead = None
        else:
            # Its queued read-ahead is cancelled below, but the streams it served go on for
            # the version's other handles: their next reads ask for it again.
            for stream in handle.readahead.streams:
                stream.scheduled_until = min(stream.scheduled_until, stream.next_offset)
        self._maybe_free(handle.node)
        self._share_windows()
        self.fetcher.cancel(handle)
        self.cache.close_version(handle.key, handle.etag)

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise BadFileHandleError(f"file handle {fh} is not open") from None

    @overload
    async def read(
        self, fh: int, offset: int, size: int, *, holds: None = None
    ) -> bytes | bytearray | memoryview: ...

    @overload
    async def read(
        self, fh: int, offset: int, size: int, *, holds: list[Callable[[], None]]
    ) -> bytes | bytearray | memoryview | list[memoryview]: ...

    async def read(
        self, fh: int, offset: int, size: int, *, holds: list[Callable[[], None]] | None = None
    ) -> bytes | bytearray | memoryview | list[memoryview]:
        """Return ``size`` bytes from ``offset``, fewer only at end of file.

        Without ``holds`` the reply must reach the kernel before the trio thread runs anything
        else (the view's buffer may be recycled after). With ``holds`` (a transport that
        writes replies from other threads) the bytes stay valid, and charged to the budget,
        until every callback appended to ``holds`` has run: the caller runs them on the trio
        thread once the reply is written (cached blocks are pinned, pooled and reply-share
        bytes given back by the callbacks); and a read across cached blocks that are not
        adjacent in memory is answered with a list of views, one per block, in order (the
        caller writes them with one ``writev``), rather than copied into one buffer."""
        self._release_reply_buffers()
        self.fetcher.touch()
        handle = self._handle(fh)
        end = min(offset + size, handle.size)
        if offset >= end:
            return b""
        window = handle.readahead.on_read(offset, end - offset, handle.fh)
        if window is not None:
            self.fetcher.prefetch(
                handle, window, cancellable=True, stream=handle.readahead.last_stream
            )
        elif handle.readahead.last_random:
            data = await self._read_random(handle, offset, end, holds)
            if data is not None:
                return data
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        if first == last:
            # The usual case: one block, answered with a view of its buffer (the kernel copies
            # it before the trio thread runs anything else, so nothing can recycle it first).
            base = first * bs
            block = await self._block(handle, first, to_end=self._reaches_end(handle, first, end))
            if block is not None:
                self._hold_blocks([self.fetcher.key(handle, first)], holds)
                return block[offset - base : end - base]
            # Budget smaller than a block, or evicted again: read around the memory tier.
            nbytes = end - offset
            await self.cache.replies.acquire(nbytes)
            try:
                around = await self._read_range(handle, offset, nbytes)
            except BaseException:
                self.cache.replies.release(nbytes)
                raise
            # The reply reaches the kernel before the trio thread runs anything else (or,
            # with holds, the share is given back once it has).
            self._release_share(nbytes, holds)
            return around
        # A read across blocks (the kernel's requests are rarely block-aligned): one view
        # when the blocks sit in adjacent buffers (the usual case, see BufferPool), once
        # every block is here.
        keys = [self.fetcher.key(handle, i) for i in range(first, last + 1)]
        for index, key in zip(range(first, last + 1), keys, strict=True):
            if not self.cache.contains(key):
                await self.fetcher.demand(handle, index)
        joined = self.cache.span(keys)
        if joined is not None:
            # No await from the check to the reply: nothing can recycle them. Pinned before
            # they are marked used: marking one used may evict the least recently used, which
            # must not be another block of this reply while a writer thread still needs it.
            self._hold_blocks(keys, holds)
            for index in range(first, last + 1):
                self._cached(handle, index, to_end=self._reaches_end(handle, index, end))
            self.reads_spanned += 1
            return joined[offset - first * bs : end - first * bs]
        parts = self._scatter(keys, first, offset, end) if holds is not None else None
        if parts is not None:
            # No await from the check to the reply, and pinned first, as above.
            self._hold_blocks(keys, holds)
            for index in range(first, last + 1):
                self._cached(handle, index, to_end=self._reaches_end(handle, index, end))
            self.reads_scattered += 1
            return parts
        # Else it is assembled in a pooled buffer charged to the reply share: no
        # zero-filling, no fresh pages. Each piece is copied at once (the next block's fetch
        # may wait, and this one may be evicted meanwhile).
        self.reads_assembled += 1
        pooled = end - offset <= self.cache.pool.buffer_size
        nbytes = self.cache.pool.buffer_size if pooled else end - offset
        await self.cache.replies.acquire(nbytes)
        buf: Buffer | bytearray | None = None
        try:
            buf = self.cache.pool.acquire() if pooled else bytearray(end - offset)
            out = (buf.view if isinstance(buf, Buffer) else memoryview(buf))[: end - offset]
            for index in range(first, last + 1):
                base = index * bs
                lo, hi = max(offset, base), min(end, base + bs)
                block = await self._block(
                    handle, index, to_end=self._reaches_end(handle, index, end)
                )
                if block is not None:
                    out[lo - offset : hi - offset] = block[lo - base : hi - base]
                else:
                    # Around the memory tier, straight into the reply: no second buffer.
                    await self._read_range_into(handle, lo, out[lo - offset : hi - offset])
        except BaseException:
            if isinstance(buf, Buffer):
                self.cache.pool.release(buf)
            self.cache.replies.release(nbytes)
            raise
        if isinstance(buf, Buffer) and holds is not None:
            pooled_buf = buf

            def give_back() -> None:
                self.cache.pool.release(pooled_buf)
                self.cache.replies.release(self.cache.pool.buffer_size)

            holds.append(give_back)
        elif isinstance(buf, Buffer):
            # The kernel copies the reply before the trio thread runs anything else: the
            # buffer goes back to the pool, and its bytes to the share, when the next read
            # starts, or when a read waiting for the reply share wakes (poke) and reclaims it.
            self._reply_buffers.append(buf)
            self.cache.replies.poke()
        else:
            self._release_share(nbytes, holds)
        return out

    def _scatter(
        self, keys: list[BlockKey], first: int, offset: int, end: int
    ) -> list[memoryview] | None:
        """Views of ``[offset, end)`` in the cached blocks ``keys`` (block ``first`` on), one
        per block; None unless every one is in memory now."""
        bs = self.block_size
        parts = []
        for index, key in enumerate(keys, start=first):
            block = self.cache.peek(key)
            if block is None or block.buffer is None:
                return None
            base = index * bs
            lo, hi = max(offset, base), min(end, base + bs)
            if hi - base > len(block.view):
                return None
            parts.append(block.view[lo - base : hi - base])
        return parts

    def _hold_blocks(self, keys: list[BlockKey], holds: list[Callable[[], None]] | None) -> None:
        """Pin the cached blocks of ``keys`` until the holds run (no-op without holds)."""
        if holds is None:
            return
        for key in keys:
            block = self.cache.peek(key)
            if block is not None:
                block.pin()
                holds.append(block.unpin)

    def _release_share(self, nbytes: int, holds: list[Callable[[], None]] | None) -> None:
        """Give ``nbytes`` back to the reply share now, or once the holds run."""
        if holds is None:
            self.cache.replies.release(nbytes)
        else:
            holds.append(lambda: self.cache.replies.release(nbytes))

    def _release_reply_buffers(self) -> None:
        """Give back the pooled buffers of answered reads: any handler that runs comes after
        their replies reached the kernel."""
        while self._reply_buffers:
            self.cache.pool.release(self._reply_buffers.pop())
            self.cache.replies.release(self.cache.pool.buffer_size)

    def _reaches_end(self, handle: Handle, index: int, end: int) -> bool:
        """Whether a read that ends at ``end`` reaches the last byte of block ``index``."""
        return end >= (index + 1) * self.block_size or end == handle.size

    def _cached(self, handle: Handle, index: int, *, to_end: bool) -> memoryview | None:
        """Block ``index`` from the memory tier now, or None. ``to_end``: the read reaches
        the block's end, so the block is served (never fetched ahead again) and used."""
        if to_end:
            handle.served[index] = 1
        return self.cache.get_nowait(self.fetcher.key(handle, index), to_end=to_end)

    async def _block(self, handle: Handle, index: int, *, to_end: bool) -> memoryview | None:
        """Block ``index`` of the handle's version, from the memory tier or fetched now; None
        if the tier cannot hold it (a budget smaller than a block, or evicted again before
        it was read): the caller then reads around the tier."""
        data = self._cached(handle, index, to_end=to_end)
        if data is not None:
            return data
        await self.fetcher.demand(handle, index)
        return self.cache.get_nowait(self.fetcher.key(handle, index), to_end=to_end)

    async def _read_random(
        self, handle: Handle, offset: int, end: int, holds: list[Callable[[], None]] | None
    ) -> memoryview | None:
        """Bytes [offset, end) for a random read, or None to read through the block cache
        (some of its blocks are cached or on their way there)."""
        bs = self.block_size
        indexes = list(range(offset // bs, (end - 1) // bs + 1))
        keys = [self.fetcher.key(handle, i) for i in indexes]
        if any(self.cache.is_cached_or_pending(k) for k in keys):
            return None
        if self.disk is not None and self.disk.enabled:
            # The blocks are read from disk side by side into one buffer (no join), charged
            # to the reply share until the reply reaches the kernel (before the trio thread
            # runs anything else).
            base = indexes[0] * bs
            nbytes = min(handle.size, (indexes[-1] + 1) * bs) - base
            await self.cache.replies.acquire(nbytes)
            answered = False
            try:
                buf = memoryview(bytearray(nbytes))
                wanted = [(i, buf[i * bs - base : (i + 1) * bs - base]) for i in indexes]
                found = await trio.to_thread.run_sync(
                    self.fetcher.read_disk_blocks_into,
                    handle,
                    wanted,
                    limiter=self.fetcher.disk_read_limiter,
                )
                if len(found) == len(indexes):
                    answered = True
                    return buf[offset - base : end - base]
            finally:
                if answered:
                    self._release_share(nbytes, holds)
                else:
                    self.cache.replies.release(nbytes)
        start = offset // RANDOM_READ_ALIGN * RANDOM_READ_ALIGN
        stop = min(handle.size, ceil_div(end, RANDOM_READ_ALIGN) * RANDOM_READ_ALIGN)

        async def fetch() -> bytes:
            return await self._read_range(handle, start, stop - start)

        # Readers of the same range (other handles, other processes) share one GET. Each
        # charges the range to the reply share while it waits and until its reply reaches the
        # kernel (the shared bytes may be counted more than once: never less than once).
        nbytes = stop - start
        await self.cache.replies.acquire(nbytes)
        answered = False
        try:
            if any(self.cache.is_cached_or_pending(k) for k in keys):
                return None  # fetched by read-ahead or a neighbour while this read waited
            data = await self._range_flight.run((handle.key, handle.etag, start, stop), fetch)
            answered = True
            return memoryview(data)[offset - start : end - start]
        finally:
            if answered:
                self._release_share(nbytes, holds)
            else:
                self.cache.replies.release(nbytes)

    async def _read_range(self, handle: Handle, start: int, length: int) -> bytes:
        """One GET outside the block cache, with the same stale-version handling."""
        try:
            return await self.backend.read_range(handle.key, handle.etag, start, length)
        except StaleObjectError:
            self._forget_version(handle)
            raise

    async def _read_range_into(self, handle: Handle, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start``, outside the block cache (one GET, same stale rule)."""
        try:
            await self.backend.read_into(handle.key, handle.etag, start, [out])
        except StaleObjectError:
            self._forget_version(handle)
            raise

    def _forget_version(self, handle: Handle) -> None:
        """The store no longer has the handle's version: the next open and lookup of its name
        ask the store instead of our metadata."""
        node = handle.node
        node.checked_at = -float("inf")
        if self._current.get(node.key) is node:
            self._listings.pop(node.parent, None)
            self._probes.pop((node.parent, node.name), None)

    async def flush_disk_writes(self) -> None:
        """Wait until every block queued for the disk cache is written."""
        await self.fetcher.flush_disk_writes()

    def handle_inode(self, fh: int) -> int:
        """The inode (one file version) that handle ``fh`` reads."""
        return self._handle(fh).node.inode

    async def warm(self, inode: int) -> int:
        """Read the file's version whole into the memory and disk tiers, with no reply to
        the kernel (``objfs warm --cache-only``, through ``fsync``); returns the bytes read
        once they are written to the disk tier.

        It reads like a sequential reader on a handle of its own (same read-ahead, same
        budget, same ownership: its blocks are read, so they go first when memory is short),
        one block per step, and waits before each step while the disk tier is behind
        (``Fetcher.disk_room``), so every block it reads reaches the disk. Without a disk
        tier nothing would keep the bytes: NoDiskCacheError (EOPNOTSUPP). If the disk tier
        did not keep every block (its cap, its free-space floor, a failing disk):
        NotStoredError (ENOSPC), from ``Fetcher.check_on_disk``."""
        if self.disk is None or not self.disk.enabled:
            raise NoDiskCacheError("the mount has no usable --cache-dir to warm")
        fh, _ = await self.open(inode, os.O_RDONLY)
        done = 0
        try:
            handle = self._handle(fh)
            # Its blocks reach no page cache: marks of its own, not the node's (which say
            # what the kernel holds; see whole_on_disk).
            handle.served = bytearray(len(handle.served))
            size = handle.size
            while done < size:
                await self.fetcher.disk_room()
                got = len(await self.read(fh, done, self.block_size - done % self.block_size))
                if not got:
                    break
                # Read while its run's write was deferred (or refused earlier): queue it
                # before it can be evicted.
                self.fetcher.write_now(self.fetcher.key(handle, done // self.block_size))
                done += got
            # Before the handle closes: its blocks still waiting for the disk stay in memory.
            await self.fetcher.disk_room(settled=True)
            # Blocks lost anyway (evicted by another reader's demand before the writer got
            # to them) are fetched again now rather than when the mount is next idle.
            await self.fetcher.store_lost_now(handle.key, handle.etag)
            await self.fetcher.check_on_disk(handle)
            # Recorded as checked: the next mount serves it by passthrough with no re-read.
            disk = self.disk
            await trio.to_thread.run_sync(disk.seal, handle.key, handle.etag, handle.size)
        finally:
            self.release(fh)
        return done

    async def seal_disk_versions(self) -> int:
        """Record every file version this mount wrote or read whole through the disk tier
        as checked (``DiskCache.seal``), so that the next mount serves them by passthrough
        with no read of their bytes; returns how many are recorded. For the end of a mount,
        once the disk writes are flushed."""
        disk = self.disk
        if disk is None or not disk.enabled:
            return 0
        wanted = set(disk.checked_versions())
        sizes = {
            (node.key, node.etag): node.size
            for node in self._nodes.values()
            if not node.is_dir and (node.key, node.etag) in wanted
        }
        sealed = 0
        for (key, etag), size in sizes.items():
            sealed += await trio.to_thread.run_sync(disk.seal, key, etag, size)
        return sealed

    def statistics(self) -> dict[str, int]:
        return {
            "inodes": len(self._nodes),
            "listings": len(self._listings),
            "probes": len(self._probes),
            "metadata_requests": self.metadata_requests,
            "store_outages": self.outages,
            "stale_answers": self.stale_answers,
            "open_files": len(self._handles),
            "open_dirs": len(self._dir_handles),
            "reads_spanned": self.reads_spanned,
            "reads_assembled": self.reads_assembled,
            "reads_scattered": self.reads_scattered,
            **self.cache.statistics(),
            **self.fetcher.statistics(),
            **(self.disk.statistics() if self.disk is not None else {}),
        }
