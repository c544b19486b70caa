"""The FUSE kernel protocol's (7.x) numbers: versions, opcodes, INIT and open flags, the
/dev/fuse ioctls. No I/O, no state.

Values follow the kernel's ``include/uapi/linux/fuse.h`` (protocol 7.45, as in Linux 6.18).
Requests are parsed by :mod:`objfs.kernel.requests`, replies built by
:mod:`objfs.kernel.replies`.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final, TypeAlias

KERNEL_VERSION: Final = 7
KERNEL_MINOR_VERSION: Final = 45
ROOT_ID: Final = 1
MIN_READ_BUFFER: Final = 8192
IN_HEADER_SIZE: Final = 40
OUT_HEADER_SIZE: Final = 16

# What requests are parsed from and replies written as.
Buffer: TypeAlias = bytes | bytearray | memoryview

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


def backing_map(fd: int) -> bytes:
    """struct fuse_backing_map for DEV_IOC_BACKING_OPEN (16 bytes)."""
    return _BACKING_MAP.pack(fd, 0, 0)


if _BACKING_MAP.size != 16:  # pragma: no cover - a typo in the format string above
    raise AssertionError(f"FUSE struct size {_BACKING_MAP.size} != 16")
