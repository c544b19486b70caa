"""The FUSE-free core against the in-memory backend: semantics and request counts."""

from __future__ import annotations

import errno
import logging
import os
import stat

import pytest
import trio

from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.config import MountConfig, parse_source
from objfs.errors import (
    IsADirectoryFsError,
    NotADirectoryFsError,
    ObjectNotFoundError,
    ReadOnlyError,
    StaleObjectError,
)
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE, posix_name

MiB = 1024 * 1024


def make_fs(backend: MemoryBackend, source: str = "s3://bkt/p", **kwargs: object) -> FileSystem:
    config = MountConfig(source=parse_source(source), mountpoint="/unused", **kwargs)  # type: ignore[arg-type]
    return FileSystem(backend, config)


async def resolve(fs: FileSystem, path: str) -> int:
    """Look ``path`` up as the kernel does: each answered entry is one more reference."""
    inode = ROOT_INODE
    for part in path.split("/"):
        node = await fs.lookup(inode, part.encode())
        fs.remember(node)
        inode = node.inode
    return inode


async def names(fs: FileSystem, inode: int = ROOT_INODE) -> set[str]:
    fh = await fs.opendir(inode)
    try:
        return {node.name.decode() for _, node in fs.readdir(fh, 0)}
    finally:
        fs.releasedir(fh)


def test_posix_name_rules() -> None:
    assert posix_name("a b+c%#?.txt") == b"a b+c%#?.txt"
    assert posix_name("ü") == "ü".encode()
    for bad in ("", ".", "..", "a\0b", "x" * 256, "é" * 128):
        assert posix_name(bad) is None, bad
    assert posix_name("x" * 255) == b"x" * 255


async def test_listing_rules(caplog: pytest.LogCaptureFixture) -> None:
    backend = MemoryBackend()
    for key in (
        "p/",
        "p/file",
        "p/dir/",
        "p/dir/inner",
        "p/same",
        "p/same/child",
        "p/a//b",
        "p/../x",
        "p/implied/deep/leaf",
        "pother/file",
    ):
        backend.put(key, b"k:" + key.encode())
    fs = make_fs(backend, metadata_ttl_s=0)
    caplog.set_level(logging.WARNING, logger="objfs.fs")
    assert await names(fs) == {"file", "dir", "same", "a", "implied"}
    await names(fs)  # listed again (TTL 0): no second warning
    same = fs.node(await resolve(fs, "same"))
    assert same.is_dir
    assert await names(fs, same.inode) == {"child"}
    assert await names(fs, await resolve(fs, "a")) == set()
    assert await names(fs, await resolve(fs, "a")) == set()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("'p/same' is hidden" in w for w in warnings) == 1
    assert sum("'p/a//'" in w for w in warnings) == 1
    assert sum("'p/../'" in w for w in warnings) == 1
    assert await names(fs, await resolve(fs, "implied/deep")) == {"leaf"}
    with pytest.raises(ObjectNotFoundError):
        await fs.lookup(ROOT_INODE, b"missing")
    assert (await fs.lookup(ROOT_INODE, b".")).inode == ROOT_INODE
    dir_inode = await resolve(fs, "dir")
    assert (await fs.lookup(dir_inode, b"..")).inode == ROOT_INODE


async def test_pagination_is_followed() -> None:
    backend = MemoryBackend(page_size=7)
    for i in range(30):
        backend.put(f"p/f{i:02d}", b"x")
        backend.put(f"p/d{i:02d}/x", b"x")
    fs = make_fs(backend)
    listed = await names(fs)
    assert listed == {f"f{i:02d}" for i in range(30)} | {f"d{i:02d}" for i in range(30)}
    assert backend.statistics()["list"] == 9  # ceil(60 / 7) pages


async def test_metadata_is_cached_within_ttl() -> None:
    backend = MemoryBackend()
    backend.put("p/config.json", b"{}")
    fs = make_fs(backend, metadata_ttl_s=3600)
    for _ in range(50):
        await fs.lookup(ROOT_INODE, b"config.json")
        with pytest.raises(ObjectNotFoundError):
            await fs.lookup(ROOT_INODE, b"missing.json")  # negative answers come from it too
        await fs.getattr(await resolve(fs, "config.json"))
    # One page held the whole directory: that listing answers every lookup within the TTL.
    assert backend.statistics() == {"list": 1}


async def test_concurrent_listings_share_one_request() -> None:
    backend = MemoryBackend(latency_s=0.05)
    backend.put("p/x", b"1")
    fs = make_fs(backend)
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(fs.lookup, ROOT_INODE, b"x")
    assert backend.statistics()["list"] == 1


