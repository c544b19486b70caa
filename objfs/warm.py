"""``objfs warm PATH...``: read files on a mount ahead of time, with a progress bar.

Reading through the mount fills every tier at once: objfs's memory and disk caches and the
kernel's page cache, so a model server started afterwards loads at local speed. Files are
read whole with large sequential reads.

Which files are read at once (``plan``): big files (``BIG_FILE_BYTES`` and up: model shards)
one after another, biggest first, while up to ``jobs - 1`` other workers read the small files
(configs, tokenizers), several at a time. The daemon already fetches a big file with many
GETs at once, and its read-ahead shares one memory budget among the files being read: two
shards read side by side took 5.9 s where the same two read one after the other took 4.9 s
(medians of 2 runs each, 2.2 GB from s3rver on 2 cores; ``cat`` of both: 4.1 s). Small files
gain from reading side by side: each costs a round trip or two.

``--cache-only`` (``cache_only``) fills objfs's caches and not the page cache: the command
opens each file and ``fsync``s it, and the daemon reads the file whole into its memory and disk
tiers itself, answering once the bytes are on disk.
No byte is copied to the kernel or to this process, so it runs at the speed of the store and
the disk; a later load then reads from the disk cache (a remount's speed, not the page
cache's). It needs a mount with ``--cache-dir`` (else EOPNOTSUPP, reported once). A file
whose blocks the disk cache did not all keep (its --cache-size, its free-space floor) fails
its fsync with ENOSPC; the command then lists it and exits 17 saying how much of what was
asked could not be stored (``not_stored_message``), as it does when the files together
exceed --cache-size. Invariant: ``--cache-only`` exits 0 only if the daemon found every
block of every file on disk when it warmed it and, where the mount's status file gives its
--cache-size, the files fit in that together.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TextIO

from objfs.errors import ObjfsError, UsageError, WarmIncompleteError
from objfs.mountinfo import mount_entry

# Large sequential reads: each is a few kernel requests and keeps objfs's read-ahead ahead.
_READ_BYTES = 8 << 20
# Redraw the progress line at most this often.
_REDRAW_S = 0.2
# Files this big are read one at a time (see the module docstring).
BIG_FILE_BYTES = 64 << 20


@dataclass
class Progress:
    total_bytes: int
    done_bytes: int = 0
    files_done: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.done_bytes += n

    def line(self, files_total: int) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done_bytes / elapsed
        fraction = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        width = 24
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        eta = (self.total_bytes - self.done_bytes) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:5.0f}s" if eta != float("inf") else "    ?"
        return (
            f"[{bar}] {_size(self.done_bytes)}/{_size(self.total_bytes)} "
            f"{_size(rate)}/s ETA {eta_text}  files {self.files_done}/{files_total}"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _on_objfs_mount(path: str) -> bool:
    """True if ``path`` lies under a mount of type fuse.objfs (checked without stat-ing it)."""
    return _objfs_mountpoint(path) is not None


def _objfs_mountpoint(path: str) -> str | None:
    """The mountpoint of the fuse.objfs mount ``path`` lies under, or None (checked without
    stat-ing it)."""
    current = os.path.abspath(path)
    while True:
        entry = mount_entry(current)
        if entry is not None:
            return current if entry[0] == "fuse.objfs" else None
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _cache_size(mountpoint: str) -> int | None:
    """The mount's --cache-size, from the status file its daemon rewrites every second;
    None if that cannot be read."""
    from objfs.status import read_status

    try:
        disk = read_status(mountpoint).get("disk")
        return int(disk["limit_bytes"]) if isinstance(disk, dict) else None
    except (ObjfsError, OSError, KeyError, TypeError, ValueError):
        return None


def not_stored_message(files: list[tuple[str, int]], refused: set[str]) -> str | None:
    """What ``--cache-only`` could not leave in the disk caches, said as ``N of M could not
    be stored``, or None if nothing is missing. ``refused``: the files whose fsync said
    ENOSPC (the daemon found blocks of them not on disk after warming them). Per mount, N
    is the size of those files, or, when more, what the files exceed the mount's
    --cache-size by (a cache of that size cannot hold them all, though each file fitted
    when it was warmed: the last evict the first); M is the size of every file asked."""
    groups: dict[str | None, list[tuple[str, int]]] = {}
    mountpoints: dict[str, str | None] = {}  # directory -> its mount's mountpoint
    for path, size in files:
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in mountpoints:
            mountpoints[directory] = _objfs_mountpoint(directory)
        groups.setdefault(mountpoints[directory], []).append((path, size))
    missing = 0
    caps: set[int] = set()
    for mountpoint, group in groups.items():
        asked = sum(size for _, size in group)
        not_kept = sum(size for path, size in group if path in refused)
        cap = _cache_size(mountpoint) if mountpoint is not None else None
        if cap is not None:
            caps.add(cap)
            not_kept = max(not_kept, asked - cap)
        missing += not_kept
    if not missing:
        return None
    option = " ".join(["--cache-size", *(_size(cap) for cap in sorted(caps))])
    return (
        f"{_size(missing)} of {_size(sum(size for _, size in files))} could not be stored in "
        f"the disk cache ({option}): raise --cache-size or warm fewer files"
    )


def collect(paths: Iterable[str]) -> list[tuple[str, int]]:
    """Every regular file under ``paths`` with its size; raises UsageError for a bad path.
    A file listed in a directory but gone (or failing) when stat'ed gets size 0: reading it
    then fails, and :func:`warm` lists it among the files it could not read."""
    files: list[tuple[str, int]] = []
    for path in paths:
        if not _on_objfs_mount(path):
            raise UsageError(f"{path} is not on an objfs mount: give a path under a mountpoint")
        try:
            st = os.stat(path)
        except OSError as exc:
            raise UsageError(f"cannot warm {path}: {exc.strerror}") from None
        if os.path.isdir(path):
            for dirpath, _, filenames in os.walk(path):
                for name in sorted(filenames):
                    full = os.path.join(dirpath, name)
                    try:
                        size = os.stat(full).st_size
                    except OSError:
                        size = 0  # removed (or failing) since listed: its read says why
                    files.append((full, size))
        else:
            files.append((path, st.st_size))
    return files


def _read_whole(path: str, progress: Progress) -> None:
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [view]):
            progress.add(n)
    finally:
        os.close(fd)


def _warm_in_daemon(path: str, progress: Progress) -> None:
    # fsync on objfs makes the file's version whole in the disk cache (objfs.fuse_ops.fsync).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        progress.add(os.fstat(fd).st_size)
    finally:
        os.close(fd)


def plan(files: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Split ``files`` (path, size) into work items, each read by one worker in order: the
    big files (``BIG_FILE_BYTES`` and up) as one item, biggest first, then each other file
    as an item of its own, biggest first."""
    ordered = sorted(files, key=lambda f: -f[1])
    big = [f for f in ordered if f[1] >= BIG_FILE_BYTES]
    small = [[f] for f in ordered if f[1] < BIG_FILE_BYTES]
    return ([big] if big else []) + small


