"""The disk tier (format v4) on its own: round trips, runs, crashes and damage, eviction,
the free-space floor, errors, O_DIRECT fallbacks and sharing a directory.

Deterministic: damage comes from seeded generators, clocks are moved by hand, and system
calls are counted through monkeypatched ``os`` functions. Blocks are 64 KiB (a multiple of the
page, as the format needs) so the tests write little.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import glob
import logging
import mmap
import os
import random
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from objfs.block_cache import BlockKey
from objfs.disk_cache import DiskCache, blockio, cached_blocks, layout, space, versions
from objfs.errors import UsageError

BS = 64 * 1024
MiB = 1024 * 1024


def make_cache(directory: Path, *, block_size: int = BS, **kwargs: int) -> DiskCache:
    options = {"size_limit_bytes": 1 << 30, "min_free_bytes": 0, **kwargs}
    return DiskCache(str(directory), namespace="memory://", block_size=block_size, **options)


def block(key: str, index: int, length: int = BS) -> bytes:
    """The bytes of block ``index`` of ``key``: the same in every process."""
    return random.Random(f"{key}/{index}").randbytes(length)


@pytest.fixture(autouse=True)
def _collection_back_on() -> Iterator[None]:
    """Earlier tests' garbage collected first (their caches' descriptors closed), so that
    neither a count of calls nor a count of open descriptors takes it for this test's."""
    gc.collect()
    yield
    gc.enable()


