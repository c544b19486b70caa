"""What the kernel may read by FUSE passthrough: ``DiskCache.open_whole_version`` and
``FileSystem.whole_on_disk``, on the core (memory backend, a real disk-cache directory).

The kernel checks no hash, so a file is offered only when it holds exactly the version's
bytes: every block listed and verified (once per disk cache, recorded in the table file), no
padding past the end; a damaged block is no passthrough, and normal reads then repair it; an
inode served in cached mode stays cached.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from objfs.backends.memory import MemoryBackend
from objfs.disk_cache import DiskCache
from objfs.fs import FileSystem
from tests.test_read_path import (
    config,
    damage_blocks,
    disk_cache,
    open_file,
    read_all,
    settle,
)

MiB = 1 << 20


def read_fd(fd: int) -> bytes:
    """All of the file open as ``fd`` (closed after)."""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)


async def test_a_damaged_block_is_no_passthrough_until_normal_reads_repair_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    data = os.urandom(5 * MiB + 4097)  # the last block O_DIRECT would pad to a page
    backend = MemoryBackend()
    etag = backend.put("p/f.bin", data)
    cache = disk_cache(tmp_path / "c")
    fs = FileSystem(backend, config(), cache)
    fs.start(nursery)
    fh = await open_file(fs, "f.bin")
    assert await read_all(fs, fh, len(data)) == data
    inode = fs.handle_inode(fh)
    fs.release(fh)
    await fs.flush_disk_writes()
    await settle()
    # A second mount (nothing served in cached mode yet) with a flipped byte in block 2.
    damage_blocks(cache, "p/f.bin", etag, [2], "flip")
    cache2 = disk_cache(tmp_path / "c")
    fs2 = FileSystem(backend, config(), cache2)
    fs2.start(nursery)
    node = await fs2.lookup(1, b"f.bin")
    assert await fs2.whole_on_disk(node.inode) is None  # found, and the block dropped
    assert cache2.missing_bytes("p/f.bin", etag, [MiB] * 5 + [4097]) == MiB
    # A third mount: normal reads fetch block 2 again and write it back; then the file
    # holds exactly the object's bytes and is offered.
    fs3 = FileSystem(backend, config(), disk_cache(tmp_path / "c"))
    fs3.start(nursery)
    fh3 = await open_file(fs3, "f.bin")
    assert await read_all(fs3, fh3, len(data)) == data
    fs3.release(fh3)
    await fs3.flush_disk_writes()
    await settle()
    fs4 = FileSystem(backend, config(), disk_cache(tmp_path / "c"))
    fs4.start(nursery)
    node4 = await fs4.lookup(1, b"f.bin")
    fd = await fs4.whole_on_disk(node4.inode)
    assert fd is not None
    exact = await trio.to_thread.run_sync(read_fd, fd)
    assert exact == data  # exactly the bytes: no padding, no hole
    # On the first mount the inode was served in cached mode: it stays cached there.
    assert await fs.whole_on_disk(inode) is None


async def test_a_version_not_whole_on_disk_is_no_passthrough(tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)
    backend = MemoryBackend()
    etag = backend.put("p/g.bin", data)
    cache = disk_cache(tmp_path / "c")
    assert cache.write_blocks("p/g.bin", etag, 0, [data[:MiB], data[MiB : 2 * MiB]]) == 2
    fs = FileSystem(backend, config(), cache)
    node = await fs.lookup(1, b"g.bin")
    assert await fs.whole_on_disk(node.inode) is None  # block 2 is missing
    assert cache.write_blocks("p/g.bin", etag, 2, [data[2 * MiB :]]) == 1
    fd = await fs.whole_on_disk(node.inode)
    assert fd is not None
    assert read_fd(fd) == data
    # Without a disk tier there is nothing to offer.
    fs2 = FileSystem(backend, config())
    node2 = await fs2.lookup(1, b"g.bin")
    assert await fs2.whole_on_disk(node2.inode) is None


def test_a_version_is_verified_once_per_disk_cache_until_its_files_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verification is recorded in the table file after the data is synced: another
    process (a remount) offers the version without reading its bytes again. Dropping a
    block, or a data file replaced under the table, voids the record."""
    data = os.urandom(4 * MiB + 7)
    etag = '"v1"'
    reads: list[str] = []
    original = DiskCache._first_bad_block

    def counting(self: DiskCache, v: Any, fd: int, lengths: Any) -> int | None:
        reads.append(v.digest)
        return original(self, v, fd, lengths)

    monkeypatch.setattr(DiskCache, "_first_bad_block", counting)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(5)]
    # Written by another process (which did not seal it): this one reads it to check it.
    assert disk_cache(tmp_path / "c").write_blocks("p/s.bin", etag, 0, blocks) == 5
    first = disk_cache(tmp_path / "c")
    path = first.whole_version_file("p/s.bin", etag, len(data))
    assert path is not None
    assert first.whole_version_file("p/s.bin", etag, len(data)) == path
    assert len(reads) == 1  # once in this process
    # A remount: a new process offers it with no read of its bytes.
    assert disk_cache(tmp_path / "c").whole_version_file("p/s.bin", etag, len(data)) == path
    assert len(reads) == 1
    # A dropped block voids the record (and the version is not whole until fetched again).
    third = disk_cache(tmp_path / "c")
    damage_blocks(third, "p/s.bin", etag, [3], "flip")
    assert third.read_blocks("p/s.bin", etag, [3], [MiB]) == {}  # found, dropped
    assert third.whole_version_file("p/s.bin", etag, len(data)) is None
    assert disk_cache(tmp_path / "c").write_blocks("p/s.bin", etag, 3, [blocks[3]]) == 1
    fourth = disk_cache(tmp_path / "c")
    assert fourth.whole_version_file("p/s.bin", etag, len(data)) == path
    assert len(reads) == 2  # verified again
    assert Path(path).read_bytes() == data
    # The data file replaced under the table (another inode): verified again, damage found.
    copy = Path(path).read_bytes()
    os.unlink(path)
    Path(path).write_bytes(copy[:1000] + bytes([copy[1000] ^ 1]) + copy[1001:])
    assert disk_cache(tmp_path / "c").whole_version_file("p/s.bin", etag, len(data)) is None
    assert len(reads) == 3


