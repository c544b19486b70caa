"""FUSE passthrough for objfs's own transport: whether it is on, and each open inode's mode.

Contract: :func:`passthrough_refusal` says why the kernel will not read cached versions itself
(None: it will: a disk cache, a kernel that offers it, CAP_SYS_ADMIN), and
:func:`backing_stack_depth` how deep the cache directory's file system stacks (overlayfs, a
container's root, is 1), which INIT raises ``max_stack_depth`` over, so that the kernel takes
backing files there. :class:`OpenInodes` is the one owner of the open inodes' read modes. The
kernel refuses to mix the two modes on one inode and needs one backing file per inode while
any passthrough open lasts, so an inode's entry is made by its first open and keeps that mode;
a passthrough open counts on the inode's one backing id, registered at its first passthrough
open from the descriptor the disk tier verified (never a path opened again); and
:meth:`OpenInodes.released` closes the backing id after the inode's last release. A
registration the kernel refuses for a reason that holds for every file (anything but a
shortage of memory) turns passthrough off for the mount, with one warning
(:attr:`OpenInodes.refused`). Nothing else changes the table.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
from dataclasses import dataclass

from objfs.kernel import protocol as p
from objfs.kernel.requests import Init

# The transport's log lines keep one logger name (objfs.kernel.session).
log = logging.getLogger("objfs.kernel.session")


def passthrough_refusal(init: Init, *, has_disk_cache: bool) -> str | None:
    """Why the kernel will not serve cached versions itself (None: it will)."""
    if not has_disk_cache:
        return "no --cache-dir (passthrough serves versions whole in the disk cache)"
    if not init.flags & p.PASSTHROUGH or not init.flags & p.INIT_EXT:
        return "the kernel does not offer it (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)"
    if not _has_cap_sys_admin():
        return "no CAP_SYS_ADMIN (the kernel registers backing files only for it)"
    return None


# statfs f_type of the stacking file systems a cache directory may sit on (a container's root
# is overlayfs): their files are one level deeper than the disk's.
_STACKED_MAGIC = {0x794C7630: "overlayfs", 0xF15F: "ecryptfs"}
# Errors of a registration that are not the file's own: a retry may succeed.
_TRANSIENT = frozenset({errno.ENOMEM, errno.EAGAIN, errno.EINTR})


def backing_stack_depth(path: str) -> int:
    """How many file systems stack under ``path``'s: 1 on overlayfs or ecryptfs, else 0 (a
    deeper stack, overlayfs on overlayfs, is found out by the kernel's ELOOP)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first, 120 bytes on 64-bit
    try:
        if _libc().statfs(os.fsencode(path), buf) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    # f_type is a long but on s390x (an unsigned int there).
    width = ctypes.c_uint if os.uname().machine == "s390x" else ctypes.c_ulong
    f_type = width.from_buffer(buf).value & 0xFFFFFFFF
    return 1 if f_type in _STACKED_MAGIC else 0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (bit 21 of CapEff), which passthrough
    needs (in the initial user namespace)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 21 & 1)
    except (OSError, ValueError):
        pass
    return False


@dataclass
class _InodeIO:
    """How an open inode is read: cached (``backing_id`` None) or by passthrough."""

    backing_id: int | None
    opens: int = 0


class OpenInodes:
    """Open inodes: their I/O mode and, in passthrough, their backing id (see the contract).
    ``dev_fd``: the session's ``/dev/fuse`` fd, which backing ids belong to."""

    def __init__(self) -> None:
        self._io: dict[int, _InodeIO] = {}
        #: Why the kernel refused passthrough for good on this mount (None: it did not).
        self.refused: str | None = None

    def cached(self, inode: int) -> bool:
        """Whether ``inode`` is open in cached mode (no passthrough open until it closes)."""
        io = self._io.get(inode)
        return io is not None and io.backing_id is None

    def by_passthrough(self, inode: int) -> bool:
        """Whether ``inode`` is open by passthrough (every open of it is, until it closes)."""
        io = self._io.get(inode)
        return io is not None and io.backing_id is not None

    def opened(self, dev_fd: int, inode: int, backing_fd: int | None) -> int | None:
        """Count an open of ``inode``; returns its backing id, or None for a cached open.
        ``backing_fd`` (the version's file as the disk tier verified it, None for a cached
        open) is this call's: it is closed before the call returns.

        An inode open by passthrough stays so: the kernel refuses a cached open of it, and an
        inode is one version, so its backing file serves the open even where ``backing_fd``
        is None now (the version's file left the disk cache since; the kernel keeps the
        file). Else ``backing_fd`` is registered where the inode is not open at all and the
        kernel takes the file; anything else opens cached."""
        try:
            io = self._io.get(inode)
            if io is not None and io.backing_id is not None:
                io.opens += 1
                return io.backing_id
            if backing_fd is not None and io is None and self.refused is None:
                backing_id = self._register(dev_fd, backing_fd)
                if backing_id is not None:
                    self._io[inode] = _InodeIO(backing_id, opens=1)
                    return backing_id
            if io is None:
                io = self._io[inode] = _InodeIO(None)
            io.opens += 1
            return None
        finally:
            if backing_fd is not None:
                os.close(backing_fd)

    def _register(self, dev_fd: int, backing_fd: int) -> int | None:
        """A backing id for ``backing_fd``, or None (refused: for good, unless transient)."""
        try:
            return _register(dev_fd, backing_fd)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if exc.errno in _TRANSIENT:
                log.warning("FUSE passthrough of one file refused (%s): serving it", reason)
                return None
            if exc.errno == errno.ELOOP:
                reason += (
                    ": the cache directory's file system stacks too deep; put --cache-dir on "
                    "a volume of its own"
                )
            self.refused = reason
            log.warning(
                "FUSE passthrough off for this mount: the kernel refused a backing file (%s); "
                "objfs serves cached files itself",
                reason,
            )
            return None

    def released(self, dev_fd: int, inode: int) -> None:
        """A handle of ``inode`` was released: after the last one, its backing id goes."""
        io = self._io.get(inode)
        if io is None:
            return
        assert io.opens > 0, f"inode {inode} counted {io.opens} opens"
        io.opens -= 1
        if io.opens > 0:
            return
        del self._io[inode]
        if io.backing_id is not None:
            try:
                fcntl.ioctl(
                    dev_fd, p.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<i", io.backing_id))
                )
            except OSError as exc:
                log.warning("FUSE: closing backing id %d failed (%s)", io.backing_id, exc)


def _register(dev_fd: int, backing_fd: int) -> int:
    """A backing id for the file open as ``backing_fd`` (FUSE_DEV_IOC_BACKING_OPEN; the
    kernel keeps its own reference to the file)."""
    return int(fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_OPEN, bytearray(p.backing_map(backing_fd))))
