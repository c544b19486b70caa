"""Issue 30's core items, on the FUSE-free core with the memory backend.

Each test names the item it covers: exception groups from nurseries (item 2), the memory a
listed key costs (item 5), versions of a store that sends no ETags (item 9) and the one rule
for a nursery's errors (:mod:`objfs.nursery`).
"""

from __future__ import annotations

import errno
import logging
import os
import tracemalloc

import pytest
import trio

from objfs.backends.base import (
    content_range_total,
    if_match,
    reply_version_error,
    version_pin,
)
from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.errors import (
    AccessDeniedError,
    EndpointUnreachableError,
    ObjfsError,
    StaleObjectError,
    TransientStoreError,
)
from objfs.inodes import ROOT_INODE
from objfs.nursery import collapse, open_nursery
from tests.test_fs_core import resolve
from tests.test_long_lived import Clock, make_fs

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("objfs.namespace.time.monotonic", fake)
    return fake


class Faults:
    """A fault hook: raises ``error`` (if set) for every request."""

    def __init__(self) -> None:
        self.error: ObjfsError | None = None

    def __call__(self, op: str, key: str) -> None:
        if self.error is not None:
            raise self.error


def big_directory(faults: Faults) -> MemoryBackend:
    """A prefix of 1,500 keys: a lookup there probes (HEAD plus a listing under key/)."""
    backend = MemoryBackend(page_size=1000, fault=faults)
    for i in range(1500):
        backend.put(f"p/k{i:04d}", b"x" * 10)
    return backend


# -- item 2: errors of a probe's nursery ------------------------------------------------------


async def test_item2_a_known_name_in_a_big_directory_is_served_stale_during_an_outage(
    clock: Clock,
) -> None:
    faults = Faults()
    fs = make_fs(big_directory(faults))
    inode = await resolve(fs, "k0042")
    assert fs.node(ROOT_INODE).big  # the lookup probed: HEAD and listing in one nursery
    clock.now += 120  # past the TTL
    faults.error = EndpointUnreachableError("connection refused (test outage)")
    node = await fs.lookup(ROOT_INODE, b"k0042")  # both probe requests fail
    assert node.inode == inode
    assert fs.outages == 1  # the outage is recorded...
    assert fs.stale_answers == 1  # ...and the known entry served


async def test_item2_a_refusal_in_a_probe_is_eacces_not_eio(clock: Clock) -> None:
    faults = Faults()
    fs = make_fs(big_directory(faults))
    await resolve(fs, "k0001")
    clock.now += 120
    faults.error = AccessDeniedError("access denied (test)")
    with pytest.raises(AccessDeniedError) as caught:
        await fs.lookup(ROOT_INODE, b"k0001")
    assert caught.value.errno == errno.EACCES


def _group(*excs: BaseException) -> BaseExceptionGroup[BaseException]:
    return BaseExceptionGroup("test", list(excs))


def test_nursery_rule_picks_one_leaf() -> None:
    unreachable = EndpointUnreachableError("down")
    denied = AccessDeniedError("403")
    bug = KeyError("bug")
    # A refusal says more than a timeout of the other request; a bug more than either.
    assert collapse(_group(unreachable, denied)) is denied
    assert collapse(_group(unreachable, _group(denied, bug))) is bug
    assert collapse(_group(unreachable, TransientStoreError("x"))) is unreachable
    interrupt = KeyboardInterrupt()
    assert collapse(_group(bug, interrupt)) is interrupt


async def test_nursery_raises_a_leaf_never_a_group() -> None:
    async def fails(exc: Exception) -> None:
        raise exc  # before any checkpoint: both tasks fail, neither is cancelled first

    async def both_fail(denied: AccessDeniedError) -> None:
        async with open_nursery() as nursery:
            nursery.start_soon(fails, EndpointUnreachableError("down"))
            nursery.start_soon(fails, denied)

    denied = AccessDeniedError("403")
    with pytest.raises(AccessDeniedError) as caught:
        await both_fail(denied)
    assert caught.value is denied
    # Cancellation still reaches its scope (a group of Cancelled is left to trio).
    with trio.move_on_after(0.01) as scope:
        async with open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
    assert scope.cancelled_caught


