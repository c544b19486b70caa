"""The mountpoint: checks before mounting, unmounting, and clearing a dead mount.

* :func:`check_mountpoint` and :func:`check_fuse` raise (an :class:`~objfs.errors.ObjfsError`
  with its exit code) unless a new mount can be made there; a dead objfs mount on the path
  (its daemon gone: ENOTCONN) is detached first, a live or hanging one never.
* MOUNTPOINT ``/dev/fd/N`` (:func:`passed_fuse_fd`) names a FUSE fd that another, privileged
  process mounted (see :mod:`objfs.mount`); :func:`check_passed_fd` checks it is /dev/fuse.
* :func:`unmount` runs ``umount`` (root) or ``fusermount3``; :func:`probe_errno` asks a mount
  for statfs from a thread, so a hanging daemon cannot hang the caller.

Nothing here stats a mountpoint from the process that serves it.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import threading

from objfs.errors import (
    AlreadyMountedError,
    FuseUnavailableError,
    MountpointMissingError,
    MountpointNotDirectoryError,
    MountpointNotEmptyError,
    NotMountedError,
    UnmountFailedError,
    UsageError,
)
from objfs.mountinfo import mount_entry

log = logging.getLogger("objfs")

# Serving a passed fd (/dev/fd/N), the file this names is created just before pyfuse3.init
# takes the fd: the sidecar (objfs.sidecar_fd) then knows the fd may have been read.
FD_USED_ENV = "OBJFS_SIDECAR_FD_USED_FILE"

_FD_MOUNTPOINT_PREFIX = "/dev/fd/"
# /dev/fuse is the character device 10:229 on every Linux.
_FUSE_DEVICE = os.makedev(10, 229)


def passed_fuse_fd(mountpoint: str) -> int | None:
    """N if ``mountpoint`` is ``/dev/fd/N`` (an fd mounted by another process), else None."""
    if not mountpoint.startswith(_FD_MOUNTPOINT_PREFIX):
        return None
    number = mountpoint.removeprefix(_FD_MOUNTPOINT_PREFIX)
    if not number.isdigit() or not number.isascii():
        return None
    return int(number)


def check_passed_fd(fd: int) -> None:
    """Raise UsageError unless ``fd`` is open on ``/dev/fuse`` in this process."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise UsageError(
            f"MOUNTPOINT /dev/fd/{fd}: fd {fd} is not open ({exc.strerror}): pass the fd of "
            "a mounted /dev/fuse to this process"
        ) from None
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != _FUSE_DEVICE:
        raise UsageError(
            f"MOUNTPOINT /dev/fd/{fd}: fd {fd} is not /dev/fuse: pass the fd of a mounted "
            "/dev/fuse to this process"
        )


