"""The size ledger, which makes the cap hold for the cache directory, not per process.

The ledger is the first 16 bytes of ``DIR/v4/.lock``: the allocated bytes *counted* (set from
a scan of the directory, plus what each write allocated since) and the bytes *reserved* by
writes in flight (``_LEDGER``). Contract:

* It is read and written only under an exclusive flock of ``.lock``: ``exclusive`` (opened
  afresh, for a scan and an eviction) or ``locked`` (the descriptor kept open, for a write's
  reservation and settling; threads take turns on it, ``_mutex``). Both exclude each other.
* A write reserves its ``estimate`` (``reserve``) before writing and settles (``settle_write``:
  what it allocated counted, its reservation dropped) after. From before its reservation to
  its settling it holds ``.writers`` shared (all threads of a process through one descriptor,
  a count: ``enter_writing``/``leave_writing``). So when ``.writers`` can be locked
  exclusively at once no write is in flight, and what is still reserved was left by a process
  that died mid-write: ``reserved`` answers 0 then.
* ``estimate`` is at least what a write allocates but for file-system metadata past the page
  it allows for that.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence

from objfs.disk_cache.layout import ENTRY, PAGE, Version, round_up

# The size ledger shared by the processes of one directory, the first bytes of DIR/v4/.lock:
# the allocated bytes counted (as of the last scan, plus every write since) and the bytes
# reserved by writes in flight. Read and written only under an exclusive flock of .lock.
_LEDGER = struct.Struct("<qq")
_LOCK_NAME = ".lock"  # flock: eviction and the ledger
_WRITERS_NAME = ".writers"  # flock: shared by each write in flight (see reserve)


class Ledger:
    """The ledger of one cache directory (``root``: ``DIR/v4``), for one process."""

    def __init__(self, root: str) -> None:
        self.root = root
        # The ledger's and the writers' locks for writes, open for the cache's lifetime (no
        # open or close per write): threads take turns on the ledger (_mutex); the first
        # write in flight takes .writers shared and the last lets go (_writing_now).
        self._lock_fd = _open_or_create(os.path.join(root, _LOCK_NAME))
        try:
            self._writers_fd = _open_or_create(os.path.join(root, _WRITERS_NAME))
        except BaseException:
            os.close(self._lock_fd)
            raise
        weakref.finalize(self, _close_fds, self._lock_fd, self._writers_fd)
        self._mutex = threading.Lock()
        self._writers_mutex = threading.Lock()
        self._writing_now = 0

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[int]:
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
    def locked(self) -> Iterator[int]:
        """The ledger, for a write's reservation or its settling: the same exclusive flock
        as ``exclusive`` (so it waits for an eviction), on the descriptor kept open."""
        with self._mutex:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield self._lock_fd
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def reserved(self, lock_fd: int) -> int:
        """(Ledger locked, the directory just scanned) The bytes reserved by writes in flight;
        0 when no process has a write in flight (what was reserved then had been left by
        a process that died mid-write)."""
        _, reserved = read_ledger(lock_fd)
        fd = os.open(os.path.join(self.root, _WRITERS_NAME), os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return reserved  # a write in flight holds .writers shared
        finally:
            os.close(fd)
        return 0

    def reserve(self, need: int, cap: int) -> bool:
        """Reserve ``need`` bytes if they fit under ``cap`` with what is counted and reserved.
        True: reserved, and this write holds ``.writers`` shared until ``settle_write``;
        False: no room (and ``.writers`` left)."""
        # Shared before reserving: an eviction that finds .writers unlocked knows no
        # reservation is live (reserved).
        self.enter_writing()
        try:
            with self.locked() as lock_fd:
                counted, reserved = read_ledger(lock_fd)
                if counted + reserved + need <= cap:
                    write_ledger(lock_fd, counted, reserved + need)
                    return True
        except BaseException:
            self.leave_writing()
            raise
        self.leave_writing()  # before any eviction for it: that may then drop leaks
        return False

    def settle_write(self, need: int, landed: int) -> None:
        """A write that reserved ``need`` bytes is done, and allocated ``landed``: count
        those, drop the reservation, and leave ``.writers``."""
        try:
            with self.locked() as lock_fd:
                counted, reserved = read_ledger(lock_fd)
                write_ledger(lock_fd, counted + landed, max(0, reserved - need))
        finally:
            self.leave_writing()

    def enter_writing(self) -> None:
        with self._writers_mutex:
            if not self._writing_now:
                fcntl.flock(self._writers_fd, fcntl.LOCK_SH)
            self._writing_now += 1

    def leave_writing(self) -> None:
        with self._writers_mutex:
            self._writing_now -= 1
            if not self._writing_now:
                fcntl.flock(self._writers_fd, fcntl.LOCK_UN)


def estimate(v: Version, first_index: int, views: Sequence[memoryview], *, new: bool) -> int:
    """What writing ``views`` at block ``first_index`` may allocate, at most: the data in
    whole pages, the table pages its entries fall in (and the header's, for a new
    table), and a page for the file system's own (an extent block)."""
    data = sum(round_up(len(view), PAGE) for view in views)
    first = v.table_offset + first_index * ENTRY.size
    last = first + len(views) * ENTRY.size - 1
    table = (last // PAGE - first // PAGE + 1) * PAGE
    return data + table + (v.table_offset if new else 0) + PAGE


def read_ledger(lock_fd: int) -> tuple[int, int]:
    """(counted, reserved) from the ledger; zeros before the first process wrote it."""
    raw = os.pread(lock_fd, _LEDGER.size, 0)
    if len(raw) < _LEDGER.size:
        return 0, 0
    counted, reserved = _LEDGER.unpack(raw)
    return counted, reserved


def write_ledger(lock_fd: int, counted: int, reserved: int) -> None:
    os.pwrite(lock_fd, _LEDGER.pack(counted, reserved), 0)


def _open_or_create(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
