"""The inode table and the metadata cache: names, versions and attributes, free of FUSE.

* A directory is a key prefix ending in ``/``; it exists when some key lies under it
  (zero-byte markers ``dir/`` included). A file is a key.
* Names come from one ``/``-delimited listing level. A name that POSIX cannot hold (empty,
  ``.``, ``..``, NUL, over 255 bytes) is skipped with a warning, once per key. A key and a
  prefix of the same name: the directory wins and the file is hidden, with one warning.
* **One inode per object version** (:class:`~objfs.inodes.Node`). When a HEAD, a probe or a
  listing sees a new ETag, the name points at a new inode and the old one is *superseded*.
  Inode numbers are never reused while mounted; a file's node is freed once the kernel forgot
  it, no handle has it open and no cached listing or probe names it (directories are kept).
* Listings, probes (a name looked up without a fresh listing) and file attributes (a
  single-flight HEAD) are cached for ``metadata_ttl_s``. A lookup without a fresh listing asks
  for the listing's first page only: if that is the whole directory it is cached and answers
  every name; if not, the directory is marked big and the name is probed instead (a HEAD of
  the key and a one-page listing under ``key/`` at once): a lookup never lists a huge parent.
  A listing never overrides a version that a request which started later saw.
* Past the TTL, the store's failures are answered by :mod:`objfs.availability`.

Trio thread only; listings, probes and HEADs are single-flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Iterator

from objfs.availability import StoreAvailability
from objfs.backends.base import Backend, ObjectInfo
from objfs.config import MountConfig
from objfs.errors import NotADirectoryFsError, ObjectNotFoundError
from objfs.inodes import (
    ROOT_INODE,
    Attributes,
    Handle,
    Listing,
    Node,
    Probe,
    posix_name,
)
from objfs.nursery import open_nursery
from objfs.singleflight import SingleFlight

log = logging.getLogger("objfs.fs")  # the core's one name


class Namespace:
    """The nodes of one mount and the cached listings and probes that name them."""

    def __init__(
        self, backend: Backend, config: MountConfig, availability: StoreAvailability
    ) -> None:
        self.backend = backend
        self.config = config
        self.availability = availability
        self.block_size = config.block_size_bytes
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
        self._warned: set[str] = set()
        self._swept_at = time.monotonic()
        root = Node(ROOT_INODE, ROOT_INODE, b"", config.source.prefix, True)
        self._nodes[ROOT_INODE] = root
        self._inode_of[(True, root.key, "")] = ROOT_INODE
        self._next_inode = ROOT_INODE + 1

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
            self.maybe_free(current)
        self._current[info.key] = node
        return node

    def _gone(self, node: Node) -> None:
        """The store says ``node``'s key no longer exists."""
        node.superseded = True
        if self._current.get(node.key) is node:
            del self._current[node.key]
        self._listings.pop(node.parent, None)  # the parent listing is wrong now
        self._probes.pop((node.parent, node.name), None)
        self.maybe_free(node)

    def remember(self, node: Node) -> None:
        """The kernel got an entry for ``node`` (a lookup or a readdir entry)."""
        node.lookups += 1

    def forget(self, inode: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``inode``."""
        node = self._nodes.get(inode)
        if node is None:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self.maybe_free(node)

    def _named(self, node: Node) -> bool:
        """A cached listing or probe still answers with ``node``."""
        listing = self._listings.get(node.parent)
        if listing is not None and listing.entries.get(node.name) is node:
            return True
        probe = self._probes.get((node.parent, node.name))
        return probe is not None and probe.node is node

    def maybe_free(self, node: Node) -> None:
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
            self.maybe_free(node)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # -- listings --------------------------------------------------------------------------

    async def listing(self, dir_node: Node) -> Listing:
        """Return the directory's entries, from the cache while it is fresh."""
        if not dir_node.is_dir:
            raise NotADirectoryFsError(f"{dir_node.key!r} is not a directory")
        cached = self._listings.get(dir_node.inode)
        if cached is not None and self.availability.fresh(cached.fetched_at):
            return cached

        def known_at() -> float | None:
            known = self._listings.get(dir_node.inode)
            return None if known is None else known.fetched_at

        answer = await self.availability.from_store(
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
        self.availability.call()
        pages = self.backend.list_prefix(prefix)
        async for page in pages:
            if first_page and page.more:
                dir_node.big = True
                await pages.aclose()  # type: ignore[attr-defined]
                self.availability.answered()
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
        self.availability.answered()
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
                    self.maybe_free(node)
        return listing

    async def _head(self, key: str) -> tuple[ObjectInfo, float]:
        """HEAD ``key`` (single-flight: concurrent askers share one request); the version and
        the time the request started."""

        async def head() -> tuple[ObjectInfo, float]:
            started = time.monotonic()
            self.availability.call()
            info = await self.backend.head(key)
            self.availability.answered()
            return info, started

        return await self._head_flight.run(key, head)

    async def refresh_file(self, node: Node) -> None:
        """Re-check a file's version when it is older than the metadata TTL. The node's own
        attributes never change: a new version becomes a new node (``node`` is superseded)."""
        if node.superseded or self.availability.fresh(node.checked_at):
            return

        async def head() -> tuple[ObjectInfo, float]:
            try:
                return await self._head(node.key)
            except ObjectNotFoundError:
                self.availability.answered()
                self._gone(node)
                raise

        answer = await self.availability.from_store(head, lambda: node.checked_at)
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
            self.availability.call()
            is_dir = await self.backend.has_keys_under(key + "/")

        async with open_nursery() as nursery:
            nursery.start_soon(head)
            nursery.start_soon(under)
        self.availability.answered()
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
        if listing is not None and self.availability.fresh(listing.fetched_at):
            return self._newest(listing.entries.get(name))
        probe = self._probes.get((parent.inode, name))
        if probe is not None and self.availability.fresh(probe.checked_at):
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

        answer = await self.availability.from_store(
            ask, lambda: None if known is None else known[1]
        )
        if answer is None:
            assert known is not None  # served stale only when something is known
            return self._newest(known[0])
        return answer[0]

    async def getattr(self, inode: int) -> Attributes:
        node = self.node(inode)
        if not node.is_dir:
            await self.refresh_file(node)
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

    def forget_version(self, handle: Handle) -> None:
        """The store no longer has the handle's version: the next open and lookup of its name
        ask the store instead of our metadata."""
        node = handle.node
        node.checked_at = -float("inf")
        if self._current.get(node.key) is node:
            self._listings.pop(node.parent, None)
            self._probes.pop((node.parent, node.name), None)

    def file_versions(self) -> Iterator[Node]:
        """Every file version (node) known now."""
        return (node for node in self._nodes.values() if not node.is_dir)

    def statistics(self) -> dict[str, int]:
        return {
            "inodes": len(self._nodes),
            "listings": len(self._listings),
            "probes": len(self._probes),
            "metadata_requests": self.availability.metadata_requests,
            "store_outages": self.availability.outages,
            "stale_answers": self.availability.stale_answers,
        }
