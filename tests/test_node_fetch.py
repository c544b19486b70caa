"""One fetch per node: mounts that share a cache directory fetch each block once between them
(``objfs.disk_cache.fetching`` and ``Fetcher._fill``).

What is checked: the fetch locks exclude every other open of the lock file and die with their
holder; two file systems sharing a disk cache and reading the same file at once fetch it about
once from the store, every byte right; a fetcher killed while it holds locks costs the others a
wait of well under a second, not a hang, and they fetch those blocks themselves; a fetch
cancelled after taking a lock releases it; two real
``objfs mount`` processes sharing ``--cache-dir`` make the store send about the files' bytes
once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from objfs.backends.memory import MemoryBackend
from objfs.disk_cache.fetching import FetchLocks, lock_offset
from objfs.fs import FileSystem
from tests.conftest import Mount, load_at_once, put_many
from tests.helpers.proxy import Proxy
from tests.test_read_path import config, disk_cache, open_file, read_all

MiB = 1 << 20


def _digest(key: str, etag: str) -> str:
    import hashlib

    return hashlib.sha256(f"{key}\0{etag}".encode()).hexdigest()


def _holder(root: str, digest: str, key: str, blocks: int) -> subprocess.Popen[bytes]:
    """Another process that takes the fetch locks of blocks 0..``blocks`` of version
    ``digest`` and keeps them (until killed); returned once it holds them."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from objfs.disk_cache.fetching import FetchLocks\n"
            f"locks = FetchLocks({root!r}, lambda k, e: {digest!r})\n"
            f"assert locks.take({key!r}, 'e', range({blocks})) == list(range({blocks}))\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    child.stdout.close()
    assert line == b"held\n"
    return child


def _end(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=10)


def test_fetch_locks_exclude_other_opens_and_are_released(tmp_path: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    c = FetchLocks(str(tmp_path), _digest)
    assert c.take("k", "e", [7]) == [7]
    assert len(os.listdir("/proc/self/fd")) == fds_before + 1
    c.release("k", "e", [7])
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no lock held: no descriptor
    a, b = FetchLocks(str(tmp_path), _digest), FetchLocks(str(tmp_path), _digest)
    try:
        assert a.take("k", "e", [0, 1, 2]) == [0, 1, 2]
        assert a.take("k", "e", [1]) == [1]  # held here already
        assert b.take("k", "e", [1, 2, 3]) == [3]
        assert b.take("k2", "e", [1]) == [1]  # another version: another byte
        a.release("k", "e", [1])
        a.release("k", "e", [1])  # idempotent
        assert b.take("k", "e", [1, 2]) == [1]
        assert (a.held(), b.held()) == (2, 3)
        a.close()  # closing drops every lock
        assert b.take("k", "e", [0, 2]) == [0, 2]
        assert a.take("k", "e", [5]) == [5]  # closed: off, every block is its own
    finally:
        a.close()
        b.close()
    assert lock_offset("f" * 64, 3) == ((1 << 36) - 1) * (1 << 26) + 3 < 1 << 62


def test_a_holder_that_dies_releases_its_locks(tmp_path: Path) -> None:
    """The kernel drops a killed process's locks: the blocks it held are free at once."""
    child = _holder(str(tmp_path), _digest("k", "e"), "k", 4)
    locks = FetchLocks(str(tmp_path), _digest)
    try:
        assert locks.take("k", "e", range(6)) == [4, 5]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert locks.take("k", "e", range(4)) == [0, 1, 2, 3]
    finally:
        _end(child)
        locks.close()


def test_locks_refused_by_the_file_system_turn_them_off_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    from objfs.disk_cache import fetching

    def refuse(fd: int, cmd: int, arg: bytes) -> bytes:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fetching.fcntl, "fcntl", refuse)
    locks = FetchLocks(str(tmp_path), _digest)
    with caplog.at_level("WARNING", logger="objfs.disk_cache"):
        assert locks.take("k", "e", [0, 1]) == [0, 1]
        assert locks.take("k", "e", [2]) == [2]
    assert not locks.enabled
    assert len([r for r in caplog.records if "fetch locks refused" in r.getMessage()]) == 1


