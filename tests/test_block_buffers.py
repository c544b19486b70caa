"""Pooled block buffers: filled in place, written behind the reader, never recycled early.

The invariant checked here: once nothing is in flight, every buffer in use holds a cached
block; and a block evicted while the disk writer still
holds it reaches the disk intact (the writer's pin keeps its buffer out of the pool).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from objfs.backends.memory import MemoryBackend
from objfs.block_cache import Block, BlockCache, BlockKey, Reservation
from objfs.buffer_pool import Buffer, BufferPool
from objfs.config import MountConfig
from objfs.disk_cache import DiskCache
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE
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
        # Nothing leaked: each buffer in use holds a cached block.
        assert stats["buffers_in_use"] == cached_blocks(fs.cache)
        assert stats["buffers_overflow"] == 0
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

    def write_blocks(
        self,
        key: str,
        etag: str,
        first_index: int,
        blocks: Sequence[Any],
        digests: Sequence[int | None] | None = None,
    ) -> int:
        if not self.gate.wait(timeout=30):
            raise AssertionError("the gate never opened")
        return super().write_blocks(key, etag, first_index, blocks, digests)


async def all_on_disk(disk: DiskCache, keys: list[BlockKey]) -> None:
    """Wait (20 s at most) until the disk tier holds every block of ``keys``."""
    with trio.fail_after(20):
        while any(disk.read(key, MiB) is None for key in keys):  # noqa: ASYNC110 (a poll)
            await trio.sleep(0.05)


async def test_a_disk_behind_the_reader_defers_writes_and_catches_up(tmp_path: Path) -> None:
    """The read finishes while no disk write can (no reply waits for the disk); the queue
    holds at most a quarter of the budget, pinned and charged to it; once the disk catches
    up, the deferred blocks still in memory are written, and any the used-block cap evicted
    meanwhile (a few, when a loaded CPU defers more of them) are backfilled once the mount is
    idle, so the disk tier ends complete."""
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
        # The queue and the deferred runs requeued from it wrote every block not lost.
        early = fs.statistics()
        assert early["disk_writes"] + early["disk_blocks_not_cached"] == 12, early
        etag = (await backend.head("p/model.bin")).etag
        keys = [BlockKey("p/model.bin", etag, index) for index in range(12)]
        await all_on_disk(disk, keys)
        stats = fs.statistics()
        nursery.cancel_scope.cancel()
    assert stats["disk_blocks_backfilled"] <= stats["disk_blocks_not_cached"], stats
    assert stats["disk_writes"] >= 12
    for index, key in enumerate(keys):
        got = disk.read(key, MiB)
        assert got == data[index * MiB : (index + 1) * MiB], f"block {index} differs"


async def test_blocks_the_disk_lost_during_a_load_are_backfilled_when_idle(
    tmp_path: Path,
) -> None:
    """A load so much faster than the disk that blocks leave memory before the writer gets
    to them (a 16 MiB budget, 24 MiB read while no write can finish): they are counted as
    not cached, then fetched again and written once the mount has been idle for
    BACKFILL_IDLE_S, so the disk tier ends complete and a new mount reads the file without
    one GET. Nothing is fetched again while a reader is active."""
    from objfs import write_behind

    data = os.urandom(24 * MiB)
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/model.bin", data)
    backend.put("p/other.bin", b"x" * 4096)
    disk = GatedDisk(tmp_path / "cache")
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(memory_limit_bytes=16 * MiB), disk)
        fs.start(nursery)
        try:
            with trio.fail_after(20):
                assert await read_file(fs, "model.bin", len(data)) == data
        finally:
            disk.gate.set()
        with trio.fail_after(20):
            await fs.flush_disk_writes()
        lost = fs.statistics()["disk_blocks_not_cached"]
        assert lost > 0, "the test needs blocks the disk lost"
        gets = backend.statistics()["get"]
        # A reader that keeps the mount busy (one read of another file per half idle
        # period) holds it off.
        node = await fs.lookup(ROOT_INODE, b"other.bin")
        fh, _ = await fs.open(node.inode, os.O_RDONLY)
        for _ in range(4):
            await fs.read(fh, 0, 4096)
            await trio.sleep(write_behind.BACKFILL_IDLE_S / 2)
        assert fs.statistics()["disk_blocks_backfilled"] == 0
        fs.release(fh)
        etag = (await backend.head("p/model.bin")).etag
        keys = [BlockKey("p/model.bin", etag, index) for index in range(24)]
        await all_on_disk(disk, keys)
        # (A lost block that a reader fetched again meanwhile went to the disk with that
        # fetch: lost counts it, the backfill skips it.)
        assert 0 < fs.statistics()["disk_blocks_backfilled"] <= lost
        assert backend.statistics()["get"] > gets
        assert fs.cache.used_bytes <= 16 * MiB
        with trio.fail_after(20):  # a backfill run may still be on its way: it ends
            while fs.cache.reserved_bytes:  # noqa: ASYNC110 (a poll)
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    for index in range(24):
        got = disk.read(BlockKey("p/model.bin", etag, index), MiB)
        assert got == data[index * MiB : (index + 1) * MiB], f"block {index} missing or wrong"
    # A new mount on the same disk tier: the whole file without one GET.
    before = backend.statistics()["get"]
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(memory_limit_bytes=16 * MiB), disk)
        fs.start(nursery)
        with trio.fail_after(20):
            assert await read_file(fs, "model.bin", len(data)) == data
        nursery.cancel_scope.cancel()
    assert backend.statistics()["get"] == before


def _used_blocks(cache: BlockCache, count: int) -> list[Block]:
    """``count`` blocks of version ("k", "e"), cached and read to their end (used)."""
    cache.open_version("k", "e")
    blocks = []
    for index in range(count):
        reservation = cache.try_reserve(MiB, demand=True)
        assert reservation is not None
        (block,) = cache.new_blocks([MiB])
        cache.put(BlockKey("k", "e", index), block, reservation)
        assert cache.get_nowait(BlockKey("k", "e", index)) is not None  # read: used
        blocks.append(block)
    return blocks


def test_an_evicted_block_stays_charged_while_pinned() -> None:
    """Evicting a block the disk writer pins makes no room: its buffer is still in use.
    (Only orphans and removed blocks can be evicted while pinned.)"""
    cache = BlockCache(2 * MiB, block_size=MiB)
    cache.open_version("k", "e")
    blocks = []
    for index in range(2):
        reservation = cache.try_reserve(MiB, demand=False)
        assert reservation is not None
        (block,) = cache.new_blocks([MiB])
        cache.put(BlockKey("k", "e", index), block, reservation)
        block.pin()
        blocks.append(block)
    cache.close_version("k", "e")  # both unread: orphans, evicted first, pinned or not
    # Both are evicted for a new reservation, but their bytes stay charged: no room.
    assert cache.try_reserve(MiB, demand=False) is None
    assert cache.used_bytes == 2 * MiB
    assert cache.statistics()["held_bytes"] == 2 * MiB
    assert not cache.contains(BlockKey("k", "e", 0))
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
    assert stats["buffers_in_use"] == 0


async def test_a_used_block_the_disk_writer_pins_stays_cached() -> None:
    """A fetch never evicts a used block the disk writer pins (that frees no memory, and a
    reader who needs the block again before it is on disk would fetch it from the store): it
    waits until the writer lets one go, and the unpin wakes it."""
    cache = BlockCache(2 * MiB, block_size=MiB)
    blocks = _used_blocks(cache, 2)
    for block in blocks:
        block.pin()
    for demand in (False, True):
        assert cache.try_reserve(MiB, demand=demand) is None
    assert cache.statistics()["held_bytes"] == 0
    assert all(cache.contains(BlockKey("k", "e", i)) for i in range(2))
    got: list[Reservation] = []
    woken: list[int] = []
    cache.on_space = lambda: woken.append(1)  # the read-ahead queue's wake-up
    async with trio.open_nursery() as nursery:

        async def reserve() -> None:
            got.append(await cache.reserve(MiB, demand=False))

        nursery.start_soon(reserve)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        blocks[1].unpin()  # written: evictable now
        await trio.testing.wait_all_tasks_blocked()
    assert len(got) == 1, "the unpin did not wake the waiting fetch"
    assert woken
    assert cache.contains(BlockKey("k", "e", 0)), "the pinned block was evicted"
    assert not cache.contains(BlockKey("k", "e", 1))
    got[0].release()
    blocks[0].unpin()
    assert cache.statistics()["held_bytes"] == 0


def test_a_used_block_on_disk_is_evicted_before_an_older_one_that_is_not() -> None:
    """Among the least recently used blocks, one already on disk goes first (it comes back
    as a disk read); without a disk tier (nothing saved) the order is plain LRU."""
    cache = BlockCache(3 * MiB, block_size=MiB)
    blocks = _used_blocks(cache, 3)
    blocks[1].saved = True
    reservation = cache.try_reserve(MiB, demand=False)
    assert reservation is not None
    assert [cache.contains(BlockKey("k", "e", i)) for i in range(3)] == [True, False, True]
    reservation.release()
    plain = BlockCache(3 * MiB, block_size=MiB)
    _used_blocks(plain, 3)
    reservation = plain.try_reserve(MiB, demand=False)
    assert reservation is not None
    assert [plain.contains(BlockKey("k", "e", i)) for i in range(3)] == [False, True, True]
    reservation.release()


async def test_a_readers_fetch_evicts_no_unread_block_that_would_free_nothing() -> None:
    """A reader's own fetch may evict an unread (fresh) block, but never one the disk
    writer pins (that frees no memory and loses the block): it takes the newest one already
    on disk, else the newest unpinned one, else waits until the writer lets one go."""
    cache = BlockCache(4 * MiB, block_size=MiB)
    cache.open_version("k", "e")
    blocks = []
    for index in range(4):  # four fresh (unread) blocks fill the budget
        reservation = cache.try_reserve(MiB, demand=False)
        assert reservation is not None
        (block,) = cache.new_blocks([MiB])
        cache.put(BlockKey("k", "e", index), block, reservation)
        blocks.append(block)
    for block in blocks:
        block.pin()  # all queued for the disk
    blocks[0].saved = True  # (an older one on disk, but still pinned)
    assert cache.try_reserve(MiB, demand=True) is None
    assert cache.statistics()["evicted_unread"] == 0
    assert cache.statistics()["held_bytes"] == 0
    assert all(cache.contains(BlockKey("k", "e", i)) for i in range(4))
    # The writer finishes block 1 (not yet marked saved) and block 2 (saved).
    blocks[1].unpin()
    blocks[2].saved = True
    blocks[2].unpin()
    reservation = cache.try_reserve(MiB, demand=True)
    assert reservation is not None
    assert not cache.contains(BlockKey("k", "e", 2)), "the block on disk goes first"
    assert cache.contains(BlockKey("k", "e", 1))
    reservation.release()
    # A reader's fetch waiting for room is woken when the writer lets go of a block.
    blocks[0].unpin()
    blocks[3].unpin()
    filler = cache.try_reserve(MiB, demand=False)  # blocks 0, 1, 3 and this fill the budget
    assert filler is not None
    for index in (0, 1, 3):
        blocks[index].pin()
    got: list[object] = []
    async with trio.open_nursery() as nursery:

        async def reader() -> None:
            got.append(await cache.reserve(MiB, demand=True))

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not got, "every unread block is pinned: the reader waits"
        blocks[1].unpin()
        await trio.testing.wait_all_tasks_blocked()
        assert got, "the writer let go of a block: the reader's fetch went on"
    assert not cache.contains(BlockKey("k", "e", 1))
    assert cache.statistics()["evicted_unread"] == 2
    assert cache.used_bytes <= cache.capacity_bytes
    filler.release()
    got[0].release()  # type: ignore[attr-defined]
    assert cache.reserved_bytes == 0


# -- the arena: adjacent buffers, one view across blocks ------------------------------------


def test_a_run_gets_adjacent_slots_and_runs_follow_each_other() -> None:
    pool = BufferPool(4096, 16)
    first = pool.acquire_run(4)
    second = pool.acquire_run(4)
    assert [b.slot for b in first + second] == list(range(8))
    for n, buf in enumerate(first + second):
        buf.view[:] = bytes([n]) * 4096
    joined = pool.span(first[2:] + second[:1])
    assert joined is not None
    assert bytes(joined) == bytes([2]) * 4096 + bytes([3]) * 4096 + bytes([4]) * 4096
    assert pool.span([first[1], first[3]]) is None  # not adjacent
    assert pool.span([second[0], first[3]]) is None  # adjacent, but not in this order
    single = pool.acquire()  # from the far end, out of the runs' way
    assert single.slot == 15
    for buf in [*first, *second, single]:
        pool.release(buf)
    assert pool.in_use == 0


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
    reason="no transparent huge pages in this kernel",
)
def test_the_arena_asks_for_transparent_huge_pages() -> None:
    """Each block is pinned page by page by the receive or disk read and by the FUSE reply;
    2 MiB pages made that (and the first touch) 50 times fewer page faults."""
    pool = BufferPool(MiB, 8)
    buf = pool.acquire_run(1)[0]
    buf.view[:1] = b"x"
    first_byte = ctypes.c_char.from_buffer(buf.view)
    address = ctypes.addressof(first_byte)
    del first_byte  # it holds an export of the buffer
    flags = _vm_flags(address)
    assert "hg" in flags, flags  # MADV_HUGEPAGE took (the kernel decides when to use it)
    pool.release(buf)


def test_a_full_arena_hands_out_mappings_of_their_own() -> None:
    pool = BufferPool(4096, 4)
    held = pool.acquire_run(3)
    pool.release(held[1])  # slots 0 and 2 held: no two adjacent free slots
    run = pool.acquire_run(2)
    assert sorted(b.slot for b in run) == [1, 3]
    extra = pool.acquire_run(2)
    assert [b.slot for b in extra] == [-1, -1]
    assert pool.statistics()["buffers_overflow"] == 2
    assert pool.span(extra) is None
    extra[0].view[:] = b"x" * 4096  # writable, a page of its own
    for buf in [held[0], held[2], *run, *extra]:
        pool.release(buf)
    assert pool.in_use == 0


def test_a_released_buffer_cannot_be_read_or_released_again() -> None:
    pool = BufferPool(4096, 2)
    buf = pool.acquire()
    slot, view = buf.slot, buf.view
    pool.release(buf)
    assert len(buf.view) == 0
    with pytest.raises(ValueError, match="released memoryview"):
        bytes(view)  # a stale view fails instead of reading whatever reuses the slot
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(buf)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(Buffer(slot, memoryview(bytearray(4096))))  # a free slot
    run = pool.acquire_run(3)  # two slots, then a mapping of its own
    assert [b.slot for b in run] == [0, 1, -1]
    for b in run:
        pool.release(b)
    assert pool.in_use == 0
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(run[-1])
    assert pool.in_use == 0


class ArenaMachine(RuleBasedStateMachine):
    """Random runs, singles and releases: every slot has at most one owner, the counters
    match what is held, a buffer keeps its own bytes until released, and ``span`` is a view
    of exactly the buffers it joins."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BufferPool(4096, 12)
        self.held: list[tuple[Buffer, int]] = []  # buffer, the byte it was filled with
        self.runs: list[list[Buffer]] = []
        self.stamp = 0

    def _fill(self, bufs: list[Buffer]) -> None:
        for buf in bufs:
            self.stamp = (self.stamp + 1) % 251
            buf.view[:] = bytes([self.stamp]) * len(buf.view)
            self.held.append((buf, self.stamp))

    @rule(count=st.integers(1, 5))
    def take_run(self, count: int) -> None:
        bufs = self.pool.acquire_run(count)
        assert len(bufs) == count
        self._fill(bufs)
        self.runs.append(bufs)

    @rule()
    def take_one(self) -> None:
        self._fill([self.pool.acquire()])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        buf, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.runs = [[b for b in run if b is not buf] for run in self.runs]
        self.pool.release(buf)

    @invariant()
    def owners_and_bytes(self) -> None:
        slots = [b.slot for b, _ in self.held if b.slot >= 0]
        assert len(slots) == len(set(slots)), "a slot has two owners"
        assert self.pool.in_use == len(self.held)
        for buf, stamp in self.held:
            assert bytes(buf.view) == bytes([stamp]) * len(buf.view), "a buffer lost its bytes"

    @invariant()
    def spans_are_the_buffers(self) -> None:
        stamps = {id(b): s for b, s in self.held}
        for run in self.runs:
            if len(run) < 2:
                continue
            joined = self.pool.span(run)
            adjacent = run[0].slot >= 0 and [b.slot for b in run] == list(
                range(run[0].slot, run[0].slot + len(run))
            )
            assert (joined is not None) == adjacent
            if joined is not None:
                want = b"".join(bytes([stamps[id(b)]]) * 4096 for b in run)
                assert bytes(joined) == want


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_arena_machine = ArenaMachine.TestCase


