"""FUSE replies (protocol 7.x) built as bytes ready for ``writev``. No I/O, no state.

Layouts follow the kernel's ``include/uapi/linux/fuse.h`` (7.45): little-endian, the header's
field sizes, no implicit padding; each size is checked when this module is imported.

Contract: a reply is :func:`out_header` or :func:`reply`'s header followed by its payload.
Builders raise ``ValueError`` on values the protocol cannot carry (an errno outside 1..511, a
dirent name that is empty or holds ``/`` or NUL, a direntplus entry that is not 128 bytes), and
``struct.error`` on integers out of their field's range.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Final

from objfs.kernel.protocol import KERNEL_VERSION, OUT_HEADER_SIZE, Buffer

# -- structs ------------------------------------------------------------------------------------

# fuse_out_header: len, error, unique
_OUT_HEADER = struct.Struct("<IiQ")
# fuse_attr: ino, size, blocks, atime, mtime, ctime (s64 on the kernel's side), atimensec,
# mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags
_ATTR = struct.Struct("<QQQqqqIIIIIIIIII")
# fuse_entry_out: nodeid, generation, entry_valid, attr_valid, entry_valid_nsec,
# attr_valid_nsec, then fuse_attr
_ENTRY_OUT_HEAD = struct.Struct("<QQQQII")
# fuse_attr_out: attr_valid, attr_valid_nsec, dummy, then fuse_attr
_ATTR_OUT_HEAD = struct.Struct("<QII")
# fuse_open_out: fh, open_flags, backing_id (int32)
_OPEN_OUT = struct.Struct("<QIi")
# fuse_init_out: major, minor, max_readahead, flags, max_background (u16),
# congestion_threshold (u16), max_write, time_gran, max_pages (u16), map_alignment (u16),
# flags2, max_stack_depth, request_timeout (u16), unused[11] (u16)
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
# fuse_getxattr_out: size, padding
_GETXATTR_OUT = struct.Struct("<II")
# fuse_statfs_out = fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize,
# padding, spare[6]
_STATFS_OUT = struct.Struct("<QQQQQIIII24x")
# fuse_lseek_out: offset
_LSEEK_OUT = struct.Struct("<Q")
# fuse_dirent: ino, off, namelen, type, then the name (no NUL), padded to 8 bytes
_DIRENT = struct.Struct("<QQII")

ATTR_SIZE: Final = _ATTR.size
ENTRY_OUT_SIZE: Final = _ENTRY_OUT_HEAD.size + _ATTR.size
ATTR_OUT_SIZE: Final = _ATTR_OUT_HEAD.size + _ATTR.size
DIRENT_HEADER_SIZE: Final = _DIRENT.size

# Every size the header gives, checked at import: a wrong format string fails loudly.
for _s, _n in (
    (_OUT_HEADER.size, OUT_HEADER_SIZE),
    (_ATTR.size, 88),
    (ENTRY_OUT_SIZE, 128),
    (ATTR_OUT_SIZE, 104),
    (_OPEN_OUT.size, 16),
    (_INIT_OUT.size, 64),
    (_STATFS_OUT.size, 80),
    (_DIRENT.size, 24),
):
    if _s != _n:  # pragma: no cover - a typo in a format string above
        raise AssertionError(f"FUSE struct size {_s} != {_n}")
del _s, _n


# -- replies ------------------------------------------------------------------------------------


def out_header(unique: int, payload_len: int) -> bytes:
    """A success reply's 16-byte header, for a payload written after it (writev)."""
    return _OUT_HEADER.pack(OUT_HEADER_SIZE + payload_len, 0, unique)


def data_reply(unique: int, data: Buffer | list[memoryview]) -> tuple[list[Buffer], int]:
    """A READ reply's parts for one ``writev`` (the header, then ``data``: one buffer or a
    list of them, in order) and its payload's length."""
    parts: list[Buffer] = data if isinstance(data, list) else [data]  # type: ignore[assignment]
    nbytes = sum(len(part) for part in parts)
    return [out_header(unique, nbytes), *parts], nbytes


def reply(unique: int, payload: Buffer = b"") -> bytes:
    """A whole success reply: header and payload in one ``bytes``."""
    return _OUT_HEADER.pack(OUT_HEADER_SIZE + len(payload), 0, unique) + payload


def reply_error(unique: int, errno: int) -> bytes:
    """An error reply: the header alone, ``error = -errno`` (the kernel takes 1..511)."""
    if not 0 < errno < 512:
        raise ValueError(f"errno {errno} is not one a FUSE reply can carry (1..511)")
    return _OUT_HEADER.pack(OUT_HEADER_SIZE, -errno, unique)


@dataclass(frozen=True, slots=True)
class Attr:
    """What objfs says of an inode; atime and ctime are mtime, rdev and flags 0."""

    ino: int
    size: int
    blocks: int  # 512-byte units
    mtime_ns: int  # since the epoch; may be negative
    mode: int
    nlink: int
    uid: int
    gid: int
    blksize: int


def attr_bytes(a: Attr) -> bytes:
    """struct fuse_attr (88 bytes)."""
    sec, nsec = divmod(a.mtime_ns, 1_000_000_000)
    return _ATTR.pack(
        a.ino, a.size, a.blocks, sec, sec, sec, nsec, nsec, nsec,
        a.mode, a.nlink, a.uid, a.gid, 0, a.blksize, 0,
    )  # fmt: skip


