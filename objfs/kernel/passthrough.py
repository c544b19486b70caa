"""FUSE passthrough for objfs's own transport: whether it is on, and each open inode's mode.

Contract: :func:`passthrough_refusal` says why the kernel will not read cached versions itself
(None: it will: a disk cache, a kernel that offers it, and CAP_SYS_ADMIN or a broker), and
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

Backing ids are registered and closed by a :class:`Registrar`: the ioctls on the session's own
``/dev/fuse`` fd (CAP_SYS_ADMIN), or, for an ``objfs sidecar`` child without that capability,
:class:`BrokerRegistrar`: the node plugin's broker (:mod:`objfs.csi.node_cache`), which checks
the file and makes the ioctl on its copy of the same connection's fd. A broker that is gone (a
node plugin restart) or does not answer within :data:`BROKER_TIMEOUT_S` is a refusal for good:
new opens are served by objfs, opens by passthrough keep their backing files.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import threading
from dataclasses import dataclass

from objfs.kernel import protocol as p
from objfs.kernel.requests import Init

# The transport's log lines keep one logger name (objfs.kernel.session).
log = logging.getLogger("objfs.kernel.session")


#: Set by ``objfs sidecar`` for its ``objfs mount`` child: the descriptor number of its end of
#: the node plugin's passthrough broker (a SOCK_SEQPACKET socket).
BROKER_ENV = "OBJFS_BACKING_BROKER_FD"
#: How long a broker request may take (the node plugin answers in microseconds).
BROKER_TIMEOUT_S = 5.0
#: The broker's messages: a request is one byte (``O`` with one fd attached: register it;
#: ``C`` then a little-endian int32: close that id), an answer an errno and a value (0 and the
#: backing id, or the errno and 0).
BROKER_OPEN = b"O"
BROKER_CLOSE = b"C"
BROKER_ID = struct.Struct("<i")
BROKER_ANSWER = struct.Struct("<ii")


def passthrough_refusal(init: Init, *, has_disk_cache: bool, brokered: bool = False) -> str | None:
    """Why the kernel will not serve cached versions itself (None: it will). ``brokered``: a
    node plugin's broker registers backing files for this process."""
    if not has_disk_cache:
        return "no --cache-dir (passthrough serves versions whole in the disk cache)"
    if not init.flags & p.PASSTHROUGH or not init.flags & p.INIT_EXT:
        return "the kernel does not offer it (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)"
    if not brokered and not _has_cap_sys_admin():
        return "no CAP_SYS_ADMIN (the kernel registers backing files only for it)"
    return None


class Registrar:
    """Registers and closes backing ids with the ioctls on the session's fd (CAP_SYS_ADMIN)."""

    def open(self, dev_fd: int, backing_fd: int) -> int:
        """A backing id for the file open as ``backing_fd`` (FUSE_DEV_IOC_BACKING_OPEN; the
        kernel keeps its own reference to the file); OSError when refused."""
        map_ = bytearray(p.backing_map(backing_fd))
        return int(fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_OPEN, map_))

    def close(self, dev_fd: int, backing_id: int) -> None:
        fcntl.ioctl(dev_fd, p.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<i", backing_id)))


class BrokerRegistrar(Registrar):
    """Backing ids through the node plugin's broker, on the socket ``sock_fd`` (owned here).
    One request at a time; a broker gone or silent raises ENOTCONN (a refusal for good)."""

    def __init__(self, sock_fd: int) -> None:
        self._sock = socket.socket(fileno=sock_fd)
        self._sock.settimeout(BROKER_TIMEOUT_S)
        self._mutex = threading.Lock()

    @classmethod
    def from_environment(cls) -> BrokerRegistrar | None:
        """The broker ``objfs sidecar`` handed this process (:data:`BROKER_ENV`), or None."""
        value = os.environ.pop(BROKER_ENV, "")
        if not value.isdigit():
            return None
        fd = int(value)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                return None
            os.set_inheritable(fd, False)
        except OSError:
            return None
        return cls(fd)

    def open(self, dev_fd: int, backing_fd: int) -> int:
        return self._call(BROKER_OPEN, [backing_fd])

    def close(self, dev_fd: int, backing_id: int) -> None:
        self._call(BROKER_CLOSE + BROKER_ID.pack(backing_id), [])

    def _call(self, message: bytes, fds: list[int]) -> int:
        with self._mutex:
            if self._sock.fileno() < 0:
                raise OSError(errno.ENOTCONN, "the node plugin's passthrough broker is gone")
            try:
                socket.send_fds(self._sock, [message], fds)
                answer = self._sock.recv(BROKER_ANSWER.size + 1)
            except (OSError, TimeoutError) as exc:
                self._sock.close()  # a late answer must never meet the next request
                raise OSError(
                    errno.ENOTCONN,
                    f"the node plugin's passthrough broker is gone or silent ({exc}); a node "
                    "plugin restart ends it until the sidecar restarts",
                ) from None
            if len(answer) != BROKER_ANSWER.size:
                self._sock.close()
                raise OSError(
                    errno.ENOTCONN,
                    "the node plugin's passthrough broker is gone (a node plugin restart ends "
                    "it until the sidecar restarts)",
                )
            code, value = BROKER_ANSWER.unpack(answer)
            if code:
                raise OSError(code, f"the node plugin refused: {os.strerror(code)}")
            return int(value)


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

    def __init__(self, registrar: Registrar | None = None) -> None:
        self._io: dict[int, _InodeIO] = {}
        self.registrar = registrar or Registrar()
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
            return self.registrar.open(dev_fd, backing_fd)
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
                self.registrar.close(dev_fd, io.backing_id)
            except OSError as exc:
                log.warning("FUSE: closing backing id %d failed (%s)", io.backing_id, exc)
