"""Mount lifecycle: checks, the FUSE session, signals, readiness, daemon mode, unmount.

``serve`` runs in the foreground: it checks the mountpoint and FUSE, verifies the bucket,
mounts, serves until SIGINT/SIGTERM or an external unmount, and always unmounts on the way
out. ``spawn_daemon`` runs ``serve`` in a detached child and returns only once the child
reports that the mount serves (or fails with the child's error and exit code), so a script
can use the mountpoint as soon as ``objfs mount`` returns; once it serves, the warnings the
child logged until then (an empty SOURCE, a disk cache turned off, kernel tuning refused) are
printed on the stderr of ``objfs mount``. An internal error of a daemon goes to its log with
the traceback, and to ``objfs mount`` as one line.

Never stat the mountpoint from the process that serves it: the kernel would wait for an
answer only this process can give. The daemon's parent does the final check instead.

MOUNTPOINT ``/dev/fd/N`` serves a FUSE file system that another, privileged process already
mounted (``objfs csi`` opens ``/dev/fuse``, mounts with ``fd=N`` and passes the fd on; see
:mod:`objfs.sidecar_fd`). libfuse (3.3 and later) then uses fd N instead of mounting, and its
unmount does nothing. objfs skips what needs the mount or privileges: the mountpoint and
``/dev/fuse`` checks, the kernel tuning (the mounting process does it) and the unmount on the
way out (it just stops serving and closes the fd; the kernel then fails requests on the mount
with ENOTCONN until its owner unmounts it). Only ``--foreground`` is supported for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import logging.handlers
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pyfuse3
import trio

from objfs.backends.base import Backend
from objfs.config import MountConfig
from objfs.disk_cache import DiskCache
from objfs.errors import (
    INTERNAL_ERROR_RECORD,
    AlreadyMountedError,
    FuseUnavailableError,
    InternalError,
    MountFailedError,
    MountpointMissingError,
    MountpointNotDirectoryError,
    MountpointNotEmptyError,
    NotMountedError,
    ObjfsError,
    UnmountFailedError,
    UsageError,
    internal_error_message,
    log_internal_error,
)
from objfs.fs import FileSystem
from objfs.fuse_ops import ObjfsOperations

if TYPE_CHECKING:
    from objfs.kernel.session import KernelSession
from objfs.jsonlog import JsonFormatter
from objfs.metrics import InstrumentedBackend, Telemetry
from objfs.mountinfo import _mountinfo_record, mount_entry
from objfs.nursery import open_nursery

log = logging.getLogger("objfs")

# How long `objfs mount` (daemon mode) waits for the child to report; the child's own store
# check gives up well before this (connect timeout x attempts).
_READY_TIMEOUT_S = 120.0
# On unmount, how long to wait for blocks still queued for the disk cache.
_DISK_FLUSH_TIMEOUT_S = 30.0
# The kernel sends INIT as it mounts; this bound only keeps READY from waiting forever.
_INIT_WAIT_S = 30.0
# Serving a passed fd (/dev/fd/N), the file this names is created just before pyfuse3.init
# takes the fd: the sidecar (objfs.sidecar_fd) then knows the fd may have been read.
FD_USED_ENV = "OBJFS_SIDECAR_FD_USED_FILE"
# pyfuse3 worker tasks: enough that slow GETs do not starve cheap metadata requests.
_MAX_FUSE_TASKS = 64


# -- logging ---------------------------------------------------------------------------------


def setup_logging(
    level: str, log_file: str | None, *, daemon: bool, log_format: str = "text"
) -> None:
    """Log to stderr in the foreground, to --log-file if given, else to syslog as a daemon.

    An internal error's traceback (:func:`objfs.errors.log_internal_error`) goes to the file
    and syslog at every level, to stderr only at debug level."""
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_format == "json":
        fmt = JsonFormatter()
    handlers: list[logging.Handler] = []
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    if not daemon:
        terminal = logging.StreamHandler(sys.stderr)
        if level.lower() != "debug":
            # An internal error's traceback: the command prints its one line here itself.
            terminal.addFilter(lambda record: not getattr(record, INTERNAL_ERROR_RECORD, False))
        handlers.append(terminal)
    elif not log_file and os.path.exists("/dev/log"):
        syslog = logging.handlers.SysLogHandler(address="/dev/log")
        syslog.setFormatter(logging.Formatter("objfs[%(process)d]: %(levelname)s %(message)s"))
        root.addHandler(syslog)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    # botocore logs request details (never secrets at INFO, but much noise); keep it quiet
    # unless the user asks for debug output of objfs itself.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("pyfuse3").setLevel(logging.INFO if level.lower() != "debug" else "DEBUG")


# -- local checks ----------------------------------------------------------------------------

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


def fuse_options(config: MountConfig) -> set[str]:
    # fsname shows in /proc/mounts and df; commas would split the option string.
    fsname = config.source.url().replace(",", "%2C").replace(" ", "%20")
    options = {"ro", f"fsname={fsname}", "subtype=objfs", "default_permissions", "noatime"}
    if config.allow_other:
        options.add("allow_other")
    return options


# -- serving ---------------------------------------------------------------------------------


async def _watch_signals(cancel_scope: trio.CancelScope, stop: Callable[[], None]) -> None:
    """SIGINT/SIGTERM: stop taking requests (the mount is removed on the way out); a second
    signal cancels whatever is still running."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        first = True
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            if first:
                stop()
                first = False
            else:
                cancel_scope.cancel()
                return


