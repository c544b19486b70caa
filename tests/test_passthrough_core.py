"""What the kernel may read by FUSE passthrough: ``DiskCache.whole_version_file`` and
``FileSystem.whole_on_disk``, on the core (memory backend, a real disk-cache directory).

The kernel checks no hash, so a file is offered only when it holds exactly the version's
bytes: every block listed and verified (once per disk cache, recorded in the table file), no
padding past the end; a damaged block is no passthrough, and normal reads then repair it; an
inode served in cached mode stays cached.
"""

from __future__ import annotations

import os
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
    path = await fs4.whole_on_disk(node4.inode)
    assert path is not None
    exact = await trio.to_thread.run_sync(Path(path).read_bytes)
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
    assert await fs.whole_on_disk(node.inode) is not None
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

    def counting(self: DiskCache, v: Any, lengths: Any) -> int | None:
        reads.append(v.digest)
        return original(self, v, lengths)

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

    def counting(self: DiskCache, v: Any, lengths: Any) -> int | None:
        reads.append(v.digest)
        return original(self, v, lengths)

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
