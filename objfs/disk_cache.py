"""Persistent on-disk tier of blocks, kept across unmount and restart.

Layout: ``DIR/v1/XY/<digest>.<block>``, where ``digest`` is a SHA-256 of (namespace = endpoint
and bucket, key, ETag, block size), so a new object version or another block size never meets
an old block and nothing ever needs invalidation. Each file holds a small header (magic,
length, CRC-32 of the data) and the block; it is written under a temporary name and renamed
into place, so a reader sees a whole block or none. A block whose length or checksum is wrong
is deleted and reported as a miss (the caller fetches it again), with a warning.

Several objfs processes may share one directory: renames are atomic and identical blocks may
be written twice harmlessly; eviction runs under an exclusive ``flock`` on ``DIR/v1/.lock``
and re-reads the directory first, so it sees the other processes' files.

Eviction is least-recently-used by file mtime (a hit touches the file), under a size cap and a
free-space floor. The directory is created with mode 0700.

Errors: a full, read-only or otherwise failing cache disk turns the tier off with one
warning; objfs goes on without it.

Thread safety: every method may run in a worker thread; the index is guarded by a lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict

from objfs.block_cache import BlockKey

log = logging.getLogger(__name__)

_MAGIC = b"OBJFSBK1"
_HEADER = struct.Struct("<8sQI")  # magic, data length, crc32(data)
# Temporary files older than this were left by a crashed writer and are removed on scan.
_STALE_TMP_S = 600.0
# Re-scan the directory after this many writes so a shared cache sees the others' files.
_RESCAN_EVERY_WRITES = 512


class DiskCache:
    def __init__(
        self,
        directory: str,
        *,
        namespace: str,
        block_size: int,
        size_limit_bytes: int,
        min_free_bytes: int,
    ) -> None:
        self.root = os.path.join(os.path.abspath(directory), "v1")
        self.namespace = namespace
        self.block_size = block_size
        self.size_limit_bytes = size_limit_bytes
        self.min_free_bytes = min_free_bytes
        self.enabled = True
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # path -> file size, LRU order
        self._total = 0
        self._writes_since_scan = 0
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.corrupt = 0
        self._prepare(os.path.abspath(directory))
        self._scan()

    # -- setup -----------------------------------------------------------------------------

    def _prepare(self, directory: str) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for path in (directory, self.root):
            st = os.stat(path)
            if stat.S_IMODE(st.st_mode) & 0o077:
                # Cached model bytes are as private as the bucket: no access for others.
                os.chmod(path, 0o700)
        lock_path = os.path.join(self.root, ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)

    def _scan(self) -> None:
        """Rebuild the index from the directory (oldest mtime first)."""
        entries: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                entries.append((st.st_mtime, entry.path, st.st_size))
        with self._lock:
            # mtime ties (the kernel's clock is coarse) keep this process's own, exact order.
            known = {path: n for n, path in enumerate(self._index)}
            entries.sort(key=lambda e: (e[0], known.get(e[1], -1)))
            self._index = OrderedDict((path, size) for _, path, size in entries)
            self._total = sum(size for _, _, size in entries)
            self._writes_since_scan = 0

    # -- addressing ------------------------------------------------------------------------

    def path_for(self, key: BlockKey) -> str:
        ident = "\0".join((self.namespace, key.key, key.etag, str(self.block_size)))
        digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()
        return os.path.join(self.root, digest[:2], f"{digest[2:42]}.{key.block}")

    # -- read / write ----------------------------------------------------------------------

    def read(self, key: BlockKey, expected_length: int) -> bytes | None:
        """Return the block if it is cached and intact, else None (a corrupt one is removed)."""
        if not self.enabled:
            return None
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                raw = f.read(_HEADER.size + expected_length + 1)
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as exc:
            self._disable(f"reading {path} failed: {exc.strerror}")
            return None
        problem = self._check(raw, expected_length)
        if problem is not None:
            self.corrupt += 1
            log.warning(
                "disk cache: dropping corrupt block %s (%s); fetching it again", path, problem
            )
            self._forget(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for LRU eviction, also across restarts
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)
        self.hits += 1
        return raw[_HEADER.size :]

    @staticmethod
    def _check(raw: bytes, expected_length: int) -> str | None:
        if len(raw) < _HEADER.size:
            return "truncated header"
        magic, length, crc = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            return "bad magic"
        if length != expected_length or len(raw) != _HEADER.size + length:
            return f"length {len(raw) - _HEADER.size}, expected {expected_length}"
        if zlib.crc32(memoryview(raw)[_HEADER.size :]) != crc:
            return "checksum mismatch"
        return None

    def write(self, key: BlockKey, data: bytes) -> None:
        """Store a block (atomically); evict old blocks if over the limits."""
        if not self.enabled:
            return
        path = self.path_for(key)
        header = _HEADER.pack(_MAGIC, len(data), zlib.crc32(data))
        tmp = os.path.join(
            os.path.dirname(path), f".tmp-{os.getpid()}-{threading.get_ident()}-{key.block}"
        )
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb", closefd=True) as f:
                    f.write(header)
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                self._disable(f"writing to {self.root} failed: {exc.strerror}")
                return
            log.warning("disk cache: writing %s failed: %s", path, exc.strerror)
            return
        size = len(header) + len(data)
        with self._lock:
            old = self._index.pop(path, None)
            self._total += size - (old or 0)
            self._index[path] = size
            self._writes_since_scan += 1
            rescan = self._writes_since_scan >= _RESCAN_EVERY_WRITES
        self.writes += 1
        if rescan or self._over_limits():
            self.evict()

    def _forget(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with self._lock:
            size = self._index.pop(path, None)
            if size is not None:
                self._total -= size

    def _disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("disk cache turned off: %s; objfs continues without it", reason)

    # -- eviction --------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _over_limits(self) -> bool:
        if self._total > self.size_limit_bytes:
            return True
        return self.min_free_bytes > 0 and self._free_bytes() < self.min_free_bytes

    def evict(self) -> None:
        """Delete least recently used blocks until under the size cap and above the floor."""
        lock_fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._scan()  # include what other processes wrote
            while self._index and self._over_limits():
                with self._lock:
                    path, size = self._index.popitem(last=False)
                    self._total -= size
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            os.close(lock_fd)  # releases the flock

    def statistics(self) -> dict[str, int]:
        return {
            "disk_hits": self.hits,
            "disk_misses": self.misses,
            "disk_writes": self.writes,
            "disk_corrupt": self.corrupt,
            "disk_bytes": self._total,
            "disk_enabled": int(self.enabled),
        }