def open_disk_cache(config: MountConfig, backend: Backend) -> DiskCache | None:
    """The persistent tier, or None; a cache directory that cannot be used is a usage error."""
    if config.cache_dir is None:
        return None
    min_free = config.cache_min_free_bytes
    try:
        if min_free is None:
            os.makedirs(config.cache_dir, mode=0o700, exist_ok=True)
            st = os.statvfs(config.cache_dir)
            # 10% of the cache's file system, at most 5 GiB: never fill the disk.
            min_free = min(5 << 30, st.f_blocks * st.f_frsize // 10)
        return DiskCache(
            config.cache_dir,
            namespace=backend.description,
            block_size=config.block_size_bytes,
            size_limit_bytes=config.cache_size_bytes,
            min_free_bytes=min_free,
        )
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            # The disk's trouble, not the user's mistake: serve without the tier, as when the
            # disk fails later (see DiskCache._disable).
            log.warning(
                "disk cache turned off: %s: %s; objfs continues without it",
                config.cache_dir,
                exc.strerror,
            )
            return None
        raise UsageError(
            f"--cache-dir {config.cache_dir}: {exc.strerror}: give a writable directory "
            "on a local disk"
        ) from None


def _mount_devnum(mountpoint: str) -> tuple[int, int] | None:
    """(major, minor) of the mount at ``mountpoint``, read from mountinfo.

    ``mountpoint`` must already be a real path: resolving it (realpath) would stat the mount
    root, a request only this process can answer, and hang it.
    """
    record = _mountinfo_record(mountpoint)
    if record is None:
        return None
    major, minor = record[0][2].split(":")
    return int(major), int(minor)


def _write_sysfs(path: str, value: int) -> bool:
    try:
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except OSError as exc:
        log.warning("kernel tuning: cannot write %s (%s); keeping the default", path, exc.strerror)
        return False
    return True


def tune_kernel(config: MountConfig) -> None:
    """Raise the mount's read-ahead and the FUSE connection's queue, where permitted.

    pyfuse3 exposes neither; sysfs does. Runs after the mount exists and touches only sysfs,
    never the mountpoint itself (``config.mountpoint`` is a real path, resolved in
    :func:`serve` before mounting).
    """
    dev = _mount_devnum(config.mountpoint)
    if dev is None:
        return
    major, minor = dev
    if config.read_ahead_kb > 0 and _write_sysfs(
        f"/sys/class/bdi/{major}:{minor}/read_ahead_kb", config.read_ahead_kb
    ):
        log.info("kernel read-ahead for %s: %d KiB", config.mountpoint, config.read_ahead_kb)
    connections = "/sys/fs/fuse/connections"
    if os.geteuid() == 0 and os.path.isdir(connections) and not os.listdir(connections):
        # The fusectl file system holds the per-connection knobs; mount it if nobody has.
        subprocess.run(
            ["mount", "-t", "fusectl", "fusectl", connections], capture_output=True, check=False
        )
    conn = os.path.join(connections, str((major << 20) | minor))
    if not os.path.isdir(conn):
        log.info("kernel tuning: %s is not available; keeping the FUSE queue default", conn)
        return
    background = config.max_background
    # Order matters: the kernel rejects a threshold above the current max_background.
    if _write_sysfs(os.path.join(conn, "max_background"), background) and _write_sysfs(
        os.path.join(conn, "congestion_threshold"), background * 3 // 4
    ):
        log.info("FUSE queue for %s: max_background %d", config.mountpoint, background)


async def serve_async(
    config: MountConfig, backend: Backend, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Check the bucket, mount, serve until a signal or an unmount, then unmount."""
    backend = InstrumentedBackend(backend)  # counts requests for metrics and `objfs status`
    has_keys = await backend.check(config.source.prefix)
    disk = open_disk_cache(config, backend)
    try:
        fs = FileSystem(backend, config, disk)  # maps the memory budget's arena
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise UsageError(
            f"--memory-limit: the system refused {config.memory_limit_bytes >> 20}M of memory "
            f"({exc.strerror}): give less (see free -h, ulimit -v and the cgroup's limit)"
        ) from None
    if not has_keys:
        # Mounting an empty prefix is legal (objects may come later), but it is mostly a typo.
        fs.empty_source = True
        if config.source.account_root:
            log.warning(
                "%s: the credentials see no bucket or container: the mount is empty; check "
                "the account (or endpoint) and which account the credentials belong to",
                config.source.url(),
            )
        else:
            log.warning(
                "%s holds no objects: the mount is empty; check SOURCE for a mistyped bucket "
                "or prefix (a prefix is case-sensitive and has no leading slash)",
                config.source.url(),
            )
    passed_fd = passed_fuse_fd(config.mountpoint)
    kernel: KernelSession | None = None
    if config.fuse_transport == "kernel":
        from objfs.kernel.session import KernelSession

        kernel = KernelSession(fs, config, passed_fd)
    ops: ObjfsOperations | KernelSession = kernel or ObjfsOperations(fs)
    telemetry = Telemetry(config, backend, fs, ops)  # binds --metrics-addr before mounting
    mark = os.environ.pop(FD_USED_ENV, "") if passed_fd is not None else ""
    if mark:
        # From pyfuse3.init on, the kernel's INIT request may be read from the fd: the sidecar
        # must then never offer this fd to another child. Failing to mark means not starting.
        try:
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            telemetry.close()
            raise MountFailedError(
                f"cannot write {mark} ({exc.strerror}): the fd was not used"
            ) from exc
    try:
        # With /dev/fd/N libfuse takes fd N as the session's channel and mounts nothing; the
        # mount options then only configure the session (the mounting process chose the
        # kernel's).
        if isinstance(ops, ObjfsOperations):
            pyfuse3.init(ops, config.mountpoint, fuse_options(config))
        else:
            ops.mount()
    except MountFailedError:
        telemetry.close()
        raise
    except RuntimeError as exc:
        telemetry.close()
        hint = ""
        if passed_fd is not None:
            hint = ": is the fd a mounted /dev/fuse?"
        elif config.allow_other and os.geteuid() != 0:
            hint = ": --allow-other needs `user_allow_other` in /etc/fuse.conf"
        raise MountFailedError(f"mounting {config.mountpoint} failed ({exc}){hint}") from None
    if passed_fd is None:
        log.info("mounted %s on %s", backend.description, config.mountpoint)
    else:
        log.info("serving %s on fd %d (mounted by another process)", backend.description, passed_fd)

    # READY waits for the kernel tuning: a file keeps the read-ahead it was opened with, so a
    # loader that opens its shards the moment the mount command returns would otherwise read
    # them with the kernel's default 128 KiB for as long as they stay open.
    tuned = trio.Event()

    async def tune_after_init() -> None:
        with trio.move_on_after(_INIT_WAIT_S):
            await ops.initialized.wait()
        if not ops.initialized.is_set():
            log.warning(
                "the kernel sent no FUSE INIT within %.0f s; reporting ready before tuning",
                _INIT_WAIT_S,
            )
            tuned.set()
            await ops.initialized.wait()
        if passed_fd is None:  # the process that mounted the fd tunes its mount
            tune_kernel(config)
        tuned.set()

    try:
        async with open_nursery() as nursery:
            fs.start(nursery)
            nursery.start_soon(tune_after_init)
            nursery.start_soon(
                _watch_signals,
                nursery.cancel_scope,
                pyfuse3.terminate if kernel is None else kernel.stop,
            )
            # Writes the status file, reports READY once tuned, refreshes the file every second.
            nursery.start_soon(telemetry.run, on_ready, tuned)
            if kernel is not None:
                await kernel.serve()
            else:
                await pyfuse3.main(max_tasks=_MAX_FUSE_TASKS)
            if passed_fd is None:
                log.info("%s was unmounted", config.mountpoint)
            else:
                log.info("stopped serving fd %d", passed_fd)
            # Blocks fetched but not yet on disk are what the next mount would miss.
            with trio.move_on_after(_DISK_FLUSH_TIMEOUT_S):
                await fs.flush_disk_writes()
                # Versions whole on disk are recorded as checked: the next mount serves
                # them by FUSE passthrough without reading them first.
                sealed = await fs.seal_disk_versions()
                if sealed:
                    log.info("%d file versions whole in the disk cache recorded as checked", sealed)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            telemetry.close()
            # A passed fd is unmounted by the process that mounted it (this one may not be
            # allowed to); closing the session closes the fd, and the kernel then fails
            # requests on that mount with ENOTCONN.
            if kernel is not None:
                kernel.close(unmount=passed_fd is None)
            else:
                pyfuse3.close(unmount=passed_fd is None)
            await backend.aclose()
    log.info("objfs stopped: %s", fs.statistics())


def serve(config: MountConfig, backend_factory: Callable[[], Backend], ready_fd: int | None) -> int:
    """Foreground mount; returns 0 after a clean unmount, raises ObjfsError on failure.

    Readiness and the error (with its exit code) are also written to ``ready_fd``, for the
    parent of a daemon.
    """

    def report(message: str) -> None:
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (message + "\n").encode("utf-8", "replace"))

    # A daemon's warnings until it serves go to `objfs mount` too, which prints them.
    startup = _StartupWarnings(report)
    if ready_fd is not None:
        logging.getLogger().addHandler(startup)

    def ready() -> None:
        startup.detach()
        report("READY")
        _sd_notify("READY=1")

    try:
        passed_fd = passed_fuse_fd(config.mountpoint)
        if passed_fd is None:
            check_mountpoint(config.mountpoint)
            check_fuse()
            # A real path from here on: nothing may resolve it once it is mounted (see
            # tune_kernel).
            config = dataclasses.replace(config, mountpoint=os.path.realpath(config.mountpoint))
        else:
            # Mounted already by the process that passed the fd; /dev/fuse need not exist
            # here. Kept as /dev/fd/N: resolving it would name /dev/fuse.
            check_passed_fd(passed_fd)
        backend = backend_factory()
        trio.run(serve_async, config, backend, ready)
    except ObjfsError as exc:
        startup.detach()
        if ready_fd is not None:  # a daemon: stderr goes nowhere, the log is all there is
            log.error("%s", exc)
        report(f"ERROR {exc.exit_code} {exc}")
        raise
    except Exception as exc:
        if ready_fd is None:
            raise  # the command logs the traceback and prints the error (objfs.cli.main)
        # A daemon: its stderr goes nowhere. The traceback goes to its log, the error's
        # line to `objfs mount`, which prints it.
        startup.detach()
        log_internal_error(log, exc)
        message = f"{internal_error_message(exc)} ({_traceback_whereabouts(config.log_file)})"
        report(f"ERROR {InternalError.exit_code} {message}")
        raise InternalError(message) from exc
    finally:
        startup.detach()
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.close(ready_fd)
    _sd_notify("STOPPING=1")
    return 0


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
        self._report(f"WARNING {message[:1000]}")

    def detach(self) -> None:
        logging.getLogger().removeHandler(self)


def _traceback_whereabouts(log_file: str | None) -> str:
    """Where a daemon's log keeps a traceback, for the error line of ``objfs mount``."""
    if log_file:
        return f"the traceback is in {log_file}; please report it"
    if any(isinstance(h, logging.handlers.SysLogHandler) for h in logging.getLogger().handlers):
        return "the traceback is in syslog; please report it"
    return "no syslog here keeps the traceback: mount with --log-file PATH to see it"


def _sd_notify(message: str) -> None:
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


# -- daemon mode -----------------------------------------------------------------------------


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
                if line.startswith("WARNING "):
                    warnings.append(line.removeprefix("WARNING "))
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
    if line == "READY":
        # Confirm from this (non-serving) process that the kernel sees the mount and the
        # daemon answers it.
        if mount_entry(mountpoint) is None:
            raise MountFailedError(f"objfs reported ready but {mountpoint} is not mounted")
        os.stat(mountpoint)
        for warning in warnings:
            print(f"objfs: warning: {warning}", file=sys.stderr)
        return 0
    if line.startswith("ERROR "):
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


# -- unmount ---------------------------------------------------------------------------------


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