def test_a_version_this_process_wrote_whole_is_sealed_without_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks a process wrote were hashed as they went out: once the version is whole it is
    recorded as checked with no read of its bytes, and the next process (a remount) serves it
    by passthrough with none either. A version with a block written by another process is
    not sealed: its first passthrough open reads it."""
    reads: list[str] = []
    original = DiskCache._first_bad_block

    def counting(self: DiskCache, v: Any, fd: int, lengths: Any) -> int | None:
        reads.append(v.digest)
        return original(self, v, fd, lengths)

    monkeypatch.setattr(DiskCache, "_first_bad_block", counting)
    data = os.urandom(3 * MiB + 5)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(4)]
    writer = disk_cache(tmp_path / "c")
    assert writer.write_blocks("p/w.bin", '"e"', 0, blocks[:2]) == 2
    assert not writer.seal("p/w.bin", '"e"', len(data))  # not whole yet
    assert writer.write_blocks("p/w.bin", '"e"', 2, blocks[2:]) == 2
    assert writer.seal("p/w.bin", '"e"', len(data))
    assert reads == []
    path = disk_cache(tmp_path / "c").whole_version_file("p/w.bin", '"e"', len(data))
    assert path is not None
    assert Path(path).read_bytes() == data
    assert reads == []
    # Half written by one process, half by another: neither can seal it.
    one, two = disk_cache(tmp_path / "d"), disk_cache(tmp_path / "d")
    assert one.write_blocks("p/h.bin", '"e"', 0, blocks[:2]) == 2
    assert two.write_blocks("p/h.bin", '"e"', 2, blocks[2:]) == 2
    assert not one.seal("p/h.bin", '"e"', len(data))
    assert not two.seal("p/h.bin", '"e"', len(data))
    assert disk_cache(tmp_path / "d").whole_version_file("p/h.bin", '"e"', len(data)) == str(
        Path(one.locate("p/h.bin", '"e"', 0).data_path)
    )
    assert len(reads) == 1  # read and verified at its first passthrough


def test_a_second_mount_writing_the_last_block_again_never_grows_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version served by passthrough from a descriptor; a second mount sharing the cache
    directory writes its blocks again (its write-behind, its idle backfill). The table lists
    them: nothing is written, and the data file stays the object's size, so the reader reads
    exactly the object to its end (before: the O_DIRECT write padded the 4097-byte last
    block to a page and the reader read 4,095 zeros past the end)."""
    data = os.urandom(3 * MiB + 4097)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(4)]
    first = disk_cache(tmp_path / "c")
    assert first._direct  # the padding came from O_DIRECT writes
    assert first.write_blocks("p/t.bin", '"e"', 0, blocks) == 4
    fd = first.open_whole_version("p/t.bin", '"e"', len(data))
    assert fd is not None
    try:
        second = disk_cache(tmp_path / "c")
        data_inode = os.fstat(fd).st_ino
        writes: list[int] = []  # offsets written in the data file
        real_pwritev, real_pwrite = os.pwritev, os.pwrite

        def pwritev(target: int, buffers: Any, offset: int) -> int:
            if os.fstat(target).st_ino == data_inode:
                writes.append(offset)
            return real_pwritev(target, buffers, offset)

        def pwrite(target: int, buffer: Any, offset: int) -> int:
            if os.fstat(target).st_ino == data_inode:
                writes.append(offset)
            return real_pwrite(target, buffer, offset)

        monkeypatch.setattr(os, "pwritev", pwritev)
        monkeypatch.setattr(os, "pwrite", pwrite)
        assert second.write_blocks("p/t.bin", '"e"', 3, blocks[3:]) == 1  # the backfill's
        assert second.write_blocks("p/t.bin", '"e"', 0, blocks) == 4  # a write-behind's
        monkeypatch.undo()
        assert writes == []  # listed blocks are never written again
        assert os.fstat(fd).st_size == len(data)
        assert os.pread(fd, len(data) + MiB, 0) == data  # to EOF: nothing past the end
    finally:
        os.close(fd)
    # A new version written by a mount that does O_DIRECT writes: exactly its size too.
    other = disk_cache(tmp_path / "c")
    assert other.write_blocks("p/u.bin", '"e"', 0, blocks) == 4
    assert os.path.getsize(other.locate("p/u.bin", '"e"', 0).data_path) == len(data)


