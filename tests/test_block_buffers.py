"""Pooled block buffers: filled in place, written behind the reader, never recycled early.

The invariant checked here: once nothing is in flight, every mapped buffer is either in the
pool's free list or held by a cached block; and a block evicted while the disk writer still
holds it reaches the disk intact (the writer's pin keeps its buffer out of the pool).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from objfs.backends.memory import MemoryBackend
from objfs.block_cache import BlockCache, BlockKey
from objfs.config import MountConfig
from objfs.disk_cache import DiskCache
from objfs.fs import ROOT_INODE, FileSystem
from tests.test_read_path import config as read_path_config
from tests.test_read_path import disk_cache

MiB = 1 << 20


def config(**kwargs: object) -> MountConfig:
    return read_path_config(**{"memory_limit_bytes": 8 * MiB, **kwargs})


def cached_blocks(cache: BlockCache) -> int:
    return cache.statistics()["cached_bytes"] // MiB  # whole blocks in these tests


async def read_file(fs: FileSystem, name: str, size: int) -> bytes:
    node = await fs.lookup(ROOT_INODE, name.encode())
    fh, _ = await fs.open(node.inode, os.O_RDONLY)
    out = bytearray()
    for offset in range(0, size, 128 * 1024):
        out += await fs.read(fh, offset, 128 * 1024)
    fs.release(fh)
    return bytes(out)


async def test_blocks_evicted_while_queued_for_disk_reach_it_intact(tmp_path: Path) -> None:
    data = os.urandom(64 * MiB)
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/model.bin", data)
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(), disk_cache(tmp_path / "cache"))
        fs.start(nursery)
        # An 8 MiB budget: most blocks are evicted long before the disk writer gets to them.
        assert await read_file(fs, "model.bin", len(data)) == data
        await fs.flush_disk_writes()
        for _ in range(5):
            await trio.sleep(0.01)
        stats = fs.cache.statistics()
        assert stats["evictions"] >= 40
        assert stats["inflight_bytes"] == 0
        # Nothing leaked: each mapped buffer is free or holds a cached block.
        assert stats["buffers_allocated"] == stats["buffers_free"] + cached_blocks(fs.cache)
        assert stats["buffers_allocated"] <= fs.cache.pool.max_mapped
        written = fs.statistics()["disk_writes"]
        skipped = fs.statistics()["disk_blocks_not_cached"]
        nursery.cancel_scope.cancel()
    assert written + skipped > 0
    # What reached the disk is the object's bytes, block for block.
    cache = disk_cache(tmp_path / "cache")
    etag = (await backend.head("p/model.bin")).etag
    checked = 0
    for index in range(64):
        got = cache.read(BlockKey("p/model.bin", etag, index), MiB)
        if got is not None:
            assert (
                hashlib.sha256(got).digest()
                == hashlib.sha256(data[index * MiB : (index + 1) * MiB]).digest()
            ), f"block {index} on disk differs"
            checked += 1
    # Every block written is intact (the rest were evicted while the disk was behind).
    assert checked == written > 0


async def test_a_read_straddling_blocks_is_copied_before_the_next_fetch(tmp_path: Path) -> None:
    """Reads that cross a block boundary copy each piece at once: a 2-block budget evicts and
    recycles the first block's buffer while the second is fetched."""
    data = os.urandom(16 * MiB)
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/x.bin", data)
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(memory_limit_bytes=2 * MiB, part_size_bytes=MiB))
        fs.start(nursery)
        node = await fs.lookup(ROOT_INODE, b"x.bin")
        fh, _ = await fs.open(node.inode, os.O_RDONLY)
        # Random offsets (no read-ahead): each read straddles two blocks.
        for offset in (5 * MiB - 7, 11 * MiB - 4096, MiB - 1, 14 * MiB + 3):
            got = bytes(await fs.read(fh, offset, MiB))
            assert got == data[offset : offset + MiB], f"read at {offset}"
        fs.release(fh)
        nursery.cancel_scope.cancel()


