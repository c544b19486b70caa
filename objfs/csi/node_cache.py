"""The node cache: a persistent disk-cache folder per identity, its cap, and passthrough for
unprivileged sidecars (``objfs csi --node-cache-dir DIR --node-cache-size SIZE``).

**Folders.** An identity is a pod's namespace and service account (the kubelet's pod info) and
the uid its sidecar runs as (``SO_PEERCRED`` on the offer connection). Its folder is
``DIR/identities/NAMESPACE/SERVICE_ACCOUNT/UID``: the levels above it are the plugin's (root, 0700),
the folder itself is 0700 and owned by that uid. The sidecar gets an open descriptor of the
folder with the FUSE fd and uses it as its ``--cache-dir`` (``/dev/fd/N``); it has no path to
it, nor to any other folder. Pods of one identity on a node share a folder (and fetch each
block once between them: :mod:`objfs.disk_cache.fetching`); a pod of another identity is never
handed it. Every level is opened without following symlinks.

**The cap** (:class:`NodeCache` ``sweep``): the folders together allocate at most
``size_bytes``. Each sidecar's mount keeps its own folder under the cap (its ``--cache-size`` is
the node's); every :data:`SWEEP_INTERVAL_S` the plugin adds up the folders' ledgers (the first
16 bytes of ``v4/.lock``, :mod:`objfs.disk_cache.ledger`) and, over the cap, removes whole
versions, least recently used first (the data file's mtime, which every use touches), whoever
wrote them, down to 90% of the cap, each folder's ledger locked and recounted as a scan would.
So the total runs over the cap by at most what the mounts write in one interval. Nothing in a
folder is followed as a link: files are reached through directory descriptors, and the
plugin writes only the ledger of a lock file that is a regular file owned by the folder's uid
with one link.

**The broker** (:class:`Broker`): the kernel registers a backing file only for CAP_SYS_ADMIN,
on any fd of the FUSE connection. While a sidecar serves a mount with the node cache, the
plugin keeps a copy of that mount's FUSE fd and answers the sidecar on a SOCK_SEQPACKET socket
(:data:`objfs.kernel.passthrough.BROKER_OPEN`: a file descriptor in, a backing id out;
``BROKER_CLOSE``: an id closed). It registers a descriptor only if it is a regular file, open
read-only, owned by the sidecar's uid, writable by no one else, and inside that identity's
folder (its path, from ``/proc/self/fd``, under the folder's, on the folder's device);
anything else (a directory, a socket, a writable descriptor, a file elsewhere, garbage) is
refused with an errno and a log line, and the broker carries on. The copy of the FUSE fd is
closed as soon as the sidecar's broker socket or its offer connection ends, so a dead sidecar
still means ENOTCONN for readers, never a hang. After a node plugin restart, brokers are gone:
mounts keep serving, opens by passthrough keep their backing files, and new opens are served by
the sidecar itself (it is told so once) until the sidecar restarts and gets a fresh mount.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass

from objfs.disk_cache.layout import DIGEST_LENGTH, FORMAT
from objfs.errors import UsageError
from objfs.kernel.passthrough import (
    BROKER_ANSWER,
    BROKER_CLOSE,
    BROKER_ID,
    BROKER_OPEN,
    Registrar,
)

log = logging.getLogger("objfs.csi")

#: The node cache directory's one subfolder (not a name objfs mount takes for an old cache
#: format: a --cache-dir pointed there by mistake removes nothing of it).
LAYOUT = "identities"
#: How often the plugin checks the cap across identities.
SWEEP_INTERVAL_S = 1.0
#: Eviction goes this fraction under the cap (as a mount's own does).
EVICT_SLACK = 0.1
#: A sidecar's broker registers at most this many backing ids at once.
MAX_BACKING_IDS = 65536
#: How long the sweep waits for a folder's ledger lock before evicting without it.
_LOCK_WAIT_S = 2.0
_LEDGER = struct.Struct("<qq")
_ST_BLOCK = 512
# Kubernetes names: a namespace is a DNS label, a service account a DNS subdomain.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NodeCacheError(Exception):
    """This identity cannot have a node cache folder; ``str()`` says why, in one line."""


@dataclass(frozen=True)
class Identity:
    """Whose folder: the pod's namespace and service account, and the sidecar's uid and gid."""

    namespace: str
    service_account: str
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.namespace}/{self.service_account} uid {self.uid}"


def peer_identity(conn: socket.socket, namespace: str, service_account: str) -> Identity:
    """The identity of the process at the other end of ``conn`` (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    if uid == 0:
        # A directory descriptor is no jail: root follows ``..`` out of the folder and up
        # the node's tree (the levels above keep out only other users).
        raise NodeCacheError(
            "the sidecar runs as root: the node cache is handed only to a sidecar that runs "
            "as another user (runAsNonRoot, as the examples do); it keeps the pod's cache-dir"
        )
    for what, name in (("namespace", namespace), ("service account", service_account)):
        if not _NAME.fullmatch(name or ""):
            raise NodeCacheError(f"the pod's {what} {name!r} is missing or not a Kubernetes name")
    return Identity(namespace, service_account, uid, gid)


class NodeCache:
    """The node cache directory ``root`` with its cap ``size_bytes`` (see the module's text)."""

    def __init__(self, root: str, size_bytes: int) -> None:
        self.root = os.path.realpath(root)
        self.size_bytes = size_bytes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def prepare(self) -> None:
        """Creates ``root/identities`` (0700) or checks them: the plugin's own, writable by no
        one else; a UsageError if not."""
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            for path in (self.root, os.path.join(self.root, LAYOUT)):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    raise UsageError(
                        f"--node-cache-dir {self.root}: {path} must be a directory of uid "
                        f"{os.geteuid()} that no one else may write to (chown/chmod 700 it)"
                    )
        except OSError as exc:
            raise UsageError(f"--node-cache-dir {self.root}: {exc.strerror}") from None

    # -- folders -----------------------------------------------------------------------------

    def folder(self, identity: Identity) -> tuple[str, int]:
        """The identity's folder, made if missing: its path and an open descriptor of it (the
        caller's, to hand over and close). Raises NodeCacheError."""
        names = [LAYOUT, identity.namespace, identity.service_account]
        with self._lock:
            try:
                fd = os.open(self.root, _DIR_FLAGS)
                for name in names:
                    fd = _subdir(fd, name, None)
                fd = _subdir(fd, str(identity.uid), (identity.uid, identity.gid))
            except OSError as exc:
                raise NodeCacheError(
                    f"cannot make the node cache folder of {identity}: {exc.strerror}"
                ) from None
        return os.path.join(self.root, *names, str(identity.uid)), fd

    def folders(self) -> list[tuple[str, int]]:
        """Every identity's folder: (path, uid)."""
        found = []
        base = os.path.join(self.root, LAYOUT)
        with contextlib.suppress(OSError):
            for namespace in sorted(os.listdir(base)):
                level = os.path.join(base, namespace)
                with contextlib.suppress(OSError):
                    for account in sorted(os.listdir(level)):
                        with contextlib.suppress(OSError):
                            for uid in sorted(os.listdir(os.path.join(level, account))):
                                if uid.isdigit():
                                    found.append((os.path.join(level, account, uid), int(uid)))
        return found

    # -- the cap -----------------------------------------------------------------------------

    def usage(self) -> int:
        """The bytes the folders' ledgers count and reserve (cheap: 16 bytes per folder)."""
        total = 0
        for path, uid in self.folders():
            fd = _open_ledger(path, uid)
            if fd < 0:
                continue
            try:
                head = os.pread(fd, _LEDGER.size, 0).ljust(_LEDGER.size, b"\0")
                counted, reserved = _LEDGER.unpack(head)
                total += max(0, counted) + max(0, reserved)
            except OSError:
                pass
            finally:
                os.close(fd)
        return total

    def sweep(self) -> int:
        """Evicts across identities if the ledgers are over the cap; returns the versions
        removed."""
        if self.usage() <= self.size_bytes:
            return 0
        return self.evict()

    def evict(self) -> int:
        """Removes least recently used versions of every folder until the folders allocate at
        most 90% of the cap; each folder's ledger is locked meanwhile and recounted after."""
        held: list[tuple[str, int, int]] = []  # path, ledger fd (or -1), v4 fd
        versions: list[tuple[float, int, _Version]] = []  # mtime, folder, version
        totals: list[int] = []
        try:
            for path, uid in self.folders():
                try:
                    folder_fd = os.open(path, _DIR_FLAGS)
                except OSError:
                    continue
                try:
                    root_fd = os.open(FORMAT, _DIR_FLAGS, dir_fd=folder_fd)
                except OSError:
                    continue
                finally:
                    os.close(folder_fd)
                lock_fd = _open_ledger(path, uid)
                if lock_fd >= 0 and not _lock(lock_fd):
                    log.warning("node cache: %s keeps its ledger locked; evicting without it", path)
                    os.close(lock_fd)
                    lock_fd = -1
                index = len(held)
                held.append((path, lock_fd, root_fd))
                found = _versions(root_fd)
                versions.extend((v.mtime, index, v) for v in found)
                totals.append(sum(v.allocated for v in found))
            goal = self.size_bytes - int(self.size_bytes * EVICT_SLACK)
            over = sum(totals) - goal
            removed = 0
            freed = 0
            for _mtime, index, version in sorted(versions, key=lambda item: item[:2]):
                if over <= 0:
                    break
                _remove(held[index][2], version.sub, version.names)
                totals[index] -= version.allocated
                over -= version.allocated
                freed += version.allocated
                removed += 1
            for index, (_path, lock_fd, _root_fd) in enumerate(held):
                if lock_fd >= 0:
                    with contextlib.suppress(OSError):
                        head = os.pread(lock_fd, _LEDGER.size, 0).ljust(_LEDGER.size, b"\0")
                        _counted, reserved = _LEDGER.unpack(head)
                        os.pwrite(lock_fd, _LEDGER.pack(totals[index], max(0, reserved)), 0)
        finally:
            for _path, lock_fd, root_fd in held:
                _close(lock_fd)  # closing drops the flock
                _close(root_fd)
        if removed:
            log.info(
                "node cache: removed %d least recently used versions (%.1f MiB) across "
                "identities to stay under the cap of %.1f GiB",
                removed,
                freed / (1 << 20),
                self.size_bytes / (1 << 30),
            )
        return removed

    def start(self) -> None:
        """Sweeps every :data:`SWEEP_INTERVAL_S` in a thread until :meth:`stop`."""

        def run() -> None:
            while not self._stop.wait(SWEEP_INTERVAL_S):
                try:
                    self.sweep()
                except Exception as exc:  # the next sweep tries again
                    log.warning("node cache: sweeping failed: %s", exc)

        self._thread = threading.Thread(target=run, name="node cache", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def _subdir(parent_fd: int, name: str, owner: tuple[int, int] | None) -> int:
    """Opens (making it, mode 0700) ``name`` under ``parent_fd``, which it closes in any case;
    ``owner`` (uid, gid) for the identity's own folder, else the plugin's. Refuses a link, a
    non-directory, a folder of someone else or one others may use."""
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        else:
            if owner is not None:
                os.chown(name, *owner, dir_fd=parent_fd, follow_symlinks=False)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    st = os.fstat(fd)
    uid = os.geteuid() if owner is None else owner[0]
    if st.st_uid != uid or st.st_mode & 0o077:
        os.close(fd)
        raise NodeCacheError(
            f"the node cache folder level {name!r} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}, not uid {uid} with 0700: fix or remove it"
        )
    return fd


def _open_ledger(folder: str, uid: int) -> int:
    """The folder's ``v4/.lock``, open read-write, if it is a regular file of ``uid`` with one
    link, reached through directory descriptors with no link followed at any level (the
    folder's owner controls ``v4`` too); -1 if not there or not so."""
    fds: list[int] = []
    try:
        fds.append(os.open(folder, _DIR_FLAGS))
        fds.append(os.open(FORMAT, _DIR_FLAGS, dir_fd=fds[-1]))
        # O_NONBLOCK: a lease its owner put on it fails the open instead of stalling the sweep.
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(".lock", flags, dir_fd=fds[-1])
    except OSError:
        return -1
    finally:
        for parent in fds:
            os.close(parent)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
        os.close(fd)
        return -1
    return fd


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


@dataclass
class _Version:
    """One version's files in a folder, as the sweep found them."""

    sub: str  # its subdirectory of v4
    names: list[str]
    allocated: int = 0
    mtime: float = 0.0


def _versions(root_fd: int) -> list[_Version]:
    """The versions under a folder's ``v4`` (open as ``root_fd``), through descriptors only."""
    found: dict[str, _Version] = {}
    seen: set[tuple[int, int]] = set()  # inodes counted: a hard link adds no bytes
    now = time.time()
    for sub in os.scandir(root_fd):
        if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
            continue
        try:
            sub_fd = os.open(sub.name, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue
        try:
            for entry in os.scandir(sub_fd):
                digest = entry.name.removesuffix(".idx")
                if len(digest) != DIGEST_LENGTH:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                version = found.setdefault(digest, _Version(sub.name, []))
                version.names.append(entry.name)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    version.allocated += st.st_blocks * _ST_BLOCK
                # The owner sets mtimes: one in the future counts as now, not as newest.
                version.mtime = max(version.mtime, min(st.st_mtime, now))
        finally:
            os.close(sub_fd)
    return list(found.values())


def _remove(root_fd: int, sub: str, names: list[str]) -> None:
    """Unlinks a version's files (the table, ``.idx``, first) in ``sub`` of ``root_fd``."""
    try:
        sub_fd = os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return
    try:
        for name in sorted(names, key=lambda n: not n.endswith(".idx")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=sub_fd)
    finally:
        os.close(sub_fd)


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


# -- the passthrough broker ------------------------------------------------------------------


class Broker:
    """Registers backing files on one sidecar's FUSE connection (see the module's text).

    ``fuse_fd`` is a copy of the connection's fd, owned here; :attr:`theirs` is the sidecar's
    end of the socket (sent with the offer, then closed here by :meth:`handed`). The copy is
    closed by :meth:`close`, or at once when the sidecar's end is closed (end of file)."""

    def __init__(self, fuse_fd: int, folder: str, identity: Identity, label: str) -> None:
        self.folder = folder
        self.identity = identity
        self.label = label
        self.registered: set[int] = set()
        self.refusals = 0
        self._fuse_fd = fuse_fd
        self._ioctls = Registrar()  # the very ioctls a privileged mount makes itself
        self._mutex = threading.Lock()
        self._folder_dev = os.stat(folder).st_dev
        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.theirs: int = theirs.detach()
        self._thread = threading.Thread(target=self._serve, name=f"broker {label}", daemon=True)

    def start(self) -> None:
        self.handed()
        self._thread.start()

    def handed(self) -> None:
        """The sidecar has its end (or will never get it): close this process's copy."""
        _close(self.theirs)
        self.theirs = -1

    def close(self) -> None:
        """Closes the copy of the FUSE fd and the socket; waits for the thread."""
        self.handed()
        with contextlib.suppress(OSError):
            self._ours.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._drop_fuse()
        self._ours.close()

    def _drop_fuse(self) -> None:
        with self._mutex:
            fd, self._fuse_fd = self._fuse_fd, -1
        _close(fd)

    def _serve(self) -> None:
        try:
            while True:
                try:
                    data, fds, flags, _ = socket.recv_fds(self._ours, 64, 4)
                except OSError:
                    return
                if not data and not fds:
                    return  # the sidecar's end is closed
                try:
                    answer = self._answer(data, fds, flags)
                finally:
                    for fd in fds:
                        _close(fd)
                try:
                    self._ours.send(BROKER_ANSWER.pack(*answer))
                except OSError:
                    return
        finally:
            # At once: the sidecar is gone, so must the last copy of its FUSE fd be.
            self._drop_fuse()

    def _answer(self, data: bytes, fds: list[int], flags: int) -> tuple[int, int]:
        if flags & socket.MSG_CTRUNC:
            return self._refuse(errno.EBADMSG, "more descriptors than a request carries")
        if data == BROKER_OPEN and len(fds) == 1:
            reason = self.check(fds[0])
            if reason is not None:
                return self._refuse(errno.EACCES, reason)
            if len(self.registered) >= MAX_BACKING_IDS:
                return self._refuse(errno.ENOSPC, f"{MAX_BACKING_IDS} backing ids registered")
            with self._mutex:
                if self._fuse_fd < 0:
                    return errno.ENOTCONN, 0
                try:
                    backing_id = self._ioctls.open(self._fuse_fd, fds[0])
                except OSError as exc:
                    return exc.errno or errno.EIO, 0
            self.registered.add(backing_id)
            return 0, backing_id
        if len(data) == 1 + BROKER_ID.size and data[:1] == BROKER_CLOSE and not fds:
            (backing_id,) = BROKER_ID.unpack(data[1:])
            if backing_id not in self.registered:
                return self._refuse(errno.EINVAL, f"backing id {backing_id} is not the sidecar's")
            with self._mutex:
                if self._fuse_fd < 0:
                    return errno.ENOTCONN, 0
                try:
                    self._ioctls.close(self._fuse_fd, backing_id)
                except OSError as exc:
                    return exc.errno or errno.EIO, 0
            self.registered.discard(backing_id)
            return 0, 0
        return self._refuse(errno.EBADMSG, f"a request the broker does not know ({len(fds)} fds)")

    def check(self, fd: int) -> str | None:
        """Why ``fd`` may not be a backing file of this sidecar (None: it may)."""
        try:
            st = os.fstat(fd)
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as exc:
            return f"cannot inspect it ({exc.strerror})"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if mode != os.O_RDONLY:
            return "not opened read-only"
        if st.st_uid != self.identity.uid:
            return f"owned by uid {st.st_uid}, not by the sidecar's uid {self.identity.uid}"
        if st.st_mode & 0o022:
            return "writable by group or others"
        path = path.removesuffix(" (deleted)")  # removed since: it was opened inside or not
        if not path.startswith(self.folder + os.sep) or st.st_dev != self._folder_dev:
            return "not inside the identity's node cache folder"
        return None

    def _refuse(self, code: int, reason: str) -> tuple[int, int]:
        self.refusals += 1
        if self.refusals <= 20:
            log.warning(
                "passthrough broker of %s (%s): refused a request: %s",
                self.label,
                self.identity,
                reason,
            )
        return code, 0
