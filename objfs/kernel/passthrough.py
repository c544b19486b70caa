"""FUSE passthrough for objfs's own transport: whether it is on, and each open inode's mode.

Contract: :func:`passthrough_refusal` says why the kernel will not read cached versions itself
(None: it will: a disk cache, a kernel that offers it, CAP_SYS_ADMIN). :class:`OpenInodes` is
the one owner of the open inodes' read modes. The kernel refuses to mix the two modes on one
inode and needs one backing file per inode while any passthrough open lasts, so an inode's
entry is made by its first open and keeps that mode; a passthrough open counts on the inode's
one backing id, registered at its first passthrough open; :meth:`OpenInodes.released` closes
the backing id after the inode's last release. Nothing else changes the table.
"""

from __future__ import annotations

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

    def cached(self, inode: int) -> bool:
        """Whether ``inode`` is open in cached mode (no passthrough open until it closes)."""
        io = self._io.get(inode)
        return io is not None and io.backing_id is None

    def by_passthrough(self, inode: int) -> bool:
        """Whether ``inode`` is open by passthrough (every open of it is, until it closes)."""
        io = self._io.get(inode)
        return io is not None and io.backing_id is not None

    def opened(self, dev_fd: int, inode: int, path: str | None) -> int | None:
        """Count an open of ``inode``; returns its backing id, or None for a cached open.

        An inode open by passthrough stays so: the kernel refuses a cached open of it, and an
        inode is one version, so its backing file serves the open even where ``path`` is None
        now (the version's file left the disk cache since; the kernel keeps the file). Else
        ``path`` (the version's file, None for a cached open) is registered where the inode is
        not open at all and the kernel takes the file; anything else opens cached."""
        io = self._io.get(inode)
        if io is not None and io.backing_id is not None:
            io.opens += 1
            return io.backing_id
        if path is not None and io is None:
            try:
                backing_id = _register(dev_fd, path)
            except OSError as exc:
                log.warning("FUSE passthrough of %s refused (%s): serving it", path, exc)
            else:
                self._io[inode] = _InodeIO(backing_id, opens=1)
                return backing_id
        if io is None:
            io = self._io[inode] = _InodeIO(None)
        io.opens += 1
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


def _register(dev_fd: int, path: str) -> int:
    """A backing id for ``path`` (FUSE_DEV_IOC_BACKING_OPEN; the kernel keeps its own
    reference to the file, so the fd is closed at once)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return int(fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_OPEN, bytearray(p.backing_map(fd))))
    finally:
        os.close(fd)
