"""Mounting and unmounting for objfs's own FUSE transport: the ``/dev/fuse`` fd a session serves.

Contract: :func:`mount` returns an fd open on ``/dev/fuse`` whose mount is at the mountpoint,
read-only, nosuid, nodev, noatime, ``default_permissions`` (``allow_other`` where asked): as
root by mount(2) with ``fd=N`` on a ``/dev/fuse`` it opened, otherwise through ``fusermount3``,
which mounts and hands the fd back over a socket (its ``_FUSE_COMMFD`` protocol). It raises
:class:`~objfs.errors.MountFailedError` with a one-line reason. :func:`unmount` removes a mount
lazily (``MNT_DETACH``, ``fusermount3 -u -z``) where one is still there and only logs a
failure. Whether this process is root is asked here alone (``os.geteuid``).

Before mounting, :func:`raise_max_pages_limit` raises ``fs.fuse.max_pages_limit`` (as root) to
what INIT asks for: the kernel reads it when a connection is created.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import stat
import subprocess

import objfs.kernel.negotiation as negotiation  # the module: MAX_PAGES read when used
from objfs.config import MountConfig
from objfs.errors import MountFailedError

# The transport's log lines keep one logger name (objfs.kernel.session).
log = logging.getLogger("objfs.kernel.session")

_MAX_PAGES_LIMIT = "/proc/sys/fs/fuse/max_pages_limit"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]
_libc.mount.argtypes += [ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOATIME = 1, 2, 4, 1024
_MNT_DETACH = 2


def max_pages_limit() -> int:
    """The kernel's cap on pages per request (``fs.fuse.max_pages_limit``, 6.13+; 256 before)."""
    try:
        with open(_MAX_PAGES_LIMIT, encoding="ascii") as f:
            return max(1, int(f.read().strip()))
    except (OSError, ValueError):
        return 256


def raise_max_pages_limit() -> int:
    """Raise ``fs.fuse.max_pages_limit`` to ``MAX_PAGES`` where it is lower, this process is
    root and the sysctl exists (it only caps what each FUSE file system may ask for; the
    kernel reads it when a connection is created, so this runs before mounting). Returns the
    cap, logged when raised."""
    limit = max_pages_limit()
    if limit < negotiation.MAX_PAGES and os.geteuid() == 0 and os.path.exists(_MAX_PAGES_LIMIT):
        try:
            with open(_MAX_PAGES_LIMIT, "w", encoding="ascii") as f:
                f.write(str(negotiation.MAX_PAGES))
        except OSError as exc:
            log.info("fs.fuse.max_pages_limit stays %d (raising it failed: %s)", limit, exc)
        else:
            log.info("raised fs.fuse.max_pages_limit from %d to %d", limit, negotiation.MAX_PAGES)
            limit = max_pages_limit()
    return limit


def mount(config: MountConfig) -> int:
    """Mount ``config.mountpoint``; the ``/dev/fuse`` fd that serves it (see the contract)."""
    target = config.mountpoint
    fsname = config.source.url().replace(",", "%2C").replace(" ", "%20")
    if os.geteuid() == 0:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        # user_id/group_id: who may use the mount without allow_other (its owner, this
        # process; --uid/--gid only set the files' owner).
        data = (
            f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
            "default_permissions"
        )
        if config.allow_other:
            data += ",allow_other"
        flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOATIME
        if _libc.mount(fsname.encode(), os.fsencode(target), b"fuse.objfs", flags, data.encode()):
            code = ctypes.get_errno()
            os.close(fd)
            raise MountFailedError(f"mounting {target} failed ({os.strerror(code)})")
        return fd
    return _fusermount(config, target, fsname)


def _fusermount(config: MountConfig, target: str, fsname: str) -> int:
    """Mount through fusermount3, which sends the fd back over a socket."""
    options = f"ro,nosuid,nodev,noatime,default_permissions,fsname={fsname},subtype=objfs"
    if config.allow_other:
        options += ",allow_other"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        env = {**os.environ, "_FUSE_COMMFD": str(theirs.fileno())}
        done = subprocess.run(
            ["fusermount3", "-o", options, "--", target],
            env=env,
            pass_fds=(theirs.fileno(),),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
            hint = ""
            if config.allow_other:
                hint = ": --allow-other needs `user_allow_other` in /etc/fuse.conf"
            raise MountFailedError(f"mounting {target} failed ({reason}){hint}")
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise MountFailedError(f"mounting {target} failed (fusermount3 sent no fd)")
    os.set_inheritable(fds[0], False)
    log.info("mounted %s through fusermount3", target)
    return fds[0]


def unmount(target: str) -> None:
    """Remove the mount at ``target`` lazily, unless it is gone already."""
    if not _is_our_mount(target):
        return  # unmounted already (fusermount3 -u, umount)
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
            log.warning("unmounting %s failed (%s)", target, os.strerror(ctypes.get_errno()))
        return
    done = subprocess.run(
        ["fusermount3", "-u", "-z", "--", target], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        log.warning("unmounting %s failed (%s)", target, done.stderr.strip())


def _is_our_mount(target: str) -> bool:
    from objfs.mountinfo import mount_entry

    entry = mount_entry(target)
    return entry is not None


def is_fuse_fd(fd: int) -> bool:
    """Whether ``fd`` is open on /dev/fuse (major 10, minor 229)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(10, 229)