async def test_sequential_unaligned_reads_are_answered_without_copies(tmp_path: Path) -> None:
    """A sequential reader whose 1 MiB reads are not block-aligned (the kernel's usual
    requests) gets views across adjacent block buffers: correct bytes, no read assembled by a
    copy, with and without the disk tier (a remount reads blocks back into adjacent slots)."""
    data = os.urandom(24 * MiB + 12345)
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/x.bin", data)
    for run in range(2):  # a fresh disk tier, then the same one again
        async with trio.open_nursery() as nursery:
            fs = FileSystem(
                backend,
                config(memory_limit_bytes=32 * MiB, part_size_bytes=4 * MiB),
                disk_cache(tmp_path / "cache"),
            )
            fs.start(nursery)
            node = await fs.lookup(ROOT_INODE, b"x.bin")
            fh, _ = await fs.open(node.inode, os.O_RDONLY)
            out = bytearray(await fs.read(fh, 0, 8192))
            while len(out) < len(data):
                out += await fs.read(fh, len(out), MiB)
            assert hashlib.sha256(out).digest() == hashlib.sha256(data).digest(), f"run {run}"
            stats = fs.statistics()
            assert stats["reads_spanned"] >= 20, stats
            assert stats["reads_assembled"] == 0, stats
            fs.release(fh)
            await fs.flush_disk_writes()
            nursery.cancel_scope.cancel()
        if run == 0:
            assert stats["disk_writes"] > 0
        else:
            assert stats["disk_hits"] > 0


