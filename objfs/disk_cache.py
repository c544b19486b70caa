"""Persistent on-disk tier of blocks, kept across unmount and restart.

Layout: ``DIR/v2/XY/<digest>.<block>``, where ``digest`` is a SHA-256 of (namespace = endpoint
and bucket, key, ETag, block size), so a new object version or another block size never meets
an old block and nothing ever needs invalidation. Each file holds a header page (magic,
length, CRC-32C of the data) and the block from offset 4096, so blocks are written with
O_DIRECT where the file system allows it: a cold load then neither copies every block into the
page cache nor fills the page cache with a second copy of the model. A file is written under
a temporary name and renamed into place, so a reader sees a whole block or none. A block
whose length or checksum is wrong is deleted and reported as a miss (the caller fetches it
again), with a warning.

Several objfs processes may share one directory: renames are atomic and identical blocks may
be written twice harmlessly; eviction runs under an exclusive ``flock`` on ``DIR/v2/.lock``
and re-reads the directory first, so it sees the other processes' files.

Eviction is least-recently-used by file mtime (a hit touches a file whose mtime is over a
minute old; newer hits are remembered in memory), under a size cap and a free-space floor.
The directory is created with mode 0700.

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
import mmap
import os
import shutil
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import google_crc32c

from objfs.block_cache import BlockKey
from objfs.errors import UsageError

log = logging.getLogger(__name__)

_FORMAT = "v2"  # the subdirectory of this on-disk format; older formats are removed
_MAGIC = b"OBJFSBK2"
_HEADER = struct.Struct("<8sQI")  # magic, data length, CRC-32C of the data
# The header fills the first page and the data starts at a page boundary, so a block can be
# written with O_DIRECT (DMA from an aligned buffer, no copy into the page cache); files so
# written are padded to whole pages.
_PAGE = 4096
_DATA_OFFSET = _PAGE
# Temporary files older than this were left by a crashed writer and are removed on scan.
_STALE_TMP_S = 600.0
# Re-scan the directory after this many writes so a shared cache sees the others' files.
_RESCAN_EVERY_WRITES = 512
# A hit updates its file's mtime (the LRU clock shared with other processes and restarts) only
# when the mtime is older than this.
_TOUCH_AFTER_S = 60.0
# Aligned O_DIRECT buffers kept for reuse (as many as disk operations usually run at once).
_POOLED_BUFFERS = 4


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
        self.root = os.path.join(os.path.abspath(directory), _FORMAT)
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
        self._direct = hasattr(os, "O_DIRECT")
        self._buffers: list[mmap.mmap] = []  # see _aligned_buffer
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.corrupt = 0
        self._prepare(os.path.abspath(directory))
        self._scan()

    # -- setup -----------------------------------------------------------------------------

    def _prepare(self, directory: str) -> None:
        """Create the cache directory (0700) or check an existing one.

        Cached blocks are bucket data, as private as the bucket. A directory that another user
        owns, or that group or others may write to, is refused with a UsageError: someone else
        could read the blocks, or plant blocks objfs would serve. A directory only readable by
        others is tightened to 0700. A symlink is followed: the directory it resolves to is
        the one checked (and named in the error), as it is the one used.
        """
        if not os.path.lexists(directory):
            # Not makedirs(root) alone: it would create ``directory`` with the umask's mode.
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)  # whatever the umask
        self._check_private(directory, directory)
        # From here on the directory that was checked, not a path whose links could change.
        directory = os.path.realpath(directory)
        self.root = os.path.join(directory, _FORMAT)
        old = os.path.join(directory, "v1")
        if os.path.isdir(old) and not os.path.islink(old):
            log.info("disk cache: removing %s (an older cache format)", old)
            shutil.rmtree(old, ignore_errors=True)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._check_private(self.root, directory)
        lock_path = os.path.join(self.root, ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)

    @staticmethod
    def _check_private(path: str, option_value: str) -> None:
        real = os.path.realpath(path)
        shown = (
            f"--cache-dir {path}" if path == option_value else f"--cache-dir {option_value}: {path}"
        )
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
            fd, direct = self._open_for_read(path)
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as exc:
            self._disable(f"reading {path} failed: {exc.strerror}")
            return None
        try:
            try:
                header, data = self._read_file(fd, direct, expected_length)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                # O_DIRECT accepted at open but not for the read: read buffered from now on.
                self._direct = False
                os.lseek(fd, 0, os.SEEK_SET)
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                header, data = self._read_file(fd, False, expected_length)
            st = os.fstat(fd)
            now = time.time()
            if now - st.st_mtime > _TOUCH_AFTER_S:
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
        problem = self._check(header, data, expected_length, st.st_size)
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

    def _open_for_read(self, path: str) -> tuple[int, bool]:
        """Open a block file, with O_DIRECT where possible; returns (fd, direct)."""
        if self._direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # no O_DIRECT on this file system
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False

    def _read_file(self, fd: int, direct: bool, expected_length: int) -> tuple[bytes, bytes]:
        """Header page and data of an open block file (short where the file is)."""
        if direct:
            # One read by DMA into an aligned buffer: the block's pages never enter the page
            # cache (the kernel caches what objfs serves, under the mount's own inode).
            total = _DATA_OFFSET + _round_up(expected_length, _PAGE)
            with self._aligned_buffer(total) as buf:
                n = os.readv(fd, [memoryview(buf)[:total]])
                # Slices of an mmap are copies: nothing returned aliases the pooled buffer.
                header = buf[: min(n, _DATA_OFFSET)]
                data = (
                    buf[_DATA_OFFSET : min(n, _DATA_OFFSET + expected_length)]
                    if n > _DATA_OFFSET
                    else b""
                )
            return header, data
        # Two reads, so the block is not copied out of a bigger buffer.
        return os.read(fd, _DATA_OFFSET), os.read(fd, expected_length)

    @staticmethod
    def _check(header: bytes, data: bytes, expected_length: int, file_size: int) -> str | None:
        if len(header) < _DATA_OFFSET:
            return "truncated header"
        magic, length, crc = _HEADER.unpack_from(header)
        if magic != _MAGIC:
            return "bad magic"
        if length != expected_length or len(data) != length:
            return f"length {len(data)}, expected {expected_length}"
        if file_size not in (_DATA_OFFSET + length, _DATA_OFFSET + _round_up(length, _PAGE)):
            return f"file size {file_size} does not match a {length}-byte block"
        if _crc(data) != crc:
            return "checksum mismatch"
        return None

    def write(self, key: BlockKey, data: bytes) -> None:
        """Store a block (atomically); evict old blocks if over the limits."""
        if not self.enabled:
            return
        path = self.path_for(key)
        header = _HEADER.pack(_MAGIC, len(data), _crc(data))
        tmp = os.path.join(
            os.path.dirname(path), f".tmp-{os.getpid()}-{threading.get_ident()}-{key.block}"
        )
        try:
            try:
                size = self._write_file(tmp, header, data)
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
        with self._lock:
            old = self._index.pop(path, None)
            self._total += size - (old or 0)
            self._index[path] = size
            self._writes_since_scan += 1
            rescan = self._writes_since_scan >= _RESCAN_EVERY_WRITES
        self.writes += 1
        if rescan or self._over_limits():
            self.evict()

    def _write_file(self, tmp: str, header: bytes, data: bytes) -> int:
        """Write header and block to a new file ``tmp``; return the file's size."""
        if self._direct:
            total = _DATA_OFFSET + _round_up(len(data), _PAGE)
            try:
                fd = self._create(tmp, os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                fd = -1  # this file system has no O_DIRECT (tmpfs)
            if fd >= 0:
                with self._aligned_buffer(total) as buf:
                    buf[:_DATA_OFFSET] = header + bytes(_DATA_OFFSET - len(header))
                    buf[_DATA_OFFSET : _DATA_OFFSET + len(data)] = data
                    buf[_DATA_OFFSET + len(data) : total] = bytes(total - _DATA_OFFSET - len(data))
                    try:
                        written = os.write(fd, memoryview(buf)[:total])
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        written = -1
                    finally:
                        os.close(fd)
                if written == total:
                    return total
                if written >= 0:  # a short write: the disk is full
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._direct = False
            log.debug("disk cache: O_DIRECT unsupported in %s; using buffered writes", self.root)
        fd = self._create(tmp, 0)
        try:
            padding = bytes(_DATA_OFFSET - len(header))
            total = _DATA_OFFSET + len(data)
            if os.writev(fd, [header, padding, data]) != total:  # short: the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            os.close(fd)
        return total

    @contextlib.contextmanager
    def _aligned_buffer(self, size: int) -> Iterator[mmap.mmap]:
        """A page-aligned buffer (anonymous mmap) of at least ``size`` bytes, from a small
        pool: the threads doing disk I/O are shared with the store's GETs, so a buffer per
        thread would add up outside the memory budget."""
        with self._lock:
            buf = self._buffers.pop() if self._buffers else None
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, max(size, _DATA_OFFSET + _round_up(self.block_size, _PAGE)))
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._buffers) < _POOLED_BUFFERS:
                    self._buffers.append(buf)

    def _create(self, tmp: str, extra_flags: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | extra_flags
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


def _crc(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: the CPU's crc32 instruction through google-crc32c's C
    extension, about 25 GB/s here against zlib.crc32's 4 GB/s; every block is checksummed
    once when written and again whenever it is read."""
    return int(google_crc32c.value(data))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
