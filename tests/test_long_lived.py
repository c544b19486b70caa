"""What only long-lived mounts meet, on the FUSE-free core with the memory backend.

Each test names the defect of issue 13 it covers. Time is a fake monotonic clock (the core
reads ``time.monotonic`` for TTLs), advanced by the test.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from objfs.availability import OUTAGE_RETRY_S
from objfs.backends.base import ListPage
from objfs.backends.memory import MemoryBackend
from objfs.config import MountConfig, parse_source
from objfs.errors import EndpointUnreachableError, ObjectNotFoundError, StaleObjectError
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE
from tests.test_fs_core import resolve

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("objfs.namespace.time.monotonic", fake)
    return fake


def make_fs(backend: MemoryBackend, **kwargs: object) -> FileSystem:
    options: dict[str, object] = {"metadata_ttl_s": 60.0, "block_size_bytes": MiB, **kwargs}
    config = MountConfig(source=parse_source("s3://bkt/p"), mountpoint="/unused", **options)  # type: ignore[arg-type]
    return FileSystem(backend, config)


class GatedBackend(MemoryBackend):
    """Listings take their snapshot at once but answer only when ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: trio.Event | None = None  # holds the next listing only

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        gate, self.gate = self.gate, None
        pages = super().list_prefix(prefix)
        first = await pages.__anext__()  # the snapshot is taken before the first page
        if gate is not None:
            await gate.wait()
        yield first
        async for page in pages:
            yield page


class Outage:
    """A fault hook: while ``down``, every request fails as an unreachable endpoint would."""

    def __init__(self) -> None:
        self.down = False

    def __call__(self, op: str, key: str) -> None:
        if self.down:
            raise EndpointUnreachableError("connection refused (test outage)")


async def read_all(fs: FileSystem, inode: int, size: int) -> bytes:
    fh, _ = await fs.open(inode, os.O_RDONLY)
    try:
        return bytes(await fs.read(fh, 0, size))
    finally:
        fs.release(fh)


# -- defect 4: a listing that started before a replacement must not undo it -------------------


async def test_a_listing_older_than_a_head_does_not_write_the_old_version_back(
    clock: Clock,
) -> None:
    backend = GatedBackend()
    backend.put("p/w", b"a" * 100)
    fs = make_fs(backend)
    old = await resolve(fs, "w")
    clock.now += 61  # everything known is past its TTL
    gate = backend.gate = trio.Event()
    listed: list[int] = []

    async def list_dir() -> None:
        fh = await fs.opendir(ROOT_INODE)
        listed.extend(node.inode for _, node in fs.readdir(fh, 0))
        fs.releasedir(fh)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(list_dir)
        await trio.testing.wait_all_tasks_blocked()  # the listing holds the old snapshot
        backend.put("p/w", b"b" * 50)
        clock.now += 1
        assert (await fs.getattr(old)).size == 100  # the old inode is the old version
        new = await resolve(fs, "w")  # ...and the HEAD above saw the new one
        assert new != old
        gate.set()
    clock.now += 1
    # The listing finished last but started first: the name still means the new version.
    assert listed == [new]
    assert (await fs.getattr(await resolve(fs, "w"))).size == 50


# -- defect 2: stale but available ---------------------------------------------------------


async def test_cached_metadata_and_data_are_served_while_the_store_is_down(clock: Clock) -> None:
    outage = Outage()
    backend = MemoryBackend(fault=outage)
    data = os.urandom(3 * MiB)
    backend.put("p/model.bin", data)
    backend.put("p/sub/x", b"x")
    fs = make_fs(backend)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        inode = await resolve(fs, "model.bin")
        assert await read_all(fs, inode, len(data)) == data  # its blocks are cached now
        clock.now += 120  # metadata past its TTL
        outage.down = True
        before = sum(backend.requests.values())
        # stat, lookup, open and read keep working from what is known...
        assert (await fs.getattr(inode)).size == len(data)
        assert await resolve(fs, "model.bin") == inode
        assert await read_all(fs, inode, len(data)) == data
        fh = await fs.opendir(ROOT_INODE)
        assert [n.name for _, n in fs.readdir(fh, 0)] == [b"model.bin", b"sub"]
        fs.releasedir(fh)
        # ...and only the first of them waited on the store: the rest answered at once.
        assert sum(backend.requests.values()) - before == 1
        assert fs.outages == 1
        assert fs.stale_answers >= 4
        # A name in a directory nobody has listed cannot be answered: an error, not a
        # made-up miss (a known listing's misses are known, though).
        with pytest.raises(ObjectNotFoundError):
            await fs.lookup(ROOT_INODE, b"never-seen.json")
        with pytest.raises(EndpointUnreachableError):
            await fs.lookup(await resolve(fs, "sub"), b"x")
        # The store is tried again after OUTAGE_RETRY_S, once.
        clock.now += OUTAGE_RETRY_S + 1
        before = sum(backend.requests.values())
        assert (await fs.getattr(inode)).size == len(data)
        assert (await fs.getattr(inode)).size == len(data)
        assert sum(backend.requests.values()) - before == 1
        # Back: the next refresh asks the store and the outage ends.
        outage.down = False
        clock.now += OUTAGE_RETRY_S + 1
        assert (await fs.getattr(inode)).size == len(data)
        assert fs.store_state()["unreachable_for_s"] is None
        nursery.cancel_scope.cancel()


