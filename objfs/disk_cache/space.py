"""Room on disk: the size cap, the free-space floor and eviction (``SpaceKeeper``, a part of
``DiskCache``; its ``__init__`` is DiskCache's, and makes the first scan).

Contract:

* **The versions' files in the directory allocate at most ``size_limit_bytes``**, over it only
  by what writes in flight allocate beyond their estimates. The cap holds for the directory,
  shared by its processes, through the ledger (``ledger.py``): a write first claims its
  estimate (``_claim_room``: reserved if counted + reserved + estimate fit under the cap, else
  after evicting, else not made) and settles what it allocated afterwards (``_settle_room``).
  The count may run high (a block written by two processes at once, a table removed as
  corrupt, a version another process removed while this one wrote to it), which costs an
  early scan, never a byte over the cap.
* New blocks are not written while free space is under ``min_free_bytes`` (``_room_for``,
  statvfs at most once per 64 MiB written or per second; a low disk first evicts). Writes
  pausing and resuming are logged once each.
* ``evict`` removes whole versions, least recently used first, of every process sharing the
  directory (under ``.lock``, after a scan), down to 90% of the cap with the write counted
  (110% of the floor): so a full cache evicts, and scans, once per tenth of the cap written.
  Whole versions rather than hole punching: a loader reads a file whole, so its blocks age
  together; one unlink frees a version at once; per-block recency could not survive a restart.
  One thread evicts at a time (others skip it, or wait to evict for their own write).
* A version that alone would pass 90% of the cap is not cached further (it would evict
  itself): ``DiskCache.write_blocks`` stores nothing of it.
"""

from __future__ import annotations

import logging
import os
import threading

import objfs.disk_cache.versions as versions  # the module: its clock read at call time
from objfs.disk_cache.ledger import Ledger, write_ledger
from objfs.disk_cache.versions import VersionStore

log = logging.getLogger("objfs.disk_cache")  # one name for the tier

# statvfs for the free-space floor after this many bytes written, or this long: the floor
# leaves gigabytes, so 64 MiB between checks cannot fill a disk.
_SPACE_CHECK_BYTES = 64 << 20
_SPACE_CHECK_S = 1.0
# Eviction goes this fraction below the limit it enforces, so a full cache evicts (and
# scans) once per tenth of the cap written, not on every write.
EVICT_SLACK = 0.1


class SpaceKeeper(VersionStore):
    def __init__(
        self,
        directory: str,
        *,
        namespace: str,
        block_size: int,
        size_limit_bytes: int,
        min_free_bytes: int,
    ) -> None:
        super().__init__(directory, namespace=namespace, block_size=block_size)
        self.size_limit_bytes = size_limit_bytes
        self.min_free_bytes = min_free_bytes
        self._evicting = threading.Lock()
        self._unchecked_bytes = 0  # written since the last statvfs
        self._space_checked_at = -_SPACE_CHECK_S  # monotonic
        self._space_low = False  # the last statvfs found less than min_free_bytes
        self.skipped_low_space = 0  # blocks not written while free space was under the floor
        self.skipped_full = 0  # blocks not written: no room under the cap, even after evicting
        self.evictions = 0  # versions removed to make room
        self._ledger = Ledger(self.root)
        with self._ledger.exclusive() as lock_fd:
            self._scan()
            self._settle_ledger(lock_fd)

    # -- the free-space floor --------------------------------------------------------------

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _room_for(self, nbytes: int) -> bool:
        """Whether the free-space floor allows writing ``nbytes`` more (statvfs only every
        64 MiB or second; a low disk first evicts)."""
        if self.min_free_bytes <= 0:
            return True
        now = versions.monotonic()  # the tier's one clock
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

    # -- eviction --------------------------------------------------------------------------

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
            with self._ledger.exclusive() as lock_fd:
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
        reserved = self._ledger.reserved(lock_fd)
        with self._lock:
            wanted = self._total + reserved + need
        cap_goal = cap - int(cap * EVICT_SLACK) if wanted > cap else cap
        floor_goal = (
            floor + int(floor * EVICT_SLACK) if free is not None and free < floor else floor
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
            self._ledger.enter_writing()  # after reserved(): this write is in flight now
            reserved += need
        try:
            self._settle_ledger(lock_fd, reserved)
        except BaseException:
            if room:
                self._ledger.leave_writing()
            raise
        if free is not None:
            self._space_low = self._free_bytes() < floor
        return room

    # -- the size ledger, shared by the processes of the directory ----------------------------

    def _settle_ledger(self, lock_fd: int, reserved: int | None = None) -> None:
        """(Ledger locked, the directory just scanned) Count what the scan found, and the
        bytes ``reserved`` (None: as the ledger has them, or 0 with no write in flight)."""
        if reserved is None:
            reserved = self._ledger.reserved(lock_fd)
        with self._lock:
            total = self._total
        write_ledger(lock_fd, total, reserved)

    def _claim_room(self, need: int) -> bool:
        """Reserve ``need`` bytes in the ledger if they fit under the cap with what is
        counted and reserved there, else evict and reserve them then (under the eviction's
        lock). True: reserved, and this write holds ``.writers`` shared until
        ``_settle_room``; False: no room even after evicting."""
        if self._ledger.reserve(need, self.size_limit_bytes):
            return True
        return self.evict(need, reserve=True)

    def _settle_room(self, need: int, landed: int) -> None:
        """A write that reserved ``need`` bytes is done, and allocated ``landed``: count
        those, drop the reservation, and leave ``.writers``."""
        self._ledger.settle_write(need, landed)
