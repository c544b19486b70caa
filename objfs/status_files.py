"""The status files: where a daemon's status file lives, its writing, finding and clean-up.

A daemon rewrites a small JSON status file every :data:`STATUS_INTERVAL_S` (see
:class:`objfs.metrics.Telemetry`); ``objfs status`` reads it. The file lives under the runtime
folder and is named after the mountpoint (:func:`status_file_name`), so ``objfs status``
answers without touching the mount: it works while the mount hangs, and the serving process
never stats its own mountpoint (that would deadlock it). Each write replaces the file whole.

A daemon that is killed (SIGKILL, the OOM killer, a node that loses power with a persistent
runtime folder) cannot remove its status file. When a daemon first writes its own, it
removes those of daemons that are gone: a status file (or a temporary one) not rewritten for
:data:`STALE_STATUS_S` whose pid no longer runs. Both conditions, because a pid can be
reused, and a daemon in another pid namespace that shares the folder looks gone by its pid
but rewrites its file every second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time

log = logging.getLogger("objfs.metrics")

#: How often the daemon rewrites its status file.
STATUS_INTERVAL_S = 1.0


# -- where the status files live -------------------------------------------------------------


def _runtime_dirs() -> list[str]:
    """Candidate folders for status files, the daemon's choice first.

    ``$OBJFS_RUNTIME_DIR`` alone when set; else ``/run/objfs`` for root, ``$XDG_RUNTIME_DIR/
    objfs`` and ``/tmp/objfs-UID`` (mode 0700) for other users.
    """
    explicit = os.environ.get("OBJFS_RUNTIME_DIR")
    if explicit:
        return [explicit]
    dirs = ["/run/objfs"] if os.geteuid() == 0 else []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        dirs.append(os.path.join(xdg, "objfs"))
    dirs.append(os.path.join(tempfile.gettempdir(), f"objfs-{os.geteuid()}"))
    return dirs


#: A status file this old (not rewritten), of a pid that no longer runs, is removed.
STALE_STATUS_S = 60.0


def pid_gone(pid: int) -> bool:
    """True when no process ``pid`` runs (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # another user's process, or not a pid at all (kept: not ours to judge)
    return False


def remove_stale_status_files(folder: str, *, now: float | None = None) -> int:
    """Remove the status files in ``folder`` left by daemons that are gone (see the module's
    docstring); returns how many. Files that are not status files are never touched."""
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        temporary = name.startswith(".status-")
        if not (temporary or _STATUS_NAME.fullmatch(name)):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if now - st.st_mtime < STALE_STATUS_S:
                continue
            if not temporary:
                with open(path, "rb") as f:
                    text = f.read(1 << 20)
                try:
                    data = json.loads(text)
                except ValueError:
                    data = None  # not written by a daemon (each write is whole): nobody's
                pid = data.get("pid") if isinstance(data, dict) else None
                if isinstance(pid, int) and pid > 0 and not pid_gone(pid):
                    continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


_STATUS_NAME = re.compile(r"[0-9a-f]{32}\.json")


def status_file_name(mountpoint: str) -> str:
    return hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:32] + ".json"


def find_status_files(mountpoint: str) -> list[str]:
    """Status files that may describe ``mountpoint`` (a root daemon's too, for any user)."""
    name = status_file_name(mountpoint)
    dirs = _runtime_dirs()
    if "/run/objfs" not in dirs and not os.environ.get("OBJFS_RUNTIME_DIR"):
        dirs.append("/run/objfs")
    return [p for p in (os.path.join(d, name) for d in dirs) if os.path.isfile(p)]


def _usable_dir(path: str) -> bool:
    """Create ``path`` if needed; True if it is a real directory owned by this user."""
    shared = os.geteuid() == 0 and path == "/run/objfs"
    try:
        os.makedirs(path, mode=0o755 if shared else 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    # Never write into a folder someone else controls (a /tmp name taken by another user).
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


class StatusFile:
    """The status file of the daemon serving ``mountpoint``; :meth:`write` and :meth:`remove`
    are the only changes made to it.

    The first write picks the first usable runtime folder and removes the files of daemons
    that are gone there; a failure (no usable folder, a write refused) is logged once as a
    warning, after which :attr:`failed` is set and nothing is written any more.
    """

    def __init__(self, mountpoint: str) -> None:
        self._mountpoint = mountpoint
        self._path: str | None = None
        self.failed = False

    def write(self, data: bytes) -> None:
        """Replace the file with ``data`` (a whole JSON document)."""
        if self.failed:
            return
        if self._path is None:
            for folder in _runtime_dirs():
                if _usable_dir(folder):
                    self._path = os.path.join(folder, status_file_name(self._mountpoint))
                    removed = remove_stale_status_files(folder)
                    if removed:
                        log.info("removed %d status files of daemons that are gone", removed)
                    break
            else:
                self.failed = True
                log.warning(
                    "cannot create a folder for the status file (%s): `objfs status` will not "
                    "see this mount; set OBJFS_RUNTIME_DIR to a writable folder",
                    ", ".join(_runtime_dirs()),
                )
                return
        folder = os.path.dirname(self._path)
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".status-")
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self._path)
        except OSError as exc:
            self.failed = True
            log.warning("cannot write the status file in %s (%s)", folder, exc.strerror)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)

    def remove(self) -> None:
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
