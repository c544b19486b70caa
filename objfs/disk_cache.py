"""Persistent on-disk tier of blocks, kept across unmount and restart (format v4).

Layout: per object *version* (namespace = endpoint and bucket, key, ETag, block size; their
SHA-256 is the version's ``digest``) two files in ``DIR/v4/XY/`` (``XY``: the digest's first
two hex digits, so no directory grows huge):

* ``<digest>``, the data file: sparse, block ``i`` at offset ``i * block_size`` (a multiple of
  the 4096-byte page, so every block starts page-aligned and can be written and read with
  O_DIRECT). A block written with O_DIRECT is padded with zeros to a whole page.
* ``<digest>.idx``, the block table: a header naming the digest's inputs (magic
  ``OBJFSIX4``, format 4, block size, entry size, then namespace, key and ETag), padded to a
  page, then one 16-byte entry per block at ``table_offset + 16 * i``: the data's length
  (u32), the XXH3-64 of the data (u64) and a check (u32), the low 32 bits of the XXH3-64 of
  (index u64, length u32, data hash u64), all little-endian. An all-zero entry (a hole) means
  "not present": that is tested first, so a zero entry is never taken for a block whatever
  its check would say (and a written entry is never all zeros: its length is at least 1).
  Any other entry whose check fails is garbled and dropped as corrupt. The header page's
  last 32 bytes may record that the version was verified whole for FUSE passthrough
  (``_STAMP``, see ``whole_version_file``); zeros there mean it was not. A new table file is
  written under a temporary name and hard-linked into place, so a table under its own name
  has its header.

Why XXH3-64 (format v3 had CRC-32C through google-crc32c): every block is hashed once when
written and again whenever it is read, and CRC-32C took 9% of the daemon's CPU on a cold load
and 14% on a remount load. On a 1 MiB page-aligned mmap buffer XXH3-64 (the ``xxhash``
package, which takes any buffer as it is and releases the GIL) runs at about 44 GiB/s here
against 8-9 GiB/s for the CRC-32C path, about 5x faster; and a 64-bit hash misses a random
corruption with probability 2^-64 instead of 2^-32. Neither is a cryptographic hash: they
catch damage, not someone who can write the directory (which is why it is private, below).

Why a separate table file rather than a table region at the start of the data file: (1) the
data stays at ``i * block_size`` with no bound on the number of blocks (``write`` does not know
the object's size, and an Azure blob reaches 190 TiB), where a table region would have to be
sized before the first block; (2) the table is written buffered, an entry's own 16 bytes at a
time (two processes filling neighbouring entries of one page both land; through O_DIRECT each
would be a read-modify-write of a whole page that loses the other's), and the data O_DIRECT:
in one file the two modes would share one inode's locks and page-cache invalidation (a direct
write flushes and drops the cached pages of its range), in two files they never meet; (3) the
table (16 bytes per MiB) stays in the page cache, so looking a block up costs no disk read.
The cost is two files per version; a half-removed pair is harmless (see the invariant).

Invariant: a block is returned only if its table entry is intact (not all zeros, and its
check matches), its length equals the length the caller expects, the data file holds that many
bytes at the block's offset, and their XXH3-64 equals the entry's. The digest pins the
version, so the only bytes that can ever sit at a block's offset are that block's bytes,
zeros (a hole, a file recreated after another process removed it) or a torn or damaged mix:
each fails the hash comparison, but for a chance of 2^-64 (a hash guarantees nothing for any
one kind of damage; it misses random damage with that probability). A write puts the data
first and the entry after it, with no fsync: a crash between the two, a torn write, a
truncated file or a damaged table or data gives a miss (the caller fetches the block again),
never wrong bytes but for that chance. A damaged block is dropped (its entry cleared) with a
warning and counted in ``disk_corrupt``; a table whose header does not name this version (a
foreign file, or a SHA-256 collision) is removed with the data file.

Index and eviction: one scan at start builds an in-memory index (version -> allocated bytes,
``st_blocks * 512``, as the files are sparse; last use). Writes and reads keep it current with
no directory scans. Eviction removes whole versions, least recently used first, when a write
would not fit under ``size_limit_bytes`` (see the ledger below) or free space falls under
``min_free_bytes`` (checked with statvfs at most once per 64 MiB written or per second), down
to 90% of the cap with the write counted (110% of the floor). Whole versions rather than hole
punching: a loader reads a file whole, so its blocks age
together; one unlink frees a version at once on any file system; and per-block recency would
cost memory and could not survive a restart (the data file's mtime carries a version's, touched
on a hit at most once a minute). A version that alone would fill 90% of the cap is not cached
further (it would evict itself).

Sharing: several objfs processes may share one directory. Identical blocks written twice are
harmless (the same bytes at the same offsets, the same entry). Eviction runs under an
exclusive ``flock`` on ``DIR/v4/.lock`` and first re-reads the directory, so it counts and
evicts the others' versions too (a scan per eviction, and eviction frees 10% of the cap, so
there is no scan per write). A version another process removed is noticed within a second
(``fstat`` link count of the open files) and opened afresh; until then reads of the removed
files still return that version's bytes, and writes to them are merely lost.

The cap holds for the directory, not per process, through a ledger in ``.lock``'s first 16
bytes, read and written under the same exclusive flock: the allocated bytes *counted* (set
from the scan at start and after each eviction, plus what each write allocated) and the bytes
*reserved* by writes in flight. A write first reserves its estimate (``_estimate``: its data
in whole pages, the table pages its entries fall in, a new table's header, and a page for
the file system's own), evicting if counted + reserved + estimate would pass the cap, and is
not made if they still would; once written, it adds what it allocated (``fstat`` before and
after) and drops its reservation. Every write holds ``.writers`` shared from its reservation
to its settling: an eviction that can lock ``.writers`` exclusively at once knows no write is
in flight, and drops what is still reserved (left by a process that died mid-write; until
then that reservation covers what the dead process wrote). Invariant: **the versions' files
in the directory allocate at most ``size_limit_bytes``**, over it only by what writes in
flight allocate beyond their estimates (file-system metadata past the page allowed for it).
The count may run high (a block written by two processes at once, a table removed as
corrupt, a version another process removed while this one wrote to it), which costs an early
scan, never a byte over the cap.

Descriptors: the files of the 64 most recently used versions stay open, so a block costs a
``pread``/``pwrite`` of the table and a ``preadv``/``pwritev`` of the data and no open or
close; a run of consecutive blocks is one ``pwritev`` and one table ``pwrite`` (and a write
call two ledger updates, through ``.lock`` and ``.writers`` kept open). O_DIRECT I/O goes
straight from or into the caller's buffer when it is a page-aligned, writable buffer of whole
pages (the block cache's pooled mmaps), else through a small pool of page-aligned buffers
(anonymous mmaps) and one copy. Data returned as ``bytes`` never aliases a pooled
buffer. Where O_DIRECT is refused (EINVAL at open or at the I/O: tmpfs, some network file
systems) the tier switches to buffered I/O for good.

Errors: a failing read or write (EIO, EMFILE, ...) is counted (``disk_errors``) and treated as
a miss; the tier turns itself off, with one warning, after 8 errors in a row, or at once on a
full, read-only or forbidden disk (ENOSPC, EDQUOT, EROFS, EACCES, EPERM). objfs goes on
without it. Older formats (``v1``, ``v2``, ``v3``) are removed on start.

The directory is created with mode 0700 and files with 0600 (see ``_prepare``).

Interface: ``read_blocks(key, etag, indexes, lengths) -> {index: bytes}`` and
``read_blocks_into(key, etag, indexes, buffers) -> {indexes filled}`` return the present,
intact blocks of a list; ``write_blocks(key, etag, first_index, blocks) -> count`` stores a run
of consecutive blocks; ``read(BlockKey, length)`` and ``write(BlockKey, data)`` do one block;
``missing_bytes(key, etag, lengths)`` says how much of a version the table does not list.

Thread safety: every method may run in any thread at once. The index, the table of open files,
the buffer pool and the counters are guarded by one lock, never held during I/O. An open file's
descriptors are closed only when no thread is using them (a use count), so a descriptor number
is never reused under a thread's feet. Eviction runs in one thread at a time (others skip it,
or wait to evict for their own write and reserve its room). Threads take turns on the ledger's
descriptor (``_ledger_mutex``), and the writes in flight of all threads hold ``.writers``
through one descriptor (a count).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import logging
import mmap
import os
import shutil
import stat
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import xxhash

from objfs.block_cache import BlockKey
from objfs.errors import UsageError

log = logging.getLogger(__name__)

BlockData = bytes | bytearray | memoryview

_FORMAT = "v4"  # the subdirectory of this on-disk format
_OLD_FORMATS = ("v1", "v2", "v3")  # earlier formats' subdirectories, removed on start
_MAGIC = b"OBJFSIX4"  # first bytes of a table file: tells it from a foreign file
_FORMAT_NUMBER = 4  # in the header too, should the magic ever be kept across a change
# Table header: magic, format, block size, entry size, byte lengths of namespace, key and ETag
# (the digest's inputs follow, so a header names exactly one version).
_HEADER = struct.Struct("<8sIIIIII")
# Table entry: data length, XXH3-64 of the data, check (the low 32 bits of the XXH3-64 of
# (index, length, data hash)). 16 bytes: a power of two, so an entry never straddles a page
# and is written in one piece.
_ENTRY = struct.Struct("<IQI")
_ENTRY_CHECK = struct.Struct("<QIQ")  # what an entry's check covers: its block's index too
_NO_ENTRY = bytes(_ENTRY.size)  # a hole: "not present", tested before any check
# A version verified whole for passthrough (see whole_version_file): the data file's inode and
# size and the XXH3-64 of its table, in the last bytes of the table file's header page.
_STAMP = struct.Struct("<8sQQQ")
_STAMP_MAGIC = b"OBJFSOK1"
# The page: the table starts on one (the header alone in its page), data blocks start on one,
# and O_DIRECT needs buffers, offsets and lengths in whole pages (4096 covers every device).
_PAGE = 4096
# Open versions kept in the LRU of descriptors (two descriptors each): a model's shards and
# side files, several models at once, far under the usual limit of 1024 descriptors.
_OPEN_VERSIONS = 64
# Aligned buffers kept for O_DIRECT copies: one run of _MAX_IO_BLOCKS blocks.
_POOLED_BUFFERS = 8
# Blocks per preadv/pwritev: the read-ahead's runs (an 8 MiB part of 1 MiB blocks) in one call.
_MAX_IO_BLOCKS = 8
# statvfs for the free-space floor after this many bytes written, or this long: the floor
# leaves gigabytes, so 64 MiB between checks cannot fill a disk.
_SPACE_CHECK_BYTES = 64 << 20
_SPACE_CHECK_S = 1.0
# A hit updates the data file's mtime (the LRU clock shared with other processes and
# restarts) only when the last update is older than this: one metadata write per minute.
_TOUCH_AFTER_S = 60.0
# How often an open version's link count is checked (was it removed by another process?).
_RECHECK_S = 1.0
# Errors in a row (no success between) that turn the tier off: one bad sector or a brief
# descriptor shortage is a miss, a dying disk is not retried forever.
_ERROR_STREAK_LIMIT = 8
# Eviction goes this fraction below the limit it enforces, so a full cache evicts (and
# scans) once per tenth of the cap written, not on every write.
_EVICT_SLACK = 0.1
# Temporary files older than this were left by a crashed writer and are removed on scan.
_STALE_TMP_S = 600.0
# Errors that mean the disk cannot take the cache at all: turn the tier off at once.
_FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_DIGEST_LENGTH = 64  # hex digits of a SHA-256
# The size ledger shared by the processes of one directory, the first bytes of DIR/v4/.lock:
# the allocated bytes counted (as of the last scan, plus every write since) and the bytes
# reserved by writes in flight. Read and written only under an exclusive flock of .lock.
_LEDGER = struct.Struct("<qq")
_LOCK_NAME = ".lock"  # flock: eviction and the ledger
_WRITERS_NAME = ".writers"  # flock: shared by each write in flight (see _claim_room)
_ST_BLOCK = 512  # the unit of st_blocks (POSIX): allocated bytes of a sparse file


class BlockLocation(NamedTuple):
    """Where a block lives (for tests and tools)."""

    data_path: str
    data_offset: int
    index_path: str
    entry_offset: int


class _Version(NamedTuple):
    digest: str
    header: bytes  # the table file's expected header, exactly
    table_offset: int
    data_path: str
    index_path: str


class _Entry:
    """One version in the in-memory index."""

    __slots__ = ("allocated", "touched_at", "used_at")

    def __init__(self, allocated: int, used_at: float, touched_at: float) -> None:
        self.allocated = allocated  # bytes on disk (both files)
        self.used_at = used_at  # last read or write (wall clock, comparable to mtimes)
        self.touched_at = touched_at  # the data file's mtime as last set or seen


class _Files:
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

    def close(self) -> None:
        self.closed = True
        for fd in (self.data_fd, self.index_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


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
        if block_size <= 0 or block_size % _PAGE:
            raise ValueError(f"block size {block_size} is not a multiple of {_PAGE}")
        self.root = os.path.join(os.path.abspath(directory), _FORMAT)
        self.namespace = namespace
        self.block_size = block_size
        self.size_limit_bytes = size_limit_bytes
        self.min_free_bytes = min_free_bytes
        self.enabled = True
        self._lock = threading.Lock()
        # Versions whose every block was read and verified (see whole_version_file).
        self._verified: set[str] = set()
        # Blocks this process wrote (hashed as they went out) or read back intact, by
        # version: (key, etag, indexes). A version they cover whole can be sealed (see seal).
        self._checked: dict[str, tuple[str, str, set[int]]] = {}
        self._evicting = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # digest -> entry, LRU first
        self._total = 0  # sum of the index's allocated bytes
        self._files: OrderedDict[str, _Files] = OrderedDict()  # open versions, LRU first
        self._direct = hasattr(os, "O_DIRECT")
        self._buffers: list[mmap.mmap] = []  # see _aligned_buffers
        self._error_streak = 0
        self._unchecked_bytes = 0  # written since the last statvfs
        self._space_checked_at = -_SPACE_CHECK_S  # monotonic
        self._space_low = False  # the last statvfs found less than min_free_bytes
        self.skipped_low_space = 0  # blocks not written while free space was under the floor
        self.skipped_full = 0  # blocks not written: no room under the cap, even after evicting
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.corrupt = 0
        self.errors = 0
        self.evictions = 0  # versions removed to make room
        self._prepare(os.path.abspath(directory))
        # The ledger's and the writers' locks for writes, open for the cache's lifetime (no
        # open or close per write): threads take turns on the ledger (_ledger_mutex); the
        # first write in flight takes .writers shared and the last lets go (_writing_now).
        self._lock_fd = os.open(os.path.join(self.root, _LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
        self._writers_fd = os.open(os.path.join(self.root, _WRITERS_NAME), os.O_RDWR | os.O_CLOEXEC)
        weakref.finalize(self, _close_fds, self._lock_fd, self._writers_fd)
        self._ledger_mutex = threading.Lock()
        self._writers_mutex = threading.Lock()
        self._writing_now = 0
        with self._exclusive() as lock_fd:
            self._scan()
            self._settle_ledger(lock_fd)

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
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._check_private(self.root, directory)
        for name in _OLD_FORMATS:
            old = os.path.join(directory, name)
            if os.path.isdir(old) and not os.path.islink(old):
                log.info("disk cache: removing %s (an older cache format)", old)
                shutil.rmtree(old, ignore_errors=True)
        for name in (_LOCK_NAME, _WRITERS_NAME):
            fd = os.open(
                os.path.join(self.root, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
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
        """Rebuild the index from the directory (at start, and before each eviction)."""
        found: dict[str, list[float]] = {}  # digest -> [allocated bytes, latest mtime]
        now = time.time()
        for sub in os.scandir(self.root):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for dirent in os.scandir(sub.path):
                name = dirent.name
                try:
                    st = dirent.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if name.startswith(".tmp-"):
                    if now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(dirent.path)
                    continue
                digest = name.removesuffix(".idx")
                if len(digest) != _DIGEST_LENGTH or not stat.S_ISREG(st.st_mode):
                    continue  # not ours: neither counted nor removed
                seen = found.setdefault(digest, [0, 0.0])
                seen[0] += st.st_blocks * _ST_BLOCK
                seen[1] = max(seen[1], st.st_mtime)
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

    # -- addressing ------------------------------------------------------------------------

    def _version(self, key: str, etag: str) -> _Version:
        ident = "\0".join((self.namespace, key, etag, str(self.block_size)))
        digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()
        parts = [s.encode("utf-8", "surrogateescape") for s in (self.namespace, key, etag)]
        header = _HEADER.pack(
            _MAGIC, _FORMAT_NUMBER, self.block_size, _ENTRY.size, *(len(p) for p in parts)
        ) + b"".join(parts)
        data_path = os.path.join(self.root, digest[:2], digest)
        return _Version(
            digest, header, _round_up(len(header), _PAGE), data_path, data_path + ".idx"
        )

    def locate(self, key: str, etag: str, index: int) -> BlockLocation:
        """The files and offsets of block ``index`` of a version (for tests and tools)."""
        v = self._version(key, etag)
        return BlockLocation(
            v.data_path, index * self.block_size, v.index_path, v.table_offset + index * _ENTRY.size
        )

    # -- the public interface ----------------------------------------------------------------

    def read(self, key: BlockKey, expected_length: int) -> bytes | None:
        """Block ``key`` if it is cached and intact, else None (a corrupt one is dropped)."""
        return self.read_blocks(key.key, key.etag, [key.block], [expected_length]).get(key.block)

    def write(self, key: BlockKey, data: BlockData) -> None:
        """Store one block; evict old versions if over the limits."""
        self.write_blocks(key.key, key.etag, key.block, [data])

    def read_blocks(
        self, key: str, etag: str, indexes: Sequence[int], lengths: Sequence[int]
    ) -> dict[int, bytes]:
        """The cached, intact blocks among ``indexes`` of version (key, etag), by index.

        ``lengths[n]`` is the length block ``indexes[n]`` has (block_size but for an
        object's last block). Blocks not returned are misses: absent, or found damaged and
        dropped. The bytes returned are the caller's (no pooled buffer behind them).
        """
        found: dict[int, bytes] = {}

        def deliver(index: int, view: memoryview, pooled: bool) -> None:
            found[index] = view.tobytes()

        self._read(key, etag, indexes, lengths, None, deliver)
        return found

    def read_blocks_into(
        self, key: str, etag: str, indexes: Sequence[int], buffers: Sequence[memoryview]
    ) -> set[int]:
        """Fill ``buffers[n]`` (writable; its length is the block's) with block
        ``indexes[n]``; returns the indexes filled. O_DIRECT reads go straight into a
        page-aligned buffer of whole pages. A buffer not filled holds unspecified bytes."""
        filled: set[int] = set()
        outs = dict(zip(indexes, (_byte_view(b) for b in buffers), strict=True))

        def deliver(index: int, view: memoryview, pooled: bool) -> None:
            if pooled:
                outs[index][:] = view
            filled.add(index)

        self._read(key, etag, list(outs), [len(b) for b in outs.values()], outs, deliver)
        return filled

    def write_blocks(
        self, key: str, etag: str, first_index: int, blocks: Sequence[BlockData]
    ) -> int:
        """Store blocks ``first_index``, ``first_index + 1``, ... of version (key, etag);
        returns how many were stored, counted from the first (fewer than given: the rest are
        not on disk). Every block but an object's last is block_size long. Runs of up to 8
        blocks are one pwritev of the data and one pwrite of their entries.

        Nothing is written (0) when the version would pass 90% of the cap, when free space
        is under the floor, or when the cap has no room for the write even after evicting
        (the room is reserved in the ledger first: see the module docstring)."""
        if not self.enabled or not blocks:
            return 0
        views = [_byte_view(b) for b in blocks]
        if any(not 0 < len(v) <= self.block_size for v in views):
            raise ValueError(f"a block's length must be 1 to {self.block_size} bytes")
        v = self._version(key, etag)
        nbytes = sum(len(view) for view in views)
        with self._lock:
            entry = self._index.get(v.digest)
            grown = (entry.allocated if entry is not None else 0) + nbytes
        if grown > self.size_limit_bytes * (1 - _EVICT_SLACK):
            log.debug("disk cache: %s is too big for the cache; not caching it", key)
            with self._lock:
                self.skipped_full += len(views)
            return 0
        if not self._room_for(nbytes):
            with self._lock:
                self.skipped_low_space += len(views)
            return 0
        need = self._estimate(v, first_index, views, new=entry is None)
        try:
            room = self._claim_room(need)
        except OSError as exc:
            self._failed("reserving room in", self.root, exc)
            return 0
        if not room:
            log.debug("disk cache: no room for %d bytes of %s under the cap", need, key)
            with self._lock:
                self.skipped_full += len(views)
            return 0
        stored = 0
        landed = need  # what the write allocated: all it reserved, unless measured
        try:
            with self._use(v, create=True) as files:
                if files is not None:  # None: its table kept turning out foreign
                    before = _allocated(files)
                    try:
                        spans = [(first_index + n, len(view)) for n, view in enumerate(views)]
                        for start, stop in _runs(spans, self.block_size):
                            run = views[start:stop]
                            stored += self._write_chunk(v, files, first_index + start, run)
                    finally:
                        after = _allocated(files)
                        landed = after - before
                        self._account(v.digest, files, allocated=after)
        except OSError as exc:
            self._failed("writing", v.data_path, exc)
        else:
            with self._lock:
                self._error_streak = 0
        finally:
            try:
                self._settle_room(need, landed)
            except OSError as exc:
                self._failed("settling the size ledger in", self.root, exc)
        with self._lock:
            self.writes += stored
            if stored:
                self._checked_blocks(v, key, etag).update(range(first_index, first_index + stored))
        return stored

    def _checked_blocks(self, v: _Version, key: str, etag: str) -> set[int]:
        """(Under the lock) The checked blocks of ``v`` (see ``_checked``)."""
        found = self._checked.get(v.digest)
        if found is None:
            found = self._checked[v.digest] = (key, etag, set())
        return found[2]

    def checked_versions(self) -> list[tuple[str, str]]:
        """(key, etag) of the versions this process wrote or read blocks of."""
        with self._lock:
            return [(key, etag) for key, etag, _ in self._checked.values()]

    def seal(self, key: str, etag: str, size: int) -> bool:
        """Record version (key, etag) of ``size`` bytes as verified whole for passthrough
        (``_STAMP``, see whole_version_file) when this process checked every one of its
        blocks (wrote them, hashed as they went out, or read them back intact): no read of
        its bytes, here or in the next process. The data is synced to disk first. True when
        the version is recorded (now or before); False when a block is missing or was not
        checked here."""
        if not self.enabled or size <= 0:
            return False
        v = self._version(key, etag)
        count = (size + self.block_size - 1) // self.block_size
        if v.digest not in self._verified and not self._covered(v, count):
            return False
        return self.whole_version_file(key, etag, size) is not None

    def whole_version_file(self, key: str, etag: str, size: int) -> str | None:
        """The data file of version (key, etag) when it holds exactly the object's ``size``
        bytes, for the kernel to serve by FUSE passthrough (which checks no hash); else None.

        Exactly: every block is listed in the table; the file is cut to ``size`` (an O_DIRECT
        write pads the last block to a page), so it has no padding past the object's end, and
        no holes (block ``i`` fills ``[i * block_size, ...)``); and every block was checked
        against its hash once for this disk cache: written by this process (hashed as it went
        out) or read back intact by it, else read and verified now (a damaged block is
        dropped, so normal reads fetch and rewrite it, and this answers None). The check is
        recorded in the table file (``_STAMP``: the data file's inode and size and a hash of
        the table) after the data is synced to disk, so a remount serves the version with no
        read of its bytes; dropping a block, rewriting the table, replacing or resizing the
        file voids the record, and the next call verifies again. What the record cannot see
        is damage to the data on disk afterwards: passthrough reads it as any local file is
        read, while normal reads still check every block. Blocks that are listed are never
        written again, so the bytes under a passthrough file do not change; eviction unlinks
        the file, and the kernel keeps reading the unlinked one."""
        if not self.enabled or size <= 0:
            return None
        bs = self.block_size
        lengths = [min(bs, size - i * bs) for i in range((size + bs - 1) // bs)]
        if self.missing_bytes(key, etag, lengths):
            return None
        v = self._version(key, etag)
        try:
            st = os.stat(v.data_path)
            if st.st_size > size:
                os.truncate(v.data_path, size)
            elif st.st_size < size:
                return None
        except OSError:
            return None
        if v.digest not in self._verified:
            stamp = self._stamp(v, len(lengths))
            if stamp is None or not self._stamped(v, stamp):
                if not self._covered(v, len(lengths)):
                    log.info("disk cache: checking %s before its first passthrough", v.data_path)
                    bad = self._first_bad_block(v, lengths)
                    if bad is not None:
                        # Read it the usual way, which finds the damage and drops the block.
                        self.read_blocks(key, etag, [bad], [lengths[bad]])
                        return None
                if stamp is not None:
                    self._record_stamp(v, stamp)
            with self._lock:
                self._verified.add(v.digest)
        return v.data_path

    def _covered(self, v: _Version, count: int) -> bool:
        """Whether this process checked every one of the ``count`` blocks of ``v``."""
        with self._lock:
            found = self._checked.get(v.digest)
            return found is not None and all(i in found[2] for i in range(count))

    def _stamp(self, v: _Version, count: int) -> bytes | None:
        """What ``_STAMP`` holds for ``v`` as its files are now (``count`` blocks); None when
        there is no room for it in the header page or the files cannot be read."""
        if len(v.header) > v.table_offset - _STAMP.size:
            return None
        try:
            st = os.stat(v.data_path)
            fd = os.open(v.index_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                table = os.pread(fd, count * _ENTRY.size, v.table_offset)
            finally:
                os.close(fd)
        except OSError:
            return None
        return _STAMP.pack(_STAMP_MAGIC, st.st_ino, st.st_size, xxhash.xxh3_64_intdigest(table))

    def _stamped(self, v: _Version, stamp: bytes) -> bool:
        try:
            fd = os.open(v.index_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(fd, _STAMP.size, v.table_offset - _STAMP.size) == stamp
            finally:
                os.close(fd)
        except OSError:
            return False

    def _record_stamp(self, v: _Version, stamp: bytes) -> None:
        """Record a verification: the data synced first, so a crash cannot leave a record
        over bytes that never reached the disk."""
        try:
            fd = os.open(v.data_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            fd = os.open(v.index_path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, stamp, v.table_offset - _STAMP.size)
            finally:
                os.close(fd)
        except OSError as exc:
            log.info("disk cache: recording the verification of %s failed (%s)", v.data_path, exc)

    def _first_bad_block(self, v: _Version, lengths: Sequence[int]) -> int | None:
        """The first block of ``v`` whose bytes (read buffered) do not match its table entry,
        or None when all do. Any failure to read counts as block 0 being bad."""
        bs = self.block_size
        try:
            with open(v.index_path, "rb", buffering=0) as table_file:
                table = table_file.read()[v.table_offset :]
            with open(v.data_path, "rb", buffering=0) as data_file:
                chunk = 8  # blocks per read: 8 MiB of buffer, reused
                buf = bytearray(chunk * bs)
                view = memoryview(buf)
                for first in range(0, len(lengths), chunk):
                    n = data_file.readinto(view)  # sequential: the kernel reads ahead
                    for index in range(first, min(len(lengths), first + chunk)):
                        at = (index - first) * bs
                        raw = table[index * _ENTRY.size : (index + 1) * _ENTRY.size]
                        if len(raw) != _ENTRY.size or n < at + lengths[index]:
                            return index
                        length, data_hash, _ = _ENTRY.unpack(raw)
                        if length != lengths[index]:
                            return index
                        if _hash(view[at : at + length]) != data_hash:
                            return index
        except OSError:
            return 0
        return None

    def missing_bytes(self, key: str, etag: str, lengths: Sequence[int]) -> int:
        """How many bytes of version (key, etag), whose blocks 0, 1, ... have ``lengths``,
        its table does not list as present now: all of them with the tier off or no table.
        The table is read afresh from the directory (not through a descriptor kept open, so
        a version another process removed counts as missing); the data is not read, so a
        block listed may still turn out damaged when read (and is then fetched again)."""
        total = sum(lengths)
        if not self.enabled or not lengths:
            return total
        v = self._version(key, etag)
        try:
            fd = os.open(v.index_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return total
        try:
            if os.pread(fd, len(v.header), 0) != v.header:
                return total
            table = os.pread(fd, len(lengths) * _ENTRY.size, v.table_offset)
        except OSError:
            return total
        finally:
            os.close(fd)
        missing = 0
        for index, length in enumerate(lengths):
            raw = table[index * _ENTRY.size : (index + 1) * _ENTRY.size]
            if len(raw) == _ENTRY.size and raw != _NO_ENTRY:
                got_length, data_hash, check = _ENTRY.unpack(raw)
                if got_length == length and check == _entry_check(index, got_length, data_hash):
                    continue
            missing += length
        return missing

    def close(self) -> None:
        """Close the open files (those in use when their last user is done)."""
        with self._lock:
            unused = [f for f in self._files.values() if f.users == 0]
            for files in self._files.values():
                files.dropped = True
            self._files.clear()
            self._buffers.clear()
        for files in unused:
            files.close()

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "disk_hits": self.hits,
                "disk_misses": self.misses,
                "disk_writes": self.writes,
                "disk_corrupt": self.corrupt,
                "disk_bytes": self._total,
                "disk_enabled": int(self.enabled),
                "disk_errors": self.errors,
                "disk_evictions": self.evictions,
                "disk_versions": len(self._index),
                "disk_blocks_skipped_low_space": self.skipped_low_space,
                "disk_blocks_skipped_full": self.skipped_full,
            }

    # -- reading ---------------------------------------------------------------------------

    def _read(
        self,
        key: str,
        etag: str,
        indexes: Sequence[int],
        lengths: Sequence[int],
        outs: dict[int, memoryview] | None,
        deliver: Callable[[int, memoryview, bool], None],
    ) -> None:
        if not self.enabled or not indexes:
            return
        wanted = sorted(dict(zip(indexes, lengths, strict=True)).items())
        if any(not 0 < length <= self.block_size for _, length in wanted):
            raise ValueError(f"a block's length must be 1 to {self.block_size} bytes")
        v = self._version(key, etag)
        with self._lock:
            self._checked_blocks(v, key, etag)  # _verify adds the blocks found intact
        hits = 0
        try:
            with self._use(v, create=False) as files:
                if files is not None:
                    for start, stop in _runs(wanted, self.block_size):
                        hits += self._read_run(v, files, wanted[start:stop], outs, deliver)
                    if hits:
                        self._account(v.digest, files, allocated=None)
        except OSError as exc:
            self._failed("reading", v.data_path, exc)
        else:
            with self._lock:
                self._error_streak = 0
        with self._lock:
            self.hits += hits
            self.misses += len(wanted) - hits

    def _read_run(
        self,
        v: _Version,
        files: _Files,
        run: list[tuple[int, int]],
        outs: dict[int, memoryview] | None,
        deliver: Callable[[int, memoryview, bool], None],
    ) -> int:
        """Read consecutive blocks ``run`` ((index, length) pairs); returns the hits."""
        first = run[0][0]
        table = os.pread(
            files.index_fd, len(run) * _ENTRY.size, v.table_offset + first * _ENTRY.size
        )
        present: list[tuple[int, int, int]] = []  # (index, length, data hash)
        for n, (index, length) in enumerate(run):
            raw = table[n * _ENTRY.size : (n + 1) * _ENTRY.size]
            if len(raw) < _ENTRY.size or raw == _NO_ENTRY:
                continue  # cut off, or a hole: absent (never checked, so never "intact")
            got_length, data_hash, check = _ENTRY.unpack(raw)
            if check != _entry_check(index, got_length, data_hash):
                at = v.table_offset + index * _ENTRY.size
                if os.pread(files.index_fd, _ENTRY.size, at) == raw:
                    self._drop_block(v, files, index, "damaged table entry")
                # else: read while another thread or process wrote it; a miss this time
            elif got_length != length:
                self._drop_block(v, files, index, f"length {got_length}, expected {length}")
            else:
                present.append((index, length, data_hash))
        hits = 0
        # Present blocks in consecutive stretches: one preadv each.
        start = 0
        while start < len(present):
            stop = start + 1
            while stop < len(present) and present[stop][0] == present[stop - 1][0] + 1:
                stop += 1
            hits += self._read_data(v, files, present[start:stop], outs, deliver)
            start = stop
        return hits

    def _read_data(
        self,
        v: _Version,
        files: _Files,
        blocks: list[tuple[int, int, int]],
        outs: dict[int, memoryview] | None,
        deliver: Callable[[int, memoryview, bool], None],
    ) -> int:
        offset = blocks[0][0] * self.block_size
        hits = 0
        if self._use_direct(files):
            targets = [outs.get(index) if outs is not None else None for index, _, _ in blocks]
            pooled = [out is None or not _direct_capable(out) for out in targets]
            with self._aligned_buffers(sum(pooled)) as pool:
                spare = iter(pool)
                iov: list[memoryview] = []
                for (_, length, _), out, from_pool in zip(blocks, targets, pooled, strict=True):
                    if from_pool:
                        iov.append(memoryview(next(spare))[: _round_up(length, _PAGE)])
                    else:
                        assert out is not None
                        iov.append(out)  # the caller's page-aligned buffer: DMA straight in
                try:
                    got = os.preadv(files.data_fd, iov, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    got = -1  # O_DIRECT accepted at open but not for the read
                if got >= 0:
                    for n, (index, length, data_hash) in enumerate(blocks):
                        view = iov[n][:length]
                        landed = got - n * self.block_size  # bytes read into it
                        if self._verify(v, files, index, view, landed, data_hash):
                            deliver(index, view, pooled[n])
                            hits += 1
                    return hits
            self._no_direct(files)
        for n, (index, length, data_hash) in enumerate(blocks):
            at = offset + n * self.block_size
            out = outs.get(index) if outs is not None else None
            if out is not None:
                got = os.preadv(files.data_fd, [out], at)
                view = out
            else:
                view = memoryview(os.pread(files.data_fd, length, at))
                got = len(view)
            if self._verify(v, files, index, view, got, data_hash):
                deliver(index, view, False)
                hits += 1
        return hits

    def _verify(
        self, v: _Version, files: _Files, index: int, view: memoryview, got: int, data_hash: int
    ) -> bool:
        """Whether ``view`` (``got`` bytes of it were read) is the block its entry lists."""
        if got < len(view):
            self._drop_block(v, files, index, f"data file ends {max(got, 0)} bytes into it")
            return False
        if _hash(view) != data_hash:
            self._drop_block(v, files, index, "checksum mismatch")
            return False
        with self._lock:
            found = self._checked.get(v.digest)
            if found is not None:
                found[2].add(index)
        return True

    def _drop_block(self, v: _Version, files: _Files, index: int, problem: str) -> None:
        with self._lock:
            self.corrupt += 1
        log.warning(
            "disk cache: dropping corrupt block %d of %s (%s); fetching it again",
            index,
            v.data_path,
            problem,
        )
        with contextlib.suppress(OSError):
            os.pwrite(files.index_fd, _NO_ENTRY, v.table_offset + index * _ENTRY.size)
        if len(v.header) <= v.table_offset - _STAMP.size:
            with contextlib.suppress(OSError):  # no longer verified whole
                os.pwrite(files.index_fd, bytes(_STAMP.size), v.table_offset - _STAMP.size)
        with self._lock:
            self._verified.discard(v.digest)
            found = self._checked.get(v.digest)
            if found is not None:
                found[2].discard(index)

    # -- writing ---------------------------------------------------------------------------

    def _write_chunk(self, v: _Version, files: _Files, first: int, views: list[memoryview]) -> int:
        """Write consecutive blocks (all block_size long but the last) and then their table
        entries; returns how many were written whole. A short write is a full disk."""
        offset = first * self.block_size
        hashes = [_hash(view) for view in views]
        total = (len(views) - 1) * self.block_size + len(views[-1])
        written = -1
        if self._use_direct(files):
            capable = [_direct_capable(view) for view in views]
            with self._aligned_buffers(capable.count(False)) as pool:
                spare = iter(pool)
                iov: list[memoryview] = []
                for view, as_is in zip(views, capable, strict=True):
                    if as_is:
                        iov.append(view)  # the caller's page-aligned buffer: no copy
                        continue
                    padded = _round_up(len(view), _PAGE)
                    buf = memoryview(next(spare))
                    buf[: len(view)] = view
                    buf[len(view) : padded] = bytes(padded - len(view))
                    iov.append(buf[:padded])
                try:
                    written = os.pwritev(files.data_fd, iov, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            if written < 0:  # O_DIRECT accepted at open but not for the write
                self._no_direct(files)
        if written < 0:
            written = os.pwritev(files.data_fd, views, offset)
        whole = 0
        while whole < len(views) and whole * self.block_size + len(views[whole]) <= written:
            whole += 1
        if whole:
            entries = b"".join(_entry(first + n, len(views[n]), hashes[n]) for n in range(whole))
            os.pwrite(files.index_fd, entries, v.table_offset + first * _ENTRY.size)
        if written < total:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return whole

    def _use_direct(self, files: _Files) -> bool:
        """Whether to do this I/O with O_DIRECT (after the tier fell back, no file does)."""
        if files.direct and not self._direct:
            self._clear_direct(files)
        return files.direct

    def _no_direct(self, files: _Files) -> None:
        if self._direct:
            log.debug("disk cache: O_DIRECT refused in %s; using buffered I/O", self.root)
        self._direct = False
        self._clear_direct(files)

    @staticmethod
    def _clear_direct(files: _Files) -> None:
        # Safe while other threads do I/O on the descriptor: buffered I/O takes their
        # aligned buffers as well.
        with contextlib.suppress(OSError):
            flags = fcntl.fcntl(files.data_fd, fcntl.F_GETFL)
            fcntl.fcntl(files.data_fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        files.direct = False

    @contextlib.contextmanager
    def _aligned_buffers(self, count: int) -> Iterator[list[mmap.mmap]]:
        """``count`` page-aligned buffers (anonymous mmaps) of a block each, from a small pool:
        the threads doing disk I/O are shared with the store's GETs, so buffers per thread
        would add up outside the memory budget."""
        with self._lock:
            take = min(count, len(self._buffers))
            bufs = [self._buffers.pop() for _ in range(take)]
        bufs += [mmap.mmap(-1, self.block_size) for _ in range(count - take)]
        try:
            yield bufs
        finally:
            with self._lock:
                keep = max(0, _POOLED_BUFFERS - len(self._buffers))
                self._buffers += bufs[:keep]
            for buf in bufs[keep:]:
                with contextlib.suppress(BufferError):
                    buf.close()

    # -- open files ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _use(self, v: _Version, *, create: bool) -> Iterator[_Files | None]:
        """The open files of version ``v`` (None: it is not cached and ``create`` is false),
        held open for the block of the ``with``."""
        files = self._acquire(v, create)
        try:
            yield files
        finally:
            if files is not None:
                self._release(files)

    def _acquire(self, v: _Version, create: bool) -> _Files | None:
        now = _monotonic()
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
        opened = self._open_files(v, create, now)
        if opened is None:
            return None
        new, allocated, mtime = opened
        closing: list[_Files] = []
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

    def _release(self, files: _Files) -> None:
        with self._lock:
            files.users -= 1
            close = files.dropped and files.users == 0 and not files.closed
            files.closed |= close
        if close:
            files.close()

    def _drop_files(self, digest: str, files: _Files) -> None:
        """Take ``files`` out of the table of open files; closed once unused."""
        with self._lock:
            if self._files.get(digest) is files:
                del self._files[digest]
            files.dropped = True
            close = files.users == 0 and not files.closed
            files.closed |= close
        if close:
            files.close()

    def _open_files(
        self, v: _Version, create: bool, now: float
    ) -> tuple[_Files, int, float] | None:
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
        allocated = (st_data.st_blocks + st_index.st_blocks) * _ST_BLOCK
        mtime = max(st_data.st_mtime, st_index.st_mtime)
        return _Files(index_fd, data_fd, direct, now), allocated, mtime

    def _open_index(self, v: _Version, create: bool) -> int | None:
        """Open the version's table and check its header; None where there is none."""
        for _ in range(2):
            try:
                fd = os.open(v.index_path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    return None
                fd = self._create_index(v)
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
            elif head[: len(_MAGIC)] != _MAGIC:
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

    def _create_index(self, v: _Version) -> int:
        """Create the table file with its header, atomically; returns it open."""
        directory = os.path.dirname(v.index_path)
        tmp = os.path.join(directory, f".tmp-{v.digest}-{os.getpid()}-{threading.get_ident()}")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # the first version in this subdirectory (or it was removed)
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            if os.pwrite(fd, v.header, 0) != len(v.header):  # short: the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            try:
                os.link(tmp, v.index_path)  # never over a table another writer just made
            except FileExistsError:
                os.close(fd)
                fd = os.open(v.index_path, os.O_RDWR | os.O_CLOEXEC)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return fd

    def _remove_version(self, digest: str) -> int:
        """Delete a version's files (the table first: without it nothing is served) and
        forget it; returns the bytes it held by the index."""
        data_path = os.path.join(self.root, digest[:2], digest)
        for path in (data_path + ".idx", data_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with self._lock:
            entry = self._index.pop(digest, None)
            files = self._files.get(digest)
            if entry is not None:
                self._total -= entry.allocated
        if files is not None:
            self._drop_files(digest, files)
        return entry.allocated if entry is not None else 0

    def _account(self, digest: str, files: _Files, *, allocated: int | None) -> None:
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

    def _disable(self, reason: str) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            log.warning("disk cache turned off: %s; objfs continues without it", reason)

    # -- eviction --------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _room_for(self, nbytes: int) -> bool:
        """Whether the free-space floor allows writing ``nbytes`` more (statvfs only every
        64 MiB or second; a low disk first evicts)."""
        if self.min_free_bytes <= 0:
            return True
        now = _monotonic()
        with self._lock:
            self._unchecked_bytes += nbytes
            due = (
                self._unchecked_bytes >= _SPACE_CHECK_BYTES
                or now - self._space_checked_at >= _SPACE_CHECK_S
            )
            if due:
                self._unchecked_bytes = 0
                self._space_checked_at = now
        if due:
            was_low = self._space_low
            try:
                low = self._free_bytes() < self.min_free_bytes
            except OSError:
                low = False  # the write will tell
            self._space_low = low
            if low and self._index:
                self.evict()  # sets _space_low again from the space it left
            if self._space_low != was_low:
                self._log_space_change()
        return not self._space_low

    def _log_space_change(self) -> None:
        """Say once that writes pause (free space under the floor) or resume."""
        if not self._space_low:
            log.info("disk cache: free space is over the floor again; caching resumes")
            return
        try:
            free = f"{self._free_bytes() / (1 << 30):.1f} GiB"
        except OSError:
            free = "too little space"
        log.warning(
            "disk cache: %s free on the file system of %s, under the floor of %.1f GiB "
            "(--cache-min-free), after evicting what it could: new blocks are not cached until "
            "the disk has room again",
            free,
            self.root,
            self.min_free_bytes / (1 << 30),
        )

    def evict(self, need: int = 0, *, reserve: bool = False) -> bool:
        """Delete least recently used versions (of every process sharing the directory) so
        that the directory's bytes, the writes in flight and ``need`` more bytes fit 10%
        under the size cap (when they do not fit under it), and free space is 10% over the
        floor (when under it); returns False at once if another thread is evicting.

        ``reserve`` (a write that needs room, see ``_claim_room``): wait for another
        thread's eviction rather than return, and reserve ``need`` bytes in the ledger under
        the same lock, so no other write takes the room made; True if reserved (the caller
        then holds ``.writers`` shared, as after ``_claim_room``)."""
        if not self._evicting.acquire(blocking=reserve):
            return False  # another thread is at it
        try:
            with self._exclusive() as lock_fd:
                self._scan()  # include what other processes wrote
                return self._evict_locked(lock_fd, need, reserve=reserve)
        except OSError as exc:
            self._failed("evicting in", self.root, exc)
            return False
        finally:
            self._evicting.release()

    def _evict_locked(self, lock_fd: int, need: int, *, reserve: bool) -> bool:
        cap = self.size_limit_bytes
        floor = self.min_free_bytes
        free = self._free_bytes() if floor > 0 else None
        reserved = self._ledger_reserved(lock_fd)
        with self._lock:
            wanted = self._total + reserved + need
        cap_goal = cap - int(cap * _EVICT_SLACK) if wanted > cap else cap
        floor_goal = (
            floor + int(floor * _EVICT_SLACK) if free is not None and free < floor else floor
        )
        while True:
            with self._lock:
                over = self._total + reserved + need > cap_goal or (
                    free is not None and free < floor_goal
                )
                if not over or not self._index:
                    break
                digest = next(iter(self._index))
            freed = self._remove_version(digest)
            with self._lock:
                self.evictions += 1
            if free is not None:
                free += freed
        with self._lock:
            room = reserve and self._total + reserved + need <= cap
        if room:
            self._enter_writing()  # after _ledger_reserved: this write is in flight now
            reserved += need
        try:
            self._settle_ledger(lock_fd, reserved)
        except BaseException:
            if room:
                self._leave_writing()
            raise
        if free is not None:
            self._space_low = self._free_bytes() < floor
        return room

    # -- the size ledger, shared by the processes of the directory ----------------------------

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[int]:
        """``.lock`` opened afresh and exclusively flocked, for a scan (and an eviction): no
        other process or thread evicts or uses the ledger meanwhile, which the holder reads
        and writes through the descriptor yielded."""
        fd = os.open(os.path.join(self.root, _LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the flock

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[int]:
        """The ledger, for a write's reservation or its settling: the same exclusive flock
        as ``_exclusive`` (so it waits for an eviction), on the descriptor kept open."""
        with self._ledger_mutex:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield self._lock_fd
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _ledger_reserved(self, lock_fd: int) -> int:
        """(Ledger locked, the directory just scanned) The bytes reserved by writes in flight;
        0 when no process has a write in flight (what was reserved then had been left by
        a process that died mid-write)."""
        _, reserved = _read_ledger(lock_fd)
        fd = os.open(os.path.join(self.root, _WRITERS_NAME), os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return reserved  # a write in flight holds .writers shared
        finally:
            os.close(fd)
        return 0

    def _settle_ledger(self, lock_fd: int, reserved: int | None = None) -> None:
        """(Ledger locked, the directory just scanned) Count what the scan found, and the
        bytes ``reserved`` (None: as the ledger has them, or 0 with no write in flight)."""
        if reserved is None:
            reserved = self._ledger_reserved(lock_fd)
        with self._lock:
            total = self._total
        _write_ledger(lock_fd, total, reserved)

    def _estimate(
        self, v: _Version, first_index: int, views: Sequence[memoryview], *, new: bool
    ) -> int:
        """What writing ``views`` at block ``first_index`` may allocate, at most: the data in
        whole pages, the table pages its entries fall in (and the header's, for a new
        table), and a page for the file system's own (an extent block)."""
        data = sum(_round_up(len(view), _PAGE) for view in views)
        first = v.table_offset + first_index * _ENTRY.size
        last = first + len(views) * _ENTRY.size - 1
        table = (last // _PAGE - first // _PAGE + 1) * _PAGE
        return data + table + (v.table_offset if new else 0) + _PAGE

    def _claim_room(self, need: int) -> bool:
        """Reserve ``need`` bytes in the ledger if they fit under the cap with what is
        counted and reserved there, else evict and reserve them then (under the eviction's
        lock). True: reserved, and this write holds ``.writers`` shared until
        ``_settle_room``; False: no room even after evicting."""
        # Shared before reserving: an eviction that finds .writers unlocked knows no
        # reservation is live (_ledger_reserved).
        self._enter_writing()
        try:
            with self._ledger() as lock_fd:
                counted, reserved = _read_ledger(lock_fd)
                if counted + reserved + need <= self.size_limit_bytes:
                    _write_ledger(lock_fd, counted, reserved + need)
                    return True
        except BaseException:
            self._leave_writing()
            raise
        self._leave_writing()  # not while evicting: the eviction may then drop leaks
        return self.evict(need, reserve=True)

    def _settle_room(self, need: int, landed: int) -> None:
        """A write that reserved ``need`` bytes is done, and allocated ``landed``: count
        those, drop the reservation, and leave ``.writers``."""
        try:
            with self._ledger() as lock_fd:
                counted, reserved = _read_ledger(lock_fd)
                _write_ledger(lock_fd, counted + landed, max(0, reserved - need))
        finally:
            self._leave_writing()

    def _enter_writing(self) -> None:
        with self._writers_mutex:
            if not self._writing_now:
                fcntl.flock(self._writers_fd, fcntl.LOCK_SH)
            self._writing_now += 1

    def _leave_writing(self) -> None:
        with self._writers_mutex:
            self._writing_now -= 1
            if not self._writing_now:
                fcntl.flock(self._writers_fd, fcntl.LOCK_UN)


def cached_blocks(directory: str) -> int:
    """How many blocks the tables under ``directory`` (a --cache-dir) list as present, for
    tests and tools. Not checked against the data: a block counted may still turn out
    damaged when read."""
    count = 0
    for path in glob.glob(os.path.join(directory, _FORMAT, "??", "*.idx")):
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < _HEADER.size or raw[:8] != _MAGIC:
            continue
        *_, ns, key, etag = _HEADER.unpack_from(raw)
        offset = _round_up(_HEADER.size + ns + key + etag, _PAGE)
        for at in range(offset, len(raw) - _ENTRY.size + 1, _ENTRY.size):
            if raw[at : at + _ENTRY.size] == _NO_ENTRY:
                continue  # a hole
            length, data_hash, check = _ENTRY.unpack_from(raw, at)
            index = (at - offset) // _ENTRY.size
            count += check == _entry_check(index, length, data_hash)
    return count


# -- helpers -----------------------------------------------------------------------------------


def _monotonic() -> float:
    return time.monotonic()  # a function of its own, so tests can move the clock


def _read_ledger(lock_fd: int) -> tuple[int, int]:
    """(counted, reserved) from the ledger; zeros before the first process wrote it."""
    raw = os.pread(lock_fd, _LEDGER.size, 0)
    if len(raw) < _LEDGER.size:
        return 0, 0
    counted, reserved = _LEDGER.unpack(raw)
    return counted, reserved


def _write_ledger(lock_fd: int, counted: int, reserved: int) -> None:
    os.pwrite(lock_fd, _LEDGER.pack(counted, reserved), 0)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _allocated(files: _Files) -> int:
    """Allocated bytes of a version's two files (they are sparse: not their length)."""
    return (os.fstat(files.data_fd).st_blocks + os.fstat(files.index_fd).st_blocks) * _ST_BLOCK


def _entry_check(index: int, length: int, data_hash: int) -> int:
    """An entry's check: the low 32 bits of the XXH3-64 of (index, length, data hash). Only
    for entries that are not all zeros (a hole is tested for first, never checked)."""
    return xxhash.xxh3_64_intdigest(_ENTRY_CHECK.pack(index, length, data_hash)) & 0xFFFF_FFFF


def _entry(index: int, length: int, data_hash: int) -> bytes:
    return _ENTRY.pack(length, data_hash, _entry_check(index, length, data_hash))


def _runs(blocks: list[tuple[int, int]], block_size: int) -> Iterator[tuple[int, int]]:
    """Split sorted (index, length) pairs into [start, stop) spans of consecutive blocks, at
    most _MAX_IO_BLOCKS each, where only the last may be short (so block n of a span is at
    n * block_size from its first)."""
    start = 0
    for n in range(1, len(blocks) + 1):
        if (
            n == len(blocks)
            or blocks[n][0] != blocks[n - 1][0] + 1
            or blocks[n - 1][1] != block_size
            or n - start == _MAX_IO_BLOCKS
        ):
            yield start, n
            start = n


def _byte_view(data: BlockData) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _address(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte (None for a read-only one)."""
    if view.readonly or not len(view):
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _direct_capable(view: memoryview) -> bool:
    """Whether O_DIRECT can take ``view`` as it is: page-aligned, whole pages."""
    if len(view) % _PAGE or not view.c_contiguous:
        return False
    address = _address(view)
    return address is not None and address % _PAGE == 0


def _hash(data: BlockData | mmap.mmap) -> int:
    """XXH3-64 of ``data``'s bytes: bytes, bytearray, mmap or memoryview, read-only or
    writable, hashed in place (xxhash takes the buffer as it is, and releases the GIL). A
    view of any format or shape hashes as its bytes in order; only a non-contiguous view
    (which no block is) is copied first."""
    if isinstance(data, bytes):
        return xxhash.xxh3_64_intdigest(data)
    view = memoryview(data)
    if not view.c_contiguous:
        return xxhash.xxh3_64_intdigest(view.tobytes())
    return xxhash.xxh3_64_intdigest(_byte_view(view))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
