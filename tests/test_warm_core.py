"""``FileSystem.warm`` (``objfs warm --cache-only``) on the FUSE-free core.

The invariant it keeps: once ``warm`` returns, every block of the file's version is in the disk
tier (none lost to a write queue that could not keep up), the handle it read through is closed,
and it holds no memory (no reservation left, the budget within 0..capacity). Checked with the
memory backend, which answers at once, so the reader would outrun the disk writer's threads
without the pacing (``WriteBehind.disk_room``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.errors import IsADirectoryFsError, NoDiskCacheError, TransientStoreError
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE
from objfs.write_behind import WriteBehind
from tests.test_memory_ownership import (
    KeyedBackend,
    check_budget,
    make_config,
    make_disk,
    open_file,
)

MiB = 1024 * 1024
SIZE = 40 * MiB + 12_345  # an unaligned last block
BUDGET = 8 * MiB  # a write queue of 2 MiB: far slower than the memory backend's GETs


def file_data() -> bytes:
    return SyntheticData(SIZE, seed=b"warm").read(0, SIZE)


async def test_warm_leaves_every_block_on_disk_and_no_memory_held(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = KeyedBackend()
    etag = backend.put("p/model.safetensors", file_data())
    backend.put("p/sub/config.json", b"{}")
    disk = make_disk(tmp_path / "cache")
    fs = FileSystem(backend, make_config(memory_limit_bytes=BUDGET), disk)
    fs.start(nursery)
    node = await fs.lookup(ROOT_INODE, b"model.safetensors")

    assert await fs.warm(node.inode) == SIZE
    blocks = -(-SIZE // MiB)
    fetcher = fs.fetcher.statistics()
    # A block the reader's own fetch evicted before the writer got to it (rare: a demand
    # fetch may evict an unread block) is fetched again before warm returns, and no block
    # is written twice.
    lost = fetcher["disk_blocks_not_cached"]
    assert fetcher["disk_blocks_backfilled"] <= lost, fetcher
    assert fetcher["disk_write_queue_bytes"] == 0, fetcher
    assert disk.statistics()["disk_writes"] == blocks
    assert fs.statistics()["open_files"] == 0
    assert fs.cache.statistics()["inflight_bytes"] == 0
    check_budget(fs)
    # every byte fetched once, the lost blocks twice
    assert SIZE <= backend.bytes_of["p/model.safetensors"] <= SIZE + lost * MiB

    await assert_served_offline(nursery, tmp_path / "cache", etag)


async def assert_served_offline(nursery: trio.Nursery, cache: Path, etag: str) -> None:
    """A second file system over the disk cache ``cache``, with a store that fails every
    GET, serves every byte (same version: the memory backend's ETags follow the puts'
    order)."""

    def no_store(op: str, key: str) -> None:
        if op == "get":
            raise TransientStoreError(f"injected: GET {key} failed")

    offline = MemoryBackend(fault=no_store)
    assert offline.put("p/model.safetensors", file_data()) == etag
    fs2 = FileSystem(offline, make_config(memory_limit_bytes=BUDGET), make_disk(cache))
    fs2.start(nursery)
    fh = await open_file(fs2, "model.safetensors")
    got = bytearray()
    while len(got) < SIZE:
        got += await fs2.read(fh, len(got), MiB)
    fs2.release(fh)
    assert got == file_data()


async def test_blocks_lost_anyway_are_fetched_again_before_warm_returns(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line of defence: with the pacing off (no waiting for the disk writer before
    each block, no early queueing of read blocks), blocks are evicted before they reach the
    disk, and warm
    fetches them again (``store_lost_now``) before it returns, instead of leaving them to
    the idle-time backfill."""

    disk_room = WriteBehind.disk_room

    async def settled_only(self: WriteBehind, *, settled: bool = False) -> None:
        if settled:
            await disk_room(self, settled=True)

    monkeypatch.setattr(WriteBehind, "disk_room", settled_only)
    monkeypatch.setattr(WriteBehind, "write_now", lambda self, key: None)
    backend = KeyedBackend()
    etag = backend.put("p/model.safetensors", file_data())
    fs = FileSystem(backend, make_config(memory_limit_bytes=BUDGET), make_disk(tmp_path / "c"))
    fs.start(nursery)
    node = await fs.lookup(ROOT_INODE, b"model.safetensors")

    assert await fs.warm(node.inode) == SIZE
    fetcher = fs.fetcher.statistics()
    assert fetcher["disk_blocks_not_cached"] > 0, fetcher  # the premise: some were lost
    assert 0 < fetcher["disk_blocks_backfilled"] <= fetcher["disk_blocks_not_cached"], fetcher
    assert fs.cache.statistics()["inflight_bytes"] == 0
    check_budget(fs)
    await assert_served_offline(nursery, tmp_path / "c", etag)


async def test_warm_needs_a_disk_tier_and_a_file(nursery: trio.Nursery, tmp_path: Path) -> None:
    backend = MemoryBackend()
    backend.put("p/sub/a.bin", b"a" * 100)
    fs = FileSystem(backend, make_config(), None)
    fs.start(nursery)
    node = await fs.lookup(ROOT_INODE, b"sub")
    a = await fs.lookup(node.inode, b"a.bin")
    with pytest.raises(NoDiskCacheError):
        await fs.warm(a.inode)
    assert backend.requests["get"] == 0

    with_disk = FileSystem(backend, make_config(), make_disk(tmp_path / "cache"))
    with_disk.start(nursery)
    sub = await with_disk.lookup(ROOT_INODE, b"sub")
    with pytest.raises(IsADirectoryFsError):
        await with_disk.warm(sub.inode)
    a = await with_disk.lookup(sub.inode, b"a.bin")
    assert await with_disk.warm(a.inode) == 100
