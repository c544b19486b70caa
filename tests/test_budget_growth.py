"""The memory budget grows while several handles read one large version, and shrinks back.

``objfs.fs.FileSystem._fit_budget``: the base budget (``--memory-limit``) times the most
handles open on one version larger than a part, at most ``MEMORY_GROWTH`` times and at most
``memory_ceiling_bytes`` (None, an explicit ``--memory-limit``: it never grows). The block
cache's capacity, its used blocks' cap and the pool's slots follow it
(``BlockCache.set_budget``); slots past the budget give their memory back to the system
(``BufferPool.set_active``). The core property test (tests/test_core_properties.py) checks the
budget and the bytes charged against it after every step of random programs.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import trio
import trio.testing

from objfs.backends.memory import MemoryBackend
from objfs.block_cache import BlockCache, BlockKey
from objfs.buffer_pool import BufferPool
from objfs.config import MEMORY_GROWTH, default_memory_ceiling, default_memory_limit
from objfs.fs import GIVE_BACK_DELAY_S, FileSystem
from objfs.inodes import ROOT_INODE
from objfs.options import build_parser, mount_config
from tests.test_read_path import config, open_file, read_all, settle

MiB = 1024 * 1024


def _arena_rss(pool: BufferPool) -> int:
    """Resident bytes of ``pool``'s arena, page by page (mincore(2); smaps would count the
    whole mapping, which the kernel may have merged with its neighbours)."""
    first_byte = ctypes.c_char.from_buffer(pool._arena)
    address = ctypes.addressof(first_byte)
    del first_byte  # it holds an export of the arena
    size = len(pool._arena)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_a_pool_hands_out_its_active_slots_only_and_gives_the_others_memory_back() -> None:
    pool = BufferPool(MiB, 4, reserve_mapped=16)
    assert (pool.active, pool.max_mapped) == (4, 16)
    pool.set_active(16)
    held = pool.acquire_run(12)
    assert [b.slot for b in held] == list(range(12))
    for buf in held:
        buf.view[:] = b"\x01" * MiB  # touched: resident
    assert _arena_rss(pool) >= 12 * MiB
    for buf in held[2:10]:
        pool.release(buf)
    pool.set_active(4)  # slots 4-9 are free: they keep their memory until give_back
    assert _arena_rss(pool) >= 12 * MiB
    assert pool.give_back() == 10  # slots 4-9, and 12-15 (never used)
    assert _arena_rss(pool) <= 6 * MiB + 2 * MiB  # slots 0, 1, 10, 11 (a huge page of slack)
    again = pool.acquire_run(3)  # slots 2-3 are the only free active ones: one is own-mapped
    assert sorted(b.slot for b in again) == [-1, 2, 3]
    assert pool.statistics()["buffers_overflow"] == 1
    for buf in held[10:]:  # in use past the budget until now: given back on release
        pool.release(buf)
    assert _arena_rss(pool) <= 4 * MiB + 2 * MiB
    for buf in [*held[:2], *again]:
        pool.release(buf)
    assert pool.in_use == 0
    assert pool.acquire().slot == 3  # singles from the far end of the active slots
    pool.set_active(100)  # clamped to the mapping
    assert pool.active == 16


def _keys(count: int) -> list[BlockKey]:
    return [BlockKey("k", "e", n) for n in range(count)]


async def test_a_cache_budget_moves_between_its_base_and_ceiling() -> None:
    cache = BlockCache(8 * MiB, 4 * MiB, reply_bytes=MiB, ceiling_bytes=32 * MiB)
    assert (cache.capacity_bytes, cache.used_limit_bytes) == (7 * MiB, 4 * MiB)
    cache.set_budget(64 * MiB)  # clamped to the ceiling
    assert (cache.budget_bytes, cache.capacity_bytes, cache.used_limit_bytes) == (
        32 * MiB,
        31 * MiB,
        16 * MiB,
    )
    cache.set_budget(MiB)  # and to the base
    assert (cache.budget_bytes, cache.capacity_bytes) == (8 * MiB, 7 * MiB)
    fixed = BlockCache(8 * MiB, reply_bytes=MiB)  # no ceiling: an explicit --memory-limit
    fixed.set_budget(32 * MiB)
    assert fixed.budget_bytes == 8 * MiB


async def test_a_grown_budget_wakes_a_waiting_fetch_and_a_shrunk_one_reserves_nothing_over_it(
    nursery: trio.Nursery,
) -> None:
    cache = BlockCache(8 * MiB, reply_bytes=MiB, ceiling_bytes=16 * MiB)
    keys = _keys(7)
    cache.open_version("k", "e")  # an open handle's blocks: fresh, not orphans
    reservation = cache.try_reserve(7 * MiB, demand=False)
    assert reservation is not None
    assert cache.claim(keys) == keys
    for key, block in zip(keys, cache.new_blocks([MiB] * 7), strict=True):
        cache.put(key, block, reservation)  # fresh: no prefetch may evict them
    cache.finish(keys)
    got: list[int] = []

    async def prefetch() -> None:
        more = await cache.reserve(4 * MiB, demand=False)
        got.append(more.remaining)
        more.release()

    nursery.start_soon(prefetch)
    await trio.testing.wait_all_tasks_blocked()
    assert got == []  # the budget is full of unread blocks
    cache.set_budget(16 * MiB)
    await trio.testing.wait_all_tasks_blocked()
    assert got == [4 * MiB]
    cache.set_budget(4 * MiB)  # below the base: the base
    assert cache.capacity_bytes == 7 * MiB
    assert cache.try_reserve(MiB, demand=False) is None  # 7 MiB unread, none may go
    for key in keys[:3]:
        assert cache.get_nowait(key) is not None  # read: used, evictable
    assert cache.try_reserve(3 * MiB, demand=False) is not None  # by evicting those three
    assert cache.used_bytes == 7 * MiB
    assert cache.statistics()["evicted_unread"] == 0


def _grown_cache(*groups: list[BlockKey]) -> BlockCache:
    """A cache of 8 MiB grown to 32 MiB, versions "k" and "gone" open, with a 1 MiB block
    cached for each key of ``groups`` (each group one fetch, in adjacent slots)."""
    cache = BlockCache(8 * MiB, 2 * MiB, reply_bytes=MiB, ceiling_bytes=32 * MiB)
    cache.set_budget(32 * MiB)
    cache.open_version("k", "e")
    cache.open_version("gone", "e")
    for keys in groups:
        reservation = cache.try_reserve(len(keys) * MiB, demand=False)
        assert reservation is not None
        assert cache.claim(keys) == keys
        for key, block in zip(keys, cache.new_blocks([MiB] * len(keys)), strict=True):
            cache.put(key, block, reservation)
        cache.finish(keys)
    return cache


def test_a_shrunk_budget_gives_back_orphans_and_used_blocks_at_once() -> None:
    """After the handles that grew the budget close, an idle daemon does not keep the grown
    memory: what no open handle will read goes down to the base capacity and used cap."""
    groups = {"read": _keys(10), "fresh": [BlockKey("k", "e", n) for n in range(10, 14)]}
    groups["orphans"] = [BlockKey("gone", "e", n) for n in range(12)]
    cache = _grown_cache(*groups.values())
    for key in groups["read"]:
        assert cache.get_nowait(key) is not None  # used (the cap grew with the budget: 8 MiB)
    cache.close_version("gone", "e")  # its 12 fresh blocks are orphans now
    assert cache.used_bytes == (8 + 4 + 12) * MiB  # 2 read blocks already over the cap
    assert cache.pool.in_use == 24
    cache.set_budget(8 * MiB)
    # The 4 fresh blocks stay; the orphans all go; the used ones go down to the 2 MiB cap,
    # and the two left (in slots 8 and 9) go too: they are past the base budget's 8 slots.
    assert [k.block for k in groups["read"] if cache.peek(k) is not None] == []
    assert all(cache.peek(k) is None for k in groups["orphans"])
    assert all(cache.peek(k) is not None for k in groups["fresh"])
    assert cache.used_bytes == 4 * MiB
    assert cache.pool.in_use == 4
    assert cache.statistics()["evicted_unread"] == 0


def _fs(
    backend: MemoryBackend, nursery: trio.Nursery, ceiling: int | None, **options: object
) -> FileSystem:
    fs = FileSystem(
        backend,
        config(
            memory_limit_bytes=16 * MiB,
            part_size_bytes=4 * MiB,
            memory_ceiling_bytes=ceiling,
            **options,
        ),
    )
    fs.start(nursery)
    return fs


async def test_handles_sharing_one_large_version_grow_the_budget_until_they_close(
    nursery: trio.Nursery,
) -> None:
    backend = MemoryBackend()
    for name, size in [("a.bin", 8 * MiB), ("b.bin", 8 * MiB), ("small.json", 4 * MiB)]:
        backend.put(f"p/{name}", os.urandom(size))
    fs = _fs(backend, nursery, ceiling=64 * MiB)
    budget = lambda: fs.cache.budget_bytes  # noqa: E731
    small = [await open_file(fs, "small.json") for _ in range(3)]  # a part or less: no growth
    assert budget() == 16 * MiB
    a = [await open_file(fs, "a.bin")]
    b = [await open_file(fs, "b.bin")]
    assert budget() == 16 * MiB  # two large handles, but no version shared
    a.append(await open_file(fs, "a.bin"))
    assert budget() == 48 * MiB  # a shared: the three large handles count
    fs.release(b.pop())
    assert budget() == 48 * MiB  # never a step down while two large handles are open
    # The read-ahead share of the grown budget, split between the two large handles.
    assert fs._handles[a[0]].readahead.max_window == fs.config.readahead_max(48 * MiB) // 2
    assert fs.config.readahead_max(48 * MiB) // 2 > fs.config.readahead_max() // 2
    # Four ranks moving from shard a to shard b: 2 + 2, then 1 + 3, keep the whole growth.
    a += [await open_file(fs, "a.bin") for _ in range(2)]
    assert budget() == 64 * MiB
    for _ in range(3):
        fs.release(a.pop())
        b.append(await open_file(fs, "b.bin"))
        assert budget() == 64 * MiB, (len(a), len(b))
    b.append(await open_file(fs, "b.bin"))  # five large handles: still 4x (the ceiling here)
    assert budget() == 64 * MiB
    for fh in [*a, *b[:3]]:
        fs.release(fh)
    assert budget() == 16 * MiB  # one large handle left
    for fh in [*b[3:], *small]:
        fs.release(fh)
    assert budget() == 16 * MiB
    assert fs.cache.pool.active == 16


async def test_a_grown_budget_holds_its_slots_while_two_large_handles_stay_open(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks straddling two shards (nothing shared for a moment) and moving from shard to
    shard (a close, then an open): the budget never steps down while two large handles are
    open, and when it does (two ranks leave one handle for an instant) the grown slots keep
    their memory until the budget has stayed down ``GIVE_BACK_DELAY_S``: each step down
    used to give them back to the system, for the next step up to fault them in again."""
    backend = MemoryBackend()
    data = os.urandom(24 * MiB)
    backend.put("p/a.bin", data)
    backend.put("p/b.bin", os.urandom(8 * MiB))
    fs = _fs(backend, nursery, ceiling=64 * MiB)
    given_back: list[int] = []
    pool_give_back = fs.cache.pool._give_back

    def give_back(slot: int, count: int) -> None:
        given_back.append(count)
        pool_give_back(slot, count)

    monkeypatch.setattr(fs.cache.pool, "_give_back", give_back)
    budget = lambda: fs.cache.budget_bytes  # noqa: E731
    a = [await open_file(fs, "a.bin") for _ in range(3)]
    assert budget() == 48 * MiB
    b = [await open_file(fs, "b.bin")]  # the leader on the next shard: 4 large handles
    assert budget() == 64 * MiB
    for _ in range(2):  # the others follow: 3, 4, 3, 4 large handles
        fs.release(a.pop())
        assert budget() == 64 * MiB
        b.append(await open_file(fs, "b.bin"))
        assert budget() == 64 * MiB
    fs.release(b.pop())
    fs.release(b.pop())  # one on a, one on b: nothing shared, two large handles
    assert budget() == 64 * MiB
    assert fs.cache.pool.active == 64
    fs.release(a.pop())  # one large handle left: back to the base at once ...
    assert (budget(), fs.cache.pool.active) == (16 * MiB, 16)
    await trio.sleep(GIVE_BACK_DELAY_S / 2)
    a = [await open_file(fs, "a.bin") for _ in range(2)]  # ... a new episode
    assert budget() == 48 * MiB
    assert await read_all(fs, a[0], len(data)) == data  # its blocks fill grown slots too
    assert _arena_rss(fs.cache.pool) >= 24 * MiB
    fs.release(a.pop())
    fs.release(a.pop())  # back to the base again: what was in the grown slots is evicted
    assert fs.cache.pool.past_active() == 0
    await trio.sleep(GIVE_BACK_DELAY_S * 0.9)
    assert given_back == []  # ... but the memory stays until the budget stays down
    assert _arena_rss(fs.cache.pool) >= 24 * MiB
    await trio.sleep(GIVE_BACK_DELAY_S * 0.2)
    assert given_back != []
    assert _arena_rss(fs.cache.pool) <= 16 * MiB + 2 * MiB  # the base's slots (a huge page)