def check_mountpoint(path: str) -> None:
    """Raise if ``path`` cannot take a new mount: missing, not a dir, mounted, not empty.

    An objfs mount whose daemon is gone (killed, OOM) answers ENOTCONN: it is detached here,
    with a warning, so mounting again recovers (and reuses the disk cache) without a manual
    ``objfs unmount --force``. A live or hanging mount is left alone.

    ``/dev/fd/N`` (a FUSE fd mounted by another process) is served only in the foreground:
    a usage error here, where ``objfs mount`` would start a daemon.
    """
    if passed_fuse_fd(path) is not None:
        raise UsageError(
            f"MOUNTPOINT {path} is a FUSE fd mounted by another process: serve it with "
            "--foreground (objfs cannot pass the fd on to a daemon)"
        )
    entry = mount_entry(path)
    if entry is not None and entry[0] == "fuse.objfs" and clear_dead_mount(path):
        entry = mount_entry(path)
    if entry is not None:
        hint = "run `objfs unmount MOUNTPOINT` first"
        if entry[0].startswith("fuse"):
            hint = f"run `objfs unmount --force {path}` first"
        raise AlreadyMountedError(f"mountpoint {path} is already mounted ({entry[0]}): {hint}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MountpointMissingError(
            f"mountpoint {path} does not exist: create it with `mkdir -p {path}`"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise AlreadyMountedError(
                f"mountpoint {path} holds a dead FUSE mount: run `objfs unmount --force {path}`"
            ) from None
        raise MountpointMissingError(f"cannot access mountpoint {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountpointNotDirectoryError(
            f"mountpoint {path} is not a directory: give an empty directory"
        )
    try:
        with os.scandir(path) as it:
            non_empty = any(True for _ in it)
    except PermissionError:
        raise MountpointMissingError(
            f"cannot read mountpoint {path}: permission denied; use a directory you own"
        ) from None
    if non_empty:
        raise MountpointNotEmptyError(
            f"mountpoint {path} is not empty: mount on an empty directory so no files are hidden"
        )


def check_fuse() -> None:
    """Raise FuseUnavailableError unless this process can create a FUSE mount."""
    if not os.path.exists("/dev/fuse"):
        raise FuseUnavailableError(
            "/dev/fuse is missing: install fuse3 and load the module (`modprobe fuse`); in a "
            "container, pass the device (--device /dev/fuse) and CAP_SYS_ADMIN"
        )
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        raise FuseUnavailableError(
            f"cannot open /dev/fuse ({exc.strerror}): run as root, or give this user access to "
            "/dev/fuse (and, in a container, the device and CAP_SYS_ADMIN)"
        ) from None
    os.close(fd)
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise FuseUnavailableError(
            "fusermount3 is not installed: install the fuse3 package (apt-get install fuse3)"
        )


def unmount(path: str, *, force: bool = False) -> None:
    """Unmount an objfs (or any FUSE) mount; ``force`` detaches it lazily even if busy."""
    entry = mount_entry(path)
    if entry is None:
        raise NotMountedError(f"{path} is not mounted")
    if os.geteuid() == 0:
        cmd = ["umount", *(["-l"] if force else []), path]
    else:
        cmd = ["fusermount3", "-u", *(["-z"] if force else []), path]
    if shutil.which(cmd[0]) is None:
        raise UnmountFailedError(f"{cmd[0]} is not installed: install the fuse3 package")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        if "busy" in reason.lower():
            raise UnmountFailedError(
                f"{path} is busy (a process has a file open or its cwd inside): close it, or "
                "use `objfs unmount --force` to detach lazily"
            )
        raise UnmountFailedError(f"unmounting {path} failed: {reason}")


# How long a statfs may take before a mount counts as hanging (not dead) in clear_dead_mount.
STALE_CHECK_S = 5.0


def probe_errno(path: str, timeout_s: float) -> int | None:
    """statfs ``path`` in a thread: 0 if answered, the errno if it failed, None if it hangs.

    statfs always reaches the FUSE daemon (the kernel may answer a stat from its attribute
    cache even after the daemon died).
    """
    result: list[int] = []

    def probe() -> None:
        try:
            os.statvfs(path)
            result.append(0)
        except OSError as exc:
            result.append(exc.errno or errno.EIO)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else None


def clear_dead_mount(mountpoint: str) -> bool:
    """Detach a FUSE mount whose daemon is gone (ENOTCONN); True if one was removed.

    A live mount (answered) or one that hangs is left alone: ``objfs mount`` then fails with
    "already mounted" (exit 12) instead of this process taking over someone else's mount.
    """
    entry = mount_entry(mountpoint)
    if entry is None or not entry[0].startswith("fuse"):
        return False
    if probe_errno(mountpoint, STALE_CHECK_S) != errno.ENOTCONN:
        return False
    if mount_entry(mountpoint) != entry:  # another process dealt with it meanwhile
        return False
    log.warning("detaching a dead %s mount left on %s by a previous run", entry[0], mountpoint)
    try:
        unmount(mountpoint, force=True)
    except NotMountedError:
        return False  # gone already
    return True
