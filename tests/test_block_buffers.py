"""Pooled block buffers: filled in place, written behind the reader, never recycled early.

The invariant checked here: once nothing is in flight, every mapped buffer is either in the
pool's free list or held by a cached block; and a block evicted while the disk writer still
holds it reaches the disk intact (the writer's pin keeps its buffer out of the pool).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import trio

from objfs.backends.memory import MemoryBackend
from objfs.block_cache import BlockCache, BlockKey
from objfs.config import MountConfig
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
        skipped = fs.statistics()["disk_writes_skipped"]
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
    # Every block written is intact (the rest were skipped while the disk was behind).
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
