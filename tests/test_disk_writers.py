"""The write-behind's disk writers (``WriteBehind._disk_writer``): every idle writer wakes.

Checked on the FUSE-free core (``FileSystem`` over the memory backend) with a disk tier whose
``write_blocks`` blocks until released: a cold read queues several runs for the disk, and as
many writes as there are writers must then be under way at once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import trio

from objfs.backends.memory import SyntheticData
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
