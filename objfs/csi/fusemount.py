"""The privileged half of a split FUSE mount: open ``/dev/fuse``, mount(2) with ``fd=N``, detach.

The node plugin mounts; another process (the unprivileged sidecar) serves the fd. Until it
does, every request on the mount waits in the kernel, and so would any stat, ``ismount`` or
path resolution *into* the mount made here. Hence the invariants:

* nothing here resolves, stats or opens a path inside a mount it made: "is it mounted" and the
  mount's device number come from ``/proc/self/mountinfo``, and targets are made real from
  their parent (``realpath`` of the parent, never of the target);
* a mount is removed with ``umount2(MNT_DETACH)``, which never waits for the FUSE server;
* every fd opened here is close-on-exec and owned by one caller, who closes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass

from objfs.mountinfo import _mountinfo_record, _unescape_mountinfo

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOATIME = 1024
MNT_DETACH = 2
FSTYPE = "fuse.objfs"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def real_target(path: str) -> str:
    """``path`` made absolute with its parent resolved: the target itself is never stat-ed."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


@dataclass(frozen=True)
class MountInfo:
    fstype: str
    source: str
    major: int
    minor: int


def mounted(target: str) -> MountInfo | None:
    """The topmost mount at ``target`` (a real path, see :func:`real_target`), from mountinfo."""
    record = _mountinfo_record(target)
    if record is None:
        return None
    fields, rest = record
    major, minor = fields[2].split(":")
    return MountInfo(
        fstype=rest[0] if rest else "",
        source=_unescape_mountinfo(rest[1]) if len(rest) > 1 else "",
        major=int(major),
        minor=int(minor),
    )


def mounts_below(directory: str, fstype: str = FSTYPE) -> list[str]:
    """Mount points of type ``fstype`` under ``directory`` (a real path), from mountinfo."""
    found = []
    prefix = directory.rstrip("/") + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or not rest or rest[0] != fstype:
                continue
            target = _unescape_mountinfo(fields[4])
            if target.startswith(prefix) and target not in found:
                found.append(target)
    return found


def stacked(target: str, fstype: str = FSTYPE) -> int:
    """How many mounts of type ``fstype`` sit at ``target`` (a real path), from mountinfo."""
    count = 0
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and rest and rest[0] == fstype:
                count += _unescape_mountinfo(fields[4]) == target
    return count


def open_fuse_device() -> int:
    """A fresh ``/dev/fuse`` fd (close-on-exec): one FUSE connection once mounted."""
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


def mount_fd(fd: int, target: str, fsname: str) -> None:
    """Mounts the FUSE connection ``fd`` on ``target``: read-only, nosuid, nodev, noatime.

    ``allow_other`` because the pod's containers run as other users than the mount's owner
    (root); ``default_permissions`` so the kernel checks the mode bits objfs reports. The
    options match what ``objfs mount`` asks libfuse for (see ``objfs.kernel_setup.fuse_options``).
    Returns at once: the kernel queues its INIT request until a server reads ``fd``.
    """
    # fsname shows in mountinfo and df; commas would split the option string (as objfs does).
    source = fsname.replace(",", "%2C").replace(" ", "%20")
    data = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOATIME
    if (
        _libc.mount(os.fsencode(source), os.fsencode(target), FSTYPE.encode(), flags, data.encode())
        != 0
    ):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def detach(target: str) -> bool:
    """Lazily unmounts the topmost mount at ``target``; False when nothing was mounted there."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
            return False
        raise OSError(code, os.strerror(code), target)
    return True


#: A bound on the mounts :func:`detach_all` takes from one target in one call (it stops
#: earlier when mountinfo shows no objfs mount on top): the node plugin stacks at most
#: ``1 + objfs.csi.publication.MAX_REPLACEMENTS``, far below; more can only come from outside (or
#: an older objfs), and the caller reports what remains rather than looping without end.
MAX_STACKED = 4096


def detach_all(target: str) -> int:
    """Detaches the objfs mounts stacked at ``target``, topmost first, while the topmost one
    is objfs (mountinfo says); returns how many. Never waits for a FUSE server."""
    count = 0
    while (info := mounted(target)) is not None and info.fstype == FSTYPE and count < MAX_STACKED:
        if not detach(target):
            break
        count += 1
    return count


def close_quietly(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
