"""The disk tier's state: its index of versions, its table of open files, its counters and its
error policy (``VersionStore``, the base of ``DiskCache``).

Contract:

* One lock (``_lock``) guards the index, the table of open files, the buffer pool, the checked
  blocks and the counters; it is never held during I/O. Every method may run in any thread.
* The index: digest -> allocated bytes (``st_blocks * 512``, as the files are sparse), last
  use, LRU first; ``_total`` is the sum of the allocated bytes. A scan of the directory builds
  it (``_scan``, at start and before each eviction); reads and writes keep it current
  (``_account``) with no directory scans; so does a passthrough open (``open_whole_version``),
  a use like a read. A use touches the data file's mtime (the LRU clock shared with other
  processes and restarts) at most once a minute.
* Open files: the two descriptors of the 64 most recently used versions stay open
  (``_use``). A descriptor is closed only when no thread uses it (a use count), so a
  descriptor number is never reused under a thread's feet. A version another process removed
  is noticed within a second (``fstat`` link count) and opened afresh; until then reads of the
  removed files still return that version's bytes, and writes to them are merely lost.
* A table whose header does not name its version (a foreign file, or a SHA-256 collision) is
  removed with its data file and counted as corrupt.
* Errors: a failing read or write (EIO, EMFILE, ...) is counted (``_failed``) and is a miss;
  the tier turns itself off (``_disable``, the one place ``enabled`` is cleared), with one
  warning, after 8 errors in a row, or at once on a full, read-only or forbidden disk.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from objfs.disk_cache.directory import ST_BLOCK, create_table, prepare, remove_files, walk
from objfs.disk_cache.fetching import FetchLocks
from objfs.disk_cache.layout import MAGIC, PAGE, Version, version

log = logging.getLogger("objfs.disk_cache")  # one name for the tier

# Open versions kept in the LRU of descriptors (two descriptors each): a model's shards and
# side files, several models at once, far under the usual limit of 1024 descriptors.
_OPEN_VERSIONS = 64
# A hit updates the data file's mtime (the LRU clock shared with other processes and
# restarts) only when the last update is older than this: one metadata write per minute.
_TOUCH_AFTER_S = 60.0
# How often an open version's link count is checked (was it removed by another process?).
_RECHECK_S = 1.0
# Errors in a row (no success between) that turn the tier off: one bad sector or a brief
# descriptor shortage is a miss, a dying disk is not retried forever.
_ERROR_STREAK_LIMIT = 8
# Errors that mean the disk cannot take the cache at all: turn the tier off at once.
_FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class _Entry:
    """One version in the in-memory index."""

    __slots__ = ("allocated", "touched_at", "used_at")

    def __init__(self, allocated: int, used_at: float, touched_at: float) -> None:
        self.allocated = allocated  # bytes on disk (both files)
        self.used_at = used_at  # last read or write (wall clock, comparable to mtimes)
        self.touched_at = touched_at  # the data file's mtime as last set or seen


class Files:
    """The open descriptors of one version's two files."""

    __slots__ = ("checked_at", "closed", "data_fd", "direct", "dropped", "index_fd", "users")

    def __init__(self, index_fd: int, data_fd: int, direct: bool, now: float) -> None:
        self.index_fd = index_fd
        self.data_fd = data_fd
        self.direct = direct  # data_fd has O_DIRECT
        self.users = 0  # threads using the descriptors now
        self.dropped = False  # out of the table of open files: close when unused
        self.closed = False
        self.checked_at = now  # last link-count check (monotonic)

    def allocated(self) -> int:
        """Allocated bytes of the two files (they are sparse: not their length)."""
        return (os.fstat(self.data_fd).st_blocks + os.fstat(self.index_fd).st_blocks) * ST_BLOCK

    def close(self) -> None:
        self.closed = True
        for fd in (self.data_fd, self.index_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class VersionStore:
    """The versions of one cache directory as this process knows them (see the module)."""

    def __init__(self, directory: str, *, namespace: str, block_size: int) -> None:
        if block_size <= 0 or block_size % PAGE:
            raise ValueError(f"block size {block_size} is not a multiple of {PAGE}")
        self.namespace = namespace
        self.block_size = block_size
        self.enabled = True
        self._lock = threading.Lock()
        # Versions whose every block was verified, where their table has no room for the
        # record (see open_whole_version): digest -> (device, inode) of the file verified.
        # Forgotten when this process removes the version or finds it removed.
        self._verified: dict[str, tuple[int, int]] = {}
        # Blocks this process wrote (hashed as they arrived or went out) or read back intact, by
        # version: (key, etag, indexes). A version they cover whole can be sealed (see seal).
        self._checked: dict[str, tuple[str, str, set[int]]] = {}
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # digest -> entry, LRU first
        self._total = 0  # sum of the index's allocated bytes
        self._files: OrderedDict[str, Files] = OrderedDict()  # open versions, LRU first
        self._direct = hasattr(os, "O_DIRECT")
        self._buffers: list[mmap.mmap] = []  # see BlockIO._aligned_buffers
        self._error_streak = 0
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.corrupt = 0
        self.errors = 0
        self.root = prepare(os.path.abspath(directory))
        # A version's naming (a SHA-256 and its header) for the recent (key, etag) pairs.
        self._versions = functools.lru_cache(maxsize=4 * _OPEN_VERSIONS)(
            functools.partial(version, self.root, namespace)
        )
        # Which blocks the processes sharing the directory are fetching (trio thread only).
        self.fetch_locks = FetchLocks(self.root, lambda key, etag: self._version(key, etag).digest)

    def _scan(self) -> None:
        """Rebuild the index from the directory (at start, and before each eviction)."""
        found = walk(self.root)
        with self._lock:
            # A version's last use is its files' mtime or this process's later use of it; ties
            # (the kernel's clock is coarse) keep this process's own, exact order.
            old = self._index
            known = {digest: n for n, digest in enumerate(old)}
            entries: list[tuple[float, int, str, _Entry]] = []
            for digest, (allocated, mtime) in found.items():
                prev = old.get(digest)
                used = max(mtime, prev.used_at) if prev is not None else mtime
                touched = max(mtime, prev.touched_at) if prev is not None else mtime
                entry = _Entry(int(allocated), used, touched)
                entries.append((used, known.get(digest, -1), digest, entry))
            # A version open here but not found: created after the walk passed it, or removed
            # by another process (found out by _acquire's link-count check): keep it counted.
            for digest in self._files:
                prev = old.get(digest)
                if digest not in found and prev is not None:
                    entries.append((prev.used_at, known[digest], digest, prev))
            entries.sort(key=lambda e: (e[0], e[1]))
            self._index = OrderedDict((digest, entry) for _, _, digest, entry in entries)
            self._total = sum(entry.allocated for entry in self._index.values())

    def _version(self, key: str, etag: str) -> Version:
        return self._versions(key, etag, self.block_size)

    def _checked_blocks(self, v: Version, key: str, etag: str) -> set[int]:
        """(Under the lock) The checked blocks of ``v`` (see ``_checked``)."""
        found = self._checked.get(v.digest)
        if found is None:
            found = self._checked[v.digest] = (key, etag, set())
        return found[2]

    # -- open files ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _use(self, v: Version, *, create: bool) -> Iterator[Files | None]:
        """The open files of version ``v`` (None: it is not cached and ``create`` is false),
        held open for the block of the ``with``."""
        files = self._acquire(v, create)
        try:
            yield files
        finally:
            if files is not None:
                self._release(files)

    def _acquire(self, v: Version, create: bool) -> Files | None:
        now = monotonic()
        with self._lock:
            files = self._files.get(v.digest)
            if files is not None:
                self._files.move_to_end(v.digest)
                files.users += 1
                if now - files.checked_at < _RECHECK_S:
                    return files
        if files is not None:
            # Did another process remove the version? Its files would still serve this
            # version's bytes, but would take writes nobody will see, and hold disk space.
            try:
                alive = os.fstat(files.data_fd).st_nlink and os.fstat(files.index_fd).st_nlink
            except OSError:
                alive = 0
            if alive:
                files.checked_at = now
                return files
            self._release(files)
            self._drop_files(v.digest, files)
            self._forget_checks(v.digest)  # another process removed it: those were its files
        opened = self._open_files(v, create, now)
        if opened is None:
            return None
        new, allocated, mtime = opened
        closing: list[Files] = []
        with self._lock:
            files = self._files.get(v.digest)
            if files is not None:  # another thread opened it meanwhile
                files.users += 1
                closing.append(new)
            else:
                files = new
                files.users = 1
                self._files[v.digest] = files
                while len(self._files) > _OPEN_VERSIONS:
                    _, old = self._files.popitem(last=False)
                    old.dropped = True
                    if old.users == 0:
                        closing.append(old)
            entry = self._index.get(v.digest)
            if entry is None:  # another process's version, or a new one
                self._index[v.digest] = _Entry(allocated, mtime, mtime)
                self._total += allocated
        for old in closing:
            old.close()
        return files

    def _held_open(self, v: Version) -> Files | None:
        """The open files of ``v``, their use count raised (``_release`` them), only if they
        are open already and their link count was checked in the last ``_RECHECK_S``; else
        None. Opens nothing and checks nothing: no system call."""
        now = monotonic()
        with self._lock:
            files = self._files.get(v.digest)
            if files is None or now - files.checked_at >= _RECHECK_S:
                return None
            files.users += 1
            return files

    def _release(self, files: Files, *, close_in_thread: bool = False) -> None:
        """Drop a use of ``files``; the last use of dropped files closes them (in a thread of
        its own with ``close_in_thread``: closing an evicted version's files frees its disk
        blocks, which may wait on the disk)."""
        with self._lock:
            files.users -= 1
            close = files.dropped and files.users == 0 and not files.closed
            files.closed |= close
        if close and close_in_thread:
            threading.Thread(target=files.close, name="objfs-close", daemon=True).start()
        elif close:
            files.close()

    def _drop_files(self, digest: str, files: Files) -> None:
        """Take ``files`` out of the table of open files; closed once unused."""
        with self._lock:
            if self._files.get(digest) is files:
                del self._files[digest]
            files.dropped = True
            close = files.users == 0 and not files.closed
            files.closed |= close
        if close:
            files.close()

    def _open_files(self, v: Version, create: bool, now: float) -> tuple[Files, int, float] | None:
        """Open (or create) a version's files: (files, allocated bytes, mtime), or None."""
        index_fd = self._open_index(v, create)
        if index_fd is None:
            return None
        try:
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
            direct = self._direct
            data_fd = -1
            if direct:
                try:
                    data_fd = os.open(v.data_path, flags | os.O_DIRECT, 0o600)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    direct = self._direct = False  # no O_DIRECT on this file system
                    log.debug("disk cache: no O_DIRECT in %s; using buffered I/O", self.root)
            if data_fd < 0:
                data_fd = os.open(v.data_path, flags, 0o600)
        except FileNotFoundError:
            os.close(index_fd)
            if create:
                raise
            return None  # the table without its data (being removed): nothing cached
        except BaseException:
            os.close(index_fd)
            raise
        try:
            st_data, st_index = os.fstat(data_fd), os.fstat(index_fd)
        except BaseException:
            os.close(data_fd)
            os.close(index_fd)
            raise
        allocated = (st_data.st_blocks + st_index.st_blocks) * ST_BLOCK
        mtime = max(st_data.st_mtime, st_index.st_mtime)
        return Files(index_fd, data_fd, direct, now), allocated, mtime

    def _open_index(self, v: Version, create: bool) -> int | None:
        """Open the version's table and check its header; None where there is none."""
        for _ in range(2):
            try:
                fd = os.open(v.index_path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    return None
                fd = create_table(v)
            try:
                head = os.pread(fd, len(v.header), 0)
            except BaseException:
                os.close(fd)
                raise
            if head == v.header:
                return fd
            os.close(fd)
            # Never a table being written: a new table appears under its name whole.
            if len(head) < len(v.header):
                problem = "truncated header"
            elif head[: len(MAGIC)] != MAGIC:
                problem = "bad magic"
            else:
                problem = "it names another version"
            with self._lock:
                self.corrupt += 1
            log.warning(
                "disk cache: dropping the corrupt block table %s (%s); fetching its blocks again",
                v.index_path,
                problem,
            )
            self._remove_version(v.digest)
            if not create:
                return None
        return None

    def _remove_version(self, digest: str) -> int:
        """Delete a version's files (the table first: without it nothing is served) and
        forget it; returns the bytes it held by the index."""
        remove_files(self.root, digest)
        self._forget_checks(digest)
        with self._lock:
            entry = self._index.pop(digest, None)
            files = self._files.get(digest)
            if entry is not None:
                self._total -= entry.allocated
        if files is not None:
            self._drop_files(digest, files)
        return entry.allocated if entry is not None else 0

    def _forget_checks(self, digest: str) -> None:
        """The version's files are gone: what this process checked of them no longer
        speaks for the files that may take their place."""
        with self._lock:
            self._verified.pop(digest, None)
            self._checked.pop(digest, None)

    def _account(self, digest: str, files: Files, *, allocated: int | None) -> None:
        """Note a use of a version: its recency and, after a write, its size
        (``allocated``: its files' allocated bytes after the write; None for a read)."""
        now = time.time()
        touch = False
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:  # evicted meanwhile
                return
            self._index.move_to_end(digest)
            entry.used_at = now
            if allocated is not None:
                self._total += allocated - entry.allocated
                entry.allocated = allocated
                entry.touched_at = now  # a write sets the mtime
            elif now - entry.touched_at > _TOUCH_AFTER_S:
                # Recency for eviction across restarts and for other processes sharing the
                # directory; a recent mtime is close enough, and skipping the update saves a
                # metadata write per hit.
                entry.touched_at = now
                touch = True
        if touch:
            with contextlib.suppress(OSError):
                os.utime(files.data_fd)

    # -- errors ----------------------------------------------------------------------------

    def _failed(self, what: str, path: str, exc: OSError) -> None:
        """Count a failed read or write: the tier goes on (a miss) unless the disk cannot
        take the cache at all or errors keep coming."""
        with self._lock:
            self.errors += 1
            self._error_streak += 1
            streak = self._error_streak
        reason = f"{what} {path} failed: {exc.strerror or exc}"
        if exc.errno in _FATAL_ERRNOS:
            self._disable(reason)
        elif streak >= _ERROR_STREAK_LIMIT:
            self._disable(f"{streak} errors in a row, the last {reason}")
        elif streak == 1:
            log.warning("disk cache: %s; treating it as a miss", reason)
        # The open files may be what failed: open them afresh next time.
        digest = os.path.basename(path).removesuffix(".idx")
        with self._lock:
            files = self._files.get(digest)
        if files is not None:
            self._drop_files(digest, files)

    def _succeeded(self) -> None:
        """A read or write went through: the streak of errors is over."""
        with self._lock:
            self._error_streak = 0

    def _disable(self, reason: str) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            log.warning("disk cache turned off: %s; objfs continues without it", reason)


def monotonic() -> float:
    """The disk tier's one clock (a function of its own, so tests can move it)."""
    return time.monotonic()
