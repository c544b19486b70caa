"""The file system: object-store semantics on inode and handle numbers, free of FUSE.

:class:`FileSystem` is what the FUSE front ends (:mod:`objfs.fuse_ops`,
:mod:`objfs.kernel.session`) call. It owns the mount's parts and the open handles:

* the inode table and metadata cache (:mod:`objfs.namespace`), with the stale-but-available
  rule for store outages (:mod:`objfs.availability`);
* the memory tier (:mod:`objfs.block_cache`), the optional disk tier (:mod:`objfs.disk_cache`),
  the fetcher and read-ahead scheduler (:mod:`objfs.scheduler`, with :mod:`objfs.write_behind`)
  and read assembly (:mod:`objfs.reads`);
* file and directory handles. An open handle is pinned to the version (ETag) its inode
  stands for: every read of it is conditional on that ETag, so a replaced object yields
  StaleObjectError, never a mix of versions; opening a superseded version answers ESTALE, on
  which the kernel looks the path up again. The open handles of one version share one
  read-ahead state; files every loader reads whole (``*.safetensors``) are fetched ahead from
  the first open.

Everything runs on the trio thread.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import overload

import trio

from objfs.availability import StoreAvailability
from objfs.backends.base import Backend
from objfs.block_cache import BlockCache
from objfs.config import MEMORY_GROWTH, MountConfig
from objfs.disk_cache import DiskCache
from objfs.errors import (
    BadFileHandleError,
    IsADirectoryFsError,
    NoDiskCacheError,
    ReadOnlyError,
    StaleObjectError,
)
from objfs.inodes import Attributes, DirHandle, Handle, Listing, Node
from objfs.namespace import Namespace
from objfs.readahead import Readahead, Stream
from objfs.reads import ReadPath
from objfs.scheduler import Fetcher, ceil_div

# Passthrough checks of different versions that may run at once (see whole_on_disk).
_WHOLE_CHECKS = 2


#: How long a shrunk memory budget keeps its grown slots' memory before giving it back to the
#: system (``FileSystem._give_back_later``).
GIVE_BACK_DELAY_S = 2.0


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
            ceiling_bytes=config.memory_ceiling_bytes,
        )
        self.disk = disk
        # Store outages seen by metadata requests, and what is served meanwhile.
        self.availability = StoreAvailability(config)
        self.names = Namespace(backend, config, self.availability)
        # Read-ahead runs queued jobs in order on all connections but two, which stay free
        # for the readers' own (demand) fetches: a random read never queues behind a file.
        self.fetcher = Fetcher(
            backend,
            self.cache,
            disk,
            block_size=self.block_size,
            part_blocks=self.part_blocks,
            prefetch_workers=max(1, config.s3.max_connections - 2),
            on_stale=self.names.forget_version,
        )
        self.reads = ReadPath(
            backend,
            self.cache,
            disk,
            self.fetcher,
            block_size=self.block_size,
            on_stale=self.names.forget_version,
        )
        self._handles: dict[int, Handle] = {}
        self._dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        # The budget's growth: how many budgets the large handles get (see _fit_budget), and
        # when it last shrank (trio's clock; None: its memory was given back since).
        self._readers = 1
        self._shrunk_at: float | None = None
        self._nursery: trio.Nursery | None = None
        # Passthrough checks (see whole_on_disk): one per version at a time, on threads of
        # their own (a first check reads a whole version; ordinary disk reads never wait
        # behind it).
        self._whole_checks: dict[tuple[str, str], trio.Lock] = {}
        self._whole_limiter = trio.CapacityLimiter(_WHOLE_CHECKS)
        self.empty_source = False  # SOURCE held no object at mount (see mount.serve_async)

    def start(self, nursery: trio.Nursery) -> None:
        """Give the file system a nursery for read-ahead, disk-cache and memory tasks."""
        self.fetcher.start(nursery)
        self._nursery = nursery

    # -- metadata (objfs.namespace) ---------------------------------------------------------

    def node(self, inode: int) -> Node:
        return self.names.node(inode)

    async def lookup(self, parent_inode: int, name: bytes) -> Node:
        return await self.names.lookup(parent_inode, name)

    async def listing(self, dir_node: Node) -> Listing:
        """Return the directory's entries, from the cache while it is fresh."""
        return await self.names.listing(dir_node)

    async def getattr(self, inode: int) -> Attributes:
        return await self.names.getattr(inode)

    def attributes(self, node: Node) -> Attributes:
        return self.names.attributes(node)

    def remember(self, node: Node) -> None:
        """The kernel got an entry for ``node`` (a lookup or a readdir entry)."""
        self.names.remember(node)

    def forget(self, inode: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``inode``."""
        self.names.forget(inode, nlookup)

    @property
    def outages(self) -> int:
        return self.availability.outages

    @property
    def stale_answers(self) -> int:
        return self.availability.stale_answers

    def store_state(self) -> dict[str, float | int | None]:
        return self.availability.state()

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

    async def whole_on_disk(self, inode: int) -> int | None:
        """A read-only descriptor (the caller's to close) of the disk tier's file that holds
        exactly this file version's bytes, verified, for the kernel to read itself (FUSE
        passthrough); None when there is none (see
        :meth:`objfs.disk_cache.DiskCache.open_whole_version`).

        Concurrent opens of one version wait for one check (vLLM's ranks open a shard
        together; a first check reads the version whole): the others then find it verified.
        Checks run under a limiter of their own, not the disk-read limiter that the read
        path and the read-ahead share."""
        node = self.node(inode)
        if node.is_dir or node.size == 0 or self.disk is None or not self.disk.enabled:
            return None
        if 1 in node.served:
            # Served in cached mode on this mount: the kernel's page cache of this inode
            # holds those bytes, and a passthrough open would read them from disk again (a
            # warm reload took 3.6 s instead of 0.3 s).
            return None
        version = (node.key, node.etag)
        lock = self._whole_checks.setdefault(version, trio.Lock())
        try:
            async with lock:
                return await trio.to_thread.run_sync(
                    self.disk.open_whole_version,
                    node.key,
                    node.etag,
                    node.size,
                    limiter=self._whole_limiter,
                )
        finally:
            if not lock.locked() and self._whole_checks.get(version) is lock:
                del self._whole_checks[version]

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
        await self.names.refresh_file(node)
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
                max_window=self.config.readahead_max(self.cache.budget_bytes),
            )
        handle = Handle(
            fh, node, node.key, node.etag, node.size, readahead, node.served, fetches=prefetch
        )
        self._handles[fh] = handle
        self.cache.open_version(handle.key, handle.etag)
        self._fit_budget()
        if prefetch and first_open:
            self._prefetch_on_open(handle)
        return fh, keep_cache

    def served_after_all(self, fh: int) -> None:
        """An open made with ``prefetch=False`` was answered as a cached open after all (the
        kernel refused the backing file, or the inode's passthrough opens ended meanwhile):
        its reads come to objfs, so it counts for the budget (``_fit_budget``) and, alone on
        its file, gets the prefetch on open."""
        handle = self._handle(fh)
        if handle.fetches:
            return
        handle.fetches = True
        self._fit_budget()
        if handle.node.opens == 1:
            self._prefetch_on_open(handle)

    def _prefetch_on_open(self, handle: Handle) -> None:
        """Fetch the whole file ahead where its name asks for it (``--prefetch-on-open``)."""
        if not handle.key.endswith(self.config.prefetch_on_open_suffixes):
            return
        whole = handle.readahead.start_whole_file()
        if whole is not None:
            # Not tied to this handle: loaders often open a shard once for its header and
            # again for its data, and the prefetch should outlive the first open. Its blocks
            # still belong to the version's handles: if they all close first, the blocks go
            # first when memory is short (see objfs.block_cache).
            self.fetcher.prefetch(
                handle, whole, cancellable=False, stream=handle.readahead.last_stream
            )

    def _fit_budget(self) -> None:
        """Size the memory budget for the open handles, then share its read-ahead part.

        The budget grows when some large version (more than a part) has several handles
        that read through objfs (not passthrough: the kernel reads those itself), such as
        tensor-parallel ranks: to its base times the number of handles on large versions, at
        most ``MEMORY_GROWTH`` times and at most ``memory_ceiling_bytes`` (None: it never
        grows). Each rank's part of a tensor waits in memory until that rank reaches it, so
        the blocks held grow with the ranks' drift, which a base budget for one reader did
        not hold (see ``config.default_memory_ceiling``).

        Once grown, it never steps down while two or more large handles are open, shared or
        not; it goes back to its base when at most one is left. Ranks move from shard to
        shard (a close, then an open: a handle fewer for a moment) and straddle two shards
        (nothing shared while each is on its own), and every step down gave the grown slots'
        memory back to the system only for the next step up to fault it in again (figures in
        tests/benchmarks/README.md). Back at its base, what no open handle will read is
        evicted (``BlockCache.set_budget``)."""
        big = [
            h for h in self._handles.values() if h.fetches and h.size > self.config.part_size_bytes
        ]
        ceiling = self.config.memory_ceiling_bytes
        if ceiling is not None:
            if len(big) <= 1:
                self._readers = 1
            elif max(Counter((h.key, h.etag) for h in big).values()) > 1:
                self._readers = max(self._readers, min(len(big), MEMORY_GROWTH))
            before = self.cache.budget_bytes
            self.cache.set_budget(min(ceiling, self.config.memory_limit_bytes * self._readers))
            if self.cache.budget_bytes < before:
                self._give_back_later()
        self._share_windows(big)

    def _give_back_later(self) -> None:
        """Give the shrunk budget's slots back to the system (``BufferPool.give_back``) once
        it has not shrunk for ``GIVE_BACK_DELAY_S``: two ranks moving from shard to shard
        leave one large handle for an instant (a close, then an open), and memory given back
        then would be faulted in again at once."""
        pending = self._shrunk_at is not None
        self._shrunk_at = trio.current_time()
        if pending:
            return
        if self._nursery is not None:
            try:
                self._nursery.start_soon(self._give_back_when_settled)
                return
            except RuntimeError:  # its nursery is closed (unmounted): no waiting
                pass
        self._give_back_now()

    async def _give_back_when_settled(self) -> None:
        try:
            while self._shrunk_at is not None:
                wait = self._shrunk_at + GIVE_BACK_DELAY_S - trio.current_time()
                if wait <= 0:
                    break
                await trio.sleep(wait)
        finally:  # also when cancelled (unmount): a later shrink must not find it pending
            if self._shrunk_at is not None:
                self._give_back_now()

    def _give_back_now(self) -> None:
        self._shrunk_at = None
        self.cache.pool.give_back()

    def _share_windows(self, big: list[Handle]) -> None:
        """Split the read-ahead share of the budget (``readahead_max``, about half) among the
        open handles in ``big`` (those that can use it), so concurrent streams do not evict
        each other's unread blocks. Handles of one version share one read-ahead state, whose
        streams each get this share (not a share per version: that filled the budget with
        blocks the slower of several tensor-parallel ranks had not read)."""
        share = self.config.readahead_max(self.cache.budget_bytes) // max(1, len(big))
        window = max(self.config.part_size_bytes, share)
        for readahead in {id(h.readahead): h.readahead for h in big}.values():
            readahead.max_window = window
            for stream in readahead.streams:
                stream.window = min(stream.window, window)

    def release(self, fh: int) -> None:
        """Close a handle: cancel its read-ahead (queued jobs and fetches in flight); after the
        last handle of a version, its unread blocks are the first to go."""
        self.reads.release_reply_buffers()
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
        self.names.maybe_free(handle.node)
        self.fetcher.cancel(handle)
        self.cache.close_version(handle.key, handle.etag)
        self._fit_budget()

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
        self.reads.release_reply_buffers()
        self.fetcher.writes.touch()
        return await self.reads.read(self._handle(fh), offset, size, holds)

    def read_nowait(
        self, fh: int, offset: int, size: int, *, holds: list[Callable[[], None]]
    ) -> bytes | memoryview | list[memoryview] | None:
        """:meth:`read` answered from memory with no await (a view per block, pinned until the
        holds run), or None when a block it touches is not in memory: nothing was done then,
        and the caller awaits :meth:`read` (see ``ReadPath.read_nowait``)."""
        self.reads.release_reply_buffers()
        self.fetcher.writes.touch()
        return self.reads.read_nowait(self._handle(fh), offset, size, holds)

    def read_locked(
        self, fh: int, offset: int, size: int
    ) -> tuple[bytes | memoryview | list[memoryview], tuple[int, int] | None, Stream | None] | None:
        """A read answered from memory by a thread other than trio's that holds the core's
        lock, or None (``ReadPath.read_locked``): the reply, to write under that lock, and
        a read-ahead window and its stream for :meth:`read_ahead` on the trio thread."""
        return self.reads.read_locked(self._handle(fh), offset, size)

    def read_ahead(self, fh: int, window: tuple[int, int], stream: Stream | None) -> None:
        """(trio thread) Queue the read-ahead a :meth:`read_locked` asked for, if the handle
        is still open; and the mount is not idle (the backfill waits)."""
        self.fetcher.writes.touch()
        handle = self._handles.get(fh)
        if handle is not None:
            self.fetcher.prefetch(handle, window, cancellable=True, stream=stream)

    async def flush_disk_writes(self) -> None:
        """Wait until every block queued for the disk cache is written."""
        await self.fetcher.writes.flush_disk_writes()

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
        (``WriteBehind.disk_room``), so every block it reads reaches the disk. Without a disk
        tier nothing would keep the bytes: NoDiskCacheError (EOPNOTSUPP). If the disk tier
        did not keep every block (its cap, its free-space floor, a failing disk):
        NotStoredError (ENOSPC), from ``WriteBehind.check_on_disk``."""
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
                await self.fetcher.writes.disk_room()
                got = len(await self.read(fh, done, self.block_size - done % self.block_size))
                if not got:
                    break
                # Read while its run's write was deferred (or refused earlier): queue it
                # before it can be evicted.
                self.fetcher.writes.write_now(self.fetcher.key(handle, done // self.block_size))
                done += got
            # Before the handle closes: its blocks still waiting for the disk stay in memory.
            await self.fetcher.writes.disk_room(settled=True)
            # Blocks lost anyway (evicted by another reader's demand before the writer got
            # to them) are fetched again now rather than when the mount is next idle.
            await self.fetcher.writes.store_lost_now(handle.key, handle.etag)
            await self.fetcher.writes.check_on_disk(handle)
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
            for node in self.names.file_versions()
            if (node.key, node.etag) in wanted
        }
        sealed = 0
        for (key, etag), size in sizes.items():
            sealed += await trio.to_thread.run_sync(disk.seal, key, etag, size)
        return sealed

    def statistics(self) -> dict[str, int]:
        return {
            **self.names.statistics(),
            "open_files": len(self._handles),
            "open_dirs": len(self._dir_handles),
            "reads_spanned": self.reads.reads_spanned,
            "reads_assembled": self.reads.reads_assembled,
            "reads_scattered": self.reads.reads_scattered,
            **self.cache.statistics(),
            **self.fetcher.statistics(),
            **(self.disk.statistics() if self.disk is not None else {}),
        }