async def test_a_give_back_cut_short_by_unmount_still_happens_and_blocks_no_later_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The file system's nursery closes (unmount) while a shrunk budget waits to give its
    memory back: it is given back then, and a shrink after that gives it back at once."""
    backend = MemoryBackend()
    backend.put("p/a.bin", os.urandom(8 * MiB))
    async with trio.open_nursery() as nursery:
        fs = _fs(backend, nursery, ceiling=64 * MiB)
        for fh in [await open_file(fs, "a.bin") for _ in range(2)]:
            fs.release(fh)
        assert fs._shrunk_at is not None  # waiting
        nursery.cancel_scope.cancel()
    assert fs._shrunk_at is None
    assert fs.cache.pool._settled
    for fh in [await open_file(fs, "a.bin") for _ in range(2)]:
        fs.release(fh)
    assert fs._shrunk_at is None
    assert fs.cache.pool._settled


def test_a_used_block_unpinned_over_its_cap_goes_and_wakes_the_read_ahead() -> None:
    """Used blocks the disk writer pins stay over their cap; the one it lets go of is
    evicted at once, and the room that makes wakes the read-ahead queue (``on_space``),
    not only the readers' own fetches."""
    read = _keys(6)
    cache = _grown_cache(read)
    cache.set_budget(8 * MiB)  # used cap 2 MiB
    woken: list[int] = []
    cache.on_space = lambda: woken.append(1)
    blocks = [cache.peek(k) for k in read]
    for block in blocks:
        assert block is not None
        block.pin()
    for key in read:
        assert cache.get_nowait(key) is not None
    assert cache.used_bytes == 6 * MiB  # all pinned: over the cap
    woken.clear()
    assert blocks[0] is not None
    blocks[0].unpin()
    assert cache.peek(read[0]) is None
    assert cache.used_bytes == 5 * MiB
    assert woken == [1]