async def test_two_file_systems_sharing_a_disk_cache_fetch_each_block_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two mounts (file systems with their own disk-cache opens of one directory) read one
    16 MiB file at once: the store sends it about once, and both get every byte (before:
    twice)."""
    data = os.urandom(16 * MiB + 12345)
    backend = MemoryBackend(latency_s=0.02)
    backend.put("p/m.safetensors", data)
    mounts = []
    for _ in range(2):
        # A budget that holds the file: with 64 MiB the memory tier sometimes drops a block
        # before the disk writer gets to it, and then the other mount must fetch it too.
        fs = FileSystem(backend, config(memory_limit_bytes=256 * MiB), disk_cache(tmp_path / "c"))
        fs.start(nursery)
        mounts.append(fs)
    got: list[bytes] = []

    async def load(fs: FileSystem) -> None:
        fh = await open_file(fs, "m.safetensors")
        got.append(await read_all(fs, fh, len(data)))
        fs.release(fh)

    with trio.fail_after(60):
        async with trio.open_nursery() as loads:
            for fs in mounts:
                loads.start_soon(load, fs)
    assert got == [data, data]
    fetched = backend.requests["get_bytes"]
    assert fetched <= 1.05 * len(data), fetched / len(data)
    waits = sum(fs.disk.fetch_locks.waits for fs in mounts if fs.disk is not None)
    assert waits > 0  # the second waited for the first's blocks at least once
    for fs in mounts:
        await fs.fetcher.writes.flush_disk_writes()
        assert fs.disk is not None
        assert fs.disk.fetch_locks.held() == 0  # every lock released once on disk


async def test_a_killed_fetcher_costs_the_others_a_short_wait_not_a_hang(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Another process holds the locks of a version's first blocks (it is fetching them)
    and is killed: this mount's read waits for it, then fetches those blocks itself; every
    byte is right and nothing was fetched twice."""
    data = os.urandom(6 * MiB + 1)
    backend = MemoryBackend()
    etag = backend.put("p/k.bin", data)
    cache = disk_cache(tmp_path / "c")
    digest = cache._version("p/k.bin", etag).digest
    child = await trio.to_thread.run_sync(_holder, cache.root, digest, "p/k.bin", 4)
    try:
        fs = FileSystem(backend, config(), cache)
        fs.start(nursery)
        fh = await open_file(fs, "k.bin")
        result: list[bytes] = []

        async def read() -> None:
            result.append(await read_all(fs, fh, len(data)))

        async with trio.open_nursery() as reading:
            reading.start_soon(read)
            await trio.sleep(0.5)
            assert result == []  # waiting for the other's blocks
            killed_at = time.monotonic()
            child.send_signal(signal.SIGKILL)
            await trio.to_thread.run_sync(child.wait)
        assert time.monotonic() - killed_at < 3
        assert result == [data]
        assert backend.requests["get_bytes"] == len(data)  # each block once
        assert cache.fetch_locks.waits > 0
    finally:
        _end(child)


def test_two_mounts_sharing_a_cache_dir_fetch_the_files_once(
    mount_s3: Any, s3_server: Any, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """Two ``objfs mount`` processes of one source sharing ``--cache-dir`` load the same
    files at once: the store sends about the files' bytes once (counted at a proxy in front
    of it), every byte right (before: twice)."""
    files = {f"m/shard{i}.safetensors": os.urandom(24 * MiB + 1000 * i) for i in range(2)}
    put_many(s3, bucket, files)
    port = int(s3_server.url.rsplit(":", 1)[1])
    with Proxy(port) as origin:
        cache = tmp_path / "shared-cache"
        mounts: list[Mount] = [
            mount_s3(f"s3://{bucket}/m", "--endpoint-url", origin.url, "--cache-dir", str(cache))
            for _ in range(2)
        ]
        before = origin.stats.response_bytes
        errors = load_at_once(mounts, {k[2:]: v for k, v in files.items()})
        assert errors == []
        sent = origin.stats.response_bytes - before
    total = sum(len(v) for v in files.values())
    assert sent <= 1.05 * total, sent / total


async def test_a_fetch_cancelled_after_taking_a_lock_releases_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A fetch waits for a block another process holds, takes its lock once free, and is
    cancelled (its handle closed) while it waits for a disk-read slot: the lock goes with it,
    so the other mounts need not wait for a fetch that will never come."""
    data = os.urandom(2 * MiB)
    backend = MemoryBackend()
    etag = backend.put("p/c.bin", data)
    cache = disk_cache(tmp_path / "c")
    other = FetchLocks(cache.root, lambda key, tag: cache._version(key, tag).digest)
    try:
        assert other.take("p/c.bin", etag, [0]) == [0]
        fs = FileSystem(backend, config(), cache)
        fs.start(nursery)
        fh = await open_file(fs, "c.bin")
        handle = fs._handle(fh)
        reservation = await fs.cache.reserve(MiB, demand=True)
        blocks = dict(enumerate(fs.cache.new_blocks([MiB])))
        limiter = fs.fetcher.disk_read_limiter
        owners = [object() for _ in range(int(limiter.total_tokens))]
        async with trio.open_nursery() as fetching:
            fetching.start_soon(fs.fetcher._fill, handle, blocks, reservation)
            await trio.sleep(0.2)  # waiting for the other's lock
            for owner in owners:
                await limiter.acquire_on_behalf_of(owner)
            other.release("p/c.bin", etag, [0])
            await trio.sleep(0.3)  # took the lock; waits for a disk-read slot
            assert cache.fetch_locks.held() == 1
            fetching.cancel_scope.cancel()
        for owner in owners:
            limiter.release_on_behalf_of(owner)
        assert cache.fetch_locks.held() == 0
        assert other.take("p/c.bin", etag, [0]) == [0]
        assert backend.requests["get_bytes"] == 0
        for block in blocks.values():
            block.discard()
        reservation.release()
        fs.release(fh)
    finally:
        other.close()