_U64_MAX = (1 << 64) - 1


def _timeout(valid_s: float) -> tuple[int, int]:
    """A cache timeout in seconds as (seconds, nanoseconds); negative or NaN is 0."""
    if not valid_s > 0:  # also NaN
        return 0, 0
    if valid_s >= _U64_MAX:  # also inf
        return _U64_MAX, 999_999_999
    frac, whole = math.modf(valid_s)
    sec, nsec = int(whole), round(frac * 1e9)
    if nsec >= 1_000_000_000:
        sec, nsec = sec + 1, nsec - 1_000_000_000
    return sec, nsec


_NO_ATTR = bytes(_ATTR.size)


def entry_out(
    nodeid: int,
    attr: Attr | None,
    entry_valid_s: float,
    attr_valid_s: float,
    generation: int = 0,
) -> bytes:
    """struct fuse_entry_out (128 bytes); nodeid 0 with no attr is a negative entry, which the
    kernel caches for entry_valid_s."""
    if attr is None and nodeid != 0:
        raise ValueError(f"entry for node {nodeid} without its attributes")
    entry_sec, entry_nsec = _timeout(entry_valid_s)
    attr_sec, attr_nsec = _timeout(attr_valid_s)
    head = _ENTRY_OUT_HEAD.pack(nodeid, generation, entry_sec, attr_sec, entry_nsec, attr_nsec)
    return head + (_NO_ATTR if attr is None else attr_bytes(attr))


def attr_out(attr: Attr, valid_s: float) -> bytes:
    """struct fuse_attr_out (104 bytes)."""
    sec, nsec = _timeout(valid_s)
    return _ATTR_OUT_HEAD.pack(sec, nsec, 0) + attr_bytes(attr)


def open_out(fh: int, open_flags: int, backing_id: int = 0) -> bytes:
    """struct fuse_open_out (16 bytes); backing_id with FOPEN_PASSTHROUGH."""
    return _OPEN_OUT.pack(fh, open_flags, backing_id)


def init_out(
    *,
    minor: int,
    max_readahead: int,
    flags: int,
    max_background: int,
    congestion_threshold: int,
    max_write: int,
    time_gran: int = 1,
    max_pages: int = 0,
    map_alignment: int = 0,
    max_stack_depth: int = 0,
    request_timeout: int = 0,
) -> bytes:
    """struct fuse_init_out (64 bytes), major KERNEL_VERSION; flags' bits 32..63 go in flags2.

    ``minor`` is the caller's choice: min(the kernel's, KERNEL_MINOR_VERSION).
    """
    return _INIT_OUT.pack(
        KERNEL_VERSION,
        minor,
        max_readahead,
        flags & 0xFFFF_FFFF,
        max_background,
        congestion_threshold,
        max_write,
        time_gran,
        max_pages,
        map_alignment,
        flags >> 32,
        max_stack_depth,
        request_timeout,
    )


def statfs_out(
    *,
    blocks: int,
    bfree: int,
    bavail: int,
    files: int,
    ffree: int,
    bsize: int,
    namelen: int,
    frsize: int,
) -> bytes:
    """struct fuse_statfs_out (80 bytes)."""
    return _STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, 0)


def lseek_out(offset: int) -> bytes:
    """struct fuse_lseek_out (8 bytes)."""
    return _LSEEK_OUT.pack(offset)


def getxattr_size_out(size: int) -> bytes:
    """struct fuse_getxattr_out (8 bytes): the answer to a GETXATTR/LISTXATTR of size 0."""
    return _GETXATTR_OUT.pack(size, 0)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def dirent_size(name: bytes) -> int:
    """The bytes one READDIR entry takes, padding included."""
    return _align8(DIRENT_HEADER_SIZE + len(name))


def dirent_size_plus(name: bytes) -> int:
    """The bytes one READDIRPLUS entry takes, padding included."""
    return _align8(ENTRY_OUT_SIZE + DIRENT_HEADER_SIZE + len(name))


def _check_name(name: bytes) -> None:
    # The kernel fails the whole READDIR with EIO on an empty name or one holding a slash.
    if not name or b"/" in name or b"\0" in name:
        raise ValueError(f"{name!r} cannot be a directory entry's name")


def _append_dirent(buf: bytearray, ino: int, off: int, dtype: int, name: bytes) -> None:
    buf += _DIRENT.pack(ino, off, len(name), dtype)
    buf += name
    pad = -len(name) % 8  # the header and entry_out are multiples of 8
    if pad:
        buf += bytes(pad)


def pack_dirent(buf: bytearray, ino: int, off: int, dtype: int, name: bytes) -> None:
    """Appends one struct fuse_dirent with its name and padding to 8 bytes.

    ``off`` is the offset of the entry after this one (the next READDIR's ``offset``);
    ``dtype`` is the DT_* type (``mode >> 12``).
    """
    _check_name(name)
    _append_dirent(buf, ino, off, dtype, name)


def pack_direntplus(
    buf: bytearray, entry: bytes, ino: int, off: int, dtype: int, name: bytes
) -> None:
    """Appends one struct fuse_direntplus: ``entry`` (an :func:`entry_out`), then the dirent."""
    _check_name(name)
    if len(entry) != ENTRY_OUT_SIZE:
        raise ValueError(f"entry of {len(entry)} bytes, not {ENTRY_OUT_SIZE}")
    buf += entry
    _append_dirent(buf, ino, off, dtype, name)
