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

Eviction is least-recently-used by file mtime (a hit touches a file whose mtime is over a
minute old; newer hits are remembered in memory), under a size cap and a free-space floor. The directory is created with mode 0700.

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
# A hit updates its file's mtime (the LRU clock shared with other processes and restarts) only
# when the mtime is older than this.
_TOUCH_AFTER_S = 60.0


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
        # Hits whose file mtime was not updated (see read): path -> when, for the LRU order.
        self._used_at: dict[str, float] = {}
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
            # A file's last use is its mtime or this process's later hit on it; ties (the
            # kernel's clock is coarse) keep this process's own, exact order.
            known = {path: n for n, path in enumerate(self._index)}
            used = self._used_at
            entries.sort(key=lambda e: (max(e[0], used.get(e[1], 0.0)), known.get(e[1], -1)))
            self._index = OrderedDict((path, size) for _, path, size in entries)
            self._used_at = {path: t for path, t in used.items() if path in self._index}
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
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as exc:
            self._disable(f"reading {path} failed: {exc.strerror}")
            return None
        try:
            # Header and data in two reads, so the block is not copied out of a bigger buffer.
            header = os.read(fd, _HEADER.size)
            data = os.read(fd, expected_length + 1)
            mtime = os.fstat(fd).st_mtime
            now = time.time()
            if now - mtime > _TOUCH_AFTER_S:
                # Recency for eviction across restarts and for other processes sharing the
                # directory; a recent mtime is close enough, and skipping the update saves a
                # metadata write per hit.
                with contextlib.suppress(OSError):
                    os.utime(fd)
        except OSError as exc:
            self._disable(f"reading {path} failed: {exc.strerror}")
            return None
        finally:
            os.close(fd)
        problem = self._check(header, data, expected_length)
        if problem is not None:
            self.corrupt += 1
            log.warning(
                "disk cache: dropping corrupt block %s (%s); fetching it again", path, problem
            )
            self._forget(path)
            return None
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)
                self._used_at[path] = now
        self.hits += 1
        return data

    @staticmethod
    def _check(header: bytes, data: bytes, expected_length: int) -> str | None:
        if len(header) < _HEADER.size:
            return "truncated header"
        magic, length, crc = _HEADER.unpack(header)
        if magic != _MAGIC:
            return "bad magic"
        if length != expected_length or len(data) != length:
            return f"length {len(data)}, expected {expected_length}"
        if zlib.crc32(data) != crc:
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
            fd = self._create(tmp)
            try:
                try:
                    written = os.writev(fd, [header, data])
                    if written != len(header) + len(data):  # a short write: the disk is full
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                finally:
                    os.close(fd)
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

    def _create(self, tmp: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # first block in this subdirectory (or it was removed)
            os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
            return os.open(tmp, flags, 0o600)

    def _forget(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with self._lock:
            size = self._index.pop(path, None)
            self._used_at.pop(path, None)
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
                    self._used_at.pop(path, None)
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
