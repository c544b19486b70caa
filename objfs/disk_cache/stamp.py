"""The record that a version was verified whole, for FUSE passthrough (``STAMP``).

Contract: the record sits in the last ``STAMP.size`` bytes of the table's header page and
holds the data file's inode and size and the XXH3-64 of the table's entries (``current_stamp``), so
dropping a block, rewriting the table, or replacing or resizing the data file voids it. It is
written (``record_stamp``) only after the data file is synced to disk, so a crash cannot leave it
over bytes that never reached the disk; ``clear_stamp`` zeros it. A header with no room for it (a
long key) never holds one. ``first_bad_block`` is the check by reading that a record stands
for.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import xxhash

from objfs.disk_cache.layout import ENTRY, STAMP, STAMP_MAGIC, Version, block_hash

log = logging.getLogger("objfs.disk_cache")  # one name for the tier


def current_stamp(v: Version, entries: bytes, data_fd: int) -> bytes | None:
    """What ``STAMP`` holds for ``v`` as its files are now: its table's ``entries`` (as read)
    and its data file open as ``data_fd``; None when there is no room for it in the header
    page or the data file cannot be read."""
    if len(v.header) > v.table_offset - STAMP.size:
        return None
    try:
        st = os.fstat(data_fd)
    except OSError:
        return None
    return STAMP.pack(STAMP_MAGIC, st.st_ino, st.st_size, xxhash.xxh3_64_intdigest(entries))


def stamp_recorded(v: Version, table: bytes, stamp: bytes) -> bool:
    """Whether the table of ``v``, read from its start (``table``), holds the record
    ``stamp``."""
    return table[v.table_offset - STAMP.size : v.table_offset] == stamp


def record_stamp(v: Version, stamp: bytes, data_fd: int) -> None:
    """Record a verification of the data file open as ``data_fd``: the data synced first,
    so a crash cannot leave a record over bytes that never reached the disk. The table keeps
    its times: a record is not a use (the files' mtimes are the eviction order)."""
    try:
        os.fdatasync(data_fd)
        fd = os.open(v.index_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            os.pwrite(fd, stamp, v.table_offset - STAMP.size)
            os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
        finally:
            os.close(fd)
    except OSError as exc:
        log.info("disk cache: recording the verification of %s failed (%s)", v.data_path, exc)


def clear_stamp(index_fd: int, v: Version) -> None:
    """Void the record of ``v`` (its table open as ``index_fd``): no longer verified whole."""
    if len(v.header) <= v.table_offset - STAMP.size:
        with contextlib.suppress(OSError):
            os.pwrite(index_fd, bytes(STAMP.size), v.table_offset - STAMP.size)


def first_bad_block(
    v: Version, data_fd: int, lengths: Sequence[int], block_size: int
) -> int | None:
    """The first block of ``v`` whose bytes (read buffered from ``data_fd``, its data file)
    do not match its table entry, or None when all do. Any failure to read counts as block 0
    being bad."""
    bs = block_size
    try:
        with open(v.index_path, "rb", buffering=0) as table_file:
            table = table_file.read()[v.table_offset :]
        chunk = 8  # blocks per read: 8 MiB of buffer, reused
        buf = bytearray(chunk * bs)
        view = memoryview(buf)
        for first in range(0, len(lengths), chunk):
            n = os.preadv(data_fd, [view], first * bs)  # sequential: the kernel reads ahead
            for index in range(first, min(len(lengths), first + chunk)):
                at = (index - first) * bs
                raw = table[index * ENTRY.size : (index + 1) * ENTRY.size]
                if len(raw) != ENTRY.size or n < at + lengths[index]:
                    return index
                length, data_hash, _ = ENTRY.unpack(raw)
                if length != lengths[index]:
                    return index
                if block_hash(view[at : at + length]) != data_hash:
                    return index
    except OSError:
        return 0
    return None
