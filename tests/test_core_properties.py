"""Stateful property test of the FUSE-free core: random programs against invariants.

Hypothesis draws a world (one to four files of 0-40 MiB, some ``*.safetensors``; a memory
budget of 16-64 MiB, which may grow to 2 or 4 times that while handles share a version; 1 MiB
blocks and 2-8 MiB parts; a store latency; with or without a disk
cache, whose cap may be small enough to evict versions that handles still read; a store with
ETags or one that sends none, whose versions are pinned by size and last-modified second) and
a program of one to three mounts. Each mount is a new ``FileSystem`` over the same
``MemoryBackend`` and the same disk-cache directory (so a later mount hits the disk tier, and
may use larger parts than the mount that filled it), opens every file once, then runs steps:
opens, closes, sequential and random reads, background readers overlapping the main one,
replacing an object with a new version, making the next store requests fail (the backend's
fault hook raises ``TransientStoreError``), closing a handle while a read of it runs, and
sleeping. The whole program runs in one ``trio.run`` under ``MockClock(autojump_threshold=0)``
(hypothesis's ``RuleBasedStateMachine`` would need the nursery to outlive each rule).

After every step:

* every read that completed returned exactly the bytes of the version its handle was opened
  on (never another version's), whether it went through ``fs.read``, as objfs's own transport
  answers on arrival (``read_nowait`` from memory with no await, else ``fs.read``, with holds
  given back after a checkpoint), or as its reader thread does (``read_locked``, nothing
  pinned, then the read-ahead it asks for), a third of the reads each, or raised an
  ``ObjfsError`` with a cause: the handle was closed, the object replaced, or an injected
  store failure happened during the read;
* once a version larger than a part has several handles, the budget is ``--memory-limit``
  times the handles open on such versions (at most 4), never fewer while two or more of them
  are open, else ``--memory-limit``, within its ceiling (the world's growth: 1, 2 or 4
  budgets; 1 is an explicit ``--memory-limit``, which never grows);
* ``0 <= fs.cache.used_bytes <= capacity_bytes``, or, after the budget shrank, at most the
  capacity it had when the bytes last fitted; ``inflight_bytes >= 0``, the reply
  buffers within their share, and the peak of both together within the ceiling (plus,
  only for a read larger than the reply share, which the kernel never sends, its excess).

At the end of each mount, after closing every handle and letting the background work end:
``inflight_bytes == 0`` and ``reply_bytes == 0``, and the mount holds no fetch lock (the node's
one-fetch-per-block locks, ``objfs.disk_cache.fetching``); at the end of the program the bytes
fetched from the store stay within a bound (see :func:`fetch_bound`).
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar
from unittest import mock

import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

from objfs.backends.memory import MemoryBackend
from objfs.config import MountConfig, S3Options, parse_source
from objfs.disk_cache import DiskCache
from objfs.errors import ObjfsError, TransientStoreError
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE

T = TypeVar("T")
KiB = 1024
MiB = 1024 * KiB
BLOCK = MiB
PART = 4 * MiB
MAX_FILE = 40 * MiB
POOL = MAX_FILE + 8 * MiB
# At most this many fs.read calls per sequential step (8 MiB in 4 KiB reads would be 2048).
MAX_READS_PER_STEP = 256
# A program whose run takes longer than this (real time) is taken to hang.
HANG_AFTER_S = 20.0


@functools.cache
def pool() -> bytes:
    """Random bytes every object version is a slice of (cheap to serve and to compare)."""
    return random.Random(20240601).randbytes(POOL)


def content(file: int, version: int, size: int) -> bytes:
    """The bytes of version ``version`` of file ``file``: versions of a file differ."""
    start = ((file + 1) * 7_919 + version * 524_309) % (POOL - size + 1)
    return pool()[start : start + size]


# -- the program ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Open:
    file: int


@dataclass(frozen=True)
class Close:
    slot: int  # which open handle: index into the open handles, modulo their number


@dataclass(frozen=True)
class Read:
    """Sequential reads of ``length`` bytes from ``start_permille`` of the file, in chunks."""

    slot: int
    start_permille: int
    length: int
    chunk: int


@dataclass(frozen=True)
class RandomRead:
    slot: int
    reads: tuple[tuple[int, int], ...]  # (permille of the file, length)


@dataclass(frozen=True)
class Background:
    """A :class:`Read` in a task of its own, overlapping whatever runs next."""

    slot: int
    start_permille: int
    length: int
    chunk: int


@dataclass(frozen=True)
class Replace:
    file: int
    size: int


@dataclass(frozen=True)
class FailNext:
    """The next ``count`` store requests fail: GETs only, or any (listings and HEADs too)."""

    count: int
    gets_only: bool


@dataclass(frozen=True)
class CloseWhileReading:
    slot: int
    start_permille: int
    length: int
    delay_s: float


@dataclass(frozen=True)
class Sleep:
    seconds: float


Op = Open | Close | Read | RandomRead | Background | Replace | FailNext | CloseWhileReading | Sleep


@dataclass(frozen=True)
class Mount:
    """A ``FileSystem`` over the store (and the disk cache, kept across mounts) that opens
    every file once, then runs ``ops``; its first ``failing_gets`` GETs fail (a store that is
    flaky after a restart). Then every handle is closed and the end invariants checked."""

    failing_gets: int
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class World:
    files: tuple[tuple[int, bool], ...]  # (size, is *.safetensors)
    budget: int
    growth: int  # the budget's ceiling in budgets: 1 never grows (an explicit --memory-limit)
    parts: tuple[int, ...]  # part size of mount i: parts[i % len(parts)]
    latency_s: float
    connections: int
    disk: bool
    disk_cap: int  # the disk tier's --cache-size: small ones evict versions still open
    etags: bool  # False: a store that sends no ETags


# Whole MiB counts plus an odd tail (hypothesis favours small integers, so the MiB count is
# drawn on its own), and the boundary sizes.
sizes = st.one_of(
    st.sampled_from([0, 1, 4095, BLOCK - 1, BLOCK, 3 * BLOCK + 17, PART, 9 * MiB + 5, MAX_FILE]),
    st.builds(
        lambda mib, tail: min(MAX_FILE, mib * MiB + tail),
        st.integers(0, MAX_FILE // MiB),
        st.sampled_from([0, 1, 4096, BLOCK // 2 + 3]),
    ),
)
lengths = st.sampled_from([1, 4 * KiB, 128 * KiB, BLOCK - 1, BLOCK, 3 * BLOCK + 7, 8 * MiB])
chunks = st.sampled_from([4 * KiB, 128 * KiB, BLOCK])
slots = st.integers(0, 7)
# Reads from the start are common (and make two passes over the same blocks likely).
permilles = st.one_of(st.just(0), st.integers(0, 1000))
worlds = st.builds(
    World,
    files=st.lists(st.tuples(sizes, st.booleans()), min_size=1, max_size=4).map(tuple),
    budget=st.sampled_from([16 * MiB, 32 * MiB, 64 * MiB]),
    growth=st.sampled_from([1, 2, 4]),
    # A remount may use larger parts (the disk cache is keyed by block size only), so a fetch
    # may find some blocks of its part on disk and not the others.
    parts=st.sampled_from(
        [
            (PART // 2, 2 * PART),
            (PART // 2, PART),
            (PART, 2 * PART),
            (PART // 2, PART, 2 * PART),
            (PART,),
        ]
    ),
    latency_s=st.sampled_from([0.0, 0.002, 0.01]),
    connections=st.sampled_from([3, 8, 32]),
    disk=st.sampled_from([True, True, False]),  # mostly: remounts then hit the disk tier
    disk_cap=st.sampled_from([1 << 30, 1 << 30, 8 * MiB, 24 * MiB]),
    etags=st.sampled_from([True, True, False]),
)
reads = st.one_of(
    st.builds(Read, slot=slots, start_permille=permilles, length=lengths, chunk=chunks),
    st.builds(
        RandomRead,
        slot=slots,
        reads=st.lists(st.tuples(permilles, lengths), min_size=1, max_size=4).map(tuple),
    ),
    st.builds(Background, slot=slots, start_permille=permilles, length=lengths, chunk=chunks),
)
ops: st.SearchStrategy[Op] = st.one_of(
    reads,
    st.builds(Open, file=st.integers(0, 3)),
    st.builds(Close, slot=slots),
    st.builds(Replace, file=st.integers(0, 3), size=sizes),
    st.builds(FailNext, count=st.integers(1, 6), gets_only=st.booleans()),
    st.builds(
        CloseWhileReading,
        slot=slots,
        start_permille=permilles,
        length=lengths,
        delay_s=st.sampled_from([0.0, 0.001, 0.005, 0.02]),
    ),
    st.builds(Sleep, seconds=st.sampled_from([0.0, 0.001, 0.01, 0.1, 1.0])),
    reads,
)
# One to three mounts: the later ones find the earlier ones' blocks in the disk tier.
programs = st.lists(
    st.builds(
        Mount, failing_gets=st.sampled_from([0, 1, 3]), ops=st.lists(ops, max_size=10).map(tuple)
    ),
    min_size=1,
    max_size=3,
)


# -- running it ------------------------------------------------------------------------------


@dataclass
class OpenHandle:
    fh: int
    file: int
    version: int
    data: bytes
    closed: bool = False


@dataclass
class Model:
    """What the program did, and what the file system must therefore have done."""

    world: World
    backend: MemoryBackend
    versions: list[int]  # the store's current version of each file
    fs: FileSystem = field(init=False)  # the current mount
    mount_number: int = 0
    contents: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (file, version)
    etags: dict[tuple[int, int], str] = field(default_factory=dict)  # (file, version)
    handles: list[OpenHandle] = field(default_factory=list)  # open, in opening order
    fail_remaining: int = 0
    fail_gets_only: bool = True
    faults_fired: int = 0
    violations: list[str] = field(default_factory=list)
    read_block_bytes: int = 0  # bytes of the blocks the reads touched
    slack_bytes: int = 0  # read-ahead a correct implementation may fetch and waste
    # The most reply bytes one read so far may hold: the whole blocks it spans. One larger
    # than the reply share passes alone (the kernel never asks more than 1 MiB at once, two
    # blocks; this core test does, up to 8 MiB).
    largest_read: int = 0
    reads: int = 0  # every other read goes as objfs's own transport does it (see read)
    answered_now: int = 0  # reads answered from memory with no await (read_nowait)
    fitted_capacity: int = 0  # the capacity when the bytes charged last fitted it
    readers: int = 1  # the budget's growth, in budgets (see refit)

    def config(self) -> MountConfig:
        return MountConfig(
            source=parse_source("s3://bkt/p"),
            mountpoint="/unused",
            # 0: every open sees the store's current version, so the model knows which
            # version a handle is pinned to.
            metadata_ttl_s=0.0,
            block_size_bytes=BLOCK,
            part_size_bytes=self.part,
            memory_limit_bytes=self.world.budget,
            memory_ceiling_bytes=None
            if self.world.growth == 1
            else self.world.growth * self.world.budget,
            s3=S3Options(max_connections=self.world.connections),
        )

    @property
    def part(self) -> int:
        return self.world.parts[self.mount_number % len(self.world.parts)]

    def name(self, file: int) -> str:
        return f"f{file}.safetensors" if self.world.files[file][1] else f"f{file}.bin"

    def fault(self, op: str, key: str) -> None:
        if self.fail_remaining > 0 and (op == "get" or not self.fail_gets_only):
            self.fail_remaining -= 1
            self.faults_fired += 1
            raise TransientStoreError(f"injected: {op} {key} failed")

    def read_ahead_slack(self) -> int:
        return self.config().readahead_max(self.world.growth * self.world.budget) + self.part

    def handle(self, slot: int) -> OpenHandle | None:
        return self.handles[slot % len(self.handles)] if self.handles else None

    async def read(self, h: OpenHandle, offset: int, size: int) -> bool:
        """One ``fs.read``, checked; False if it raised (the caller stops reading)."""
        end = min(offset + size, len(h.data))
        if offset < end:
            spanned = ((end - 1) // BLOCK - offset // BLOCK + 1) * BLOCK
            self.read_block_bytes += spanned
            # A read's reply buffers are charged at most the whole blocks it spans (the
            # ReplyGate lets one request larger than its share through alone).
            self.largest_read = max(self.largest_read, spanned)
        faults = self.faults_fired
        self.reads += 1
        try:
            if self.reads % 3 == 0:
                got = bytes(await self.fs.read(h.fh, offset, size))
            elif self.reads % 3 == 1:
                got = await self.read_as_the_kernel_transport(h, offset, size)
            else:
                got = await self.read_as_the_reader_thread(h, offset, size)
        except ObjfsError as exc:
            replaced = self.versions[h.file] != h.version
            if not (h.closed or replaced or self.faults_fired > faults):
                self.violations.append(
                    f"read of {self.name(h.file)} v{h.version} [{offset}, +{size}) raised "
                    f"{exc!r}: not closed, not replaced, no store failure during the read"
                )
            return False
        except Exception as exc:
            self.violations.append(f"read [{offset}, +{size}) raised {exc!r}")
            return False
        want = h.data[offset:end]
        if got != want:
            other = [
                v
                for (f, v), data in self.contents.items()
                if f == h.file and v != h.version and got == data[offset : offset + len(got)]
            ]
            self.violations.append(
                f"read of {self.name(h.file)} v{h.version} [{offset}, +{size}) returned "
                f"{len(got)} bytes, not the {len(want)} of its version"
                + (f" (they are version {other}'s)" if other else "")
            )
            return False
        return True

    async def read_as_the_kernel_transport(self, h: OpenHandle, offset: int, size: int) -> bytes:
        """A READ as KernelSession answers it: from memory on arrival when every block is
        there (``read_nowait``), else awaited; with holds, given back only after the reply
        was "written" (here: after a checkpoint, so other tasks run while the views are
        out, as while a writer thread copies them)."""
        holds: list[Callable[[], None]] = []
        try:
            data = self.fs.read_nowait(h.fh, offset, size, holds=holds)
            if data is not None:
                self.answered_now += 1
            else:
                data = await self.fs.read(h.fh, offset, size, holds=holds)
            await trio.lowlevel.checkpoint()
            got = b"".join(data) if isinstance(data, list) else bytes(data)
        finally:
            for release in holds:
                release()
        return got

    async def read_as_the_reader_thread(self, h: OpenHandle, offset: int, size: int) -> bytes:
        """A READ as the kernel transport's reader thread answers it under the core's lock
        (``read_locked``: nothing pinned, the bytes copied before anything else runs, the
        read-ahead queued after), else awaited as the trio thread would."""
        answer = self.fs.read_locked(h.fh, offset, size)
        if answer is None:
            return bytes(await self.fs.read(h.fh, offset, size))
        data, window, stream = answer
        self.answered_now += 1
        got = b"".join(data) if isinstance(data, list) else bytes(data)
        del data
        if window is not None:
            self.fs.read_ahead(h.fh, window, stream)
        return got

    async def read_sequentially(self, h: OpenHandle, start: int, length: int, chunk: int) -> None:
        length = min(length, MAX_READS_PER_STEP * chunk)
        for offset in range(start, start + length, chunk):
            if not await self.read(h, offset, min(chunk, start + length - offset)):
                return

    def check_step(self, step: str) -> None:
        stats = self.fs.cache.statistics()
        assert not self.violations, f"after {step}: {self.violations}"
        assert stats["inflight_bytes"] >= 0, f"after {step}: {stats}"
        used = self.fs.cache.used_bytes
        # Within the capacity; over it only after the budget shrank (its handles closed),
        # and then never more than the capacity it had when the bytes last fitted.
        if used <= stats["capacity_bytes"]:
            self.fitted_capacity = stats["capacity_bytes"]
        assert 0 <= used <= self.fitted_capacity, f"after {step}: {stats}"
        # The budget: while a version larger than a part has several handles, the base
        # times the handles on such versions (at most 4), within the ceiling.
        expected = min(self.world.growth, self.readers) * self.world.budget
        assert stats["budget_bytes"] == expected, f"after {step}: {self.readers} readers, {stats}"
        assert stats["ceiling_bytes"] == self.world.growth * self.world.budget, stats
        assert stats["capacity_bytes"] + stats["reply_capacity_bytes"] == stats["budget_bytes"]
        # Reply buffers have their own share of the same budget; together within it.
        oversize = max(0, self.largest_read - stats["reply_capacity_bytes"])
        assert 0 <= stats["reply_bytes"] <= stats["reply_capacity_bytes"] + oversize, (
            f"after {step}: {stats}"
        )
        assert stats["peak_bytes"] <= stats["ceiling_bytes"] + oversize, f"after {step}: {stats}"

    async def open(self, file: int) -> None:
        faults = self.faults_fired
        outage = self.in_outage()
        try:
            node = await self.fs.lookup(ROOT_INODE, self.name(file).encode())
            fh, _ = await self.fs.open(node.inode, os.O_RDONLY)
        except ObjfsError as exc:
            if self.faults_fired == faults:
                self.violations.append(f"open of {self.name(file)} raised {exc!r}")
            return
        # The version the handle pins: the store's current one, unless the store failed
        # during the open or was in an outage before it (objfs then answers from its cached
        # metadata, --max-stale, and tries the store again only every OUTAGE_RETRY_S).
        etag = self.fs._handle(fh).etag
        version = next(v for (f, v), e in self.etags.items() if f == file and e == etag)
        if version != self.versions[file] and not (outage or self.faults_fired > faults):
            self.violations.append(
                f"open of {self.name(file)} pinned version {version}, not the store's "
                f"{self.versions[file]}, with the store reachable"
            )
        self.handles.append(OpenHandle(fh, file, version, self.contents[file, version]))
        self.refit()
        self.slack_bytes += self.read_ahead_slack() if self.world.files[file][1] else self.part

    def refit(self) -> None:
        """The budget's growth after a handle opened or closed: once a version larger than a
        part has several handles, the handles open on such versions (at most 4), never
        fewer while two or more are open; back to 1 when at most one is."""
        large = Counter((h.file, h.version) for h in self.handles if len(h.data) > self.part)
        if sum(large.values()) <= 1:
            self.readers = 1
        elif max(large.values()) > 1:
            self.readers = max(self.readers, min(4, sum(large.values())))

    def in_outage(self) -> bool:
        """Whether objfs counts the store as unreachable now (an earlier call failed)."""
        return self.fs.availability.outage_since is not None

    async def close_all(self) -> None:
        """Let the work in flight end (the readers, read-ahead), then close every handle."""
        await self.settle()
        for h in list(self.handles):
            self.handles.remove(h)
            h.closed = True
            self.fs.release(h.fh)
            self.refit()

    async def apply(self, op: Op, readers: trio.Nursery) -> None:
        if isinstance(op, Open):
            await self.open(op.file % len(self.world.files))
        elif isinstance(op, Close | CloseWhileReading):
            h = self.handle(op.slot)
            if h is None:
                return
            if isinstance(op, CloseWhileReading):
                start = len(h.data) * op.start_permille // 1000
                readers.start_soon(self.read_sequentially, h, start, op.length, BLOCK)
                self.slack_bytes += self.read_ahead_slack()
                await trio.sleep(op.delay_s)
            self.handles.remove(h)
            h.closed = True
            self.fs.release(h.fh)
            self.refit()
        elif isinstance(op, Read | Background):
            h = self.handle(op.slot)
            if h is None:
                return
            start = len(h.data) * op.start_permille // 1000
            self.slack_bytes += self.read_ahead_slack()
            if isinstance(op, Read):
                await self.read_sequentially(h, start, op.length, op.chunk)
            else:
                readers.start_soon(self.read_sequentially, h, start, op.length, op.chunk)
        elif isinstance(op, RandomRead):
            h = self.handle(op.slot)
            if h is None:
                return
            for permille, length in op.reads:
                self.slack_bytes += self.read_ahead_slack()
                if not await self.read(h, len(h.data) * permille // 1000, length):
                    break
        elif isinstance(op, Replace):
            file = op.file % len(self.world.files)
            self.versions[file] += 1
            data = content(file, self.versions[file], op.size)
            self.contents[file, self.versions[file]] = data
            self.etags[file, self.versions[file]] = self.backend.put(f"p/{self.name(file)}", data)
        elif isinstance(op, FailNext):
            self.fail_remaining += op.count
            self.fail_gets_only = op.gets_only
        elif isinstance(op, Sleep):
            await trio.sleep(op.seconds)

    async def settle(self) -> None:
        """Wait until no fetch holds memory: ``inflight_bytes`` stays at or below 0 for a few
        polls (read-ahead of a closed safetensors file may still run: it is not cancelled)."""
        await self.fs.flush_disk_writes()
        quiet = 0
        deadline = time.monotonic() + 5.0
        while quiet < 5 and time.monotonic() < deadline:
            await trio.sleep(0.05)
            quiet = quiet + 1 if self.fs.cache.statistics()["inflight_bytes"] <= 0 else 0
        await self.fs.flush_disk_writes()


def fetch_bound(model: Model) -> int:
    """The most a correct implementation fetches from the store for this program.

    Every fetched byte (the memory backend counts successful GETs only) is either

    * in a block some read touched (``read_block_bytes``): a correct cache fetches such a
      block again only after losing it (a reader's own fetch evicted it unread, a fetch failed
      or was cancelled with it, a remount emptied memory), allowed for by a factor of 4; or
    * read-ahead nobody read: at most one window (``readahead_max()``, about half the budget)
      rounded up to a part per read request that may start or grow a stream and per safetensors open
      (whole-file read-ahead), one part per other open (``slack_bytes``).

    It is loose (the read-ahead allowance dominates small programs): it catches fetch loops,
    not the milder over-fetching that ``test_memory_ownership`` measures.
    """
    return 4 * model.read_block_bytes + model.slack_bytes


async def nursery_task(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    """A nursery that outlives the steps of a program; cancel its scope to end it."""
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()


class Hang(Exception):
    pass


async def watchdog(started: float) -> None:
    """Fail a program that makes no progress: under the autojump clock a deadlock would
    otherwise wait forever (nothing else has a deadline)."""
    while True:
        await trio.sleep(1.0)
        if time.monotonic() - started > HANG_AFTER_S:
            raise Hang(f"the program ran over {HANG_AFTER_S} s of real time: a hang?")


def mount(world: World, backend: MemoryBackend, tmp: str, config: MountConfig) -> FileSystem:
    disk = None
    if world.disk:
        disk = DiskCache(
            tmp,
            namespace="memory://",
            block_size=BLOCK,
            size_limit_bytes=world.disk_cap,
            min_free_bytes=0,
        )
    return FileSystem(backend, config, disk)


async def run_program(world: World, program: Sequence[Mount], tmp: str) -> None:
    backend = MemoryBackend(latency_s=world.latency_s, etags=world.etags)
    model = Model(world, backend, [0] * len(world.files))
    backend.fault = model.fault
    for file, (size, _) in enumerate(world.files):
        model.contents[file, 0] = content(file, 0, size)
        model.etags[file, 0] = backend.put(f"p/{model.name(file)}", model.contents[file, 0])
    async with trio.open_nursery() as root:
        root.start_soon(watchdog, time.monotonic())
        for number, mounted in enumerate(program):
            fs_nursery: trio.Nursery = await root.start(nursery_task)
            model.mount_number = number
            if mounted.failing_gets:
                model.fail_remaining, model.fail_gets_only = mounted.failing_gets, True
            model.fs = mount(world, backend, tmp, model.config())
            model.readers = 1
            model.fs.start(fs_nursery)
            async with trio.open_nursery() as readers:
                # Every mount starts with each file open once (the ops address open handles).
                for file in range(len(world.files)):
                    await model.open(file)
                model.check_step(f"mount {number} opening every file")
                for step, op in enumerate(mounted.ops):
                    await model.apply(op, readers)
                    model.check_step(f"mount {number} step {step} {op}")
                await model.close_all()
            await model.settle()
            model.check_step(f"closing mount {number}")
            # Pooled reply buffers are given back lazily, by the next handler that runs (see
            # ReplyGate): a reader that finished after the last close may have left one.
            assert model.fs.cache.replies.reclaim is not None
            model.fs.cache.replies.reclaim()
            stats = model.fs.cache.statistics()
            if model.fs.disk is not None:
                # Every fetch lock ends with its fetch and its disk write (or their failure).
                held = model.fs.disk.fetch_locks.held()
                assert held == 0, f"closed mount {number}: {held} fetch locks held"
            assert stats["inflight_bytes"] == 0, f"closed mount {number}: {stats}"
            assert stats["reply_bytes"] == 0, f"closed mount {number}: {stats}"
            fs_nursery.cancel_scope.cancel()
        fetched = backend.requests["get_bytes"]
        note(f"fetched {fetched}, read blocks {model.read_block_bytes}, bound {fetch_bound(model)}")
        assert fetched <= fetch_bound(model), (fetched, model.read_block_bytes, model.slack_bytes)
        root.cancel_scope.cancel()


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


async def run_sync_inline(
    fn: Callable[..., T], *args: object, limiter: object = None, **kwargs: object
) -> T:
    """``trio.to_thread.run_sync`` without the thread: the disk tier's reads and writes run
    on the trio thread, so a program's schedule depends on its simulated time only (with real
    threads the autojump clock jumps while they run, and a failing example would not
    reproduce). Same cancellation semantics: cancellable before the call, not during it."""
    await trio.lowlevel.checkpoint_if_cancelled()
    result = fn(*args)
    await trio.lowlevel.cancel_shielded_checkpoint()
    return result


def run(world: World, program: Sequence[Mount]) -> None:
    # tmpfs where there is one: the disk tier then costs no disk I/O (it falls back from
    # O_DIRECT to buffered I/O there, as it does on any file system that refuses O_DIRECT).
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="objfs-props-", dir=shm) as tmp,
        mock.patch.object(trio.to_thread, "run_sync", run_sync_inline),
    ):
        clock = trio.testing.MockClock(autojump_threshold=0)
        main: Callable[[], object] = functools.partial(run_program, world, program, tmp)
        failure: BaseException | None = None
        try:
            trio.run(main, clock=clock)  # type: ignore[arg-type]
        except BaseExceptionGroup as group:
            found = leaves(group)
            if len(found) != 1:
                raise
            failure = found[0]
    if failure is not None:
        # One failure, shown and shrunk as itself: raised outside the ``except`` so that the
        # nursery groups around it (which differ with where it happened) are not its context,
        # and hypothesis sees one error however deep in the program it was found.
        raise failure


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    # No "explain" phase: it reruns the failing example hundreds of times.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(world=worlds, program=programs)
# Ranks that move from shard to shard: a version opened twice beside another (three large
# handles), then the other closed (two left: the budget stays), then one more (back to base).
@example(
    world=World(
        files=((9 * MiB + 5, False), (9 * MiB + 5, True)),
        budget=16 * MiB,
        growth=4,
        parts=(PART,),
        latency_s=0.0,
        connections=8,
        disk=False,
        disk_cap=1 << 30,
        etags=True,
    ),
    program=[
        Mount(
            failing_gets=0,
            ops=(
                Open(file=0),
                Read(slot=2, start_permille=0, length=8 * MiB, chunk=BLOCK),
                Close(slot=1),
                Read(slot=0, start_permille=500, length=8 * MiB, chunk=BLOCK),
                Close(slot=0),
            ),
        )
    ],
)
def test_core_invariants_hold_for_any_program(world: World, program: list[Mount]) -> None:
    run(world, program)