async def test_a_read_across_blocks_apart_in_memory_is_a_view_per_block_when_held() -> None:
    """With ``holds`` (the kernel transport's writer threads), a read across cached blocks
    whose buffers are not adjacent is answered with one view per block, in order, and no
    copy; the blocks stay pinned until the holds run. Without holds the same read is
    assembled by a copy (the pyfuse3 transport)."""
    a, b = os.urandom(4 * MiB), os.urandom(4 * MiB)
    backend = MemoryBackend()
    backend.put("p/a.bin", a)
    backend.put("p/b.bin", b)
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(memory_limit_bytes=16 * MiB, part_size_bytes=MiB))
        fs.start(nursery)
        handles = []
        for name in (b"a.bin", b"b.bin"):
            node = await fs.lookup(ROOT_INODE, name)
            handles.append((await fs.open(node.inode, os.O_RDONLY))[0])
        fa, fb = handles
        # Alternate, at random offsets (no read-ahead): a's blocks land in slots apart.
        for index in (0, 1, 2, 3):
            for fh in (fa, fb):
                await fs.read(fh, index * MiB + 5 * (index + 1), 4096)
        holds: list[Callable[[], None]] = []
        got = await fs.read(fa, MiB - 100, 2 * MiB + 200, holds=holds)
        assert isinstance(got, list), type(got)
        assert [len(part) for part in got] == [100, MiB, MiB, 100]
        assert b"".join(got) == a[MiB - 100 : 3 * MiB + 100]
        pinned = [fs.cache.peek(fs.fetcher.key(fs._handle(fa), i)) for i in range(4)]
        assert all(block is not None and block.pins == 1 for block in pinned)
        for release in holds:
            release()
        assert all(block is not None and block.pins == 0 for block in pinned)
        stats = fs.statistics()
        assert stats["reads_scattered"] == 1, stats
        assert stats["reads_assembled"] == 0, stats
        plain = await fs.read(fa, MiB - 100, 2 * MiB + 200)
        assert bytes(plain) == a[MiB - 100 : 3 * MiB + 100]
        assert fs.statistics()["reads_assembled"] == 1
        for fh in handles:
            fs.release(fh)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("adjacent", [True, False])