def count_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Count calls of ``os.<name>`` made by this thread from now on.

    Garbage collection is off until the test ends (after one full collection): a cycle
    of an earlier test's objects collected mid-count closes its descriptors through
    ``os.close`` (CI counted 30 such closes once), and other threads' calls are not
    the code under test's either."""
    gc.collect()
    gc.disable()  # enabled again by ``_collection_back_on``
    counts = dict.fromkeys(names, 0)
    me = threading.get_ident()
    for name in names:
        real = getattr(os, name)

        def counting(*args: Any, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            if threading.get_ident() == me:
                counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(os, name, counting)
    return counts


def corrupt_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum("corrupt" in r.getMessage() for r in caplog.records)


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_round_trips_blocks_of_every_length(tmp_path: Path, direct: bool) -> None:
    """Blocks are written with O_DIRECT where the file system allows it, else buffered;
    either way every length reads back intact, also across the two modes, and the data file
    ends where the object does (an O_DIRECT write is never padded past it)."""
    cache = make_cache(tmp_path / "c")
    cache._direct = direct and hasattr(os, "O_DIRECT")
    lengths = (1, 4095, 4096, 5000, BS - 1, BS)
    blobs = {BlockKey(f"k{n}", "e", 3): os.urandom(n) for n in lengths}
    for key, blob in blobs.items():
        cache.write(key, blob)
    for key, blob in blobs.items():
        where = cache.locate(key.key, key.etag, key.block)
        assert os.path.getsize(where.data_path) == 3 * BS + len(blob)
        other = make_cache(tmp_path / "c")
        other._direct = not cache._direct and hasattr(os, "O_DIRECT")
        assert cache.read(key, len(blob)) == blob
        assert other.read(key, len(blob)) == blob
        assert type(cache.read(key, len(blob))) is bytes
        wrong_length = len(blob) + 1 if len(blob) < BS else len(blob) - 1
        assert cache.read(key, wrong_length) is None  # a length mismatch is a corrupt block
        assert cache.read(key, len(blob)) is None  # ... and was dropped
    assert cache.corrupt == len(blobs)
    assert cache.statistics()["disk_writes"] == len(blobs)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_run_is_one_pwritev_and_one_table_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    cache = make_cache(tmp_path / "c")
    cache._direct = direct and hasattr(os, "O_DIRECT")
    blobs = [block("k", i) for i in range(20)] + [block("k", 20, 777)]
    cache.write_blocks("k", "e", 100, blobs[:1])  # creates the version's files
    calls = count_calls(monkeypatch, "pwritev", "pwrite", "open", "close", "statvfs", "scandir")
    assert cache.write_blocks("k", "e", 1, blobs[1:9]) == 8
    # One table write, and two of the 16-byte size ledger (the reservation, then what landed).
    assert calls == {"pwritev": 1, "pwrite": 3, "open": 0, "close": 0, "statvfs": 0, "scandir": 0}
    # 12 more, the last short: runs of at most 8. With O_DIRECT, the short block's bytes
    # past its last whole page go through a buffered descriptor (one open, pwrite and close).
    tail = 1 if cache._direct else 0
    assert cache.write_blocks("k", "e", 9, blobs[9:]) == 12
    assert calls["pwritev"] == 1 + 2
    assert calls["pwrite"] == 3 + 2 + 2 + tail
    assert calls["open"] == calls["close"] == tail
    reads = count_calls(monkeypatch, "preadv", "pread")
    got = cache.read_blocks("k", "e", list(range(1, 21)), [len(b) for b in blobs[1:]])
    assert got == {i: blobs[i] for i in range(1, 21)}
    # Three runs (8, 8, 4): a table read each, and one preadv each with O_DIRECT.
    assert reads["pread"] == 3 + (0 if cache._direct else 20)
    assert reads["preadv"] == (3 if cache._direct else 0)
    assert calls["open"] == tail


def test_missing_bytes_are_what_the_table_does_not_list(tmp_path: Path) -> None:
    """``missing_bytes`` (a warm's last check): the bytes of the blocks with no intact entry
    of the right length, read afresh; every byte once the version's files are gone."""
    cache = make_cache(tmp_path / "c")
    lengths = [BS, BS, BS, 100]
    assert cache.missing_bytes("k", "e", lengths) == 3 * BS + 100  # no table at all
    cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    cache.write_blocks("k", "e", 3, [block("k", 3, 100)])
    assert cache.missing_bytes("k", "e", lengths) == BS
    assert cache.missing_bytes("k", "e", [BS, BS, BS, 99]) == BS + 99  # a length that differs
    where = cache.locate("k", "e", 1)
    patch_bytes(where.index_path, where.entry_offset + 4, b"\xff")  # a garbled entry
    assert cache.missing_bytes("k", "e", lengths) == 2 * BS
    assert cache.missing_bytes("k", "e", []) == 0
    other = make_cache(tmp_path / "c")  # another process evicts it
    other.size_limit_bytes = 0
    other.evict()
    assert cache.missing_bytes("k", "e", lengths) == 3 * BS + 100


def test_present_blocks_of_a_list_are_returned(tmp_path: Path) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", i) for i in range(3)])
    cache.write_blocks("k", "e", 5, [block("k", 5)])
    got = cache.read_blocks("k", "e", [5, 0, 1, 2, 3, 4, 6], [BS] * 7)
    assert got == {i: block("k", i) for i in (0, 1, 2, 5)}
    assert cache.statistics()["disk_hits"] == 4
    assert cache.statistics()["disk_misses"] == 3
    assert cache.read_blocks("other", "e", [0], [BS]) == {}


def test_the_table_is_read_without_waiting_only_where_it_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``listed_now`` (the trio thread's look before it hands a disk read to a thread): the
    blocks the table lists, present or damaged, and the others counted as misses; None for
    a version not open here, and where the entries are not in the page cache."""
    cache = make_cache(tmp_path / "c")
    assert cache.listed_now("k", "e", [0, 1]) is None  # no table yet: nothing opened for it
    cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    cache.write_blocks("k", "e", 5, [block("k", 5, 100)])
    misses = cache.statistics()["disk_misses"]
    assert cache.listed_now("k", "e", [5, 0, 1, 2, 3]) == {0, 1, 5}
    assert cache.listed_now("k", "e", [6, 40]) == set()  # past the table's end: not listed
    assert cache.statistics()["disk_misses"] == misses + 4
    where = cache.locate("k", "e", 1)
    patch_bytes(where.index_path, where.entry_offset + 4, b"\xff")  # garbled: a read finds out
    assert cache.listed_now("k", "e", [1]) == {1}
    other = make_cache(tmp_path / "c")  # another process sharing the directory
    other.write_blocks("k", "e", 3, [block("k", 3)])
    assert cache.listed_now("k", "e", [2, 3]) == {3}
    assert cache.listed_now("k", "e", [0, 10_000]) is None  # more than a page of entries
    assert cache.listed_now("never", "e", [0]) is None
    real_preadv = os.preadv

    def not_in_memory(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags:
            raise BlockingIOError(errno.EAGAIN, "not in the page cache")
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", not_in_memory)
    assert cache.listed_now("k", "e", [0, 2]) is None
    assert cache._nowait  # EAGAIN is of the moment
    monkeypatch.setattr(os, "preadv", real_preadv)
    # A random read reads none unless all are listed: a partial answer is all misses.
    misses = cache.statistics()["disk_misses"]
    assert cache.listed_now("k", "e", [0, 2], all_or_none=True) == {0}
    assert cache.listed_now("k", "e", [0, 1], all_or_none=True) == {0, 1}
    assert cache.statistics()["disk_misses"] == misses + 2
    # Files not checked for another process's removal in the last second: not used until
    # a read or write checks them again.
    later = versions.monotonic() + 2
    monkeypatch.setattr(versions, "monotonic", lambda: later)
    assert cache.listed_now("k", "e", [0]) is None
    assert cache.read_blocks("k", "e", [0], [BS]) == {0: block("k", 0)}
    assert cache.listed_now("k", "e", [0]) == {0}

    def refused(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        raise OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT here")

    monkeypatch.setattr(os, "preadv", refused)
    assert cache.listed_now("k", "e", [0]) is None
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert cache.listed_now("k", "e", [0]) is None  # off for good in this cache
    assert make_cache(tmp_path / "c").listed_now("k", "e", [0]) is None  # not open there
    cache._nowait = True
    cache.enabled = False
    assert cache.listed_now("k", "e", [0]) is None


def test_files_dropped_during_a_look_are_closed_in_a_thread_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trio thread never closes an evicted version's files (which frees its disk blocks)
    when the version was dropped while ``listed_now`` held them."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0)])
    v = cache._version("k", "e")
    files = cache._files[v.digest]
    real_preadv, real_close = os.preadv, versions.Files.close
    closed_by: list[str] = []
    done = threading.Event()

    def evicted_meanwhile(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        cache._drop_files(v.digest, files)  # in use here: not closed yet
        return real_preadv(fd, buffers, offset, flags)

    def close(self: versions.Files) -> None:
        closed_by.append(threading.current_thread().name)
        real_close(self)
        done.set()

    monkeypatch.setattr(os, "preadv", evicted_meanwhile)
    monkeypatch.setattr(versions.Files, "close", close)
    assert cache.listed_now("k", "e", [0]) == {0}
    assert done.wait(10)
    assert closed_by == ["objfs-close"]
    assert files.closed


def test_digests_given_are_written_as_they_are_and_checked_on_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_blocks``' digests (the fetcher's, hashed as the bytes arrived) go into the
    entries without hashing the blocks again; a wrong one makes its block a miss, dropped as
    corrupt, never wrong bytes; None hashes that block here."""
    cache = make_cache(tmp_path / "c")
    blocks = [block("k", i) for i in range(3)]
    digests = [layout.block_hash(b) for b in blocks]
    hashed: list[int] = []
    real_hash = layout.block_hash
    monkeypatch.setattr(
        blockio, "block_hash", lambda data: hashed.append(len(data)) or real_hash(data)
    )
    assert cache.write_blocks("k", "e", 0, blocks, [digests[0], None, digests[2] ^ 1]) == 3
    assert hashed == [BS]  # block 1's only
    monkeypatch.setattr(blockio, "block_hash", real_hash)
    assert cache.read_blocks("k", "e", [0, 1, 2], [BS] * 3) == {0: blocks[0], 1: blocks[1]}
    assert cache.corrupt == 1
    with pytest.raises(ValueError, match="2 digests for 3 blocks"):
        cache.write_blocks("k", "e", 0, blocks, digests[:2])


def test_page_aligned_buffers_go_to_disk_and_back_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block cache's pooled mmaps are written from and read into as they are (a short
    last block's whole pages too, its rest buffered); only a short last block read goes
    through the cache's own aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    cache = make_cache(tmp_path / "c")
    source = mmap.mmap(-1, 3 * BS)
    blobs = [block("k", 0), block("k", 1), block("k", 2, 5000)]
    views = [memoryview(source)[i * BS : i * BS + len(b)] for i, b in enumerate(blobs)]
    for view, blob in zip(views, blobs, strict=True):
        view[:] = blob
    staged: list[int] = []
    real = cache._aligned_buffers

    def counting(count: int) -> Any:
        staged.append(count)
        return real(count)

    monkeypatch.setattr(cache, "_aligned_buffers", counting)
    assert cache.write_blocks("k", "e", 0, views) == 3
    targets = [memoryview(mmap.mmap(-1, BS))[: len(b)] for b in blobs]
    assert cache.read_blocks_into("k", "e", [0, 1, 2], targets) == {0, 1, 2}
    assert [bytes(t) for t in targets] == blobs
    if cache._direct:
        assert staged == [0, 1]  # the 5000-byte block, read into a whole page
    assert cache.read_blocks_into("k", "e", [0], [memoryview(bytearray(BS))]) == {0}


def test_returned_bytes_never_alias_a_pooled_buffer(tmp_path: Path) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", i) for i in range(8)])
    first = cache.read_blocks("k", "e", list(range(8)), [BS] * 8)
    again = cache.read_blocks("k", "e", list(range(8)), [BS] * 8)  # reuses the pool
    cache.write_blocks("j", "e", 0, [block("j", i) for i in range(8)])  # so do writes
    assert all(type(b) is bytes for b in first.values())
    assert first == again == {i: block("k", i) for i in range(8)}


def test_hash_of_every_kind_of_buffer() -> None:
    """XXH3-64 of the bytes, whatever holds them: bytes, bytearray, an mmap, a view of
    either (read-only or writable), a view of another format or shape; a non-contiguous
    view hashes as its bytes in order."""
    data = os.urandom(100_000)
    expected = xxhash.xxh3_64_intdigest(data)
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    kinds: list[Any] = [
        data,
        bytearray(data),
        memoryview(data),
        buf,
        memoryview(buf),
        memoryview(buf).toreadonly(),
        memoryview(bytearray(data)).cast("I"),  # 4-byte items
        memoryview(buf).cast("B", (1000, 100)),  # two dimensions
    ]
    for kind in kinds:
        assert layout.block_hash(kind) == expected
    assert layout.block_hash(memoryview(buf)[10:-10]) == xxhash.xxh3_64_intdigest(data[10:-10])
    assert layout.block_hash(memoryview(buf)[::3]) == xxhash.xxh3_64_intdigest(data[::3])
    assert layout.block_hash(b"") == xxhash.xxh3_64_intdigest(b"")


def test_table_layout(tmp_path: Path) -> None:
    """Format v4 as documented: ``DIR/v4/``, a header with magic ``OBJFSIX4`` and format 4,
    then 16-byte entries (length u32, XXH3-64 of the data u64, check u32 = the low 32 bits
    of the XXH3-64 of (index u64, length u32, data hash u64)), little-endian, computed here
    independently of the module's helpers."""
    cache = make_cache(tmp_path / "c")
    blobs = [block("k", 4), block("k", 5, 3000)]
    cache.write_blocks("k", "e", 4, blobs)
    where = cache.locate("k", "e", 4)
    assert where.index_path.startswith(str(tmp_path / "c" / "v4") + os.sep)
    with open(where.index_path, "rb") as f:
        table = f.read()
    assert table[:8] == b"OBJFSIX4"
    assert struct.unpack_from("<III", table, 8) == (4, BS, 16)
    assert where.entry_offset % 4096 == 4 * 16
    assert table[where.entry_offset - 4 * 16 : where.entry_offset] == bytes(4 * 16)  # holes
    for n, blob in enumerate(blobs):
        raw = table[where.entry_offset + 16 * n : where.entry_offset + 16 * (n + 1)]
        data_hash = xxhash.xxh3_64_intdigest(blob)
        check = xxhash.xxh3_64_intdigest(struct.pack("<QIQ", 4 + n, len(blob), data_hash))
        assert raw == struct.pack("<IQI", len(blob), data_hash, check & 0xFFFFFFFF)
    assert len(table) == where.entry_offset + 2 * 16


# -- crashes and damage ---------------------------------------------------------------------


def test_data_without_its_table_entry_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash after the data and before the entry: a miss, not a corrupt block."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    where = cache.locate("k", "e", 1)
    patch_bytes(where.index_path, where.entry_offset, bytes(16))
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    assert cache.read_blocks("k", "e", [0, 1], [BS, BS]) == {0: block("k", 0)}
    assert corrupt_warnings(caplog) == 0
    assert cache.corrupt == 0
    cache.write_blocks("k", "e", 1, [block("k", 1)])  # the caller fetched it again
    assert make_cache(tmp_path / "c").read(BlockKey("k", "e", 1), BS) == block("k", 1)


def test_a_hole_is_a_miss_and_never_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An all-zero entry is "not present" before any check: even under a check that a zero
    entry would pass, it is a plain miss, not a block and not a corrupt one."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0)])
    cache.write_blocks("k", "e", 2, [block("k", 2)])  # entry 1 is a hole: zeros
    where = cache.locate("k", "e", 1)
    with open(where.index_path, "rb") as f:
        f.seek(where.entry_offset)
        assert f.read(16) == bytes(16)
    monkeypatch.setattr(layout, "entry_check", lambda index, length, data_hash: 0)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    fresh = make_cache(tmp_path / "c")
    assert fresh.read_blocks("k", "e", [1], [BS]) == {}
    assert fresh.statistics()["disk_misses"] == 1
    assert fresh.corrupt == 0
    assert corrupt_warnings(caplog) == 0
    assert cached_blocks(str(tmp_path / "c")) == 0  # 0 and 2 fail this check; 1 is a hole
    monkeypatch.undo()
    assert cached_blocks(str(tmp_path / "c")) == 2
    got = make_cache(tmp_path / "c").read_blocks("k", "e", [0, 1, 2], [BS] * 3)
    assert got == {0: block("k", 0), 2: block("k", 2)}


@pytest.mark.parametrize("damage", ["check", "moved"])
def test_an_entry_whose_check_fails_is_dropped_though_its_data_matches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """The data's hash matches the entry's, but the entry's check does not: a bit flipped in
    the check, or an entry (and its data) copied to another block's place, which the check
    tells by the index it covers. Dropped as corrupt; the moved one would be wrong bytes."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    first, second = cache.locate("k", "e", 0), cache.locate("k", "e", 1)
    with open(first.index_path, "rb") as f:
        f.seek(second.entry_offset)
        entry = f.read(16)
        f.seek(first.entry_offset)
        entry0 = f.read(16)
    if damage == "check":
        patch_bytes(second.index_path, second.entry_offset + 12, bytes([entry[12] ^ 0x01]))
    else:
        patch_bytes(second.index_path, second.entry_offset, entry0)
        patch_bytes(second.data_path, second.data_offset, block("k", 0))
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    fresh = make_cache(tmp_path / "c")
    assert fresh.read_blocks("k", "e", [0, 1], [BS, BS]) == {0: block("k", 0)}
    assert fresh.corrupt == 1
    assert corrupt_warnings(caplog) == 1
    assert "damaged table entry" in caplog.records[-1].getMessage()
    with open(second.index_path, "rb") as f:
        f.seek(second.entry_offset)
        assert f.read(16) == bytes(16)  # cleared: a hole now
    assert cached_blocks(str(tmp_path / "c")) == 1


@pytest.mark.parametrize("tear", ["zeros", "half-written", "one-sector"])
def test_an_entry_whose_data_is_torn_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tear: str
) -> None:
    """An entry on disk whose data write did not (wholly) reach the disk: a miss with one
    warning; the entry is cleared, so the next read is a plain miss."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    where = cache.locate("k", "e", 1)
    if tear == "zeros":  # a hole: the data never landed
        patch_bytes(where.data_path, where.data_offset, bytes(BS))
    elif tear == "half-written":
        patch_bytes(where.data_path, where.data_offset + BS // 2, bytes(BS // 2))
    else:  # one sector of garbage
        patch_bytes(where.data_path, where.data_offset + 4096, os.urandom(512))
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    assert make_cache(tmp_path / "c").read_blocks("k", "e", [0, 1], [BS, BS]) == {0: block("k", 0)}
    assert corrupt_warnings(caplog) == 1
    assert make_cache(tmp_path / "c").read(BlockKey("k", "e", 1), BS) is None
    assert corrupt_warnings(caplog) == 1  # dropped: the entry is gone
    assert cached_blocks(str(tmp_path / "c")) == 1


@pytest.mark.parametrize("cut", [BS // 2, 1, 0])
def test_a_data_file_truncated_in_a_block_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    cache = make_cache(tmp_path / "c")
    blobs = [block("k", i) for i in range(4)]
    cache.write_blocks("k", "e", 0, blobs)
    where = cache.locate("k", "e", 2)
    os.truncate(where.data_path, where.data_offset + cut)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    got = cache.read_blocks("k", "e", [0, 1, 2, 3], [BS] * 4)
    assert got == {0: blobs[0], 1: blobs[1]}
    assert corrupt_warnings(caplog) == 2
    assert cache.write_blocks("k", "e", 2, blobs[2:]) == 2
    assert cache.read_blocks("k", "e", [0, 1, 2, 3], [BS] * 4) == dict(enumerate(blobs))


def test_a_truncated_table_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", i) for i in range(4)])
    where = cache.locate("k", "e", 2)
    os.truncate(where.index_path, where.entry_offset + 5)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    got = make_cache(tmp_path / "c").read_blocks("k", "e", [0, 1, 2, 3], [BS] * 4)
    assert got == {0: block("k", 0), 1: block("k", 1)}
    assert corrupt_warnings(caplog) == 0  # entries cut off are simply absent


@pytest.mark.parametrize("damage", ["bad-magic", "another-version", "short-header"])
def test_a_table_that_does_not_name_the_version_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """A table with a bad magic, or naming other inputs (a foreign file, or a SHA-256
    collision), serves nothing: it is removed with its data, once, with a warning."""
    cache = make_cache(tmp_path / "c")
    cache.write_blocks("k", "e", 0, [block("k", 0)])
    cache.write_blocks("other", "e", 0, [block("other", 0)])
    where = cache.locate("k", "e", 0)
    if damage == "bad-magic":
        patch_bytes(where.index_path, 0, b"NOTOBJFS")
    elif damage == "another-version":  # its entries are intact: only the header tells
        other = cache.locate("other", "e", 0)
        os.replace(other.index_path, where.index_path)
    else:
        os.truncate(where.index_path, 20)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    fresh = make_cache(tmp_path / "c")
    assert fresh.read(BlockKey("k", "e", 0), BS) is None
    assert corrupt_warnings(caplog) == 1
    assert not os.path.exists(where.index_path)
    assert not os.path.exists(where.data_path)
    assert fresh.read(BlockKey("k", "e", 0), BS) is None
    assert corrupt_warnings(caplog) == 1
    fresh.write(BlockKey("k", "e", 0), block("k", 0))
    assert make_cache(tmp_path / "c").read(BlockKey("k", "e", 0), BS) == block("k", 0)


def test_random_damage_never_returns_wrong_bytes(tmp_path: Path) -> None:
    """Bytes flipped at random in the data and the table (seeded): every read is the right
    block or a miss, and a rewrite makes the version whole again."""
    rng = random.Random(1234)
    blobs = [block("k", i) for i in range(5)] + [block("k", 5, 3000)]
    lengths = [len(b) for b in blobs]
    outcomes = {"hit": 0, "miss": 0}
    for trial in range(60):
        directory = tmp_path / f"c{trial % 3}"
        cache = make_cache(directory)
        cache.write_blocks("k", "e", 0, blobs)
        where = cache.locate("k", "e", 0)
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                path = where.data_path
                offset = rng.randrange(os.path.getsize(path))
            else:
                path = where.index_path
                # The header or the entries, where damage can matter.
                offset = rng.choice(
                    [rng.randrange(64), where.entry_offset + rng.randrange(len(blobs) * 16)]
                )
            with open(path, "rb") as f:
                f.seek(offset)
                old = f.read(1)
            if old:
                patch_bytes(path, offset, bytes([old[0] ^ (1 << rng.randrange(8))]))
        fresh = make_cache(directory)
        got = fresh.read_blocks("k", "e", list(range(len(blobs))), lengths)
        for index in range(len(blobs)):
            if index in got:
                assert got[index] == blobs[index], f"trial {trial}: wrong bytes, block {index}"
                outcomes["hit"] += 1
            else:
                outcomes["miss"] += 1
        fresh.write_blocks("k", "e", 0, blobs)
        assert make_cache(directory).read_blocks("k", "e", list(range(6)), lengths) == dict(
            enumerate(blobs)
        )
    assert outcomes["hit"]
    assert outcomes["miss"]


# -- eviction and the free-space floor -------------------------------------------------------


def version_size(tmp_path: Path) -> int:
    """Bytes one version of one block takes on this file system."""
    probe = make_cache(tmp_path / "probe")
    probe.write(BlockKey("probe", "e", 0), block("probe", 0))
    return probe.statistics()["disk_bytes"]


def present_versions(cache: DiskCache, count: int) -> list[int]:
    return [i for i in range(count) if os.path.exists(cache.locate(f"k{i}", "e", 0).data_path)]


def test_eviction_removes_least_recently_used_versions_under_the_cap(tmp_path: Path) -> None:
    unit = version_size(tmp_path)
    cap = unit * 11 // 2  # room for five versions and a half
    cache = make_cache(tmp_path / "c", size_limit_bytes=cap)
    for i in range(5):
        cache.write(BlockKey(f"k{i}", "e", 0), block(f"k{i}", 0))
    assert cache.read(BlockKey("k0", "e", 0), BS) is not None  # k0 is now the most recent
    assert cache.statistics()["disk_evictions"] == 0
    cache.write(BlockKey("k5", "e", 0), block("k5", 0))  # over the cap: down to 90% of it
    assert present_versions(cache, 6) == [0, 3, 4, 5]
    stats = cache.statistics()
    assert stats["disk_evictions"] == 2
    assert stats["disk_bytes"] == 4 * unit <= cap * 0.9
    # What survived reads back; what went is a miss.
    assert cache.read(BlockKey("k0", "e", 0), BS) == block("k0", 0)
    assert cache.read(BlockKey("k1", "e", 0), BS) is None


def test_recency_survives_a_restart_through_mtimes(tmp_path: Path) -> None:
    unit = version_size(tmp_path)
    first = make_cache(tmp_path / "c")
    for i in range(4):
        first.write(BlockKey(f"k{i}", "e", 0), block(f"k{i}", 0))
    for i, age in enumerate([100, 400, 200, 300]):  # k1 oldest, then k3, k2, k0
        where = first.locate(f"k{i}", "e", 0)
        for path in (where.data_path, where.index_path):
            os.utime(path, (1e9 - age, 1e9 - age))
    second = make_cache(tmp_path / "c", size_limit_bytes=unit * 21 // 5)
    second.write(BlockKey("k4", "e", 0), block("k4", 0))  # 5 versions: down to 3.78
    assert present_versions(second, 5) == [0, 2, 4]


def test_a_version_bigger_than_the_cache_is_not_cached(tmp_path: Path) -> None:
    cache = make_cache(tmp_path / "c", size_limit_bytes=4 * BS)
    cache.write_blocks("small", "e", 0, [block("small", 0)])
    assert cache.write_blocks("big", "e", 0, [block("big", i) for i in range(4)]) == 0
    assert cache.read(BlockKey("small", "e", 0), BS) == block("small", 0)
    assert cache.statistics()["disk_evictions"] == 0


def test_threads_that_need_room_at_once_each_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full cache, and two threads whose writes both need an eviction at once: the one that
    finds the other evicting evicts after it for its own write, rather than being refused
    for lack of the room the first made for itself."""
    unit = version_size(tmp_path)
    cache = make_cache(tmp_path / "c", size_limit_bytes=unit * 21 // 2)  # ten versions and a half
    for i in range(10):
        cache.write(BlockKey(f"old{i}", "e", 0), block(f"old{i}", 0))
    real_scan = cache._scan
    scanning = threading.Barrier(2, timeout=5)

    def slow_scan() -> None:  # the first eviction lasts until the second write wants room
        with contextlib.suppress(threading.BrokenBarrierError):
            scanning.wait(timeout=0.5)
        real_scan()

    monkeypatch.setattr(cache, "_scan", slow_scan)
    stored: dict[str, int] = {}

    def write(name: str) -> None:
        stored[name] = cache.write_blocks(name, "e", 0, [block(name, 0), block(name, 1)])

    threads = [threading.Thread(target=write, args=(name,)) for name in ("new0", "new1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stored == {"new0": 2, "new1": 2}
    assert cache.statistics()["disk_blocks_skipped_full"] == 0
    assert version_bytes(tmp_path / "c") <= cache.size_limit_bytes


def test_writes_scan_no_directory_and_check_free_space_rarely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No periodic scan: writing under the cap lists and stats nothing; statvfs runs once per
    _SPACE_CHECK_BYTES written (or per second), not per write."""
    clock = [1000.0]
    monkeypatch.setattr(versions, "monotonic", lambda: clock[0])  # the tier's clock
    monkeypatch.setattr(space, "_SPACE_CHECK_BYTES", 16 * BS)
    cache = make_cache(tmp_path / "c", min_free_bytes=1)
    for i in range(10):  # creates the versions' files (and subdirectories: os.makedirs stats)
        cache.write_blocks(f"k{i}", "e", 0, [block(f"k{i}", 0)])
    clock[0] += 1.0
    names = ("scandir", "listdir", "stat", "lstat", "statvfs", "utime")
    calls = count_calls(monkeypatch, *names)
    for i in range(160):  # 160 writes over 10 versions
        cache.write_blocks(f"k{i % 10}", "e", 1 + i // 10, [block("k", i)])
    assert calls == dict.fromkeys(names, 0) | {"statvfs": 10}  # writes 1, 17, ... 145
    clock[0] += 1.0
    cache.write_blocks("k0", "e", 500, [block("k", 500)])
    assert calls["statvfs"] == 11  # a second passed
    for i in range(200):  # reads check nothing
        assert cache.read(BlockKey(f"k{i % 10}", "e", 1 + i // 10 % 16), BS) is not None
    assert calls == dict.fromkeys(names, 0) | {"statvfs": 11}


def test_a_low_disk_evicts_and_pauses_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="objfs.disk_cache")
    clock = [1000.0]
    monkeypatch.setattr(versions, "monotonic", lambda: clock[0])  # the tier's clock
    cache = make_cache(tmp_path / "c", min_free_bytes=1)
    for i in range(4):
        cache.write(BlockKey(f"k{i}", "e", 0), block(f"k{i}", 0))
    unit = cache.statistics()["disk_bytes"] // 4
    cache.min_free_bytes = 10 * unit
    # Another program fills the disk: the next check evicts (the oldest first) until 10%
    # over the floor; each removal gives its bytes back.
    monkeypatch.setattr(
        cache, "_free_bytes", lambda: 9 * unit + 1 + cache.statistics()["disk_evictions"] * unit
    )
    clock[0] += 1.0
    assert cache.write_blocks("k4", "e", 0, [block("k4", 0)]) == 1
    assert present_versions(cache, 5) == [2, 3, 4]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # evicting helped
    # Full, and nothing helps: all evicted, and writes pause until the disk has room again,
    # said once (a warning naming the floor), and counted.
    monkeypatch.setattr(cache, "_free_bytes", lambda: 0)
    clock[0] += 1.0
    assert cache.write_blocks("k5", "e", 0, [block("k5", 0)]) == 0
    assert present_versions(cache, 6) == []
    clock[0] += 1.0
    assert cache.write_blocks("k5", "e", 0, [block("k5", 0), block("k5", 1)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "under the floor" in warnings[0]
    assert cache.statistics()["disk_blocks_skipped_low_space"] == 3
    monkeypatch.setattr(cache, "_free_bytes", lambda: 50 * unit)
    clock[0] += 1.0
    assert cache.write_blocks("k5", "e", 0, [block("k5", 0)]) == 1
    assert any("caching resumes" in r.getMessage() for r in caplog.records)
    assert cache.statistics()["disk_blocks_skipped_low_space"] == 3
    assert cache.enabled
    assert cache.statistics()["disk_errors"] == 0


def test_hits_touch_the_mtime_at_most_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write(BlockKey("k", "e", 0), block("k", 0))
    calls = count_calls(monkeypatch, "utime")
    for _ in range(20):
        assert cache.read(BlockKey("k", "e", 0), BS) is not None
    assert calls["utime"] == 0  # written just now
    digest = next(iter(cache._index))
    cache._index[digest].touched_at -= 61
    for _ in range(20):
        assert cache.read(BlockKey("k", "e", 0), BS) is not None
    assert calls["utime"] == 1


# -- descriptors -----------------------------------------------------------------------------


def test_descriptors_stay_open_for_recent_versions_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "_OPEN_VERSIONS", 4)
    cache = make_cache(tmp_path / "c")
    before = len(os.listdir("/proc/self/fd"))
    for i in range(10):
        cache.write_blocks(f"k{i}", "e", 0, [block(f"k{i}", 0)])
    assert len(os.listdir("/proc/self/fd")) - before == 2 * 4  # a table and a data file each
    calls = count_calls(monkeypatch, "open", "close")
    for _ in range(5):
        for i in range(6, 10):
            cache.write_blocks(f"k{i}", "e", 1, [block(f"k{i}", 1)])
            assert cache.read(BlockKey(f"k{i}", "e", 0), BS) == block(f"k{i}", 0)
    assert calls == {"open": 0, "close": 0}
    cache.close()
    assert len(os.listdir("/proc/self/fd")) == before


# -- errors ----------------------------------------------------------------------------------


def test_transient_read_errors_are_misses_until_they_repeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write(BlockKey("k", "e", 0), block("k", 0))
    real_pread = os.pread
    failing = [True]

    def flaky(fd: int, n: int, offset: int) -> bytes:
        if failing[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", flaky)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    for _ in range(7):
        assert cache.read(BlockKey("k", "e", 0), BS) is None
    assert cache.enabled
    assert cache.statistics()["disk_errors"] == 7
    failing[0] = False
    assert cache.read(BlockKey("k", "e", 0), BS) == block("k", 0)  # a success: streak over
    failing[0] = True
    for _ in range(7):
        assert cache.read(BlockKey("k", "e", 0), BS) is None
    assert cache.enabled
    assert cache.read(BlockKey("k", "e", 0), BS) is None  # the 8th in a row
    assert not cache.enabled
    assert cache.statistics()["disk_enabled"] == 0
    assert cache.statistics()["disk_errors"] == 15
    messages = [r.getMessage() for r in caplog.records]
    assert sum("turned off" in m for m in messages) == 1
    assert sum("treating it as a miss" in m for m in messages) == 2  # one per streak
    assert cache.read(BlockKey("k", "e", 0), BS) is None
    assert cache.write_blocks("k", "e", 1, [block("k", 1)]) == 0


def test_too_many_open_files_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(tmp_path / "c")
    real_open = os.open

    def no_descriptors(path: str, flags: int, mode: int = 0o777) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "open", no_descriptors)
    assert cache.write_blocks("k", "e", 0, [block("k", 0)]) == 0
    assert cache.read(BlockKey("k", "e", 0), BS) is None
    monkeypatch.setattr(os, "open", real_open)
    assert cache.enabled
    assert cache.write_blocks("k", "e", 0, [block("k", 0)]) == 1
    assert cache.read(BlockKey("k", "e", 0), BS) == block("k", 0)
    assert cache.statistics()["disk_errors"] >= 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_full_or_forbidden_disk_turns_the_tier_off_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    cache = make_cache(tmp_path / "c")
    cache.write(BlockKey("k", "e", 0), block("k", 0))

    def refuse(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", refuse)
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    assert cache.write_blocks("k", "e", 1, [block("k", 1)]) == 0
    assert cache.write_blocks("k", "e", 2, [block("k", 2)]) == 0
    assert not cache.enabled
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1
    assert os.strerror(code) in caplog.records[-1].getMessage()


def test_a_short_write_is_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(tmp_path / "c")
    real = os.pwritev

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, buffers[:1], offset)  # the first block only

    monkeypatch.setattr(os, "pwritev", short)
    assert cache.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)]) == 0
    assert not cache.enabled
    monkeypatch.setattr(os, "pwritev", real)
    reader = make_cache(tmp_path / "c")
    # The block written whole before the disk filled up is listed and intact.
    assert reader.read_blocks("k", "e", [0, 1], [BS, BS]) == {0: block("k", 0)}


def test_unwritable_cache_turns_the_tier_off_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache(tmp_path / "c")
    caplog.set_level(logging.WARNING, logger="objfs.disk_cache")
    os.chmod(cache.root, 0o500)
    try:
        if os.geteuid() == 0:
            pytest.skip("root writes to read-only directories anyway")
        cache.write(BlockKey("k", "e", 0), b"x" * 100)
        cache.write(BlockKey("k", "e", 1), b"x" * 100)
    finally:
        os.chmod(cache.root, 0o700)
    assert not cache.enabled
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1


# -- O_DIRECT fallbacks ----------------------------------------------------------------------


def test_falls_back_to_buffered_io_without_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses O_DIRECT (EINVAL, as older tmpfs does): the cache notices
    and reads and writes buffered, with correct bytes."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open
    refused: list[str] = []

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, mode)

    cache = make_cache(tmp_path / "c")
    monkeypatch.setattr(os, "open", no_direct)
    cache.write(BlockKey("k", "e", 0), b"abc" * 1000)
    assert refused
    assert not cache._direct
    assert os.path.getsize(cache.locate("k", "e", 0).data_path) == 3000  # not page-padded
    reader = make_cache(tmp_path / "c")
    assert reader.read(BlockKey("k", "e", 0), 3000) == b"abc" * 1000
    assert not reader._direct
    assert len(refused) == 2


def test_reads_buffered_when_o_direct_reads_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that accepts O_DIRECT at open but refuses the read (EINVAL): the block
    is read buffered, the tier stays on, and later reads skip O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    cache = make_cache(tmp_path / "c")
    blob = os.urandom(BS)
    cache.write(BlockKey("k", "e", 0), blob)

    def refuse(fd: int, buffers: object, offset: int) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "preadv", refuse)
    assert cache.read(BlockKey("k", "e", 0), BS) == blob
    assert cache.enabled
    assert not cache._direct
    assert cache.read(BlockKey("k", "e", 0), BS) == blob
    assert cache.statistics()["disk_errors"] == 0


def test_writes_buffered_when_o_direct_writes_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    import fcntl

    cache = make_cache(tmp_path / "c")
    real = os.pwritev
    refused = [0]

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused[0] += 1
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", refuse_direct)
    blobs = [block("k", 0), block("k", 1, 3000)]
    assert cache.write_blocks("k", "e", 0, blobs) == 2
    assert cache.write_blocks("j", "e", 0, blobs) == 2
    assert refused[0] == 1
    assert cache.enabled
    assert not cache._direct
    for key in ("k", "j"):
        assert make_cache(tmp_path / "c").read_blocks(key, "e", [0, 1], [BS, 3000]) == {
            0: blobs[0],
            1: blobs[1],
        }


# -- sharing one directory -------------------------------------------------------------------


def test_two_processes_may_share_one_cache_directory(tmp_path: Path) -> None:
    """Two DiskCache instances (as two mounts would hold) write and read the same blocks
    from many threads at once: every read is a whole, correct block or a miss."""
    a, b = make_cache(tmp_path / "c", block_size=MiB), make_cache(tmp_path / "c", block_size=MiB)
    blobs = {BlockKey("k", "e", i): os.urandom(256 * 1024) for i in range(32)}
    errors: list[str] = []

    def worker(cache: DiskCache, seed: int) -> None:
        order = list(blobs)[seed:] + list(blobs)[:seed]
        for _ in range(3):
            for key in order:
                cache.write(key, blobs[key])
                got = cache.read(key, len(blobs[key]))
                if got is not None and got != blobs[key]:
                    errors.append(f"wrong bytes for {key}")

    threads = [threading.Thread(target=worker, args=(c, i)) for i, c in enumerate([a, b] * 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert a.corrupt == b.corrupt == 0
    for key, blob in blobs.items():
        assert a.read(key, len(blob)) == blob
        assert b.read(key, len(blob)) == blob


def test_threads_churning_descriptors_and_evicting_never_see_a_closed_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few open versions and a small cap: descriptors are dropped and versions evicted while
    other threads use them; every read is right or a miss and no I/O hits a closed or reused
    descriptor (which would count as an error)."""
    monkeypatch.setattr(versions, "_OPEN_VERSIONS", 2)
    cache = make_cache(tmp_path / "c", size_limit_bytes=24 * (BS + 8192))
    wrong: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            key = f"k{rng.randrange(8)}"
            first = rng.randrange(4)
            cache.write_blocks(key, "e", first, [block(key, i) for i in range(first, first + 2)])
            got = cache.read_blocks(key, "e", list(range(6)), [BS] * 6)
            wrong.extend(f"{key}/{i}" for i, data in got.items() if data != block(key, i))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.statistics()
    assert wrong == []
    assert stats["disk_errors"] == 0
    assert stats["disk_evictions"] > 0
    assert stats["disk_hits"] > 0
    assert cache.enabled
    cache.close()


def test_a_version_removed_by_another_process_is_never_served_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process evicts a version this one has open: reads are right or miss, and
    within a second the files are opened afresh (so writes land where others see them)."""
    clock = [1000.0]
    monkeypatch.setattr(versions, "monotonic", lambda: clock[0])  # the tier's clock
    a, b = make_cache(tmp_path / "c"), make_cache(tmp_path / "c")
    a.write_blocks("k", "e", 0, [block("k", 0), block("k", 1)])
    assert b.read(BlockKey("k", "e", 0), BS) == block("k", 0)
    b.size_limit_bytes = 0
    b.evict()
    assert not os.path.exists(a.locate("k", "e", 0).data_path)
    for index in (0, 1):  # still open here: the removed files' bytes, which are right
        assert a.read(BlockKey("k", "e", index), BS) in (block("k", index), None)
    clock[0] += 2
    assert a.write_blocks("k", "e", 2, [block("k", 2)]) == 1
    assert os.path.exists(a.locate("k", "e", 0).data_path)
    b.size_limit_bytes = 1 << 30
    assert b.read_blocks("k", "e", [0, 1, 2], [BS] * 3) == {2: block("k", 2)}
    assert a.read_blocks("k", "e", [0, 1, 2], [BS] * 3) == {2: block("k", 2)}
    assert a.corrupt == b.corrupt == 0


SHARER = textwrap.dedent(
    """
    import random, sys
    from objfs.disk_cache import DiskCache

    BS = 64 * 1024
    def block(key, index):
        return random.Random(f"{key}/{index}").randbytes(BS)

    directory, seed = sys.argv[1], int(sys.argv[2])
    # Room for about 6 of the 12 versions: the two processes evict each other's.
    cache = DiskCache(directory, namespace="memory://", block_size=BS,
                      size_limit_bytes=6 * 8 * BS, min_free_bytes=0)
    rng = random.Random(seed)
    wrong = 0
    for _ in range(150):
        key = f"k{rng.randrange(12)}"
        first = rng.randrange(8)
        if rng.random() < 0.5:
            cache.write_blocks(key, "e", first, [block(key, i) for i in range(first, 8)])
        got = cache.read_blocks(key, "e", list(range(8)), [BS] * 8)
        wrong += sum(data != block(key, i) for i, data in got.items())
    stats = cache.statistics()
    print(wrong, stats["disk_hits"], stats["disk_evictions"])
    """
)


def test_two_processes_evicting_each_others_versions_serve_no_wrong_bytes(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "c"
    make_cache(directory)  # created (0700) before the two race for it
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARER, str(directory), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append([int(n) for n in out.split()])
    assert [wrong for wrong, _, _ in results] == [0, 0]
    assert all(hits > 0 for _, hits, _ in results)
    assert sum(evictions for _, _, evictions in results) > 0


CAPPED_SHARER = textwrap.dedent(
    """
    import glob, os, random, sys, time
    from objfs.disk_cache import DiskCache

    BS = 64 * 1024
    directory, name, cap, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def allocated():  # as version_bytes below
        total = 0
        for path in glob.glob(os.path.join(directory, "v4", "??", "*")):
            try:
                total += os.lstat(path).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    cache = DiskCache(directory, namespace="memory://", block_size=BS,
                      size_limit_bytes=cap, min_free_bytes=0)
    while not os.path.exists(go):  # both start writing at once
        time.sleep(0.001)
    peak = 0
    for i in range(40):  # versions of its own, 4 blocks each, in runs of 2
        for first in (0, 2):
            blocks = [random.Random(f"{name}{i}/{n}").randbytes(BS) for n in (first, first + 1)]
            cache.write_blocks(f"{name}{i}", "e", first, blocks)
            peak = max(peak, allocated())
    print(peak, cache.statistics()["disk_evictions"])
    """
)


def version_bytes(directory: str | Path) -> int:
    """Allocated bytes of the versions' files in a cache directory, as ``du`` counts them
    (a table's temporary name, a hard link to it, is not counted twice)."""
    total = 0
    for path in glob.glob(os.path.join(directory, "v4", "??", "*")):
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            total += os.lstat(path).st_blocks * 512
    return total


def test_processes_sharing_a_directory_keep_it_under_the_cap_together(tmp_path: Path) -> None:
    """Two processes write versions of their own into one directory with one cap: the
    directory's allocated bytes (both files of every version, as ``du`` counts them) never
    pass the cap, wherever the bytes came from."""
    directory = tmp_path / "c"
    make_cache(directory)
    cap = 40 * BS  # about 9 versions of 4 blocks; each process writes 40
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CAPPED_SHARER, str(directory), name, str(cap), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append([int(n) for n in out.split()])
    peaks = [peak for peak, _ in results]
    assert all(evictions > 0 for _, evictions in results), results
    assert max(peaks) <= cap, f"peaks {peaks} over the cap of {cap}"
    assert version_bytes(directory) <= cap
    # And the cache still serves: whole versions (the most recent), and only right bytes.
    reader = make_cache(directory, size_limit_bytes=cap)
    whole = 0
    for key in [f"{name}{i}" for name in ("a", "b") for i in range(40)]:
        got = reader.read_blocks(key, "e", [0, 1, 2, 3], [BS] * 4)
        assert got == {n: random.Random(f"{key}/{n}").randbytes(BS) for n in got}
        whole += len(got) == 4
    assert whole >= 4
    assert reader.corrupt == 0


# -- setup -----------------------------------------------------------------------------------


def test_older_formats_are_removed_on_start(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    for old in ("v1", "v2"):
        (directory / old / "ab").mkdir(parents=True, mode=0o700)
        (directory / old / "ab" / "block.0").write_bytes(b"x" * 100)
    # A v3 directory as the CRC-32C format left it: a table and its data file.
    (directory / "v3" / "ab").mkdir(parents=True, mode=0o700)
    (directory / "v3" / "ab" / ("ab" + "0" * 62 + ".idx")).write_bytes(b"OBJFSIX3" + bytes(40))
    (directory / "v3" / "ab" / ("ab" + "0" * 62)).write_bytes(b"x" * 100)
    (directory / "v3" / ".lock").write_bytes(b"")
    directory.chmod(0o700)
    cache = make_cache(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["v4"]
    assert cache.root == str(directory / "v4")
    assert stat_mode(directory / "v4") == 0o700
    assert cache.statistics()["disk_versions"] == 0  # nothing of v3 counted


def test_a_shared_or_foreign_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    (directory / "v4").mkdir(parents=True, mode=0o700)
    directory.chmod(0o700)
    (directory / "v4").chmod(0o707)
    with pytest.raises(UsageError, match="is writable by group or others"):
        make_cache(directory)
    (directory / "v4").chmod(0o700)
    directory.chmod(0o755)  # only readable by others: tightened
    make_cache(directory)
    assert stat_mode(directory) == 0o700


def test_block_sizes_and_lengths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        make_cache(tmp_path / "c", block_size=5000)
    cache = make_cache(tmp_path / "c")
    with pytest.raises(ValueError, match="length"):
        cache.write_blocks("k", "e", 0, [b""])
    with pytest.raises(ValueError, match="length"):
        cache.write_blocks("k", "e", 0, [bytes(BS + 1)])
    with pytest.raises(ValueError, match="length"):
        cache.read_blocks("k", "e", [0], [0])


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777
