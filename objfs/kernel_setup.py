"""The kernel's side of a mount: the options objfs asks libfuse to mount with, and tuning.

:func:`fuse_options` is the option set for ``pyfuse3.init`` (read-only, fsname, subtype).
:func:`tune_kernel` raises the mount's read-ahead and the FUSE connection's queue through
sysfs once the mount exists, where permitted (a refusal is a warning, never an error); it
finds the mount in mountinfo and never touches the mountpoint itself.
"""

from __future__ import annotations

import logging
import os
import subprocess

from objfs.config import MountConfig
from objfs.mountinfo import _mountinfo_record

log = logging.getLogger("objfs")


def fuse_options(config: MountConfig) -> set[str]:
    # fsname shows in /proc/mounts and df; commas would split the option string.
    fsname = config.source.url().replace(",", "%2C").replace(" ", "%20")
    options = {"ro", f"fsname={fsname}", "subtype=objfs", "default_permissions", "noatime"}
    if config.allow_other:
        options.add("allow_other")
    return options


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
    :func:`objfs.mount.serve` before mounting).
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