def test_a_block_kept_past_a_shrink_while_pinned_goes_when_unpinned() -> None:
    """Used blocks the disk writer pinned when the budget shrank stay cached (their memory is
    not free yet; pinned orphans are evicted but held), and go as soon as it lets them go: an
    idle daemon keeps none of them in a grown slot, nor used blocks over their cap."""
    read = _keys(12)
    orphans = [BlockKey("gone", "e", n) for n in range(4)]
    cache = _grown_cache(read, orphans)
    for key in read:
        assert cache.get_nowait(key) is not None
    pinned = [cache.peek(k) for k in [*read[-4:], *orphans]]  # read: slots 8-11; orphans 12-15
    for block in pinned:
        assert block is not None
        block.pin()
    cache.close_version("gone", "e")
    cache.set_budget(8 * MiB)
    assert [cache.peek(k) is not None for k in read] == [False] * 8 + [True] * 4
    assert all(cache.peek(k) is None for k in orphans)  # evicted, held while pinned
    assert cache.pool.past_active() == 8
    for block in pinned:
        assert block is not None
        block.unpin()
    assert all(cache.peek(k) is None for k in [*read, *orphans])
    assert cache.pool.past_active() == 0
    assert cache.pool.in_use == 0
    assert cache.used_bytes == 0


