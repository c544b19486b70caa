"""Serving a mount: the FUSE session from the bucket check to the unmount on the way out.

``serve`` runs in the foreground: it checks the mountpoint and FUSE (:mod:`objfs.mountpoint`),
verifies the bucket, mounts, serves until SIGINT/SIGTERM or an external unmount, and always
unmounts on the way out. As a daemon's child (``--daemon-ready-fd``) it reports readiness, its
start-up warnings and its error (with its exit code) to ``objfs mount`` through
:class:`objfs.daemon.ReadyPipe`; an internal error goes to its log with the traceback, and to
``objfs mount`` as one line.

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

import dataclasses
import errno
import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyfuse3
import trio

from objfs.backends.base import Backend
from objfs.config import MountConfig
from objfs.daemon import ReadyPipe, sd_notify
from objfs.disk_cache import DiskCache
from objfs.errors import (
    InternalError,
    MountFailedError,
    ObjfsError,
    UsageError,
    internal_error_message,
    log_internal_error,
)
from objfs.fs import FileSystem
from objfs.fuse_ops import ObjfsOperations
from objfs.kernel_setup import fuse_options, tune_kernel
from objfs.logsetup import traceback_whereabouts
from objfs.metrics import Telemetry
from objfs.mountpoint import (
    FD_USED_ENV,
    check_fuse,
    check_mountpoint,
    check_passed_fd,
    passed_fuse_fd,
)
from objfs.nursery import open_nursery
from objfs.store_metrics import InstrumentedBackend

if TYPE_CHECKING:
    from objfs.kernel.session import KernelSession

log = logging.getLogger("objfs")

# On unmount, how long to wait for blocks still queued for the disk cache.
_DISK_FLUSH_TIMEOUT_S = 30.0
# The kernel sends INIT as it mounts; this bound only keeps READY from waiting forever.
_INIT_WAIT_S = 30.0
# pyfuse3 worker tasks: enough that slow GETs do not starve cheap metadata requests.
_MAX_FUSE_TASKS = 64


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
        if config.memory_ceiling_bytes is None:
            raise UsageError(
                f"--memory-limit: the system refused {config.memory_limit_bytes >> 20}M of memory "
                f"({exc.strerror}): give less (see free -h, ulimit -v and the cgroup's limit)"
            ) from None
        raise UsageError(
            f"the system refused {config.memory_ceiling_bytes >> 20}M of address space for the "
            f"default memory budget ({config.memory_limit_bytes >> 20}M, which grows up to that "
            f"while several processes read one file; {exc.strerror}): give --memory-limit, "
            "which never grows (see free -h, ulimit -v and the cgroup's limit)"
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
    parent of a daemon (see :class:`objfs.daemon.ReadyPipe`).
    """
    pipe = ReadyPipe(ready_fd)
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
        trio.run(serve_async, config, backend, pipe.ready)
    except ObjfsError as exc:
        pipe.stop_warnings()
        if pipe.daemon:  # a daemon: stderr goes nowhere, the log is all there is
            log.error("%s", exc)
        pipe.error(exc.exit_code, str(exc))
        raise
    except Exception as exc:
        if not pipe.daemon:
            raise  # the command logs the traceback and prints the error (objfs.cli.main)
        # A daemon: its stderr goes nowhere. The traceback goes to its log, the error's
        # line to `objfs mount`, which prints it.
        pipe.stop_warnings()
        log_internal_error(log, exc)
        message = f"{internal_error_message(exc)} ({traceback_whereabouts(config.log_file)})"
        pipe.error(InternalError.exit_code, message)
        raise InternalError(message) from exc
    finally:
        pipe.close()
    sd_notify("STOPPING=1")
    return 0