class GatedDisk(DiskCache):
    """A disk tier whose writes wait until ``gate`` opens (a disk far behind the reader)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(
            str(directory),
            namespace="memory://",
            block_size=MiB,
            size_limit_bytes=1 << 30,
            min_free_bytes=0,
        )
        self.gate = threading.Event()

    def write_blocks(self, key: str, etag: str, first_index: int, blocks: Sequence[Any]) -> int:
        if not self.gate.wait(timeout=30):
            raise AssertionError("the gate never opened")
        return super().write_blocks(key, etag, first_index, blocks)


async def test_a_disk_behind_the_reader_defers_writes_and_catches_up(tmp_path: Path) -> None:
    """The read finishes while no disk write can (no reply waits for the disk); the queue
    holds at most a quarter of the budget, pinned and charged to it; once the disk catches
    up, the deferred blocks still in memory are written, so the disk tier ends complete."""
    data = os.urandom(12 * MiB)  # the queue fills (7 MiB at most), the rest is deferred
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/model.bin", data)
    disk = GatedDisk(tmp_path / "cache")
    async with trio.open_nursery() as nursery:
        # A 32 MiB budget: the queue may pin 7 MiB, and the 8 MiB of read blocks kept
        # (a quarter) still hold the deferred ones when the disk catches up.
        fs = FileSystem(backend, config(memory_limit_bytes=32 * MiB), disk)
        fs.start(nursery)
        try:
            with trio.fail_after(20):
                assert await read_file(fs, "model.bin", len(data)) == data
            stats = fs.statistics()
            assert stats["disk_writes"] == 0
            assert stats["disk_writes_deferred"] > 0
            # The queue is full to within one piece (pieces of at most half the queue, in whole
            # blocks): its limit is a quarter of the block tier's share (28 of the 32 MiB:
            # 7 MiB; pieces of 3 blocks). It is pinned and inside the budget.
            limit = fs.cache.capacity_bytes // 4
            piece = limit // 2 // MiB * MiB
            assert limit - piece < stats["disk_write_queue_bytes"] <= limit, stats
            assert fs.cache.used_bytes <= 32 * MiB
        finally:
            disk.gate.set()
        with trio.fail_after(20):
            await fs.flush_disk_writes()
        stats = fs.statistics()
        nursery.cancel_scope.cancel()
    assert stats["disk_blocks_not_cached"] == 0
    assert stats["disk_writes"] == 12
    etag = (await backend.head("p/model.bin")).etag
    for index in range(12):
        got = disk.read(BlockKey("p/model.bin", etag, index), MiB)
        assert got is not None, f"block {index} is not on disk"
        assert got == data[index * MiB : (index + 1) * MiB], f"block {index} differs"


def test_an_evicted_block_stays_charged_while_pinned() -> None:
    """Evicting a block the disk writer pins makes no room: its buffer is still in use."""
    cache = BlockCache(2 * MiB, block_size=MiB)
    cache.open_version("k", "e")
    blocks = []
    for index in range(2):
        reservation = cache.try_reserve(MiB, demand=True)
        assert reservation is not None
        block = cache.new_block(MiB)
        cache.put(BlockKey("k", "e", index), block, reservation)
        assert cache.get_nowait(BlockKey("k", "e", index)) is not None  # read: used
        blocks.append(block)
    blocks[0].pin()
    blocks[1].pin()
    # Both are evicted for a new reservation, but their bytes stay charged: no room.
    assert cache.try_reserve(MiB, demand=False) is None
    assert cache.used_bytes == 2 * MiB
    assert cache.statistics()["held_bytes"] == 2 * MiB
    blocks[0].unpin()  # written: its buffer goes back, its bytes leave the budget
    assert cache.used_bytes == MiB
    reservation = cache.try_reserve(MiB, demand=False)
    assert reservation is not None
    assert cache.used_bytes == 2 * MiB
    reservation.release()
    blocks[1].unpin()
    assert cache.used_bytes == 0
    assert cache.statistics()["held_bytes"] == 0
    stats = cache.statistics()
    assert stats["buffers_allocated"] == stats["buffers_free"]
