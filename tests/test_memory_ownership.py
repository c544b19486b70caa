"""Who owns the bytes of the memory budget: regression tests for three reported defects.

Each test drives the FUSE-free core (``FileSystem`` over the in-memory backend, with a latency,
under trio's autojump clock so that simulated time is measurable) and asserts what a correct
memory budget guarantees:

1. Orphaned read-ahead: blocks prefetched for a file that was closed before anyone read them
   must not keep the budget from a later reader (its GETs, bytes and time match a fresh mount).
2. Budget drift: a fetch that took disk-cache hits and then failed (store error, replaced
   object, cancellation) gives back exactly what it reserved: ``inflight_bytes`` returns to 0.
3. Thrashing under pressure: concurrent readers under a small budget fetch every byte about
   once (read-ahead does not evict blocks a reader has not consumed yet).

Only the public surface is used: ``FileSystem.lookup/open/read/release``, ``fs.cache``'s
``statistics()`` and ``used_bytes``, ``flush_disk_writes()``, the memory backend's request
counters and fault hook, and ``DiskCache``. The tests take pytest-trio's ``autojump_clock``
fixture (``MockClock(autojump_threshold=0)``): pytest-trio runs a test under the clock found
among its fixture values.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.config import MountConfig, parse_source
from objfs.disk_cache import DiskCache
from objfs.errors import ObjfsError, StaleObjectError, TransientStoreError
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE

MiB = 1024 * 1024
KiB = 1024
LATENCY_S = 0.005  # per request, in simulated time


def make_config(**overrides: object) -> MountConfig:
    base: dict[str, object] = {
        "source": parse_source("s3://bkt/p"),
        "mountpoint": "/unused",
        "block_size_bytes": MiB,
        "part_size_bytes": 8 * MiB,
        "memory_limit_bytes": 256 * MiB,
    }
    base.update(overrides)
    return MountConfig(**base)  # type: ignore[arg-type]


def make_disk(directory: Path) -> DiskCache:
    return DiskCache(
        str(directory),
        namespace="memory://",
        block_size=MiB,
        size_limit_bytes=1 << 30,
        min_free_bytes=0,
    )


async def open_file(fs: FileSystem, name: str) -> int:
    node = await fs.lookup(ROOT_INODE, name.encode())
    fh, _ = await fs.open(node.inode, os.O_RDONLY)
    return fh


async def settle(seconds: float = 5.0) -> None:
    """Let background work finish: simulated seconds, free under the autojump clock."""
    await trio.sleep(seconds)


async def wait_for(condition: Callable[[], bool], *, real_timeout_s: float = 10.0) -> bool:
    """Poll until ``condition()`` holds or ``real_timeout_s`` of real time pass; return it.

    Real time, not trio's: under the autojump clock trio's time jumps ahead while a disk read
    or write runs in a worker thread, so a trio timeout would fire before the thread is done.
    """
    deadline = time.monotonic() + real_timeout_s
    # Polling: the conditions are counters of objfs and of the backend, with no event to wait on.
    while not condition() and time.monotonic() < deadline:  # noqa: ASYNC110
        await trio.sleep(0.001)
    return condition()


def check_budget(fs: FileSystem) -> None:
    stats = fs.cache.statistics()
    assert stats["cached_bytes"] >= 0, stats
    assert stats["inflight_bytes"] >= 0, stats
    assert 0 <= fs.cache.used_bytes <= stats["capacity_bytes"], (fs.cache.used_bytes, stats)


class KeyedBackend(MemoryBackend):
    """The memory backend, also counting GETs and fetched bytes per key (every fetch goes
    through ``read_range``, the backend contract's one read)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gets_of: Counter[str] = Counter()
        self.bytes_of: Counter[str] = Counter()

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        data = await super().read_range(key, etag, start, length)
        self.gets_of[key] += 1
        self.bytes_of[key] += length
        return data


# -- 1. orphaned read-ahead ------------------------------------------------------------------

SHARDS = 16
SHARD_SIZE = 32 * MiB  # 16 shards: twice the budget, so their read-ahead fills it
BIG_SIZE = 256 * MiB


@dataclass
class SequentialRun:
    seconds: float
    gets: int
    get_bytes: int
    digest: str


async def sequential_read_after(nursery: trio.Nursery, *, headers_first: bool) -> SequentialRun:
    """Read big.bin start to end in 1 MiB requests on a new file system; first, if
    ``headers_first``, open every shard, read its 64 KiB header and close it (a loader
    reading safetensors headers), and let its read-ahead run."""
    backend = KeyedBackend(latency_s=LATENCY_S)
    for i in range(SHARDS):
        backend.put(f"p/shard-{i:02}.safetensors", SyntheticData(SHARD_SIZE, seed=b"s%d" % i))
    backend.put("p/big.bin", SyntheticData(BIG_SIZE, seed=b"big"))
    fs = FileSystem(backend, make_config())
    fs.start(nursery)
    if headers_first:
        for i in range(SHARDS):
            fh = await open_file(fs, f"shard-{i:02}.safetensors")
            header = await fs.read(fh, 0, 64 * KiB)
            assert bytes(header) == SyntheticData(SHARD_SIZE, seed=b"s%d" % i).read(0, 64 * KiB)
            fs.release(fh)
        await settle()
        check_budget(fs)
    fh = await open_file(fs, "big.bin")
    digest = hashlib.sha256()
    started = trio.current_time()
    for offset in range(0, BIG_SIZE, MiB):
        digest.update(await fs.read(fh, offset, MiB))
    seconds = trio.current_time() - started
    fs.release(fh)
    await settle()
    check_budget(fs)
    return SequentialRun(
        seconds, backend.gets_of["p/big.bin"], backend.bytes_of["p/big.bin"], digest.hexdigest()
    )


async def test_closed_files_read_ahead_does_not_starve_a_later_reader(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """16 safetensors shards opened for their header and closed: their unread read-ahead
    must give way to the next reader, which then costs what it costs on a fresh mount."""
    expected = hashlib.sha256()
    for offset in range(0, BIG_SIZE, 16 * MiB):
        expected.update(SyntheticData(BIG_SIZE, seed=b"big").read(offset, 16 * MiB))
    fresh = await sequential_read_after(nursery, headers_first=False)
    after = await sequential_read_after(nursery, headers_first=True)
    assert fresh.digest == after.digest == expected.hexdigest()
    assert fresh.get_bytes == BIG_SIZE  # the baseline fetches every byte once
    problems = []
    if after.get_bytes > BIG_SIZE * 1.05:
        problems.append(f"fetched {after.get_bytes / BIG_SIZE:.3f}x the file")
    if after.gets > fresh.gets * 1.1 + 2:
        problems.append(f"{after.gets} GETs, {fresh.gets} on a fresh mount")
    # Two round trips of slack on top of 10%: the fresh read takes only a few round trips.
    if after.seconds > fresh.seconds * 1.1 + 2 * LATENCY_S:
        problems.append(f"{after.seconds:.3f} s, {fresh.seconds:.3f} s on a fresh mount")
    assert not problems, "; ".join(problems)


# -- 2. budget drift after a failed fetch that took disk hits ---------------------------------

FILES = 3
CACHED_PREFIX = 4 * MiB  # the disk cache holds blocks 0-3 of each file
FILE_SIZE = 8 * MiB  # one 8 MiB part: blocks 4-7 must come from the store


def file_data(i: int) -> bytes:
    return SyntheticData(FILE_SIZE, seed=b"f%d" % i).read(0, FILE_SIZE)


async def fill_disk_with_prefixes(nursery: trio.Nursery, directory: Path) -> list[str]:
    """Cache blocks 0-3 of each file's version on disk, and only those; returns the ETags.

    The memory backend's ETag depends on the key and the order of puts only, so a backend
    that holds just the first 4 MiB under the same ETag fills exactly those blocks.
    """
    backend = MemoryBackend()
    etags = [backend.put(f"p/f{i}.bin", file_data(i)[:CACHED_PREFIX]) for i in range(FILES)]
    disk = make_disk(directory)
    fs = FileSystem(backend, make_config(memory_limit_bytes=64 * MiB), disk)
    fs.start(nursery)
    for i in range(FILES):
        fh = await open_file(fs, f"f{i}.bin")
        got = b"".join([bytes(await fs.read(fh, off, MiB)) for off in range(0, CACHED_PREFIX, MiB)])
        assert got == file_data(i)[:CACHED_PREFIX]
        fs.release(fh)
    await fs.flush_disk_writes()
    assert disk.statistics()["disk_writes"] >= FILES * CACHED_PREFIX // MiB
    return etags


class GatedBackend(MemoryBackend):
    """The memory backend, whose GETs (when ``gated``) wait for ``gate``: ``entered`` is set
    when one starts, so a test can act while a fetch is surely in its GET."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gated = False
        self.gate = trio.Event()
        self.entered = trio.Event()

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        if self.gated:
            self.entered.set()
            await self.gate.wait()
        return await super().read_range(key, etag, start, length)


async def read_until_error(fs: FileSystem, fh: int) -> tuple[bytes, ObjfsError | None]:
    out = bytearray()
    try:
        for offset in range(0, FILE_SIZE, MiB):
            out += await fs.read(fh, offset, MiB)
    except ObjfsError as exc:
        return bytes(out), exc
    return bytes(out), None


@pytest.mark.parametrize("failure", ["store_error", "replaced_object", "closed_while_fetching"])
async def test_a_failed_fetch_after_disk_hits_gives_back_what_it_reserved(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    failure: str,
) -> None:
    """Three failures in a row, each of a fetch that first took disk hits: after each the
    budget holds no reservation and stays within 0..capacity (the report: -4, -8, -12 MiB)."""
    etags = await fill_disk_with_prefixes(nursery, tmp_path / "cache")
    failing = failure == "store_error"

    def fault(op: str, key: str) -> None:
        if failing and op == "get":
            raise TransientStoreError(f"injected: GET {key} failed")

    backend = GatedBackend(latency_s=LATENCY_S, fault=fault)
    backend.gated = failure == "closed_while_fetching"
    assert [backend.put(f"p/f{i}.bin", file_data(i)) for i in range(FILES)] == etags
    disk = make_disk(tmp_path / "cache")
    fs = FileSystem(backend, make_config(memory_limit_bytes=64 * MiB), disk)
    fs.start(nursery)
    for i in range(FILES):
        hits_before = disk.statistics()["disk_hits"]
        fh = await open_file(fs, f"f{i}.bin")
        if failure == "closed_while_fetching":
            backend.entered = trio.Event()
            first = await fs.read(fh, 0, MiB)  # block 0 is on disk: no GET
            assert bytes(first) == file_data(i)[:MiB]
            # Close while the read-ahead of blocks 1-7 is in its GET (after its disk hits):
            # GETs never finish here, so this one is cancelled.
            assert await wait_for(backend.entered.is_set)
            fs.release(fh)
        else:
            if failure == "replaced_object":
                backend.put(f"p/f{i}.bin", b"new version " * 1000)
            got, error = await read_until_error(fs, fh)
            fs.release(fh)
            expected_error = StaleObjectError if failure == "replaced_object" else ObjfsError
            assert isinstance(error, expected_error), error
            assert CACHED_PREFIX <= len(got) < FILE_SIZE
            assert got == file_data(i)[: len(got)]
        # Let the failed or cancelled fetch end: its reservation goes (0, or below with the
        # defect), and nothing waits for the disk (its threads run in real time).
        await fs.flush_disk_writes()
        await wait_for(lambda: fs.cache.statistics()["inflight_bytes"] <= 0)
        await settle()
        # The premise: this round read from the disk cache (every GET of the first two
        # failures failed, so the 4 MiB the reader got came from the disk).
        assert disk.statistics()["disk_hits"] > hits_before
        stats = fs.cache.statistics()
        assert stats["inflight_bytes"] == 0, f"after failure {i + 1}: {stats}"
        check_budget(fs)


# -- 3. thrashing under pressure ----------------------------------------------------------------


def mismatches(expected: SyntheticData) -> tuple[list[int], Callable[[int, bytes], None]]:
    """A list of offsets whose bytes differed from ``expected``, and the check that fills it."""
    wrong: list[int] = []

    def check(offset: int, data: bytes) -> None:
        if data != expected.read(offset, len(data)):
            wrong.append(offset)

    return wrong, check


async def test_parallel_pieces_of_one_file_are_fetched_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """torch_io's pattern: 16 tasks on one descriptor take 16 MiB pieces of a 1 GiB file from
    a shared counter and read each as 1 MiB requests, under a 256 MiB budget (the report:
    1.29-1.36 GiB fetched)."""
    size, piece = 1 << 30, 16 * MiB
    content = SyntheticData(size, seed=b"weights")
    backend = MemoryBackend(latency_s=LATENCY_S)
    backend.put("p/model.bin", content)
    fs = FileSystem(backend, make_config(memory_limit_bytes=256 * MiB))
    fs.start(nursery)
    fh = await open_file(fs, "model.bin")
    pieces = iter(range(0, size, piece))
    wrong, check = mismatches(content)
    read = 0

    async def worker() -> None:
        nonlocal read
        for start in pieces:
            for offset in range(start, start + piece, MiB):
                data = bytes(await fs.read(fh, offset, MiB))
                check(offset, data)
                read += len(data)

    async with trio.open_nursery() as workers:
        for _ in range(16):
            workers.start_soon(worker)
    fs.release(fh)
    await settle()
    assert read == size
    assert wrong == []
    fetched = backend.requests["get_bytes"]
    assert fetched <= size * 1.05, f"fetched {fetched / size:.3f}x the file"
    check_budget(fs)


async def test_concurrent_streams_under_a_small_budget_fetch_each_byte_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """8 files of 128 MiB read at once in 128 KiB requests with a 64 MiB budget: read-ahead
    must not evict blocks a reader has only half read (the report: 9.3 GiB for 1 GiB)."""
    files, size, request = 8, 128 * MiB, 128 * KiB
    contents = [SyntheticData(size, seed=b"file%d" % i) for i in range(files)]
    backend = MemoryBackend(latency_s=LATENCY_S)
    for i, content in enumerate(contents):
        backend.put(f"p/f{i}.bin", content)
    fs = FileSystem(backend, make_config(memory_limit_bytes=64 * MiB))
    fs.start(nursery)
    digests: dict[int, str] = {}

    async def reader(i: int) -> None:
        fh = await open_file(fs, f"f{i}.bin")
        digest = hashlib.sha256()
        for offset in range(0, size, request):
            digest.update(await fs.read(fh, offset, request))
        fs.release(fh)
        digests[i] = digest.hexdigest()

    async with trio.open_nursery() as readers:
        for i in range(files):
            readers.start_soon(reader, i)
    await settle()
    for i, content in enumerate(contents):
        expected = hashlib.sha256()
        for offset in range(0, size, 16 * MiB):
            expected.update(content.read(offset, 16 * MiB))
        assert digests[i] == expected.hexdigest(), f"f{i}.bin"
    fetched, total = backend.requests["get_bytes"], files * size
    assert fetched <= total * 1.05, f"fetched {fetched / total:.3f}x the files"
    check_budget(fs)


class ConcurrencyBackend(MemoryBackend):
    """Counts the bytes of ranged GETs in flight at once (random reads fetch around the
    block tier, so their buffers are only visible here)."""

    def __init__(self) -> None:
        super().__init__(latency_s=LATENCY_S)
        self.in_flight = 0
        self.peak_in_flight = 0

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        self.in_flight += length
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await super().read_range(key, etag, start, length)
        finally:
            self.in_flight -= length


async def test_random_reads_buffers_stay_inside_the_budget(autojump_clock: object) -> None:
    """Defect 9 of the long-lived-mount issue: 64 random 1 MiB reads at once (64 readers of
    one file) held 64 MiB of GET buffers outside a 32 MiB budget. Their buffers are charged
    to the reply share of the budget: the GETs in flight, plus everything the block tier
    holds, never exceed the budget, and every byte is right."""
    size = 256 * MiB
    data = SyntheticData(size)
    backend = ConcurrencyBackend()
    backend.put("p/big.bin", data)
    budget = 32 * MiB
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, make_config(memory_limit_bytes=budget))
        fs.start(nursery)
        fh = await open_file(fs, "big.bin")
        # One sequential read first, so the next reads are seen as random.
        await fs.read(fh, 0, 128 * KiB)
        offsets = [(i * 37 + 11) % 250 * MiB + 4096 * i for i in range(64)]
        wrong: list[int] = []

        async def reader(offset: int) -> None:
            got = await fs.read(fh, offset, MiB)
            if bytes(got) != data.read(offset, MiB):
                wrong.append(offset)

        async with trio.open_nursery() as readers:
            for offset in offsets:
                readers.start_soon(reader, offset)
        assert wrong == []
        stats = fs.statistics()
        # Every GET in flight at once (random reads and read-ahead) fitted in the budget; on
        # the old code the 64 random GETs alone held 68 MiB.
        assert backend.peak_in_flight <= budget, (backend.peak_in_flight, stats)
        assert stats.get("reply_waits", 0) > 0, stats  # the share was full: readers waited
        assert stats["reply_peak_bytes"] <= stats["reply_capacity_bytes"], stats
        assert stats["peak_bytes"] <= budget, stats
        fs.release(fh)
        assert fs.statistics()["reply_bytes"] == 0
        check_budget(fs)
        nursery.cancel_scope.cancel()
