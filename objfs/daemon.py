"""Daemon mode: ``objfs mount`` starts the serving process detached and waits on a pipe.

The child (``objfs mount ... --foreground --daemon-ready-fd N``) writes lines to fd N, each
in one write: any number of ``WARNING MESSAGE`` (the warnings it logs until it serves), then
``READY`` or ``ERROR CODE MESSAGE``. :class:`ReadyPipe` is the child's end and the only writer
of those lines; :func:`spawn_daemon` is the parent's end: it returns once the child serves
(after checking from outside that the mount answers, and printing the warnings) or prints the
child's error and returns its exit code. :func:`sd_notify` tells systemd the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from objfs.errors import MountFailedError
from objfs.mountinfo import mount_entry

# How long `objfs mount` (daemon mode) waits for the child to report; the child's own store
# check gives up well before this (connect timeout x attempts).
_READY_TIMEOUT_S = 120.0


#: The lines of the readiness pipe (see the module's docstring).
READY = "READY"
ERROR_PREFIX = "ERROR "
WARNING_PREFIX = "WARNING "


class ReadyPipe:
    """The child's end of the readiness pipe; with ``fd`` None (the foreground) it writes
    nothing. Until :meth:`stop_warnings` (or READY, or an error), each warning logged goes
    down the pipe too."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        # A daemon's warnings until it serves go to `objfs mount` too, which prints them.
        self._startup = _StartupWarnings(self._report)
        if fd is not None:
            logging.getLogger().addHandler(self._startup)

    @property
    def daemon(self) -> bool:
        """True when a parent waits on the pipe (this process is a daemon)."""
        return self._fd is not None

    def _report(self, message: str) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, (message + "\n").encode("utf-8", "replace"))

    def stop_warnings(self) -> None:
        """Warnings logged from now on stay in the log."""
        self._startup.detach()

    def ready(self) -> None:
        """The mount serves: READY to the parent and to systemd."""
        self.stop_warnings()
        self._report(READY)
        sd_notify("READY=1")

    def error(self, exit_code: int, message: str) -> None:
        """Starting failed: the parent prints ``message`` and exits with ``exit_code``."""
        self.stop_warnings()
        self._report(f"{ERROR_PREFIX}{exit_code} {message}")

    def close(self) -> None:
        self.stop_warnings()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)


class _StartupWarnings(logging.Handler):
    """Until a daemon reports ready: each warning logged (an empty SOURCE, a disk cache
    turned off, kernel tuning refused) is also sent to ``objfs mount`` as a ``WARNING
    MESSAGE`` line on the readiness pipe (one write of one line, so lines from several
    threads never mix); the command prints it on its terminal."""

    def __init__(self, report: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self._report = report

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = " ".join(record.getMessage().split())
        except Exception:
            self.handleError(record)
            return
        # At most 1000 characters: a line of at most PIPE_BUF (4096) bytes is written whole.
        self._report(f"{WARNING_PREFIX}{message[:1000]}")

    def detach(self) -> None:
        logging.getLogger().removeHandler(self)


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    import socket

    if address.startswith("@"):
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(message.encode())


def spawn_daemon(argv: Sequence[str], mountpoint: str, log_file: str | None) -> int:
    """Start ``objfs mount ... --foreground`` detached; return once it serves or failed.

    Once it serves, the warnings the daemon logged until then are printed on stderr (its
    own stderr goes nowhere); if it failed, its error alone, in one line (the warnings are in
    its log), and its exit code is returned."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "objfs", *argv, "--foreground", "--daemon-ready-fd", str(write_fd)]
    try:
        proc = subprocess.Popen(
            cmd,
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        os.close(write_fd)
    mountpoint = os.path.abspath(mountpoint)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    buf = b""
    line = ""
    warnings: list[str] = []
    try:
        while True:
            # WARNING lines (see _StartupWarnings) until READY or ERROR.
            head, newline, rest = buf.partition(b"\n")
            if newline:
                buf = rest
                line = head.decode("utf-8", "replace").strip()
                if line.startswith(WARNING_PREFIX):
                    warnings.append(line.removeprefix(WARNING_PREFIX))
                    continue
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.terminate()
                raise MountFailedError(
                    f"objfs did not report ready within {_READY_TIMEOUT_S:.0f} s; see the log "
                    + (f"in {log_file}" if log_file else "(syslog, or pass --log-file)")
                )
            ready, _, _ = select.select([read_fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(read_fd, 4096)
            if not chunk:
                line = buf.decode("utf-8", "replace").strip()
                break
            buf += chunk
    finally:
        os.close(read_fd)
    if line == READY:
        # Confirm from this (non-serving) process that the kernel sees the mount and the
        # daemon answers it.
        if mount_entry(mountpoint) is None:
            raise MountFailedError(f"objfs reported ready but {mountpoint} is not mounted")
        os.stat(mountpoint)
        for warning in warnings:
            print(f"objfs: warning: {warning}", file=sys.stderr)
        return 0
    if line.startswith(ERROR_PREFIX):
        _, code, message = line.split(" ", 2)
        # As the command itself prints them (objfs.cli.main).
        kind = "" if message.startswith("internal error: ") else "error: "
        print(f"objfs: {kind}{message}", file=sys.stderr)
        return int(code)
    status = proc.wait(timeout=30)
    raise MountFailedError(
        f"the objfs daemon exited (status {status}) before serving; see the log "
        + (f"in {log_file}" if log_file else "(syslog, or run with --foreground)")
    )
