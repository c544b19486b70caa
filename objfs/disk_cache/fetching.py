"""Which blocks some process sharing the cache directory is fetching now (``FetchLocks``).

Mounts that share a cache directory (pods of one identity on a node, several systemd mounts
of one source on a host) fetch each block once between them: a mount about to fetch a block
takes its lock first; a mount that finds it taken waits for the block to land in the disk tier
instead, and reads it from there.

Contract:

* A block's lock is a write lock (``F_OFD_SETLK``, never waiting) on one byte of the
  directory's file ``fetching``, at an offset made of the version's digest and the block's
  index. Open file description locks conflict between every two opens of the file, in one
  process or in two, and the kernel drops them when the descriptor is closed or its holder
  dies: a killed fetcher never blocks the others.
* The lock file is open only while this open holds a lock (closing it drops none then).
* ``take`` takes the locks of the blocks it can and says which (a failure of a moment, such as
  no descriptor left, counts as taken: that block is fetched unlocked); a taken lock stays until
  ``release`` (the block is on disk, or will not be: the holder fetched it and gave up on
  writing it, or its fetch failed) or ``close``. Releasing is idempotent.
* Two blocks may share an offset (36 bits of the digest; indexes past 2^26): a waiter in
  another process then waits for an unrelated fetch, reads the disk and fetches the block
  itself if it is not there; in this process the byte stays locked until every block on it is
  released. That costs time at most: a block is read from the disk tier only after its hash
  is checked.
* Once per node is as good as the disk tier keeps what it is given: a block the memory tier
  drops before the disk writer gets to it (a budget too small for the load), or one the disk
  refuses (its cap, its free-space floor), is fetched again by whichever mount needs it next.
* A file system that refuses the locks (some network file systems) turns them off with one
  warning: every mount then fetches for itself, as before.

Trio thread only: the calls are non-blocking system calls of a few microseconds.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections.abc import Callable, Iterable

from objfs.block_cache import BlockKey

log = logging.getLogger("objfs.disk_cache")  # one name for the tier

# struct flock (LP64 Linux: l_type, l_whence short; l_start, l_len off_t; l_pid int), padded
# to its C size.
_FLOCK = struct.Struct("@hhqqi")
_FLOCK_SIZE = 32
# Block indexes per version in the lock file's offsets (64 Mi blocks: 64 TiB of 1 MiB blocks,
# past any object a store holds; beyond, indexes wrap and share bytes).
_INDEX_BITS = 26
# Bits of the digest above them (offsets stay under 2^62, within off_t).
_DIGEST_BITS = 36
_CONFLICT = frozenset({errno.EAGAIN, errno.EACCES})
# Errors of a moment (descriptors, memory): that block is fetched without its lock, and the
# locks stay on.
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR})


def lock_offset(digest: str, index: int) -> int:
    """The byte of the lock file that stands for block ``index`` of version ``digest``."""
    high = int(digest[: _DIGEST_BITS // 4], 16)
    return (high << _INDEX_BITS) + (index % (1 << _INDEX_BITS))


class FetchLocks:
    """The fetch locks of one cache directory, as this open of its lock file holds them.
    ``digest_of(key, etag)``: a version's digest (the disk tier's naming, memoized there)."""

    def __init__(self, root: str, digest_of: Callable[[str, str], str]) -> None:
        self.path = os.path.join(root, "fetching")
        self.enabled = True
        self._digest_of = digest_of
        self._fd = -1  # open only while a lock is held (see _close_if_idle)
        # Offsets locked here, and the blocks (key, etag, index) that hold each.
        self._held: dict[int, set[tuple[str, str, int]]] = {}
        #: Blocks this process wanted while another was fetching them (the fetcher counts).
        self.waits = 0

    def _offset(self, key: str, etag: str, index: int) -> int:
        return lock_offset(self._digest_of(key, etag), index)

    def take(self, key: str, etag: str, indexes: Iterable[int]) -> list[int]:
        """Lock the blocks ``indexes`` of version (key, etag) that no other open of the lock
        file holds; returns those (all of them when the locks are off)."""
        wanted = list(indexes)
        if not self.enabled:
            return wanted
        if self._fd < 0:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    self._refused(exc)
                return wanted
        taken = []
        for index in wanted:
            offset = self._offset(key, etag, index)
            holders = self._held.get(offset)
            if holders is None:
                got = self._lock(offset, fcntl.F_WRLCK)
                if not self.enabled:
                    return wanted
                if got is None:
                    taken.append(index)  # a failure of a moment: fetched unlocked
                    continue
                if not got:
                    continue
                holders = self._held[offset] = set()
            holders.add((key, etag, index))
            taken.append(index)
        self._close_if_idle()
        return taken

    def release(self, key: str, etag: str, indexes: Iterable[int]) -> None:
        """Unlock blocks of (key, etag) that this open holds (the others are left alone); a
        byte is unlocked once no block that holds it here is left."""
        if not self._held:
            return
        for index in indexes:
            offset = self._offset(key, etag, index)
            holders = self._held.get(offset)
            if holders is None:
                continue
            holders.discard((key, etag, index))
            if not holders:
                del self._held[offset]
                if self.enabled:
                    self._lock(offset, fcntl.F_UNLCK)
        self._close_if_idle()

    def release_keys(self, keys: Iterable[BlockKey]) -> None:
        """``release`` by block keys."""
        if not self._held:
            return
        for k in keys:
            self.release(k.key, k.etag, [k.block])

    def held(self) -> int:
        """How many bytes of the lock file (blocks' locks) this open holds."""
        return len(self._held)

    def _close_if_idle(self) -> None:
        """No lock held: the descriptor goes too (it is opened again by the next take), so an
        open of the cache that stopped fetching, or was never closed, holds none."""
        if not self._held and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Drop every lock (closing the descriptor does it); the locks are off after."""
        self._held.clear()
        self.enabled = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _lock(self, offset: int, kind: int) -> bool | None:
        """One lock operation on one byte; False when another open holds it, None for a
        failure of a moment (the locks stay on; any other failure turns them off)."""
        request = _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0).ljust(_FLOCK_SIZE, b"\0")
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, request)
        except OSError as exc:
            if exc.errno in _CONFLICT:
                return False
            if exc.errno in _TRANSIENT:
                return None
            self._refused(exc)
            return False
        return True

    def _refused(self, exc: OSError) -> None:
        log.warning(
            "disk cache: fetch locks refused in %s (%s); each mount fetches for itself",
            self.path,
            exc.strerror or exc,
        )
        self.close()  # none may stay held: the others would wait for them