async def test_the_last_close_of_a_shared_version_gives_back_its_unread_blocks(
    nursery: trio.Nursery,
) -> None:
    """Two handles grow the budget and read-ahead fills it; the first close shrinks it while
    the other handle's unread blocks stay; the last close (the budget already at its base)
    evicts them too, down to the base capacity, and none is left in a grown slot."""
    backend = MemoryBackend(latency_s=0.001)
    backend.put("p/m.safetensors", os.urandom(48 * MiB))  # fetched ahead from its open
    # A read-ahead window as large as the file, so that it fills any budget.
    fs = _fs(backend, nursery, ceiling=64 * MiB, readahead_max_bytes=48 * MiB)
    handles = [await open_file(fs, "m.safetensors") for _ in range(2)]
    assert fs.cache.budget_bytes == 32 * MiB
    await fs.read(handles[0], 0, 128 * 1024)
    await settle()
    assert fs.cache.used_bytes > 16 * MiB  # past the base budget
    fs.release(handles[0])
    assert fs.cache.budget_bytes == 16 * MiB
    assert fs.cache.used_bytes > fs.cache.capacity_bytes  # the open handle's unread blocks
    await settle()  # the fetches in flight end; the rest of the file's prefetch waits
    assert fs.cache.statistics()["inflight_bytes"] == 0
    fs.release(handles[1])  # checked at once: no fetch may make room meanwhile
    assert fs.cache.used_bytes <= fs.cache.capacity_bytes
    assert fs.cache.pool.past_active() == 0