def warm(
    paths: list[str], *, jobs: int = 8, out: TextIO | None = None, cache_only: bool = False
) -> int:
    """Read every file under ``paths``; returns the bytes read. Raises WarmIncompleteError
    (after reading everything else) if some files could not be read. ``cache_only``: into
    objfs's caches only (see the module docstring); raises UsageError if the mount cannot,
    and WarmIncompleteError if its disk cache could not keep everything asked (see
    ``not_stored_message``). ``out``: where progress goes, ``sys.stderr`` as it is at the
    call (a default bound at import would keep a stream replaced since)."""
    if out is None:
        out = sys.stderr
    files = collect(paths)
    total = sum(size for _, size in files)
    progress = Progress(total)
    failures: list[str] = []
    interactive = out.isatty()
    last_log = [0.0]

    def draw(final: bool = False) -> None:
        line = progress.line(len(files))
        if interactive:
            out.write("\r" + line + ("\n" if final else ""))
            out.flush()
        elif final or time.monotonic() - last_log[0] > 5:
            last_log[0] = time.monotonic()
            out.write(line + "\n")
            out.flush()

    read_one = _warm_in_daemon if cache_only else _read_whole
    unsupported: list[str] = []
    refused: list[str] = []  # --cache-only: files the disk cache did not keep whole

    def work(item: list[tuple[str, int]]) -> None:
        for path, _ in item:
            if unsupported:
                return  # the mount cannot warm its caches alone: said once, below
            try:
                read_one(path, progress)
            except OSError as exc:
                with progress.lock:
                    if cache_only and exc.errno == errno.EOPNOTSUPP:
                        unsupported.append(path)
                    elif cache_only and exc.errno == errno.ENOSPC:
                        refused.append(path)
                    else:
                        failures.append(f"{path}: {exc.strerror}")
            with progress.lock:
                progress.files_done += 1

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(work, item) for item in plan(files)]
        # Redraw every _REDRAW_S, and return as soon as the last file is read (a sleep
        # between checks would add up to _REDRAW_S to every warm).
        while wait(futures, timeout=_REDRAW_S).not_done:
            draw()
    if unsupported:
        if interactive:
            out.write("\n")
        raise UsageError(
            f"--cache-only: the mount of {unsupported[0]} has no --cache-dir, so nothing "
            "would keep the bytes: mount with --cache-dir, or drop --cache-only to warm the "
            "page cache by reading through the mount"
        )
    draw(final=True)
    elapsed = time.monotonic() - progress.started
    where = " into objfs's caches" if cache_only else ""
    out.write(
        f"warmed {len(files) - len(failures) - len(refused)} files{where}, "
        f"{_size(progress.done_bytes)} in {elapsed:.1f} s "
        f"({_size(progress.done_bytes / max(elapsed, 1e-6))}/s)\n"
    )
    for failure in failures:
        out.write(f"objfs: could not read {failure}\n")
    for path in refused:
        out.write(f"objfs: not stored whole in the disk cache: {path}\n")
    problems = []
    if failures:
        problems.append(f"{len(failures)} of {len(files)} files could not be read (listed above)")
    shortfall = not_stored_message(files, set(refused)) if cache_only else None
    if shortfall is not None:
        problems.append(shortfall)
    if problems:
        raise WarmIncompleteError("; ".join(problems))
    return progress.done_bytes
