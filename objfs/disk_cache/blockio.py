"""Reading and writing blocks of a version's open files (``BlockIO``, a part of ``DiskCache``).

Contract:

* A block is returned only if its table entry is intact (``decode_entry``: not a hole, its
  check matches), its length equals the length the caller expects, the data file holds that
  many bytes at the block's offset, and their XXH3-64 equals the entry's. The digest pins the
  version, so the only bytes that can sit at a block's offset are that block's, zeros (a hole,
  a file recreated after another process removed it) or a torn or damaged mix: each fails the
  hash but for a chance of 2^-64. Anything else is a miss; a damaged block is dropped
  (``_drop_block``: its entry zeroed, the version's verification record cleared) with a
  warning and counted in ``corrupt``.
* A write puts the data first and the entries after it, with no fsync, and lists only blocks
  written whole: a crash between the two, a torn write or a truncated file gives a miss, never
  wrong bytes. A run of consecutive blocks (at most 8, ``runs``) is one ``pwritev`` of the data
  and one ``pwrite`` of its entries; a read run one table ``pread`` and one ``preadv``.
* ``listed_now`` reads table entries only from the page cache and only of a version open
  already, so the trio thread can skip a worker thread's read of blocks the table does not
  list (a cold load's fetches once the version's first write has opened its files); what
  it cannot tell at once it leaves to that read.
* O_DIRECT I/O goes straight from or into the caller's buffer when it is a page-aligned,
  writable buffer of whole pages (the block cache's pooled mmaps), else through a small pool of
  page-aligned buffers and one copy. A write never pads: the bytes of an object's last block
  past its last whole page go through a buffered descriptor, so a data file never grows past
  its object's size (FUSE passthrough serves the file as it is). Bytes returned as ``bytes``
  never alias a pooled buffer. Where O_DIRECT is refused (EINVAL at open, ``versions.py``, or
  at the I/O: tmpfs, some network file systems) the tier switches to buffered I/O for good.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Callable, Iterator, Sequence

from objfs.disk_cache.layout import (
    ENTRY,
    NO_ENTRY,
    PAGE,
    Version,
    block_hash,
    decode_entry,
    encode_entry,
    round_up,
)
from objfs.disk_cache.stamp import clear_stamp
from objfs.disk_cache.versions import Files, VersionStore

log = logging.getLogger("objfs.disk_cache")  # one name for the tier

# Aligned buffers kept for O_DIRECT copies: one run of _MAX_IO_BLOCKS blocks.
_POOLED_BUFFERS = 8
# Blocks per preadv/pwritev: the read-ahead's runs (an 8 MiB part of 1 MiB blocks) in one call.
_MAX_IO_BLOCKS = 8
# Table entries ``listed_now`` reads at most (one page's worth).
_PEEK_ENTRIES = PAGE // ENTRY.size
# preadv's "only what is in the page cache" flag, where this Python and kernel have it.
_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

#: Called with each block found intact: its index, a view of its bytes, and whether that view
#: is of a pooled buffer (to be copied out before the call returns).
Deliver = Callable[[int, memoryview, bool], None]


class BlockIO(VersionStore):
    # Whether ``listed_now`` may try RWF_NOWAIT reads (off for good once refused).
    _nowait = bool(_NOWAIT)

    # -- reading ---------------------------------------------------------------------------

    def _read(
        self,
        key: str,
        etag: str,
        indexes: Sequence[int],
        lengths: Sequence[int],
        outs: dict[int, memoryview] | None,
        deliver: Deliver,
    ) -> None:
        if not self.enabled or not indexes:
            return
        wanted = sorted(dict(zip(indexes, lengths, strict=True)).items())
        if any(not 0 < length <= self.block_size for _, length in wanted):
            raise ValueError(f"a block's length must be 1 to {self.block_size} bytes")
        v = self._version(key, etag)
        with self._lock:
            self._checked_blocks(v, key, etag)  # _verify adds the blocks found intact
        hits = 0
        try:
            with self._use(v, create=False) as files:
                if files is not None:
                    for start, stop in runs(wanted, self.block_size):
                        hits += self._read_run(v, files, wanted[start:stop], outs, deliver)
                    if hits:
                        self._account(v.digest, files, allocated=None)
        except OSError as exc:
            self._failed("reading", v.data_path, exc)
        else:
            self._succeeded()
        with self._lock:
            self.hits += hits
            self.misses += len(wanted) - hits

    def listed_now(
        self, key: str, etag: str, indexes: Sequence[int], *, all_or_none: bool = False
    ) -> set[int] | None:
        """Which of blocks ``indexes`` of version (key, etag) the table lists (present or
        not, intact or not), told without waiting on a disk: for the trio thread, before it
        hands a read of the blocks to a worker thread. None where that cannot be told at
        once: the version's files not open in this process or their link count not checked
        in the last second (``_held_open``), the entries not in the page cache
        (``RWF_NOWAIT``; None always where the kernel or file system lacks it), or more than
        a page of entries. The blocks not listed count as misses; with ``all_or_none`` (the
        caller reads none of them unless all are listed) a partial answer counts them all."""
        if not self.enabled or not indexes or not self._nowait:
            return None
        first, last = min(indexes), max(indexes)
        if last - first >= _PEEK_ENTRIES:
            return None
        v = self._version(key, etag)
        files = self._held_open(v)
        if files is None:
            return None
        offset = v.table_offset + first * ENTRY.size
        table = bytearray((last - first + 1) * ENTRY.size)
        try:
            got = os.preadv(files.index_fd, [table], offset, _NOWAIT)
            # A short read is the table's end, or entries not in the page cache.
            if got < len(table) and offset + got < os.fstat(files.index_fd).st_size:
                return None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False  # this file system never reads without waiting
            return None  # EAGAIN: not in the page cache
        finally:
            self._release(files, close_in_thread=True)
        found = set()
        for index in indexes:
            at = (index - first) * ENTRY.size
            if at + ENTRY.size <= got and table[at : at + ENTRY.size] != NO_ENTRY:
                found.add(index)
        wanted = set(indexes)
        missed = wanted if all_or_none and found != wanted else wanted - found
        with self._lock:
            self.misses += len(missed)
        return found

    def _read_run(
        self,
        v: Version,
        files: Files,
        run: list[tuple[int, int]],
        outs: dict[int, memoryview] | None,
        deliver: Deliver,
    ) -> int:
        """Read consecutive blocks ``run`` ((index, length) pairs); returns the hits."""
        first = run[0][0]
        table = os.pread(files.index_fd, len(run) * ENTRY.size, v.table_offset + first * ENTRY.size)
        present: list[tuple[int, int, int]] = []  # (index, length, data hash)
        for n, (index, length) in enumerate(run):
            raw = table[n * ENTRY.size : (n + 1) * ENTRY.size]
            found = decode_entry(raw, index)
            if found is None:
                continue  # cut off, or a hole: absent (never checked, so never "intact")
            if not found.intact:
                at = v.table_offset + index * ENTRY.size
                if os.pread(files.index_fd, ENTRY.size, at) == raw:
                    self._drop_block(v, files, index, "damaged table entry")
                # else: read while another thread or process wrote it; a miss this time
            elif found.length != length:
                self._drop_block(v, files, index, f"length {found.length}, expected {length}")
            else:
                present.append((index, length, found.data_hash))
        hits = 0
        # Present blocks in consecutive stretches: one preadv each.
        start = 0
        while start < len(present):
            stop = start + 1
            while stop < len(present) and present[stop][0] == present[stop - 1][0] + 1:
                stop += 1
            hits += self._read_data(v, files, present[start:stop], outs, deliver)
            start = stop
        return hits

    def _read_data(
        self,
        v: Version,
        files: Files,
        blocks: list[tuple[int, int, int]],
        outs: dict[int, memoryview] | None,
        deliver: Deliver,
    ) -> int:
        offset = blocks[0][0] * self.block_size
        hits = 0
        if self._use_direct(files):
            targets = [outs.get(index) if outs is not None else None for index, _, _ in blocks]
            pooled = [out is None or not _direct_capable(out) for out in targets]
            with self._aligned_buffers(sum(pooled)) as pool:
                spare = iter(pool)
                iov: list[memoryview] = []
                for (_, length, _), out, from_pool in zip(blocks, targets, pooled, strict=True):
                    if from_pool:
                        iov.append(memoryview(next(spare))[: round_up(length, PAGE)])
                    else:
                        assert out is not None
                        iov.append(out)  # the caller's page-aligned buffer: DMA straight in
                try:
                    got = os.preadv(files.data_fd, iov, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    got = -1  # O_DIRECT accepted at open but not for the read
                if got >= 0:
                    for n, (index, length, data_hash) in enumerate(blocks):
                        view = iov[n][:length]
                        landed = got - n * self.block_size  # bytes read into it
                        if self._verify(v, files, index, view, landed, data_hash):
                            deliver(index, view, pooled[n])
                            hits += 1
                    return hits
            self._no_direct(files)
        for n, (index, length, data_hash) in enumerate(blocks):
            at = offset + n * self.block_size
            out = outs.get(index) if outs is not None else None
            if out is not None:
                got = os.preadv(files.data_fd, [out], at)
                view = out
            else:
                view = memoryview(os.pread(files.data_fd, length, at))
                got = len(view)
            if self._verify(v, files, index, view, got, data_hash):
                deliver(index, view, False)
                hits += 1
        return hits

    def _verify(
        self, v: Version, files: Files, index: int, view: memoryview, got: int, data_hash: int
    ) -> bool:
        """Whether ``view`` (``got`` bytes of it were read) is the block its entry lists."""
        if got < len(view):
            self._drop_block(v, files, index, f"data file ends {max(got, 0)} bytes into it")
            return False
        if block_hash(view) != data_hash:
            self._drop_block(v, files, index, "checksum mismatch")
            return False
        with self._lock:
            found = self._checked.get(v.digest)
            if found is not None:
                found[2].add(index)
        return True

    def _drop_block(self, v: Version, files: Files, index: int, problem: str) -> None:
        with self._lock:
            self.corrupt += 1
        log.warning(
            "disk cache: dropping corrupt block %d of %s (%s); fetching it again",
            index,
            v.data_path,
            problem,
        )
        with contextlib.suppress(OSError):
            os.pwrite(files.index_fd, NO_ENTRY, v.table_offset + index * ENTRY.size)
        clear_stamp(files.index_fd, v)  # no longer verified whole
        with self._lock:
            self._verified.pop(v.digest, None)
            found = self._checked.get(v.digest)
            if found is not None:
                found[2].discard(index)

    # -- writing ---------------------------------------------------------------------------

    def _write_chunk(
        self,
        v: Version,
        files: Files,
        first: int,
        views: list[memoryview],
        digests: Sequence[int | None],
    ) -> int:
        """Write consecutive blocks (all block_size long but the last) and then their table
        entries (``digests``: their hashes where known, see ``write_blocks``); returns how
        many were written whole. A short write is a full disk."""
        offset = first * self.block_size
        hashes = [
            block_hash(view) if digest is None else digest
            for view, digest in zip(views, digests, strict=True)
        ]
        total = (len(views) - 1) * self.block_size + len(views[-1])
        written = -1
        if self._use_direct(files):
            if len(views[-1]) % PAGE:
                # An object's last block, short of a page: O_DIRECT would pad it to a page and
                # grow the file past the object's end (a passthrough reader would read the
                # zeros). The whole pages go direct, the rest through a buffered descriptor.
                written = self._write_tail(files, views, offset)
            else:
                written = self._pwritev_direct(files, views, offset)
        if written < 0:  # buffered I/O, or O_DIRECT accepted at open but not for the write
            written = os.pwritev(files.data_fd, views, offset)
        whole = 0
        while whole < len(views) and whole * self.block_size + len(views[whole]) <= written:
            whole += 1
        if whole:
            entries = b"".join(
                encode_entry(first + n, len(views[n]), hashes[n]) for n in range(whole)
            )
            os.pwrite(files.index_fd, entries, v.table_offset + first * ENTRY.size)
        if written < total:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return whole

    def _pwritev_direct(self, files: Files, views: list[memoryview], offset: int) -> int:
        """One O_DIRECT pwritev of ``views`` (whole pages each) at ``offset``: a caller's
        page-aligned buffer as it is, any other copied into a pooled aligned one. Returns
        the bytes written, or -1 where O_DIRECT turns out refused for writes (the tier then
        falls back to buffered I/O)."""
        capable = [_direct_capable(view) for view in views]
        with self._aligned_buffers(capable.count(False)) as pool:
            spare = iter(pool)
            iov: list[memoryview] = []
            for view, as_is in zip(views, capable, strict=True):
                if as_is:
                    iov.append(view)  # the caller's page-aligned buffer: no copy
                    continue
                staged = memoryview(next(spare))[: len(view)]
                staged[:] = view
                iov.append(staged)
            try:
                return os.pwritev(files.data_fd, iov, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        self._no_direct(files)
        return -1

    def _write_tail(self, files: Files, views: list[memoryview], offset: int) -> int:
        """Write ``views`` (the last one short of a page) at ``offset`` without growing the
        data file past their end: every view but the last, and the last one's whole pages,
        with O_DIRECT; its remainder through a buffered descriptor of the same file. Returns
        the bytes written from ``offset`` (short: a full disk), or -1 where O_DIRECT is
        refused for writes (nothing written)."""
        tail = views[-1]
        pages = len(tail) - len(tail) % PAGE
        head = [*views[:-1], tail[:pages]] if pages else views[:-1]
        written = 0
        if head:
            written = self._pwritev_direct(files, head, offset)
            if written < sum(len(view) for view in head):
                return written  # -1, or a full disk
        # The same inode as files.data_fd (the path may name a newer file by now).
        fd = os.open(f"/proc/self/fd/{files.data_fd}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            return written + os.pwrite(fd, tail[pages:], offset + written)
        finally:
            os.close(fd)

    # -- O_DIRECT --------------------------------------------------------------------------

    def _use_direct(self, files: Files) -> bool:
        """Whether to do this I/O with O_DIRECT (after the tier fell back, no file does)."""
        if files.direct and not self._direct:
            self._clear_direct(files)
        return files.direct

    def _no_direct(self, files: Files) -> None:
        if self._direct:
            log.debug("disk cache: O_DIRECT refused in %s; using buffered I/O", self.root)
        self._direct = False
        self._clear_direct(files)

    @staticmethod
    def _clear_direct(files: Files) -> None:
        # Safe while other threads do I/O on the descriptor: buffered I/O takes their
        # aligned buffers as well.
        with contextlib.suppress(OSError):
            flags = fcntl.fcntl(files.data_fd, fcntl.F_GETFL)
            fcntl.fcntl(files.data_fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        files.direct = False

    @contextlib.contextmanager
    def _aligned_buffers(self, count: int) -> Iterator[list[mmap.mmap]]:
        """``count`` page-aligned buffers (anonymous mmaps) of a block each, from a small pool:
        the threads doing disk I/O are shared with the store's GETs, so buffers per thread
        would add up outside the memory budget."""
        with self._lock:
            take = min(count, len(self._buffers))
            bufs = [self._buffers.pop() for _ in range(take)]
        bufs += [mmap.mmap(-1, self.block_size) for _ in range(count - take)]
        try:
            yield bufs
        finally:
            with self._lock:
                keep = max(0, _POOLED_BUFFERS - len(self._buffers))
                self._buffers += bufs[:keep]
            for buf in bufs[keep:]:
                with contextlib.suppress(BufferError):
                    buf.close()


def runs(blocks: list[tuple[int, int]], block_size: int) -> Iterator[tuple[int, int]]:
    """Split sorted (index, length) pairs into [start, stop) spans of consecutive blocks, at
    most _MAX_IO_BLOCKS each, where only the last may be short (so block n of a span is at
    n * block_size from its first)."""
    start = 0
    for n in range(1, len(blocks) + 1):
        if (
            n == len(blocks)
            or blocks[n][0] != blocks[n - 1][0] + 1
            or blocks[n - 1][1] != block_size
            or n - start == _MAX_IO_BLOCKS
        ):
            yield start, n
            start = n


def _address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for a read-only one)."""
    if view.readonly or not len(view):
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _direct_capable(view: memoryview) -> bool:
    """Whether O_DIRECT can take ``view`` as it is: page-aligned, whole pages."""
    if len(view) % PAGE or not view.c_contiguous:
        return False
    address = _address(view)
    return address is not None and address % PAGE == 0
