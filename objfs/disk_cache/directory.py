"""The cache directory: private, of the current format only, and its version files created
and removed whole.

Contract:

* ``prepare`` creates ``--cache-dir`` with mode 0700 (whatever the umask) or checks an existing
  one, and returns the format's subdirectory (``DIR/v4``) under the directory it checked.
  Cached blocks are bucket data, as private as the bucket: a directory another user owns, or
  that group or others may write to, is a UsageError; one only readable by others is tightened
  to 0700. Older formats' subdirectories are removed. Files are created 0600. A directory
  handed over open (``/dev/fd/N``: the node cache folder ``objfs csi`` gives a sidecar, which
  has no path to it) is checked the same way through its descriptor and used through
  ``/proc/self/fd/N``, never resolved to a path.
* ``walk`` finds the versions' files (allocated bytes, latest mtime per digest), removing the
  temporary files of crashed writers; a name that is not a version's is neither counted nor
  removed.
* ``create_table`` makes a table appear under its name with its header whole (written under a
  temporary name, hard-linked into place, never over a table another writer just made), so a
  table under its own name always has its header.
* ``remove_files`` unlinks a version's table first: without it nothing is served, so a
  half-removed pair is harmless.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import threading
import time

from objfs.disk_cache.layout import DIGEST_LENGTH, FORMAT, OLD_FORMATS, Version
from objfs.errors import UsageError

log = logging.getLogger("objfs.disk_cache")  # one name for the tier

# Temporary files older than this were left by a crashed writer and are removed on scan.
_STALE_TMP_S = 600.0
ST_BLOCK = 512  # the unit of st_blocks (POSIX): allocated bytes of a sparse file
# A directory handed over open: the node cache folder of ``objfs sidecar`` (see prepare).
_FD_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/(\d+)/?")


def prepare(directory: str) -> str:
    """Create the cache directory (0700) or check an existing one; returns ``DIR/v4``.

    A directory that another user owns, or that group or others may write to, is refused with
    a UsageError: someone else could read the blocks, or plant blocks objfs would serve. A
    directory only readable by others is tightened to 0700. A symlink is followed: the
    directory it resolves to is the one checked (and named in the error), as it is the one
    used. ``/dev/fd/N`` (or ``/proc/self/fd/N``) is the directory open as descriptor N.
    """
    handed = _FD_PATH.fullmatch(directory)
    if handed is not None:
        directory = f"/proc/self/fd/{handed[1]}"  # the magic link: no path is resolved
        _check_private(directory, directory, resolve=False)
        root = os.path.join(directory, FORMAT)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
        _check_private(root, directory, resolve=False)
        return root
    if not os.path.lexists(directory):
        # Not makedirs(root) alone: it would create ``directory`` with the umask's mode.
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # whatever the umask
    _check_private(directory, directory)
    # From here on the directory that was checked, not a path whose links could change.
    directory = os.path.realpath(directory)
    root = os.path.join(directory, FORMAT)
    os.makedirs(root, mode=0o700, exist_ok=True)
    _check_private(root, directory)
    for name in OLD_FORMATS:
        old = os.path.join(directory, name)
        if os.path.isdir(old) and not os.path.islink(old):
            log.info("disk cache: removing %s (an older cache format)", old)
            shutil.rmtree(old, ignore_errors=True)
    return root


def _check_private(path: str, option_value: str, *, resolve: bool = True) -> None:
    real = os.path.realpath(path) if resolve else path
    shown = f"--cache-dir {path}" if path == option_value else f"--cache-dir {option_value}: {path}"
    if real != path:
        shown += f" (which resolves to {real})"
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{shown} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UsageError(
            f"{shown} is owned by uid {st.st_uid}, not by objfs's user (uid {uid}): give a "
            f"directory of your own, or `chown {uid} {real}`"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UsageError(
            f"{shown} is writable by group or others (mode {mode:04o}); cached blocks are "
            f"bucket data: `chmod 700 {real}` or give a private directory"
        )
    if mode & 0o077:
        os.chmod(real, 0o700)  # readable by others: no access for others


def walk(root: str) -> dict[str, list[float]]:
    """The versions under ``root``: digest -> [allocated bytes, latest mtime] of its files."""
    found: dict[str, list[float]] = {}  # digest -> [allocated bytes, latest mtime]
    now = time.time()
    for sub in os.scandir(root):
        if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
            continue
        for dirent in os.scandir(sub.path):
            name = dirent.name
            try:
                st = dirent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name.startswith(".tmp-"):
                if now - st.st_mtime > _STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(dirent.path)
                continue
            digest = name.removesuffix(".idx")
            if len(digest) != DIGEST_LENGTH or not stat.S_ISREG(st.st_mode):
                continue  # not ours: neither counted nor removed
            seen = found.setdefault(digest, [0, 0.0])
            seen[0] += st.st_blocks * ST_BLOCK
            seen[1] = max(seen[1], st.st_mtime)
    return found


def create_table(v: Version) -> int:
    """Create the table file with its header, atomically; returns it open."""
    directory = os.path.dirname(v.index_path)
    tmp = os.path.join(directory, f".tmp-{v.digest}-{os.getpid()}-{threading.get_ident()}")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:  # the first version in this subdirectory (or it was removed)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    try:
        if os.pwrite(fd, v.header, 0) != len(v.header):  # short: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        try:
            os.link(tmp, v.index_path)  # never over a table another writer just made
        except FileExistsError:
            os.close(fd)
            fd = os.open(v.index_path, os.O_RDWR | os.O_CLOEXEC)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return fd


def remove_files(root: str, digest: str) -> None:
    """Delete a version's files, the table first (without it nothing is served)."""
    data_path = os.path.join(root, digest[:2], digest)
    for path in (data_path + ".idx", data_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
