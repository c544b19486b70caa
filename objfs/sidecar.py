"""``objfs sidecar``: a container entrypoint configured by environment variables.

It runs ``objfs mount ... --foreground`` as its child and supervises it:

* before mounting, a dead objfs mount left on the mountpoint by a previous run (the container
  was restarted after a crash: ``Transport endpoint is not connected``) is detached, so a
  restart can mount again;
* once the mount serves (the kernel lists it and a statfs from this process, not the serving
  one, is answered), it writes ``$OBJFS_READY_FILE`` if set; ``objfs status --probe
  MOUNTPOINT`` answers from then on too (the Kubernetes startup and liveness probes);
* SIGTERM or SIGINT is passed to the child, which unmounts; the entrypoint then exits 0;
* if the child dies, or the mount is unmounted under it, while serving, the dead mount is
  detached and the entrypoint exits 19, so the kubelet restarts the container. A child that
  fails before serving passes on its own exit code (e.g. 5 for a missing bucket).

Environment: ``OBJFS_SOURCE`` and ``OBJFS_MOUNTPOINT`` (required), ``OBJFS_OPTIONS`` (more
``objfs mount`` options, split like a shell would), ``OBJFS_READY_FILE``, and one variable per
option of ``objfs mount`` (:data:`VALUE_OPTIONS`; a flag's, :data:`FLAG_OPTIONS`, is ``true`` or
``false``); ``OBJFS_OPTIONS`` wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import FrameType

from objfs.errors import MountLostError, UsageError
from objfs.logsetup import setup_logging
from objfs.mountinfo import mount_entry
from objfs.mountpoint import clear_dead_mount, probe_errno, unmount
from objfs.options import flag_arguments, is_flag, mount_options, parse_boolean

log = logging.getLogger("objfs.sidecar")


def _variable(name: str) -> str:
    return "OBJFS_" + name.upper().replace("-", "_")


#: Options whose variable objfs already reads elsewhere: ``$OBJFS_FUSE_TRANSPORT`` is the switch
#: for every mount of a node or an image (:func:`objfs.options.fuse_transport`), one meaning.
READ_ELSEWHERE = frozenset({"fuse-transport"})
#: Environment variables that carry the value of an ``objfs mount`` option: one per option of
#: :func:`objfs.options.mount_options` (``--cache-dir``: ``OBJFS_CACHE_DIR``).
VALUE_OPTIONS = {
    _variable(name): f"--{name}"
    for name in mount_options()
    if not is_flag(name) and name not in READ_ELSEWHERE
}
#: Environment variables that set an ``objfs mount`` flag: ``true`` or ``false``.
FLAG_OPTIONS = {_variable(name): name for name in mount_options() if is_flag(name)}

# How long the mount may take to serve (the child's own store check gives up well before).
_READY_TIMEOUT_S = 180.0


def sidecar_command(env: Mapping[str, str]) -> tuple[str, str, list[str]]:
    """(source, mountpoint, options) from the environment; raises UsageError."""
    source = env.get("OBJFS_SOURCE", "").strip()
    mountpoint = env.get("OBJFS_MOUNTPOINT", "").strip()
    missing = [n for n, v in (("OBJFS_SOURCE", source), ("OBJFS_MOUNTPOINT", mountpoint)) if not v]
    if missing:
        raise UsageError(
            " and ".join(missing) + " not set: `objfs sidecar` takes SOURCE and MOUNTPOINT from "
            "OBJFS_SOURCE and OBJFS_MOUNTPOINT"
        )
    options: list[str] = []
    for name, flag in VALUE_OPTIONS.items():
        value = env.get(name, "").strip()
        if value:
            options += [flag, value]
    for name, flag in FLAG_OPTIONS.items():
        value = env.get(name, "").strip()
        if value:  # empty: unset, as for a value
            options += flag_arguments(
                flag, parse_boolean(value, f"{name}={value!r} is not a boolean")
            )
    try:
        options += shlex.split(env.get("OBJFS_OPTIONS", ""))
    except ValueError as exc:
        raise UsageError(f"OBJFS_OPTIONS cannot be split into options: {exc}") from None
    if "-f" in options or "--foreground" in options:
        options = [o for o in options if o not in ("-f", "--foreground")]
    return source, os.path.abspath(mountpoint), options


def _write_ready_file(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class _Supervisor:
    def __init__(self, source: str, mountpoint: str, options: list[str]) -> None:
        self.source = source
        self.mountpoint = mountpoint
        self.cmd = [
            sys.executable,
            "-m",
            "objfs",
            "mount",
            source,
            mountpoint,
            *options,
            "--foreground",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_requested = False

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.stop_requested:
            log.info("received %s: unmounting %s", signal.Signals(signum).name, self.mountpoint)
        self.stop_requested = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_ready(self) -> bool:
        """True once the mount serves; False if the child exited or stop was requested."""
        assert self.proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self.stop_requested:
            if self.proc.poll() is not None:
                return False
            entry = mount_entry(self.mountpoint)
            # The statfs comes from this process, not the serving one: it is answered once the
            # child's FUSE loop runs (or fails at once if the child died).
            if entry is not None and entry[0] == "fuse.objfs":
                return probe_errno(self.mountpoint, _READY_TIMEOUT_S) == 0
            if time.monotonic() > deadline:
                log.error("the mount did not serve within %.0f s", _READY_TIMEOUT_S)
                return False
            time.sleep(0.1)
        return False

    def run(self, ready_file: str | None) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_signal)
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL)
        if self.stop_requested:  # a signal before the child existed
            self.proc.send_signal(signal.SIGTERM)
        ready = False
        try:
            ready = self.wait_ready()
            if ready:
                if ready_file:
                    _write_ready_file(
                        ready_file, f"{self.source} {self.mountpoint} pid {self.proc.pid}\n"
                    )
                log.info("serving %s on %s (pid %d)", self.source, self.mountpoint, self.proc.pid)
            code = self.proc.wait()
        finally:
            if ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ready_file)
            if self.proc.poll() is None:  # only on an unexpected error here
                self.proc.kill()
                self.proc.wait()
        if self.stop_requested:
            self._detach_leftover()
            if code in (0, -signal.SIGTERM):
                return 0
            return code if code > 0 else 128 - code
        if not ready:
            return code if code > 0 else 14
        self._detach_leftover()
        how = f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        raise MountLostError(
            f"the mount of {self.source} on {self.mountpoint} stopped while serving (objfs "
            f"{how}); exiting so that it is restarted"
        )

    def _detach_leftover(self) -> None:
        # The child unmounts on its way out; a child that was killed leaves a dead mount.
        if mount_entry(self.mountpoint) is not None:
            with contextlib.suppress(Exception):
                unmount(self.mountpoint, force=True)


def run_sidecar(env: Mapping[str, str] | None = None) -> int:
    """The ``objfs sidecar`` command; raises ObjfsError for the CLI to report."""
    env = os.environ if env is None else env
    source, mountpoint, options = sidecar_command(env)
    level = (env.get("OBJFS_LOG_LEVEL") or "info").lower()
    log_format = (env.get("OBJFS_LOG_FORMAT") or "text").lower()
    if level not in ("debug", "info", "warning", "error") or log_format not in ("text", "json"):
        raise UsageError(
            "OBJFS_LOG_LEVEL must be debug, info, warning or error; OBJFS_LOG_FORMAT text or json"
        )
    setup_logging(level, None, daemon=False, log_format=log_format)
    clear_dead_mount(mountpoint)
    try:
        os.makedirs(mountpoint, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create OBJFS_MOUNTPOINT {mountpoint}: {exc.strerror}") from None
    ready_file = env.get("OBJFS_READY_FILE") or None
    if ready_file:
        ready_file = os.path.abspath(ready_file)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)  # left by a previous run: not ready yet
    return _Supervisor(source, mountpoint, options).run(ready_file)