async def test_stat_attributes() -> None:
    backend = MemoryBackend()
    backend.put("p/f", b"12345", mtime_ns=1_700_000_000_123_000_000)
    backend.put("p/d/x", b"")
    fs = make_fs(backend, uid=1234, gid=5678)
    f = await fs.getattr(await resolve(fs, "f"))
    assert (f.mode, f.size, f.mtime_ns, f.uid, f.gid, f.nlink) == (
        stat.S_IFREG | 0o444,
        5,
        1_700_000_000_123_000_000,
        1234,
        5678,
        1,
    )
    d = await fs.getattr(await resolve(fs, "d"))
    assert d.mode == stat.S_IFDIR | 0o555
    default = make_fs(backend)
    assert (await default.getattr(ROOT_INODE)).uid == os.getuid()


async def test_inodes_are_stable_and_distinct() -> None:
    backend = MemoryBackend()
    for key in ("p/a", "p/b/c", "p/b/d"):
        backend.put(key, b"x")
    fs = make_fs(backend, metadata_ttl_s=0)
    first = [await resolve(fs, p) for p in ("a", "b", "b/c", "b/d")]
    assert [await resolve(fs, p) for p in ("a", "b", "b/c", "b/d")] == first
    backend.put("p/a", b"new version")  # a new version is a new inode (its own page cache)
    second = [await resolve(fs, p) for p in ("a", "b", "b/c", "b/d")]
    assert second[1:] == first[1:]
    assert second[0] not in first
    assert len(set(first)) == 4


async def test_read_whole_and_partial_and_empty() -> None:
    backend = MemoryBackend()
    data = os.urandom(3 * MiB + 123)
    backend.put("p/data", data)
    backend.put("p/empty", b"")
    fs = make_fs(backend, block_size_bytes=MiB)
    fh, _ = await fs.open(await resolve(fs, "data"), os.O_RDONLY)
    assert await fs.read(fh, 0, len(data) + 100) == data
    assert await fs.read(fh, MiB - 10, 20) == data[MiB - 10 : MiB + 10]  # across blocks
    assert await fs.read(fh, len(data), 10) == b""
    assert await fs.read(fh, len(data) + 5, 10) == b""
    fs.release(fh)
    efh, _ = await fs.open(await resolve(fs, "empty"), os.O_RDONLY)
    assert await fs.read(efh, 0, 4096) == b""
    assert backend.statistics().get("get", 0) == 4  # 4 blocks for data, none for empty


async def test_reads_past_4gib() -> None:
    size = 5 * 2**30 + 7
    synthetic = SyntheticData(size)
    backend = MemoryBackend()
    backend.put("p/huge", synthetic)
    fs = make_fs(backend)
    fh, _ = await fs.open(await resolve(fs, "huge"), os.O_RDONLY)
    for offset in (2**32 - 3, 2**32, 2**32 + 4096 * 1000 + 17, size - 10):
        assert await fs.read(fh, offset, 65536) == synthetic.read(offset, 65536)
    assert (await fs.getattr(await resolve(fs, "huge"))).size == size


@pytest.mark.parametrize(
    "offsets",
    [
        [0] * 8,  # streams from the start: whole blocks, shared
        [270_000 + 4096 * i for i in range(8)],  # random reads in one 64 KiB range
    ],
    ids=["sequential", "random"],
)
async def test_concurrent_reads_of_one_block_share_one_get(offsets: list[int]) -> None:
    """Concurrent first reads, one per handle, all missing: one GET between them."""
    backend = MemoryBackend(latency_s=0.05)
    data = os.urandom(MiB)
    backend.put("p/f", data)
    fs = make_fs(backend, block_size_bytes=MiB)
    inode = await resolve(fs, "f")
    results: list[tuple[int, bytes]] = []

    async def read(fh: int, off: int) -> None:
        results.append((off, bytes(await fs.read(fh, off, 4096))))

    handles = [(await fs.open(inode, os.O_RDONLY))[0] for _ in offsets]
    async with trio.open_nursery() as nursery:
        for fh, off in zip(handles, offsets, strict=True):
            nursery.start_soon(read, fh, off)
    assert len(results) == len(offsets)
    assert all(got == data[off : off + 4096] for off, got in results)
    assert backend.statistics()["get"] == 1


