"""``DiskCache``: the disk tier's interface, and the passthrough decision (a version verified
whole).

Contract:

* ``read_blocks(key, etag, indexes, lengths) -> {index: bytes}`` and
  ``read_blocks_into(key, etag, indexes, buffers) -> {indexes filled}`` return the present,
  intact blocks of a list (see ``blockio.py``); ``write_blocks(key, etag, first_index,
  blocks, digests) -> count`` stores a run of consecutive blocks (with the hashes the caller
  computed as they arrived, where it did), or fewer (see ``space.py`` for when none);
  ``listed_now`` tells without waiting which blocks the table lists, or nothing;
  ``read(BlockKey, length)`` and ``write(BlockKey, data)`` do one block;
  ``missing_bytes(key, etag, lengths)`` says how much of a version the table does not list.
* ``open_whole_version`` opens a data file for FUSE passthrough only when it holds exactly the
  object's bytes and every block was checked against its hash once for this cache (by this
  process, or recorded in the table, ``stamp.py``); ``seal`` records that without reading a
  byte when this process checked every block as it wrote or read it. A data file never grows
  past its object's size, and a block the table lists is never written again (another mount
  sharing the directory may be serving the file by passthrough); a descriptor handed out for
  passthrough counts as a use for eviction.
* With the tier off (``enabled`` false) every read is a miss and every write stores nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import objfs.disk_cache.space as space  # the module: its EVICT_SLACK read at call time
from objfs.block_cache import BlockKey
from objfs.disk_cache.blockio import BlockIO, runs
from objfs.disk_cache.layout import (
    ENTRY,
    BlockData,
    BlockLocation,
    Version,
    byte_view,
    listed,
)
from objfs.disk_cache.ledger import estimate
from objfs.disk_cache.space import SpaceKeeper
from objfs.disk_cache.stamp import current_stamp, first_bad_block, record_stamp, stamp_recorded
from objfs.disk_cache.versions import Files

log = logging.getLogger("objfs.disk_cache")  # one name for the tier


class DiskCache(BlockIO, SpaceKeeper):
    """The persistent tier of blocks of one cache directory: ``DiskCache(directory, *,
    namespace, block_size, size_limit_bytes, min_free_bytes)`` (see ``SpaceKeeper``).
    ``fetch_locks`` (``VersionStore``): which blocks processes sharing the directory are
    fetching (``fetching.py``; the trio thread's, unlike the rest, which any thread may use)."""

    def locate(self, key: str, etag: str, index: int) -> BlockLocation:
        """The files and offsets of block ``index`` of a version (for tests and tools)."""
        v = self._version(key, etag)
        return BlockLocation(
            v.data_path, index * self.block_size, v.index_path, v.table_offset + index * ENTRY.size
        )

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
        outs = dict(zip(indexes, (byte_view(b) for b in buffers), strict=True))

        def deliver(index: int, view: memoryview, pooled: bool) -> None:
            if pooled:
                outs[index][:] = view
            filled.add(index)

        self._read(key, etag, list(outs), [len(b) for b in outs.values()], outs, deliver)
        return filled

    def write_blocks(
        self,
        key: str,
        etag: str,
        first_index: int,
        blocks: Sequence[BlockData],
        digests: Sequence[int | None] | None = None,
    ) -> int:
        """Store blocks ``first_index``, ``first_index + 1``, ... of version (key, etag);
        returns how many were stored, counted from the first (fewer than given: the rest are
        not on disk). Every block but an object's last is block_size long. Runs of up to 8
        blocks are one pwritev of the data and one pwrite of their entries.

        ``digests[n]``, where given, is the XXH3-64 of ``blocks[n]`` as the caller computed
        it (the fetcher hashes a block as it arrives, while its bytes are in the CPU's
        caches), put in its entry without hashing it again; None: hashed here. A wrong one
        is never wrong bytes: the first read of the block finds its check failing, drops it
        and reads it as a miss.

        Nothing is written (0) when the version would pass 90% of the cap, when free space
        is under the floor, or when the cap has no room for the write even after evicting
        (the room is reserved in the ledger first: see ``space.py``)."""
        if not self.enabled or not blocks:
            return 0
        views = [byte_view(b) for b in blocks]
        if any(not 0 < len(v) <= self.block_size for v in views):
            raise ValueError(f"a block's length must be 1 to {self.block_size} bytes")
        if digests is None:
            digests = [None] * len(views)
        elif len(digests) != len(views):
            raise ValueError(f"{len(digests)} digests for {len(views)} blocks")
        v = self._version(key, etag)
        nbytes = sum(len(view) for view in views)
        with self._lock:
            entry = self._index.get(v.digest)
            grown = (entry.allocated if entry is not None else 0) + nbytes
        if grown > self.size_limit_bytes * (1 - space.EVICT_SLACK):
            log.debug("disk cache: %s is too big for the cache; not caching it", key)
            with self._lock:
                self.skipped_full += len(views)
            return 0
        if not self._room_for(nbytes):
            with self._lock:
                self.skipped_low_space += len(views)
            return 0
        need = estimate(v, first_index, views, new=entry is None)
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
        stored = 0  # blocks on disk, counted from the first: listed before, or written now
        written: list[int] = []  # indexes written (hashed, here or as they arrived) by this call
        landed = need  # what the write allocated: all it reserved, unless measured
        try:
            with self._use(v, create=True) as files:
                if files is not None:  # None: its table kept turning out foreign
                    before = files.allocated()
                    try:
                        # A block the table lists is never written again: its bytes may be
                        # under a passthrough reader (another mount sharing the directory).
                        listed = self._listed(v, files, first_index, views)
                        spans = [
                            (first_index + n, len(view))
                            for n, view in enumerate(views)
                            if n not in listed
                        ]
                        for start, stop in runs(spans, self.block_size):
                            at = spans[start][0] - first_index
                            stored = at  # the blocks before this run are listed
                            run = views[at : at + stop - start]
                            whole = self._write_chunk(
                                v, files, first_index + at, run, digests[at : at + len(run)]
                            )
                            written += range(first_index + at, first_index + at + whole)
                            stored += whole
                        stored = len(views)
                    finally:
                        after = files.allocated()
                        landed = after - before
                        # Nothing written (every block listed): a use, not a change.
                        self._account(v.digest, files, allocated=after if written else None)
        except OSError as exc:
            self._failed("writing", v.data_path, exc)
        else:
            self._succeeded()
        finally:
            try:
                self._settle_room(need, landed)
            except OSError as exc:
                self._failed("settling the size ledger in", self.root, exc)
        with self._lock:
            self.writes += len(written)
            if written:
                self._checked_blocks(v, key, etag).update(written)
        return stored

    def _listed(
        self, v: Version, files: Files, first: int, views: Sequence[memoryview]
    ) -> set[int]:
        """Which of blocks ``first``, ``first + 1``, ... (``views``: their bytes) the table
        lists already with their length, as positions in ``views``."""
        entries = os.pread(
            files.index_fd, len(views) * ENTRY.size, v.table_offset + first * ENTRY.size
        )
        present = listed(entries, first, [len(view) for view in views])
        return {n for n, there in enumerate(present) if there}

    def checked_versions(self) -> list[tuple[str, str]]:
        """(key, etag) of the versions this process wrote or read blocks of."""
        with self._lock:
            return [(key, etag) for key, etag, _ in self._checked.values()]

    # -- passthrough -----------------------------------------------------------------------

    def seal(self, key: str, etag: str, size: int) -> bool:
        """Record version (key, etag) of ``size`` bytes as verified whole for passthrough
        (``STAMP``, see open_whole_version) when this process checked every one of its
        blocks (wrote them, hashed as they arrived or went out, or read them back intact):
        no read of its bytes, here or in the next process. The data is synced first. True when
        the version is recorded (now or before); False when a block is missing or was not
        checked here."""
        if not self.enabled or size <= 0:
            return False
        v = self._version(key, etag)
        count = (size + self.block_size - 1) // self.block_size
        if v.digest not in self._verified and not self._covered(v, count):
            return False
        fd = self.open_whole_version(key, etag, size, use=False)
        if fd is None:
            return False
        os.close(fd)
        return True

    def whole_version_file(self, key: str, etag: str, size: int) -> str | None:
        """The path of the data file :meth:`open_whole_version` would hand out, for tools and
        tests (passthrough registers the descriptor, never a path: the path may name a newer
        file by the time it is opened)."""
        fd = self.open_whole_version(key, etag, size, use=False)
        if fd is None:
            return None
        os.close(fd)
        return self._version(key, etag).data_path

    def open_whole_version(self, key: str, etag: str, size: int, *, use: bool = True) -> int | None:
        """A read-only descriptor (the caller's to close) of the data file of version (key,
        etag) when it holds exactly the object's ``size`` bytes, for the kernel to serve by
        FUSE passthrough (which checks no hash); else None. The checks below are made on
        that descriptor's file, so the file checked is the file handed out even if the
        version is evicted and created again meanwhile.

        Exactly: every block is listed in the table; the file is ``size`` bytes long (writes
        never pad it, ``blockio.py``; a longer file left by an older objfs is cut to size),
        so it has nothing past the object's end, and no holes (block ``i`` fills ``[i *
        block_size, ...)``); and every block was checked against its hash once for this disk
        cache: written by this process (hashed as it arrived or went out) or read back
        intact by it, else read and verified now (a damaged block is dropped, so normal reads
        fetch and rewrite it, and this answers None). The check is recorded in the table file
        (``STAMP``: the data file's inode and size and a hash of the table) after the data
        is synced to disk, so a remount serves the version with no read of its bytes;
        dropping a block, rewriting the table, replacing or resizing the file voids the
        record, and the next call verifies again. What the record cannot see is damage to
        the data on disk afterwards: passthrough reads it as any local file is read, while
        normal reads still check every block. Blocks that are listed are never written
        again (``write_blocks``), so the bytes under a passthrough file do not change;
        eviction unlinks the file, and the kernel keeps reading the unlinked one.

        A descriptor handed out with ``use`` is a use of the version, as a read is: it moves
        to the recent end of the eviction order (and its mtime, the order other processes and
        restarts see, is touched at most once a minute). ``seal`` and ``whole_version_file``
        pass ``use=False``: recording a check is not a use."""
        if not self.enabled or size <= 0:
            return None
        bs = self.block_size
        lengths = [min(bs, size - i * bs) for i in range((size + bs - 1) // bs)]
        v = self._version(key, etag)
        try:
            fd = os.open(v.data_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            # The table is read after the file is open, and the file must still be the one
            # its path names: a table listing every block then speaks for this file (a
            # version evicted and written again meanwhile is another file, refused here).
            table = self._table(v, len(lengths))
            if (
                table is not None
                and all(listed(table[v.table_offset :], 0, lengths))
                and self._current(v, fd)
                and self._whole(key, etag, v, fd, lengths, table)
            ):
                if use:
                    self._used_whole(v)
                return fd
        except OSError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    @staticmethod
    def _current(v: Version, fd: int) -> bool:
        """Whether ``fd`` is the data file the path of ``v`` names now (not one removed)."""
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return False
        path_st = os.stat(v.data_path)
        return (path_st.st_dev, path_st.st_ino) == (st.st_dev, st.st_ino)

    def _whole(
        self, key: str, etag: str, v: Version, fd: int, lengths: Sequence[int], table: bytes
    ) -> bool:
        """Whether the data file open as ``fd`` holds exactly version ``v`` (see
        open_whole_version; ``table``: its table as read, see ``_table``), verified now if it
        was not before: the record in the table (``STAMP``: this file's inode and size, the
        table's hash) is the proof; where the header has no room for one, this process's
        memory of the file it verified."""
        size = sum(lengths)
        st = os.fstat(fd)
        if st.st_size > size:
            os.truncate(f"/proc/self/fd/{fd}", size)  # that very file, not the path's
            st = os.fstat(fd)
        if st.st_size != size:
            return False
        stamp = current_stamp(v, table[v.table_offset :], fd)
        if stamp is not None and stamp_recorded(v, table, stamp):
            return True
        with self._lock:
            if stamp is None and self._verified.get(v.digest) == (st.st_dev, st.st_ino):
                return True
        if not self._covered(v, len(lengths)):
            log.info("disk cache: checking %s before its first passthrough", v.data_path)
            bad = self._first_bad_block(v, fd, lengths)
            if bad is not None:
                # Read it the usual way, which finds the damage and drops the block.
                self.read_blocks(key, etag, [bad], [lengths[bad]])
                return False
        if stamp is not None:
            record_stamp(v, stamp, fd)
        with self._lock:
            self._verified[v.digest] = (st.st_dev, st.st_ino)
        return True

    def _used_whole(self, v: Version) -> None:
        """A passthrough use of ``v``: recency, as a read of its blocks gives."""
        with self._use(v, create=False) as files:
            if files is not None:
                self._account(v.digest, files, allocated=None)

    def _first_bad_block(self, v: Version, fd: int, lengths: Sequence[int]) -> int | None:
        """The first block of ``v`` (its data file open as ``fd``) whose bytes do not match
        its entry, read now (see ``stamp.first_bad_block``); None when all do."""
        return first_bad_block(v, fd, lengths, self.block_size)

    def _covered(self, v: Version, count: int) -> bool:
        """Whether this process checked every one of the ``count`` blocks of ``v``."""
        with self._lock:
            found = self._checked.get(v.digest)
            return found is not None and all(i in found[2] for i in range(count))

    # -- the rest --------------------------------------------------------------------------

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
        table = self._table(v, len(lengths))
        if table is None:
            return total
        present = listed(table[v.table_offset :], 0, lengths)
        return sum(length for length, there in zip(lengths, present, strict=True) if not there)

    @staticmethod
    def _table(v: Version, count: int) -> bytes | None:
        """The table of ``v`` as it is now, read afresh by its path (not through a descriptor
        kept open, so a version another process removed has none) in one read: its header
        page (the record of a check included) and ``count`` entries, cut short where the
        table ends; None where there is no table that names ``v``."""
        try:
            fd = os.open(v.index_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            table = os.pread(fd, v.table_offset + count * ENTRY.size, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        return table if table[: len(v.header)] == v.header else None

    def close(self) -> None:
        """Close the open files (those in use when their last user is done) and drop the
        fetch locks."""
        self.fetch_locks.close()
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
                "disk_fetch_waits": self.fetch_locks.waits,
                "disk_enabled": int(self.enabled),
                "disk_errors": self.errors,
                "disk_evictions": self.evictions,
                "disk_versions": len(self._index),
                "disk_blocks_skipped_low_space": self.skipped_low_space,
                "disk_blocks_skipped_full": self.skipped_full,
            }
