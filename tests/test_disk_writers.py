"""The write-behind's disk writers (``WriteBehind._disk_writer``) and what a cold read costs
the disk tier.

Checked on the FUSE-free core (``FileSystem`` over the memory backend): with a disk tier whose
``write_blocks`` blocks until released, a cold read queues several runs for the disk, and as
many writes as there are writers must then be under way at once; a cold read hashes each
block once, as it arrives, and hands no disk read to a thread once the table can be read
without waiting.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import trio

import objfs.scheduler
from objfs.backends.memory import SyntheticData
from objfs.disk_cache import blockio
from objfs.disk_cache.layout import block_hash
from objfs.fs import FileSystem
from objfs.write_behind import DISK_WRITE_THREADS
from tests.test_memory_ownership import KeyedBackend, make_config, make_disk, open_file

MiB = 1024 * 1024
SIZE = 48 * MiB  # six runs of 8 blocks for the write queue (a quarter of a 256 MiB budget)


async def test_every_idle_disk_writer_takes_a_queued_run(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = KeyedBackend()
    backend.put("p/model.bin", SyntheticData(SIZE, seed=b"writers"))
    disk = make_disk(tmp_path / "cache")
    real_write = disk.write_blocks
    lock = threading.Lock()
    release = threading.Event()
    state = {"now": 0, "peak": 0, "calls": 0}

    def blocking_write(*args: Any) -> int:
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["peak"] = max(state["peak"], state["now"])
        try:
            release.wait(timeout=30)
            return real_write(*args)
        finally:
            with lock:
                state["now"] -= 1

    disk.write_blocks = blocking_write  # type: ignore[method-assign]
    fs = FileSystem(backend, make_config(), disk)
    fs.start(nursery)
    fh = await open_file(fs, "model.bin")
    try:
        for offset in range(0, SIZE, MiB):
            await fs.read(fh, offset, MiB)
        # Every run is fetched and queued now; give the idle writers (real) time to wake.
        deadline = time.monotonic() + 5.0
        while state["peak"] < DISK_WRITE_THREADS and time.monotonic() < deadline:  # noqa: ASYNC110
            await trio.sleep(0.01)
        queued = fs.fetcher.statistics()["disk_write_queue_bytes"]
        peak = state["peak"]
    finally:
        release.set()
    await fs.fetcher.writes.flush_disk_writes()
    fs.release(fh)
    assert queued > 2 * 8 * MiB, queued  # runs were waiting for a writer
    assert peak == DISK_WRITE_THREADS, f"{peak} concurrent disk writes, {queued} bytes queued"
    assert disk.statistics()["disk_writes"] == SIZE // MiB


async def test_a_cold_read_hashes_each_block_once_and_skips_threads_for_absent_blocks(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: Any
) -> None:
    backend = KeyedBackend()
    data = SyntheticData(SIZE, seed=b"hashed")
    etag = backend.put("p/model.bin", data)
    blocks = SIZE // MiB
    disk = make_disk(tmp_path / "cache")
    # The last block on disk already (another mount's): the version's files are open here.
    assert disk.write_blocks("p/model.bin", etag, blocks - 1, [data.read(SIZE - MiB, MiB)]) == 1
    counts = {"fetcher_hashes": 0, "tier_hashes": 0}
    looks: list[set[int] | None] = []  # listed_now's answers
    thread_reads: list[list[int]] = []  # the blocks of each disk read handed to a thread

    def counted(name: str) -> Any:
        def hash_counted(view: Any) -> int:
            counts[name] += 1
            return block_hash(view)

        return hash_counted

    monkeypatch.setattr(objfs.scheduler, "block_hash", counted("fetcher_hashes"))
    monkeypatch.setattr(blockio, "block_hash", counted("tier_hashes"))
    real_listed = disk.listed_now

    def listed_now(*args: Any) -> set[int] | None:
        looks.append(real_listed(*args))
        return looks[-1]

    disk.listed_now = listed_now  # type: ignore[method-assign]
    fs = FileSystem(backend, make_config(), disk)
    real_thread_read = fs.fetcher.read_disk_blocks_into

    def thread_read(handle: Any, wanted: list[tuple[int, memoryview]]) -> set[int]:
        thread_reads.append([i for i, _ in wanted])
        return real_thread_read(handle, wanted)

    fs.fetcher.read_disk_blocks_into = thread_read  # type: ignore[method-assign]
    fs.start(nursery)
    fh = await open_file(fs, "model.bin")
    got = bytearray()
    for offset in range(0, SIZE, MiB):
        got += await fs.read(fh, offset, MiB)
    await fs.fetcher.writes.flush_disk_writes()
    fs.release(fh)
    assert bytes(got) == data.read(0, SIZE)
    assert disk.statistics()["disk_writes"] == blocks
    # Each block fetched hashed once, by the fetcher as it arrived; the disk tier hashed only
    # the block it read (its check), none of those it wrote.
    assert counts == {"fetcher_hashes": blocks - 1, "tier_hashes": 1}
    # Every look was answered without waiting; only the block on disk went to a thread.
    assert len(looks) > 1, looks
    assert None not in looks, looks
    assert thread_reads == [[blocks - 1]], thread_reads
    # The digests written are the blocks' own: a fresh process reads every block back.
    other = make_disk(tmp_path / "cache")
    found = other.read_blocks("p/model.bin", etag, range(blocks), [MiB] * blocks)
    assert (len(found), other.corrupt) == (blocks, 0)
    assert b"".join(found[i] for i in range(blocks)) == bytes(got)
