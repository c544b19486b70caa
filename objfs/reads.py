"""Read assembly: one read of an open handle turned into block fetches and a reply.

Reads go through three tiers: the memory :class:`~objfs.block_cache.BlockCache` (a read that
hits it returns without waiting on anything), the optional persistent
:class:`~objfs.disk_cache.DiskCache`, and ranged GETs of ``part_size`` bytes, fetched by
:mod:`objfs.scheduler` ahead of each sequential stream (:mod:`objfs.readahead`). A block served
whole to the kernel is marked in its node's ``served`` map and never prefetched again for that
version. A random read of a block that no tier holds fetches only the bytes it touches,
rounded to ``RANDOM_READ_ALIGN``, and leaves them to the kernel's page cache.

Every read is conditional on the handle's ETag: a replaced object yields StaleObjectError
(``on_stale`` is told), never a mix of versions.

A reply is a view of a cached block's buffer, a view per block, or a pooled buffer charged to
the reply share; without ``holds`` the kernel consumes it before the trio thread runs anything
else, so a pooled buffer is given back lazily (:meth:`ReadPath.release_reply_buffers`).
Trio thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from objfs.backends.base import Backend
from objfs.block_cache import BlockCache, BlockKey
from objfs.buffer_pool import Buffer
from objfs.disk_cache import DiskCache
from objfs.errors import StaleObjectError
from objfs.inodes import Handle
from objfs.readahead import Stream
from objfs.scheduler import Fetcher, ceil_div
from objfs.singleflight import SingleFlight

# A random read that misses every tier fetches this much around what it touches (a multiple
# of the page size: the kernel caches the pages it asked for).
RANDOM_READ_ALIGN = 64 * 1024


class ReadPath:
    """Answers reads of open handles from the tiers; owns the reply buffers it lends."""

    def __init__(
        self,
        backend: Backend,
        cache: BlockCache,
        disk: DiskCache | None,
        fetcher: Fetcher,
        *,
        block_size: int,
        on_stale: Callable[[Handle], None],
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.disk = disk
        self.fetcher = fetcher
        self.block_size = block_size
        self._on_stale = on_stale
        self._range_flight: SingleFlight[tuple[str, str, int, int], bytes] = SingleFlight()
        # Answered reads' pooled buffers, still charged to the reply share (see read).
        self._reply_buffers: list[Buffer] = []
        self.reads_spanned = 0  # reads across blocks answered with one view (no copy)
        self.reads_assembled = 0  # reads across blocks assembled by a copy
        self.reads_scattered = 0  # reads across blocks answered with a view per block
        cache.replies.reclaim = self.release_reply_buffers

    async def read(
        self, handle: Handle, offset: int, size: int, holds: list[Callable[[], None]] | None
    ) -> bytes | bytearray | memoryview | list[memoryview]:
        """``size`` bytes of ``handle`` from ``offset`` (see :meth:`FileSystem.read
        <objfs.fs.FileSystem.read>` for ``holds``). The caller released the reply buffers
        of answered reads first (:meth:`release_reply_buffers`), with no await since."""
        assert not self._reply_buffers, "a read started before answered replies were reclaimed"
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
        cached = self._from_memory(handle, keys, first, offset, end, holds)
        if cached is not None:
            return cached
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
            self._give_back_after_reply(buf)
        else:
            self._release_share(nbytes, holds)
        return out

    def read_nowait(
        self, handle: Handle, offset: int, size: int, holds: list[Callable[[], None]]
    ) -> bytes | memoryview | list[memoryview] | None:
        """The read answered from the memory tier now, with no await, or None: not every
        block it touches is in memory with its bytes, and nothing was done (the caller then
        awaits :meth:`read`). The reply's blocks are pinned and the read counted as
        :meth:`read` would (served marks, hits, the read-ahead told, read-ahead queued): the
        blocks are taken first and pinned, then the read-ahead is told, so that what it
        queues cannot evict them. Same holds contract as :meth:`read`."""
        end = min(offset + size, handle.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        keys = [self.fetcher.key(handle, i) for i in range(first, last + 1)]
        data: memoryview | list[memoryview] | None
        if first == last:
            block = self.cache.peek(keys[0])
            if block is None or block.buffer is None or end - first * bs > len(block.view):
                return None
            view = self._cached(handle, first, to_end=self._reaches_end(handle, first, end))
            if view is None:
                return None
            self._hold_blocks(keys, holds)
            data = view[offset - first * bs : end - first * bs]
        else:
            data = self._from_memory(handle, keys, first, offset, end, holds)
            if data is None:
                return None
        # As read() does first: a window to read ahead; a random read of cached blocks reads
        # through the cache, as here.
        window = handle.readahead.on_read(offset, end - offset, handle.fh)
        if window is not None:
            self.fetcher.prefetch(
                handle, window, cancellable=True, stream=handle.readahead.last_stream
            )
        return data

    def read_locked(
        self, handle: Handle, offset: int, size: int
    ) -> tuple[bytes | memoryview | list[memoryview], tuple[int, int] | None, Stream | None] | None:
        """The read answered from the memory tier by a thread other than trio's, which holds
        the core's lock (so no block can be evicted or recycled before its reply is written,
        under that same lock: nothing is pinned) and must touch no trio object: only blocks
        whose read wakes nobody (``BlockCache.quiet_view``). Returns the reply (one view,
        or a view per block), the read-ahead window to queue on the trio thread (or None) and
        the stream that asked for it; None, with nothing changed, when a block is not so."""
        end = min(offset + size, handle.size)
        if offset >= end:
            return b"", None, None
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        cache = self.cache
        data: memoryview | list[memoryview]
        if first == last:  # the usual case, kept short: it runs for every such READ
            key = self.fetcher.key(handle, first)
            base = first * bs
            to_end = end >= base + bs or end == handle.size
            view = cache.quiet_view(key, to_end=to_end)
            if view is None or end - base > len(view):
                return None
            cache.read_quietly(key)
            if to_end:
                handle.served[first] = 1
            data = view[offset - base : end - base]
        else:
            views: list[memoryview] = []
            keys = []
            for index in range(first, last + 1):
                key = self.fetcher.key(handle, index)
                view = cache.quiet_view(key, to_end=self._reaches_end(handle, index, end))
                base = index * bs
                hi = min(end, base + bs)
                if view is None or hi - base > len(view):
                    return None  # nothing changed yet
                views.append(view[max(offset, base) - base : hi - base])
                keys.append(key)
            for index, key in zip(range(first, last + 1), keys, strict=True):
                cache.read_quietly(key)
                if self._reaches_end(handle, index, end):
                    handle.served[index] = 1
            self.reads_scattered += 1
            data = views
        window = handle.readahead.on_read(offset, end - offset, handle.fh)
        return data, window, handle.readahead.last_stream

    def _from_memory(
        self,
        handle: Handle,
        keys: list[BlockKey],
        first: int,
        offset: int,
        end: int,
        holds: list[Callable[[], None]] | None,
    ) -> memoryview | list[memoryview] | None:
        """``[offset, end)`` from the cached blocks ``keys`` (block ``first`` on) with no
        copy: one view when they sit in adjacent buffers, else (with ``holds`` only) a view
        per block; None when neither. Synchronous on purpose: no await from the check to
        the reply, so nothing can recycle the blocks first."""
        bs = self.block_size
        last = first + len(keys) - 1
        joined = self.cache.span(keys)
        parts: list[memoryview] | None = None
        if joined is None:
            parts = self._scatter(keys, first, offset, end) if holds is not None else None
            if parts is None:
                return None
        # Pinned before they are marked used: marking one used may evict the least recently
        # used, which must not be another block of this reply while a writer thread still
        # needs it.
        self._hold_blocks(keys, holds)
        for index in range(first, last + 1):
            self._cached(handle, index, to_end=self._reaches_end(handle, index, end))
        if joined is not None:
            self.reads_spanned += 1
            return joined[offset - first * bs : end - first * bs]
        self.reads_scattered += 1
        return parts

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

    def _give_back_after_reply(self, buf: Buffer) -> None:
        """The one way a reply's pooled buffer is given back lazily. The kernel copies the
        reply before the trio thread runs anything else: the buffer goes back to the pool,
        and its bytes to the share, when the next read starts, or when a read waiting for
        the reply share wakes (poke) and reclaims it."""
        self._reply_buffers.append(buf)
        self.cache.replies.poke()

    def release_reply_buffers(self) -> None:
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
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        # From disk unless the table, read without waiting, lacks some of the blocks.
        listed = (
            None
            if disk is None
            else disk.listed_now(handle.key, handle.etag, indexes, all_or_none=True)
        )
        if disk is not None and (listed is None or len(listed) == len(indexes)):
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
            self._on_stale(handle)
            raise

    async def _read_range_into(self, handle: Handle, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start``, outside the block cache (one GET, same stale rule)."""
        try:
            await self.backend.read_into(handle.key, handle.etag, start, [out])
        except StaleObjectError:
            self._on_stale(handle)
            raise