def test_every_nursery_in_objfs_uses_the_rule() -> None:
    """No module opens a bare trio nursery (its errors would reach callers as a group)."""
    import objfs

    root = os.path.dirname(objfs.__file__)
    offenders = []
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py") and name != "nursery.py":
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as fp:
                    if "trio.open_nursery(" in fp.read():
                        offenders.append(os.path.relpath(path, root))
    assert offenders == []


def test_wrapping_backends_forward_every_backend_method() -> None:
    """A wrapper that inherits a method from Backend runs the generic version against the
    wrapped store (item 15: the metrics wrapper made every probe's one-key listing a full
    first page)."""
    from objfs.backends.account import AccountBackend
    from objfs.backends.base import Backend
    from objfs.store_metrics import InstrumentedBackend

    public = {name for name in vars(Backend) if not name.startswith("_")} - {"description"}
    for wrapper in (InstrumentedBackend, AccountBackend):
        inherited = {name for name in public if name not in vars(wrapper)}
        assert inherited == set(), (wrapper.__name__, inherited)


# -- item 5: a listed key costs O(1) memory ----------------------------------------------------


async def test_item5_listing_huge_objects_allocates_no_per_block_memory(clock: Clock) -> None:
    backend = MemoryBackend()
    for i in range(1000):
        backend.put(f"p/shard{i:04d}", SyntheticData(100 * GiB))
    fs = make_fs(backend)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        listing = await fs.listing(fs.node(ROOT_INODE))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(listing.entries) == 1000
    # About 1 KiB per key (node, listing entry, ObjectInfo, name); a served map would be
    # 100 KiB per key (one byte per 1 MiB block).
    assert grown < 4 * MiB, grown
    # The map comes with the first open, sized to the version.
    node = listing.entries[b"shard0000"]
    fh, _ = await fs.open(node.inode, os.O_RDONLY)
    assert len(node.served) == 100 * GiB // MiB
    fs.release(fh)


# -- item 9: a store that sends no ETags --------------------------------------------------------


def test_version_pins_and_reply_checks() -> None:
    assert version_pin('"abc"', 10, 5, "k") == '"abc"'
    pin = version_pin("", 10, 5_500_000_000, "k")
    assert if_match(pin) is None
    assert if_match('"abc"') == '"abc"'
    # An ETag pin: the reply's ETag must match (quotes and W/ aside); none cannot be checked.
    assert reply_version_error('"abc"', '"abc"', None, None) is None
    assert reply_version_error('"abc"', 'W/"abc"', None, None) is None
    assert reply_version_error('"abc"', '"new"', None, None) is not None
    assert reply_version_error('"abc"', None, None, None) is None
    # A size/date pin: the reply's total size and Last-Modified second must match.
    date = "Thu, 01 Jan 1970 00:00:05 GMT"
    assert reply_version_error(pin, None, date, 10) is None
    assert reply_version_error(pin, None, date, 11) is not None
    assert reply_version_error(pin, None, "Thu, 01 Jan 1970 00:00:06 GMT", 10) is not None
    assert content_range_total("bytes 0-9/10") == 10
    assert content_range_total("bytes 0-9/*") is None


async def test_item9_without_etags_a_replacement_is_a_new_version(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    import objfs.backends.base as base

    base._warned_no_etag = False
    caplog.set_level(logging.WARNING, logger="objfs.backends.base")
    backend = MemoryBackend(etags=False)
    old = os.urandom(3 * MiB)
    backend.put("p/w.bin", old)
    fs = make_fs(backend)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        inode = await resolve(fs, "w.bin")
        fh, _ = await fs.open(inode, os.O_RDONLY)
        assert bytes(await fs.read(fh, 0, 4096)) == old[:4096]
        new = os.urandom(3 * MiB)  # same size, a later second
        backend.put("p/w.bin", new)
        clock.now += 120
        newer = await resolve(fs, "w.bin")
        assert newer != inode  # not one node for every version of the key
        fh2, _ = await fs.open(newer, os.O_RDONLY)
        assert bytes(await fs.read(fh2, 0, 3 * MiB)) == new
        # The old handle reads its own bytes or fails; never the new version's.
        try:
            got = bytes(await fs.read(fh, 2 * MiB, MiB))
        except StaleObjectError:
            got = None
        assert got is None or got == old[2 * MiB :]
        fs.release(fh)
        fs.release(fh2)
        nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if "sent no ETag" in r.getMessage()]
    assert len(warnings) == 1