async def test_passthrough_handles_do_not_grow_the_budget(nursery: trio.Nursery) -> None:
    """A handle whose reads the kernel serves from the disk tier's file (``prefetch=False``)
    fetches nothing: it counts neither for the growth nor for the read-ahead shares."""
    backend = MemoryBackend()
    backend.put("p/a.bin", os.urandom(8 * MiB))
    fs = _fs(backend, nursery, ceiling=64 * MiB)
    node = await fs.lookup(ROOT_INODE, b"a.bin")
    for _ in range(3):
        await fs.open(node.inode, os.O_RDONLY, prefetch=False)
    assert fs.cache.budget_bytes == 16 * MiB
    fh = await open_file(fs, "a.bin")
    assert fs.cache.budget_bytes == 16 * MiB
    assert fs._handles[fh].readahead.max_window == fs.config.readahead_max()


async def test_an_open_meant_for_passthrough_but_served_counts_and_prefetches(
    nursery: trio.Nursery,
) -> None:
    """An open made with ``prefetch=False`` that the kernel transport answered cached after
    all (its backing file refused) reads through objfs: it grows the budget with the other
    handles, and gets the file's prefetch on open when it is the file's only open."""
    backend = MemoryBackend()
    backend.put("p/m.safetensors", os.urandom(8 * MiB))
    fs = _fs(backend, nursery, ceiling=64 * MiB)
    node = await fs.lookup(ROOT_INODE, b"m.safetensors")
    first, _ = await fs.open(node.inode, os.O_RDONLY, prefetch=False)
    await settle()
    assert backend.requests["get_bytes"] == 0
    fs.served_after_all(first)
    await settle()
    assert fs._handles[first].fetches
    assert backend.requests["get_bytes"] == 8 * MiB  # the whole file, fetched ahead
    second, _ = await fs.open(node.inode, os.O_RDONLY, prefetch=False)
    assert fs.cache.budget_bytes == 16 * MiB
    fs.served_after_all(second)
    assert fs.cache.budget_bytes == 32 * MiB
    fs.served_after_all(second)  # once only
    assert fs.cache.budget_bytes == 32 * MiB


