"""FUSE requests (protocol 7.x) parsed from the bytes one read of ``/dev/fuse`` returns.
No I/O, no state.

Layouts follow the kernel's ``include/uapi/linux/fuse.h`` (7.45): little-endian, the header's
field sizes, no implicit padding; each size is checked when this module is imported.

Contract:

* :func:`parse` and :func:`parse_header` raise nothing but :class:`ProtocolError`, whatever
  bytes they are given: a buffer shorter than a header, a header whose length disagrees with the
  buffer, extensions longer than the message, arguments shorter than the opcode's struct, a
  name without its NUL (or an empty one), a BATCH_FORGET whose count overruns its items. An
  opcode this module does not know, or whose arguments objfs does not need (mutations, which
  objfs refuses with EROFS, STATFS, DESTROY, ...), parses as :class:`Empty`.
* Extensions (``total_extlen`` 8-byte units at the end of a request) are skipped; bytes after
  an opcode's struct (a newer kernel's longer struct) are ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from objfs.kernel.protocol import IN_HEADER_SIZE, INIT_EXT, Buffer, Opcode


class ProtocolError(Exception):
    """A request that cannot be parsed; the message is one line."""


# -- structs ------------------------------------------------------------------------------------

# fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
_IN_HEADER = struct.Struct("<IIQQIIIHH")
# fuse_init_in (7.36+): major, minor, max_readahead, flags, flags2, unused[11]
_INIT_IN_OLD = struct.Struct("<IIII")
_INIT_IN_SIZE = 64
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
# fuse_access_in: mask, padding
_ACCESS_IN = struct.Struct("<II")
# fuse_lseek_in: fh, offset, whence, padding
_LSEEK_IN = struct.Struct("<QQII")

# Every size the header gives, checked at import: a wrong format string fails loudly.
for _s, _n in (
    (_IN_HEADER.size, IN_HEADER_SIZE),
    (_READ_IN.size, 40),
    (_RELEASE_IN.size, 24),
    (_FLUSH_IN.size, 24),
    (_GETATTR_IN.size, 16),
    (_FSYNC_IN.size, 16),
    (_LSEEK_IN.size, 24),
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