async def test_max_stale_zero_fails_at_once(clock: Clock) -> None:
    outage = Outage()
    backend = MemoryBackend(fault=outage)
    backend.put("p/f", b"x" * 10)
    fs = make_fs(backend, max_stale_s=0.0)
    inode = await resolve(fs, "f")
    clock.now += 61
    outage.down = True
    with pytest.raises(EndpointUnreachableError):
        await fs.getattr(inode)
    with pytest.raises(EndpointUnreachableError):
        await fs.lookup(ROOT_INODE, b"f")


async def test_known_metadata_is_not_served_past_max_stale(clock: Clock) -> None:
    outage = Outage()
    backend = MemoryBackend(fault=outage)
    backend.put("p/f", b"x" * 10)
    fs = make_fs(backend, max_stale_s=300.0)
    inode = await resolve(fs, "f")
    outage.down = True
    clock.now += 60 + 299
    assert (await fs.getattr(inode)).size == 10
    clock.now += 2 + OUTAGE_RETRY_S
    with pytest.raises(EndpointUnreachableError):
        await fs.getattr(inode)


# -- defect 6: big directories ----------------------------------------------------------------


async def test_a_lookup_in_a_huge_directory_does_not_list_it(clock: Clock) -> None:
    backend = MemoryBackend(page_size=1000)
    for i in range(100_000):
        backend.put(f"p/k{i:06d}", b"")
    backend.put("p/k050000.d/inner", b"x")
    fs = make_fs(backend)
    await fs.lookup(ROOT_INODE, b"k050000")
    # The listing's first page showed the directory is big; then a HEAD and a one-page listing
    # under the name.
    assert backend.statistics() == {"list": 2, "head": 1}
    await fs.lookup(ROOT_INODE, b"k099999")
    with pytest.raises(ObjectNotFoundError):
        await fs.lookup(ROOT_INODE, b"k100000")
    assert (await fs.lookup(ROOT_INODE, b"k050000.d")).is_dir
    assert backend.statistics() == {"list": 5, "head": 4}
    # Listing it whole still works (readdir), and then answers lookups while fresh.
    fh = await fs.opendir(ROOT_INODE)
    assert sum(1 for _ in fs.readdir(fh, 0)) == 100_001
    fs.releasedir(fh)
    lists = backend.statistics()["list"]
    await fs.lookup(ROOT_INODE, b"k000123")
    assert backend.statistics()["list"] == lists


async def test_concurrent_refreshes_share_one_head(clock: Clock) -> None:
    backend = MemoryBackend(latency_s=0.01)
    backend.put("p/shard", b"x" * 100)
    fs = make_fs(backend)
    inode = await resolve(fs, "shard")
    clock.now += 61
    heads = backend.statistics().get("head", 0)
    async with trio.open_nursery() as nursery:
        for _ in range(16):  # 16 ranks open the shard after the TTL
            nursery.start_soon(fs.getattr, inode)
    assert backend.statistics()["head"] - heads == 1


async def test_forget_frees_nodes(clock: Clock) -> None:
    backend = MemoryBackend()
    for i in range(50):
        backend.put(f"p/f{i:02d}", b"x")
    backend.put("p/sub/x", b"x")
    fs = make_fs(backend, max_stale_s=0.0)
    inodes = [await resolve(fs, f"f{i:02d}") for i in range(50)]
    sub = await resolve(fs, "sub")
    assert fs.statistics()["inodes"] == 52
    # A replaced version the kernel forgot is freed at once.
    backend.put("p/f00", b"new")
    clock.now += 61
    new_f00 = await resolve(fs, "f00")
    assert new_f00 not in inodes
    fs.forget(inodes[0], 1)
    assert fs.statistics()["inodes"] == 52
    with pytest.raises(ObjectNotFoundError):
        fs.node(inodes[0])
    # Forgotten nodes that only an expired listing names go once that listing expires.
    for inode in inodes[1:]:
        fs.forget(inode, 1)
    clock.now += 61
    await fs.lookup(sub, b"x")  # a lookup sweeps what expired (here: the root's listing)
    # Left: the root, sub, sub/x, and f00's new version (the kernel still references it).
    assert fs.statistics()["inodes"] == 4
    assert fs.node(new_f00).key == "p/f00"


# -- defect 1: one version per inode (core side; the mount test is in test_mount_s3) -----------


async def test_an_old_handle_never_reads_a_newer_version(clock: Clock) -> None:
    backend = MemoryBackend()
    old, new = os.urandom(4 * MiB), os.urandom(4 * MiB)
    backend.put("p/w", old)
    fs = make_fs(backend, metadata_ttl_s=1.0)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        a_inode = await resolve(fs, "w")
        fh_a, _ = await fs.open(a_inode, os.O_RDONLY)
        assert bytes(await fs.read(fh_a, 0, 2 * MiB)) == old[: 2 * MiB]
        backend.put("p/w", new)
        clock.now += 2
        b_inode = await resolve(fs, "w")
        assert b_inode != a_inode
        assert await read_all(fs, b_inode, len(new)) == new
        try:
            rest = bytes(await fs.read(fh_a, 2 * MiB, 2 * MiB))
        except StaleObjectError:
            rest = None
        assert rest is None or rest == old[2 * MiB :]
        fs.release(fh_a)
        nursery.cancel_scope.cancel()