async def test_an_explicit_memory_limit_never_grows(nursery: trio.Nursery) -> None:
    backend = MemoryBackend()
    backend.put("p/a.bin", os.urandom(8 * MiB))
    fs = _fs(backend, nursery, ceiling=None)
    for _ in range(4):
        await open_file(fs, "a.bin")
    assert fs.cache.budget_bytes == fs.cache.statistics()["ceiling_bytes"] == 16 * MiB


def test_the_default_budget_grows_and_a_given_one_does_not() -> None:
    parser = build_parser()
    default = mount_config(parser.parse_args(["mount", "s3://bkt/p", "/mnt"]))
    assert default.memory_limit_bytes == default_memory_limit()
    assert default.memory_ceiling_bytes == default_memory_ceiling()
    assert default_memory_limit() <= default_memory_ceiling()
    assert default_memory_ceiling() <= MEMORY_GROWTH * default_memory_limit()
    given = mount_config(parser.parse_args(["mount", "s3://bkt/p", "/mnt", "--memory-limit", "1G"]))
    assert given.memory_ceiling_bytes is None


async def _ranks(fs: FileSystem, data: bytes, tensor: int) -> list[bytes]:
    """Four tensor-parallel ranks, each reading its quarter of every ``tensor``-byte tensor in
    128 KiB reads: rank 0 all of its quarters first, then the other three side by side (the
    drift of a rank that got the CPU first). Returns what each rank read."""
    handles = [await open_file(fs, "model.bin") for _ in range(4)]
    quarter = tensor // 4
    out = [bytearray() for _ in handles]

    async def rank(r: int) -> None:
        for start in range(r * quarter, len(data), tensor):
            for offset in range(start, start + quarter, 128 * 1024):
                out[r] += await fs.read(handles[r], offset, 128 * 1024)

    await rank(0)
    async with trio.open_nursery() as ranks:
        for r in range(1, 4):
            ranks.start_soon(rank, r)
    for fh in handles:
        fs.release(fh)
    return [bytes(b) for b in out]


async def test_ranks_that_drift_apart_fetch_each_byte_once_in_a_grown_budget(
    nursery: trio.Nursery,
) -> None:
    """With the base budget alone, the quarters fetched ahead for the slower ranks are
    evicted unread by the leader's own fetches and fetched again; grown for four handles,
    the budget holds them, and every byte is fetched once."""
    tensor = 8 * MiB
    data = os.urandom(6 * tensor)
    fetched = {}
    for ceiling in (None, 4 * 16 * MiB):
        backend = MemoryBackend(latency_s=0.001)
        backend.put("p/model.bin", data)
        fs = _fs(backend, nursery, ceiling)
        got = await _ranks(fs, data, tensor)
        quarter = tensor // 4
        for r in range(4):
            expected = b"".join(
                data[s : s + quarter] for s in range(r * quarter, len(data), tensor)
            )
            assert got[r] == expected, r
        stats = fs.cache.statistics()
        fetched[ceiling] = (backend.statistics()["get_bytes"], stats["evicted_unread"])
    assert fetched[None][0] > len(data), fetched  # fetched again what was evicted unread
    assert fetched[None][1] > 0, fetched
    assert fetched[4 * 16 * MiB] == (len(data), 0), fetched