def test_a_version_created_again_is_verified_again_before_passthrough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version verified here, then evicted by another process and written again by a third
    (not sealed): this process checks the new file before handing it out, and the
    descriptor it hands out is the file it checked (before: the verification was remembered
    by version alone, and the path opened again after the check)."""
    reads: list[int] = []
    original = DiskCache._first_bad_block

    def counting(self: DiskCache, v: Any, fd: int, lengths: Any) -> int | None:
        reads.append(os.fstat(fd).st_ino)
        return original(self, v, fd, lengths)

    monkeypatch.setattr(DiskCache, "_first_bad_block", counting)
    data = os.urandom(2 * MiB + 3)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(3)]
    assert disk_cache(tmp_path / "c").write_blocks("p/r.bin", '"e"', 0, blocks) == 3
    here = disk_cache(tmp_path / "c")
    fd = here.open_whole_version("p/r.bin", '"e"', len(data))
    assert fd is not None
    first_inode = os.fstat(fd).st_ino
    os.close(fd)
    assert reads == [first_inode]
    evictor = disk_cache(tmp_path / "c")
    evictor.size_limit_bytes = 0
    evictor.evict()
    assert here.missing_bytes("p/r.bin", '"e"', [MiB, MiB, 3]) == len(data)
    assert disk_cache(tmp_path / "c").write_blocks("p/r.bin", '"e"', 0, blocks) == 3
    fd = here.open_whole_version("p/r.bin", '"e"', len(data))
    assert fd is not None
    try:
        assert len(reads) == 2  # checked again: another file
        assert reads[1] == os.fstat(fd).st_ino  # ... and that file is the one handed out
        assert read_fd(os.dup(fd)) == data
    finally:
        os.close(fd)


def test_a_passthrough_open_counts_as_a_use_for_eviction(tmp_path: Path) -> None:
    """A version served by passthrough (last written 48 h ago) outlives an unused one
    written 24 h ago: handing its file out is a use, in this process's eviction order and in
    the mtime that other processes and restarts go by (before: the served one was evicted)."""
    blocks = [os.urandom(MiB) for _ in range(3)]
    size = 3 * MiB
    writer = disk_cache(tmp_path / "c")
    assert writer.write_blocks("p/served.bin", '"e"', 0, blocks) == 3
    assert writer.write_blocks("p/unused.bin", '"e"', 0, blocks) == 3
    assert writer.seal("p/served.bin", '"e"', size)  # checked when it was written
    now = time.time()
    for key, age_h in (("p/served.bin", 48), ("p/unused.bin", 24)):
        where = writer.locate(key, '"e"', 0)
        for path in (where.data_path, where.index_path):
            os.utime(path, (now - age_h * 3600, now - age_h * 3600))
    server = disk_cache(tmp_path / "c")
    for _ in range(3):
        fd = server.open_whole_version("p/served.bin", '"e"', size)
        assert fd is not None
        os.close(fd)
    served_data = server.locate("p/served.bin", '"e"', 0).data_path
    assert os.stat(served_data).st_mtime > now - 60  # other processes see the use
    # This process evicts one version: the unused one goes.
    server.size_limit_bytes = int(server.statistics()["disk_bytes"] * 0.8)
    server.evict()
    assert server.missing_bytes("p/unused.bin", '"e"', [MiB] * 3) == size
    assert server.missing_bytes("p/served.bin", '"e"', [MiB] * 3) == 0
    # So does another process, going by the files' mtimes.
    assert disk_cache(tmp_path / "c").missing_bytes("p/served.bin", '"e"', [MiB] * 3) == 0


async def test_concurrent_opens_of_a_version_check_it_once_off_the_disk_read_limiter(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six opens at once of a version not yet checked (vLLM's ranks open a shard together):
    one check reads it, the others wait for it and then find it verified; the check does
    not hold the disk-read limiter the read path shares (before: four checks at once, all
    four disk-read slots taken)."""
    data = os.urandom(4 * MiB + 11)
    backend = MemoryBackend()
    etag = backend.put("p/c.bin", data)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(5)]
    assert disk_cache(tmp_path / "c").write_blocks("p/c.bin", etag, 0, blocks) == 5
    fs = FileSystem(backend, config(), disk_cache(tmp_path / "c"))
    fs.start(nursery)
    node = await fs.lookup(1, b"c.bin")
    checks: list[int] = []
    original = DiskCache._first_bad_block
    disk_reads = fs.fetcher.disk_read_limiter

    def checking(self: DiskCache, v: Any, fd: int, lengths: Any) -> int | None:
        checks.append(int(disk_reads.borrowed_tokens))
        time.sleep(0.2)  # a slow disk: the other opens arrive meanwhile
        return original(self, v, fd, lengths)

    monkeypatch.setattr(DiskCache, "_first_bad_block", checking)
    fds: list[int | None] = []

    async def open_one() -> None:
        fds.append(await fs.whole_on_disk(node.inode))

    async with trio.open_nursery() as opens:
        for _ in range(6):
            opens.start_soon(open_one)
    try:
        assert checks == [0]  # one check, with no disk-read slot taken
        assert len(fds) == 6
        assert all(fd is not None for fd in fds)
        assert fs._whole_checks == {}
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def test_a_version_evicted_and_written_again_during_the_check_is_not_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process wrote a version whole (its blocks were checked as they went out); while
    it looks at the table, another process evicts the version and a third writes only its
    last block again (a file of the full size with holes). What was checked speaks for the
    old file only: the new one is not handed out (before: a descriptor of the file with
    holes, its first block zeros)."""
    data = os.urandom(3 * MiB + 5)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(4)]
    here = disk_cache(tmp_path / "c")
    assert here.write_blocks("p/x.bin", '"e"', 0, blocks) == 4
    real_table = DiskCache._table

    def replaced_meanwhile(v: Any, count: int) -> bytes | None:
        table = real_table(v, count)  # the table as it was: all listed
        evictor = disk_cache(tmp_path / "c")
        evictor.size_limit_bytes = 0
        evictor.evict()
        assert disk_cache(tmp_path / "c").write_blocks("p/x.bin", '"e"', 3, blocks[3:]) == 1
        return table

    monkeypatch.setattr(DiskCache, "_table", staticmethod(replaced_meanwhile))
    assert here.open_whole_version("p/x.bin", '"e"', len(data)) is None
    monkeypatch.undo()
    # Not whole now: no passthrough, and nothing this process checked counts for it.
    assert here.open_whole_version("p/x.bin", '"e"', len(data)) is None
    assert not here.seal("p/x.bin", '"e"', len(data))


def test_recording_a_check_is_not_a_use(tmp_path: Path) -> None:
    """Sealing a version (at unmount, after `objfs warm`) writes its record in the table
    but keeps the files' times: the eviction order other processes see is unchanged."""
    data = os.urandom(2 * MiB + 9)
    blocks = [data[i * MiB : (i + 1) * MiB] for i in range(3)]
    writer = disk_cache(tmp_path / "c")
    assert writer.write_blocks("p/old.bin", '"e"', 0, blocks) == 3
    where = writer.locate("p/old.bin", '"e"', 0)
    then = time.time() - 48 * 3600
    for path in (where.data_path, where.index_path):
        os.utime(path, (then, then))
    assert writer.seal("p/old.bin", '"e"', len(data))
    for path in (where.data_path, where.index_path):
        assert abs(os.stat(path).st_mtime - then) < 1, path
    fd = disk_cache(tmp_path / "c").open_whole_version("p/old.bin", '"e"', len(data))
    assert fd is not None  # recorded: served with no read
    assert read_fd(fd) == data
