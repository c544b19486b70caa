"""READs answered from memory with no await (``FileSystem.read_nowait``, on the trio thread)
and by the kernel transport's reader thread under the core's lock (``FileSystem.read_locked``,
``objfs.kernel.session.CoreLock``).

What is checked: a read that needs anything but memory is declined with nothing changed (no
hit counted, no read-ahead told, nothing pinned); one that memory holds returns its version's
bytes, pinned until its holds run (``read_nowait``) or with nothing pinned (``read_locked``:
the lock keeps the blocks), and only where reading wakes nobody (a fresh block read to its end
is left to the trio thread); the core's lock excludes every task step; and a real mount on the
kernel transport answers O_DIRECT reads of a file held in memory in its reader thread, byte for
byte (the random reads of ``tests/test_core_properties.py`` cover ``read_nowait`` against
evictions and replacements).
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from objfs.backends.memory import MemoryBackend
from objfs.fs import FileSystem
from objfs.kernel.memory_reads import CoreLock
from tests.conftest import fresh_status, put_many
from tests.test_read_path import config, open_file, read_all, settle

MiB = 1 << 20
KERNEL = ("--fuse-transport", "kernel")


def pins(fs: FileSystem) -> int:
    return sum(block.pins for block in [*fs.cache._used.values(), *fs.cache._fresh.values()])


async def test_reads_from_memory_decline_without_a_trace_and_answer_exactly(
    nursery: trio.Nursery,
) -> None:
    backend = MemoryBackend()
    data = os.urandom(5 * MiB + 123)
    backend.put("p/f.bin", data)
    fs = FileSystem(backend, config())
    fs.start(nursery)
    fh = await open_file(fs, "f.bin")
    hits = fs.cache.hits
    holds: list[Any] = []
    assert fs.read_nowait(fh, 0, 4096, holds=holds) is None  # nothing fetched yet
    assert fs.read_locked(fh, 0, 4096) is None
    assert holds == []
    assert fs.cache.hits == hits
    assert fs._handle(fh).readahead.streams == []  # the read-ahead was never told
    assert await read_all(fs, fh, len(data)) == data  # every block read to its end: used
    await settle()

    # On the trio thread: a view (or a view per block) of the version's bytes, pinned.
    for offset, size in [(0, 4096), (MiB - 100, 200), (3 * MiB + 7, 2 * MiB), (5 * MiB, MiB)]:
        holds = []
        got = fs.read_nowait(fh, offset, size, holds=holds)
        assert got is not None
        joined = b"".join(got) if isinstance(got, list) else bytes(got)
        assert joined == data[offset : offset + size]
        assert pins(fs) == len(holds) > 0
        del got
        for release in holds:
            release()
        assert pins(fs) == 0

    # From another thread under the core's lock: the same bytes, nothing pinned.
    for offset, size in [(0, 4096), (MiB - 100, 200), (2 * MiB, 3 * MiB + 123)]:
        answer = fs.read_locked(fh, offset, size)
        assert answer is not None
        got, _window, _stream = answer
        joined = b"".join(got) if isinstance(got, list) else bytes(got)
        assert joined == data[offset : offset + size]
        assert pins(fs) == 0
    assert fs.read_locked(fh, len(data), 10) == (b"", None, None)


async def test_a_fresh_block_read_to_its_end_is_left_to_the_trio_thread(
    nursery: trio.Nursery,
) -> None:
    """Reading a fresh block to its end makes it evictable, which may wake memory waiters
    (trio events): the reader thread declines it; short of its end it answers."""
    backend = MemoryBackend()
    data = os.urandom(2 * MiB)
    backend.put("p/f.bin", data)
    fs = FileSystem(backend, config())
    fs.start(nursery)
    fh = await open_file(fs, "f.bin")
    assert await fs.read(fh, 0, 4096) == data[:4096]  # block 0 fetched, still fresh
    await settle()
    assert fs.read_locked(fh, 0, MiB) is None
    answer = fs.read_locked(fh, 4096, 4096)
    assert answer is not None
    assert bytes(answer[0]) == data[4096:8192]


async def test_the_core_lock_excludes_every_task_step() -> None:
    """While another thread holds the core's lock, no task step runs; a step never sees it
    held by that thread."""
    core = CoreLock()
    trio.lowlevel.add_instrument(core)
    core.lock.acquire()  # as KernelSession.serve does, from inside this step
    inside = threading.Event()
    seen: list[bool] = []
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            with core.lock:
                inside.set()
                time.sleep(0.001)
                inside.clear()
            time.sleep(0.0005)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        deadline = trio.current_time() + 0.5
        while trio.current_time() < deadline:
            seen.append(inside.is_set())
            await trio.lowlevel.checkpoint()
    finally:
        stop.set()
        trio.lowlevel.remove_instrument(core)
        core.lock.release()
    await trio.to_thread.run_sync(thread.join)
    assert len(seen) > 50
    assert not any(seen)


def test_a_kernel_mount_answers_direct_reads_of_memory_in_its_reader_thread(
    mount_s3: Any, s3: Any, bucket: str
) -> None:
    data = os.urandom(8 * MiB + 4097)
    put_many(s3, bucket, {"m/w.bin": data})
    m = mount_s3(f"s3://{bucket}/m", *KERNEL)
    path: Path = m.path / "w.bin"
    assert path.read_bytes() == data  # into objfs's memory
    rng = random.Random(7)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 256 * 1024)
    try:
        for _ in range(300):
            size = rng.choice([4096, 64 * 1024, 256 * 1024])
            offset = rng.randrange(0, len(data) // 4096) * 4096
            n = os.preadv(fd, [memoryview(buf)[:size]], offset)
            assert n == min(size, len(data) - offset)
            assert buf[:n] == data[offset : offset + n]
    finally:
        os.close(fd)
        buf.close()
    fuse = fresh_status(m.path)["fuse"]
    assert fuse["reads_in_reader"] >= 250, fuse