async def test_a_held_reply_across_blocks_keeps_its_bytes_while_other_reads_evict(
    adjacent: bool,
) -> None:
    """A read across 4 blocks answered with views (one view over adjacent buffers, or one per
    block) pins every block before it marks them used: marking one used evicts the least
    recently used block when used blocks are over their cap, and that must not be another
    block of this reply, whose buffer a writer thread has yet to copy from. Other reads then
    recycle every free buffer; the reply's bytes stay right until its holds run."""
    a, b = os.urandom(8 * MiB), os.urandom(16 * MiB)
    backend = MemoryBackend()
    backend.put("p/a.bin", a)
    backend.put("p/b.bin", b)
    async with trio.open_nursery() as nursery:
        fs = FileSystem(backend, config(memory_limit_bytes=16 * MiB, part_size_bytes=MiB))
        fs.start(nursery)
        node = await fs.lookup(ROOT_INODE, b"a.bin")
        fa, _ = await fs.open(node.inode, os.O_RDONLY)
        other = await fs.lookup(ROOT_INODE, b"b.bin")
        fb, _ = await fs.open(other.inode, os.O_RDONLY)
        for index in range(4):  # blocks 0-3 of a cached, not yet used
            await fs.read(fa, index * MiB + 5, 4096)
            if not adjacent:
                await fs.read(fb, index * MiB + 5, 4096)
        fs.cache.used_limit_bytes = MiB  # one used block at most: marking used evicts
        holds: list[Callable[[], None]] = []
        got = await fs.read(fa, 100, 4 * MiB - 200, holds=holds)
        parts = got if isinstance(got, list) else [got]
        assert len(holds) == 4  # every block pinned
        # Other reads take every buffer they can.
        for offset in range(0, 16 * MiB, MiB):
            await fs.read(fb, offset, MiB)
        assert b"".join(parts) == a[100 : 4 * MiB - 100]
        for release in holds:
            release()
        fs.release(fa)
        fs.release(fb)
        nursery.cancel_scope.cancel()
