"""The FUSE kernel protocol (7.x) as bytes: requests parsed, replies built. No I/O, no state.

Layouts follow the kernel's ``include/uapi/linux/fuse.h`` (protocol 7.45, as in Linux 6.18):
every struct is little-endian with the header's field sizes and no implicit padding (each is
padded to 8 bytes by explicit fields), and each size is checked when this module is imported.

Contract:

* :func:`parse` and :func:`parse_header` raise nothing but :class:`ProtocolError`, whatever
  bytes they are given: a buffer shorter than a header, a header whose length disagrees with the
  buffer, extensions longer than the message, arguments shorter than the opcode's struct, a
  name without its NUL (or an empty one), a BATCH_FORGET whose count overruns its items. An
  opcode this module does not know, or whose arguments objfs does not need (mutations, which
  objfs refuses with EROFS, STATFS, DESTROY, ...), parses as :class:`Empty`.
* Extensions (``total_extlen`` 8-byte units at the end of a request) are skipped; bytes after
  an opcode's struct (a newer kernel's longer struct) are ignored.
* Builders return ``bytes`` ready for ``writev`` (a reply is :func:`out_header` or
  :func:`reply`'s header followed by its payload). They raise ``ValueError`` on values the
  protocol cannot carry (an errno outside 1..511, a dirent name that is empty or holds ``/`` or
  NUL, a direntplus entry that is not 128 bytes), and ``struct.error`` on integers out of their
  field's range.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

KERNEL_VERSION: Final = 7
KERNEL_MINOR_VERSION: Final = 45
ROOT_ID: Final = 1
MIN_READ_BUFFER: Final = 8192
IN_HEADER_SIZE: Final = 40
OUT_HEADER_SIZE: Final = 16

# The high bit of a request's ``unique`` marks a resent request (FUSE_HAS_RESEND).
UNIQUE_RESEND: Final = 1 << 63


class Opcode(IntEnum):
    """``enum fuse_opcode`` without its ``FUSE_`` prefix."""

    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36  # no reply of its own
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41  # no reply
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52
    COPY_FILE_RANGE_64 = 53
    CUSE_INIT = 4096


# -- INIT flags: one 64-bit value; bits 32..63 travel in fuse_init_in/out.flags2 ----------------

ASYNC_READ: Final = 1 << 0
POSIX_LOCKS: Final = 1 << 1
FILE_OPS: Final = 1 << 2
ATOMIC_O_TRUNC: Final = 1 << 3
EXPORT_SUPPORT: Final = 1 << 4
BIG_WRITES: Final = 1 << 5
DONT_MASK: Final = 1 << 6
SPLICE_WRITE: Final = 1 << 7
SPLICE_MOVE: Final = 1 << 8
SPLICE_READ: Final = 1 << 9
FLOCK_LOCKS: Final = 1 << 10
HAS_IOCTL_DIR: Final = 1 << 11
AUTO_INVAL_DATA: Final = 1 << 12
DO_READDIRPLUS: Final = 1 << 13
READDIRPLUS_AUTO: Final = 1 << 14
ASYNC_DIO: Final = 1 << 15
WRITEBACK_CACHE: Final = 1 << 16
NO_OPEN_SUPPORT: Final = 1 << 17
PARALLEL_DIROPS: Final = 1 << 18
HANDLE_KILLPRIV: Final = 1 << 19
POSIX_ACL: Final = 1 << 20
ABORT_ERROR: Final = 1 << 21
MAX_PAGES: Final = 1 << 22
CACHE_SYMLINKS: Final = 1 << 23
NO_OPENDIR_SUPPORT: Final = 1 << 24
EXPLICIT_INVAL_DATA: Final = 1 << 25
MAP_ALIGNMENT: Final = 1 << 26
SUBMOUNTS: Final = 1 << 27
HANDLE_KILLPRIV_V2: Final = 1 << 28
SETXATTR_EXT: Final = 1 << 29
INIT_EXT: Final = 1 << 30
INIT_RESERVED: Final = 1 << 31
SECURITY_CTX: Final = 1 << 32
HAS_INODE_DAX: Final = 1 << 33
CREATE_SUPP_GROUP: Final = 1 << 34
HAS_EXPIRE_ONLY: Final = 1 << 35
DIRECT_IO_ALLOW_MMAP: Final = 1 << 36
PASSTHROUGH: Final = 1 << 37
NO_EXPORT_SUPPORT: Final = 1 << 38
HAS_RESEND: Final = 1 << 39
ALLOW_IDMAP: Final = 1 << 40
OVER_IO_URING: Final = 1 << 41
REQUEST_TIMEOUT: Final = 1 << 42

# -- fuse_open_out.open_flags -------------------------------------------------------------------

FOPEN_DIRECT_IO: Final = 1 << 0
FOPEN_KEEP_CACHE: Final = 1 << 1
FOPEN_NONSEEKABLE: Final = 1 << 2
FOPEN_CACHE_DIR: Final = 1 << 3
FOPEN_STREAM: Final = 1 << 4
FOPEN_NOFLUSH: Final = 1 << 5
FOPEN_PARALLEL_DIRECT_WRITES: Final = 1 << 6
FOPEN_PASSTHROUGH: Final = 1 << 7

# -- request flags ------------------------------------------------------------------------------

GETATTR_FH: Final = 1 << 0  # fuse_getattr_in.getattr_flags: fh is valid
RELEASE_FLUSH: Final = 1 << 0  # fuse_release_in.release_flags
RELEASE_FLOCK_UNLOCK: Final = 1 << 1
READ_LOCKOWNER: Final = 1 << 1  # fuse_read_in.read_flags
FSYNC_FDATASYNC: Final = 1 << 0  # fuse_fsync_in.fsync_flags
OPEN_KILL_SUIDGID: Final = 1 << 0  # fuse_open_in.open_flags

# -- /dev/fuse ioctls: _IOC(dir, type 229, nr, size) ---------------------------------------------

_IOC_WRITE = 1
_IOC_READ = 2
DEV_IOC_MAGIC: Final = 229


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (DEV_IOC_MAGIC << 8) | nr


_BACKING_MAP = struct.Struct("<iIQ")  # struct fuse_backing_map {int32 fd; u32 flags; u64 pad}

DEV_IOC_CLONE: Final = _ioc(_IOC_READ, 0, 4)  # _IOR(229, 0, uint32_t)
DEV_IOC_BACKING_OPEN: Final = _ioc(_IOC_WRITE, 1, _BACKING_MAP.size)  # _IOW(.., fuse_backing_map)
DEV_IOC_BACKING_CLOSE: Final = _ioc(_IOC_WRITE, 2, 4)  # _IOW(229, 2, uint32_t)


class ProtocolError(Exception):
    """A request that cannot be parsed; the message is one line."""


# -- structs ------------------------------------------------------------------------------------

# fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
_IN_HEADER = struct.Struct("<IIQQIIIHH")
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
# fuse_init_in (7.36+): major, minor, max_readahead, flags, flags2, unused[11]
_INIT_IN_OLD = struct.Struct("<IIII")
_INIT_IN_SIZE = 64
# fuse_init_out: major, minor, max_readahead, flags, max_background (u16),
# congestion_threshold (u16), max_write, time_gran, max_pages (u16), map_alignment (u16),
# flags2, max_stack_depth, request_timeout (u16), unused[11] (u16)
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
# fuse_read_in: fh, offset, size, read_flags, lock_owner, flags, padding
_READ_IN = struct.Struct("<QQIIQII")
# fuse_release_in: fh, flags, release_flags, lock_owner
_RELEASE_IN = struct.Struct("<QIIQ")
# fuse_forget_in: nlookup
_FORGET_IN = struct.Struct("<Q")
# fuse_batch_forget_in: count, dummy; then count fuse_forget_one: nodeid, nlookup
_BATCH_FORGET_IN = struct.Struct("<II")
_FORGET_ONE = struct.Struct("<QQ")
# fuse_getattr_in: getattr_flags, dummy, fh
_GETATTR_IN = struct.Struct("<IIQ")
# fuse_open_in: flags, open_flags
_OPEN_IN = struct.Struct("<II")
# fuse_flush_in: fh, unused, padding, lock_owner
_FLUSH_IN = struct.Struct("<QIIQ")
# fuse_fsync_in: fh, fsync_flags, padding
_FSYNC_IN = struct.Struct("<QII")
# fuse_interrupt_in: unique
_INTERRUPT_IN = struct.Struct("<Q")
# fuse_getxattr_in (also LISTXATTR's): size, padding; GETXATTR's name follows
_GETXATTR_IN = struct.Struct("<II")
# fuse_getxattr_out: size, padding
_GETXATTR_OUT = struct.Struct("<II")
# fuse_access_in: mask, padding
_ACCESS_IN = struct.Struct("<II")
# fuse_statfs_out = fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize,
# padding, spare[6]
_STATFS_OUT = struct.Struct("<QQQQQIIII24x")
# fuse_lseek_in: fh, offset, whence, padding; fuse_lseek_out: offset
_LSEEK_IN = struct.Struct("<QQII")
_LSEEK_OUT = struct.Struct("<Q")
# fuse_dirent: ino, off, namelen, type, then the name (no NUL), padded to 8 bytes
_DIRENT = struct.Struct("<QQII")

ATTR_SIZE: Final = _ATTR.size
ENTRY_OUT_SIZE: Final = _ENTRY_OUT_HEAD.size + _ATTR.size
ATTR_OUT_SIZE: Final = _ATTR_OUT_HEAD.size + _ATTR.size
DIRENT_HEADER_SIZE: Final = _DIRENT.size

# Every size the header gives, checked at import: a wrong format string fails loudly.
for _s, _n in (
    (_IN_HEADER.size, IN_HEADER_SIZE),
    (_OUT_HEADER.size, OUT_HEADER_SIZE),
    (_ATTR.size, 88),
    (ENTRY_OUT_SIZE, 128),
    (ATTR_OUT_SIZE, 104),
    (_OPEN_OUT.size, 16),
    (_INIT_OUT.size, 64),
    (_READ_IN.size, 40),
    (_RELEASE_IN.size, 24),
    (_FLUSH_IN.size, 24),
    (_GETATTR_IN.size, 16),
    (_FSYNC_IN.size, 16),
    (_STATFS_OUT.size, 80),
    (_LSEEK_IN.size, 24),
    (_DIRENT.size, 24),
    (_BACKING_MAP.size, 16),
    (_FORGET_ONE.size, 16),
):
    if _s != _n:  # pragma: no cover - a typo in a format string above
        raise AssertionError(f"FUSE struct size {_s} != {_n}")
del _s, _n


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InHeader:
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    total_extlen: int  # extensions' length, in 8-byte units


@dataclass(frozen=True, slots=True)
class Lookup:
    name: bytes


@dataclass(frozen=True, slots=True)
class Forget:
    nlookup: int


@dataclass(frozen=True, slots=True)
class BatchForget:
    items: tuple[tuple[int, int], ...]  # (nodeid, nlookup)


@dataclass(frozen=True, slots=True)
class GetAttr:
    flags: int  # GETATTR_FH: fh is valid
    fh: int


@dataclass(frozen=True, slots=True)
class Open:
    """OPEN and OPENDIR."""

    flags: int  # the open(2) flags
    open_flags: int  # OPEN_KILL_SUIDGID


@dataclass(frozen=True, slots=True)
class Read:
    """READ, READDIR and READDIRPLUS."""

    fh: int
    offset: int
    size: int
    read_flags: int
    flags: int  # the file's open(2) flags


@dataclass(frozen=True, slots=True)
class Release:
    """RELEASE and RELEASEDIR."""

    fh: int
    flags: int
    release_flags: int


@dataclass(frozen=True, slots=True)
class Flush:
    fh: int


@dataclass(frozen=True, slots=True)
class Fsync:
    """FSYNC and FSYNCDIR."""

    fh: int
    fsync_flags: int


@dataclass(frozen=True, slots=True)
class Init:
    major: int
    minor: int
    max_readahead: int
    flags: int  # 64 bits: flags | flags2 << 32 where the kernel sent them (INIT_EXT)


@dataclass(frozen=True, slots=True)
class Interrupt:
    unique: int


@dataclass(frozen=True, slots=True)
class GetXattr:
    size: int
    name: bytes


@dataclass(frozen=True, slots=True)
class ListXattr:
    size: int


@dataclass(frozen=True, slots=True)
class Access:
    mask: int


@dataclass(frozen=True, slots=True)
class Lseek:
    fh: int
    offset: int
    whence: int


@dataclass(frozen=True, slots=True)
class Empty:
    """No arguments objfs needs: STATFS, DESTROY, READLINK, mutations, unknown opcodes."""


Args: TypeAlias = (
    Lookup
    | Forget
    | BatchForget
    | GetAttr
    | Open
    | Read
    | Release
    | Flush
    | Fsync
    | Init
    | Interrupt
    | GetXattr
    | ListXattr
    | Access
    | Lseek
    | Empty
)


@dataclass(frozen=True, slots=True)
class Request:
    header: InHeader
    args: Args


Buffer: TypeAlias = bytes | bytearray | memoryview


def _bytes_view(buf: Buffer) -> memoryview:
    try:
        view = memoryview(buf)
        if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
            view = memoryview(view.tobytes())
    except (TypeError, ValueError, BufferError) as exc:
        raise ProtocolError(f"not a byte buffer: {exc}") from None
    return view


def _header(view: memoryview) -> InHeader:
    if len(view) < IN_HEADER_SIZE:
        raise ProtocolError(f"request of {len(view)} bytes, shorter than a header")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = _IN_HEADER.unpack_from(view)
    if length != len(view):
        raise ProtocolError(f"header says {length} bytes, the request has {len(view)}")
    return InHeader(length, opcode, unique, nodeid, uid, gid, pid, extlen)


def parse_header(buf: Buffer) -> InHeader:
    """The request's header; ProtocolError if short or its length is not the buffer's."""
    return _header(_bytes_view(buf))


def _need(args: memoryview, size: int, what: str) -> None:
    if len(args) < size:
        raise ProtocolError(f"{what}: {len(args)} bytes of arguments, needs {size}")


def _name(args: memoryview, what: str) -> bytes:
    raw = bytes(args)
    end = raw.find(b"\0")
    if end < 0:
        raise ProtocolError(f"{what}: name without a terminating NUL")
    if end == 0:
        raise ProtocolError(f"{what}: empty name")
    return raw[:end]


def _lookup(args: memoryview) -> Args:
    return Lookup(_name(args, "LOOKUP"))


def _forget(args: memoryview) -> Args:
    _need(args, _FORGET_IN.size, "FORGET")
    return Forget(_FORGET_IN.unpack_from(args)[0])


def _batch_forget(args: memoryview) -> Args:
    _need(args, _BATCH_FORGET_IN.size, "BATCH_FORGET")
    count = _BATCH_FORGET_IN.unpack_from(args)[0]
    room = (len(args) - _BATCH_FORGET_IN.size) // _FORGET_ONE.size
    if count > room:
        raise ProtocolError(f"BATCH_FORGET: count {count}, room for {room} items")
    end = _BATCH_FORGET_IN.size + count * _FORGET_ONE.size
    items = args[_BATCH_FORGET_IN.size : end]
    return BatchForget(tuple(_FORGET_ONE.iter_unpack(items)))


def _getattr(args: memoryview) -> Args:
    _need(args, _GETATTR_IN.size, "GETATTR")
    flags, _, fh = _GETATTR_IN.unpack_from(args)
    return GetAttr(flags, fh)


def _open(args: memoryview) -> Args:
    _need(args, _OPEN_IN.size, "OPEN")
    flags, open_flags = _OPEN_IN.unpack_from(args)
    return Open(flags, open_flags)


def _read(args: memoryview) -> Args:
    _need(args, _READ_IN.size, "READ")
    fh, offset, size, read_flags, _, flags, _ = _READ_IN.unpack_from(args)
    return Read(fh, offset, size, read_flags, flags)


def _release(args: memoryview) -> Args:
    _need(args, _RELEASE_IN.size, "RELEASE")
    fh, flags, release_flags, _ = _RELEASE_IN.unpack_from(args)
    return Release(fh, flags, release_flags)


def _flush(args: memoryview) -> Args:
    _need(args, _FLUSH_IN.size, "FLUSH")
    return Flush(_FLUSH_IN.unpack_from(args)[0])


def _fsync(args: memoryview) -> Args:
    _need(args, _FSYNC_IN.size, "FSYNC")
    fh, fsync_flags, _ = _FSYNC_IN.unpack_from(args)
    return Fsync(fh, fsync_flags)


def _init(args: memoryview) -> Args:
    # 7.36+ kernels send the 64-byte struct (flags2 counts where INIT_EXT is set); older ones
    # its first 16 bytes.
    _need(args, _INIT_IN_OLD.size, "INIT")
    major, minor, max_readahead, flags = _INIT_IN_OLD.unpack_from(args)
    if len(args) >= _INIT_IN_SIZE and flags & INIT_EXT:
        flags |= struct.unpack_from("<I", args, _INIT_IN_OLD.size)[0] << 32
    return Init(major, minor, max_readahead, flags)


def _interrupt(args: memoryview) -> Args:
    _need(args, _INTERRUPT_IN.size, "INTERRUPT")
    return Interrupt(_INTERRUPT_IN.unpack_from(args)[0])


def _getxattr(args: memoryview) -> Args:
    _need(args, _GETXATTR_IN.size, "GETXATTR")
    size, _ = _GETXATTR_IN.unpack_from(args)
    return GetXattr(size, _name(args[_GETXATTR_IN.size :], "GETXATTR"))


def _listxattr(args: memoryview) -> Args:
    _need(args, _GETXATTR_IN.size, "LISTXATTR")
    return ListXattr(_GETXATTR_IN.unpack_from(args)[0])


def _access(args: memoryview) -> Args:
    _need(args, _ACCESS_IN.size, "ACCESS")
    return Access(_ACCESS_IN.unpack_from(args)[0])


def _lseek(args: memoryview) -> Args:
    _need(args, _LSEEK_IN.size, "LSEEK")
    fh, offset, whence, _ = _LSEEK_IN.unpack_from(args)
    return Lseek(fh, offset, whence)


_PARSERS: dict[int, Callable[[memoryview], Args]] = {
    Opcode.LOOKUP: _lookup,
    Opcode.FORGET: _forget,
    Opcode.BATCH_FORGET: _batch_forget,
    Opcode.GETATTR: _getattr,
    Opcode.OPEN: _open,
    Opcode.OPENDIR: _open,
    Opcode.READ: _read,
    Opcode.READDIR: _read,
    Opcode.READDIRPLUS: _read,
    Opcode.RELEASE: _release,
    Opcode.RELEASEDIR: _release,
    Opcode.FLUSH: _flush,
    Opcode.FSYNC: _fsync,
    Opcode.FSYNCDIR: _fsync,
    Opcode.INIT: _init,
    Opcode.INTERRUPT: _interrupt,
    Opcode.GETXATTR: _getxattr,
    Opcode.LISTXATTR: _listxattr,
    Opcode.ACCESS: _access,
    Opcode.LSEEK: _lseek,
}

_EMPTY = Empty()


def parse(buf: Buffer) -> Request:
    """A whole request (exactly the bytes one read of /dev/fuse returned): header and args."""
    view = _bytes_view(buf)
    header = _header(view)
    extensions = header.total_extlen * 8
    if extensions > header.length - IN_HEADER_SIZE:
        raise ProtocolError(
            f"opcode {header.opcode}: {extensions} bytes of extensions in a request of "
            f"{header.length}"
        )
    parser = _PARSERS.get(header.opcode)
    if parser is None:
        return Request(header, _EMPTY)
    return Request(header, parser(view[IN_HEADER_SIZE : header.length - extensions]))


# -- replies ------------------------------------------------------------------------------------


def out_header(unique: int, payload_len: int) -> bytes:
    """A success reply's 16-byte header, for a payload written after it (writev)."""
    return _OUT_HEADER.pack(OUT_HEADER_SIZE + payload_len, 0, unique)


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


def backing_map(fd: int) -> bytes:
    """struct fuse_backing_map for DEV_IOC_BACKING_OPEN (16 bytes)."""
    return _BACKING_MAP.pack(fd, 0, 0)