async def test_handle_is_pinned_to_its_etag() -> None:
    backend = MemoryBackend()
    old, new = os.urandom(2 * MiB), os.urandom(MiB)
    backend.put("p/w", old)
    fs = make_fs(backend, block_size_bytes=MiB, metadata_ttl_s=0)
    inode = await resolve(fs, "w")
    fh, keep = await fs.open(inode, os.O_RDONLY)
    assert keep is True  # an inode is one version: its page cache can only hold it
    assert await fs.read(fh, 0, 10) == old[:10]
    backend.put("p/w", new)
    with pytest.raises(StaleObjectError) as info:
        await fs.read(fh, MiB, 10)  # block 1 is not cached: the conditional GET fails
    assert info.value.errno == errno.ESTALE
    fs.release(fh)
    # The old version's inode cannot be opened again: ESTALE makes the kernel look the
    # path up again, which finds the new version's inode.
    with pytest.raises(StaleObjectError):
        await fs.open(inode, os.O_RDONLY)
    new_inode = await resolve(fs, "w")
    assert new_inode != inode
    fh2, keep2 = await fs.open(new_inode, os.O_RDONLY)
    assert keep2 is True
    assert await fs.read(fh2, 0, 2 * MiB) == new
    assert (await fs.getattr(inode)).size == len(old)  # an old inode keeps its attributes


async def test_a_stale_random_read_makes_the_next_open_see_the_new_version() -> None:
    """With a long metadata TTL, a random read (outside the block cache) that finds the object
    replaced raises ESTALE and forgets the old metadata, as a block fetch does."""
    backend = MemoryBackend()
    old, new = os.urandom(3 * MiB), os.urandom(MiB + 5)
    backend.put("p/w", old)
    fs = make_fs(backend, block_size_bytes=MiB, metadata_ttl_s=3600)
    inode = await resolve(fs, "w")
    fh, _ = await fs.open(inode, os.O_RDONLY)
    backend.put("p/w", new)
    with pytest.raises(StaleObjectError):
        await fs.read(fh, 2 * MiB + 4096, 4096)  # random: a 64 KiB GET, not a block
    fs.release(fh)
    with pytest.raises(StaleObjectError):
        await fs.open(inode, os.O_RDONLY)  # the kernel retries with a new lookup
    new_inode = await resolve(fs, "w")
    fh2, _ = await fs.open(new_inode, os.O_RDONLY)
    assert (await fs.getattr(new_inode)).size == len(new)
    assert await fs.read(fh2, 0, 2 * MiB) == new


async def test_a_newer_version_seen_by_stat_leaves_old_handles_on_their_version() -> None:
    backend = MemoryBackend()
    backend.put("p/w", b"a" * 100)
    fs = make_fs(backend, metadata_ttl_s=0)
    inode = await resolve(fs, "w")
    fh, _ = await fs.open(inode, os.O_RDONLY)
    assert await fs.read(fh, 0, 10) == b"a" * 10  # block now cached
    backend.put("p/w", b"b" * 50)
    # The old inode is the old version: same size, and its handle reads its own bytes.
    assert (await fs.getattr(inode)).size == 100
    assert await fs.read(fh, 10, 10) == b"a" * 10
    new_inode = await resolve(fs, "w")
    assert (await fs.getattr(new_inode)).size == 50
    fh2, _ = await fs.open(new_inode, os.O_RDONLY)
    assert await fs.read(fh2, 0, 100) == b"b" * 50
    assert await fs.read(fh, 90, 10) == b"a" * 10  # still the old version, never a mix


async def test_open_for_writing_and_directories_refused() -> None:
    backend = MemoryBackend()
    backend.put("p/f", b"x")
    backend.put("p/d/x", b"x")
    fs = make_fs(backend)
    f, d = await resolve(fs, "f"), await resolve(fs, "d")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        with pytest.raises(ReadOnlyError) as info:
            await fs.open(f, flags)
        assert info.value.errno == errno.EROFS
    with pytest.raises(IsADirectoryFsError):
        await fs.open(d, os.O_RDONLY)
    with pytest.raises(NotADirectoryFsError):
        await fs.opendir(f)


async def test_deleted_object_gives_enoent_after_ttl() -> None:
    backend = MemoryBackend()
    backend.put("p/f", b"x")
    fs = make_fs(backend, metadata_ttl_s=0)
    inode = await resolve(fs, "f")
    backend.delete("p/f")
    with pytest.raises(ObjectNotFoundError):
        await fs.getattr(inode)
    with pytest.raises(ObjectNotFoundError):
        await fs.lookup(ROOT_INODE, b"f")
