"""The kernel transport's request handling without the kernel: recorded request bytes are fed
to :class:`objfs.kernel.session.KernelSession` over a pipe standing in for ``/dev/fuse``, and
the replies read back from it (the memory backend behind a real ``FileSystem``).

What it checks: every request that expects a reply gets exactly one, with the errno pyfuse3
would give (EROFS for mutations, ENOSYS for what objfs does not handle, EIO for a request
that cannot be parsed); FORGET and INTERRUPT get none; an INTERRUPT cancels the request it
names (EINTR); a READ is answered by a writer thread with the exact bytes, and its holds are
given back once written.
"""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from objfs.backends.memory import MemoryBackend
from objfs.config import MountConfig, parse_source
from objfs.fs import FileSystem
from objfs.inodes import ROOT_INODE
from objfs.kernel import protocol as p
from objfs.kernel.session import KernelSession
from tests.test_read_path import settle

MiB = 1 << 20


def request(opcode: int, unique: int, nodeid: int, body: bytes = b"") -> bytes:
    """A request as the kernel writes it: fuse_in_header (40 bytes) and the body."""
    header = struct.pack("<IIQQIIIHH", 40 + len(body), opcode, unique, nodeid, 0, 0, 1, 0, 0)
    return header + body


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def replies(fd: int) -> list[tuple[int, int, bytes]]:
    """(unique, error, payload) of every reply written to the pipe so far."""
    try:
        data = os.read(fd, 1 << 22)
    except BlockingIOError:
        return []
    out = []
    while data:
        length, error, unique = struct.unpack_from("<IiQ", data)
        out.append((unique, error, data[16:length]))
        data = data[length:]
    return out


def make_session(backend: MemoryBackend) -> KernelSession:
    config = MountConfig(source=parse_source("s3://bkt/p"), mountpoint="/unused")
    return KernelSession(FileSystem(backend, config), config, passed_fd=None)


async def test_requests_get_one_reply_with_pyfuse3s_errnos(pipe: tuple[int, int]) -> None:
    r, w = pipe
    backend = MemoryBackend()
    backend.put("p/a.bin", b"hello")
    session = make_session(backend)
    # LOOKUP of an existing and a missing name.
    await session._handle(w, request(p.Opcode.LOOKUP, 1, ROOT_INODE, b"a.bin\0"))
    await session._handle(w, request(p.Opcode.LOOKUP, 2, ROOT_INODE, b"nope\0"))
    got = replies(r)
    assert [(u, e) for u, e, _ in got] == [(1, 0), (2, 0)]
    nodeid = struct.unpack_from("<Q", got[0][2])[0]
    assert nodeid > ROOT_INODE
    assert struct.unpack_from("<Q", got[1][2])[0] == 0  # a negative entry, cached
    # Mutations: EROFS. Unhandled: ENOSYS. Malformed: EIO. FORGET: no reply.
    await session._handle(w, request(p.Opcode.MKDIR, 3, ROOT_INODE, b"\0" * 8 + b"d\0"))
    await session._handle(w, request(p.Opcode.UNLINK, 4, ROOT_INODE, b"a.bin\0"))
    await session._handle(w, request(p.Opcode.GETXATTR, 5, nodeid, b"\0" * 8 + b"user.x\0"))
    await session._handle(w, request(9999, 6, ROOT_INODE))
    await session._handle(w, request(p.Opcode.LOOKUP, 7, ROOT_INODE, b"no-nul"))
    await session._handle(w, request(p.Opcode.FORGET, 8, nodeid, struct.pack("<Q", 1)))
    await session._handle(w, b"\x01\x02")  # not even a header: nothing to answer
    assert [(u, e) for u, e, _ in replies(r)] == [
        (3, -errno.EROFS),
        (4, -errno.EROFS),
        (5, -errno.ENOSYS),
        (6, -errno.ENOSYS),
        (7, -errno.EIO),
    ]


async def test_a_read_is_written_by_a_writer_thread_and_its_holds_given_back(
    pipe: tuple[int, int],
) -> None:
    r, w = pipe
    backend = MemoryBackend()
    data = os.urandom(3 * MiB + 5)
    backend.put("p/w.bin", data)
    session = make_session(backend)
    token = trio.lowlevel.current_trio_token()
    writer = threading.Thread(target=session._writers.run, args=(token,))
    writer.start()
    try:
        async with trio.open_nursery() as nursery:
            session.fs.start(nursery)
            await session._handle(w, request(p.Opcode.LOOKUP, 1, ROOT_INODE, b"w.bin\0"))
            nodeid = struct.unpack_from("<Q", replies(r)[0][2])[0]
            await session._handle(w, request(p.Opcode.OPEN, 2, nodeid, struct.pack("<II", 0, 0)))
            (_, error, payload) = replies(r)[0]
            assert error == 0
            fh, open_flags = struct.unpack_from("<QI", payload)
            assert open_flags & p.FOPEN_KEEP_CACHE
            got = bytearray()
            unique = 10
            for offset in range(0, len(data), MiB):
                body = struct.pack("<QQIIQII", fh, offset, MiB, 0, 0, 0, 0)
                await session._handle(w, request(p.Opcode.READ, unique, nodeid, body), unique - 10)
                unique += 1
                # The writer thread answers (a reply is larger than the pipe: read as it comes).
                frame = bytearray()
                while len(frame) < 16 or len(frame) < struct.unpack_from("<I", frame)[0]:
                    try:
                        frame += os.read(r, 1 << 20)
                    except BlockingIOError:
                        await trio.sleep(0.005)
                length, error, answered = struct.unpack_from("<IiQ", frame)
                assert (error, answered, length) == (0, unique - 1, len(frame))
                got += frame[16:]
            assert bytes(got) == data
            await trio.sleep(0.05)  # the holds come back through run_sync_soon
            stats = session.fs.cache.statistics()
            assert stats["held_bytes"] == 0
            assert stats["reply_bytes"] == 0
            assert session.reads == 4
            assert session.bytes_served == len(data)
            nursery.cancel_scope.cancel()
    finally:
        session._writers.end_one()
        writer.join(timeout=5)


async def test_an_interrupt_cancels_the_request_it_names(pipe: tuple[int, int]) -> None:
    r, w = pipe
    backend = MemoryBackend(latency_s=30.0)  # a listing that would take 30 s
    backend.put("p/a.bin", b"x")
    session = make_session(backend)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session._handle, w, request(p.Opcode.LOOKUP, 41, ROOT_INODE, b"a\0"))
        await trio.sleep(0.05)
        assert replies(r) == []
        await session._handle(w, request(p.Opcode.INTERRUPT, 42, 0, struct.pack("<Q", 41)))
    assert [(u, e) for u, e, _ in replies(r)] == [(41, -errno.EINTR)]


async def test_an_interrupt_right_behind_its_request_is_never_lost(
    pipe: tuple[int, int],
) -> None:
    """As the reader thread hands them over: each LOOKUP and its INTERRUPT reach ``_arrived``
    back to back, before the LOOKUP's task has run at all. Every one is cancelled (EINTR),
    none waits out the 30 s listing. (Before the fix about half were not interrupted.)"""
    r, w = pipe
    backend = MemoryBackend(latency_s=30.0)
    backend.put("p/a.bin", b"x")
    session = make_session(backend)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for n in range(20):
                unique = 100 + 2 * n
                session._arrived(nursery, w, request(p.Opcode.LOOKUP, unique, ROOT_INODE, b"a\0"))
                body = struct.pack("<Q", unique)
                session._arrived(nursery, w, request(p.Opcode.INTERRUPT, unique + 1, 0, body))
    assert sorted((u, e) for u, e, _ in replies(r)) == [
        (100 + 2 * n, -errno.EINTR) for n in range(20)
    ]
    assert session._inflight == {}


def test_the_transport_comes_from_the_option_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from objfs.errors import UsageError
    from objfs.options import fuse_transport

    monkeypatch.delenv("OBJFS_FUSE_TRANSPORT", raising=False)
    assert fuse_transport(None) == MountConfig.fuse_transport
    monkeypatch.setenv("OBJFS_FUSE_TRANSPORT", "pyfuse3")
    assert fuse_transport(None) == "pyfuse3"
    assert fuse_transport("kernel") == "kernel"  # the option wins
    monkeypatch.setenv("OBJFS_FUSE_TRANSPORT", "libfuse")
    with pytest.raises(UsageError, match="OBJFS_FUSE_TRANSPORT: 'libfuse' is not a FUSE"):
        fuse_transport(None)


# -- the open inodes' modes (objfs.kernel.passthrough.OpenInodes), without a kernel ---------------


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_an_inode_open_by_passthrough_stays_so_until_its_last_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One backing id per inode, registered once from the descriptor it was handed (which
    is always closed), closed after the last release; an open that finds no version file (it
    left the disk cache) still gets the inode's backing id, since the kernel refuses a cached
    open of a passthrough inode and an inode is one version."""
    from objfs.kernel import passthrough

    registered: list[int] = []
    closed: list[int] = []

    def register(self: object, dev_fd: int, backing_fd: int) -> int:
        assert _is_open(backing_fd)
        registered.append(backing_fd)
        return 40 + len(registered)

    monkeypatch.setattr(passthrough.Registrar, "open", register)

    def ioctl(fd: int, request: int, arg: bytearray) -> int:
        assert request == p.DEV_IOC_BACKING_CLOSE
        closed.append(struct.unpack("<i", bytes(arg))[0])
        return 0

    monkeypatch.setattr(passthrough.fcntl, "ioctl", ioctl)
    inodes = passthrough.OpenInodes()
    a, b, c, d = os.pipe() + os.pipe()
    assert inodes.opened(9, 5, a) == 41
    assert inodes.by_passthrough(5)
    assert inodes.opened(9, 5, None) == 41  # the version's file is gone: the same backing
    assert inodes.opened(9, 5, b) == 41
    assert registered == [a]
    assert not _is_open(a)
    assert not _is_open(b)
    for _ in range(2):
        inodes.released(9, 5)
        assert closed == []
    inodes.released(9, 5)
    assert closed == [41]
    assert not inodes.by_passthrough(5)
    # A cached inode stays cached while open, whatever file appears meanwhile.
    assert inodes.opened(9, 6, None) is None
    assert inodes.cached(6)
    assert inodes.opened(9, 6, c) is None
    assert not _is_open(c)
    assert registered == [a]

    # A registration refused for want of memory serves that open cached, and the next
    # file is tried again.
    def short_of_memory(self: object, dev_fd: int, backing_fd: int) -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(passthrough.Registrar, "open", short_of_memory)
    assert inodes.opened(9, 7, d) is None
    assert inodes.cached(7)
    assert inodes.refused is None
    assert not _is_open(d)


async def test_an_open_whose_backing_file_is_refused_reads_through_objfs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk tier holds the version whole, but the kernel refuses its backing file (no
    memory for it): the open is answered cached, and its handle then counts as one that
    reads through objfs (the budget's growth, the prefetch on open), as a cached open would
    from the start."""
    from objfs.kernel import passthrough

    def short_of_memory(self: object, dev_fd: int, backing_fd: int) -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(passthrough.Registrar, "open", short_of_memory)
    backend = MemoryBackend()
    backend.put("p/m.safetensors", os.urandom(8 * MiB))
    session = make_session(backend)
    session.passthrough = True
    files: list[int] = []

    async def whole_on_disk(inode: int) -> int:
        r, w = os.pipe()
        os.close(w)
        files.append(r)
        return r

    monkeypatch.setattr(session.fs, "whole_on_disk", whole_on_disk)
    async with trio.open_nursery() as nursery:
        session.fs.start(nursery)
        node = await session.fs.lookup(ROOT_INODE, b"m.safetensors")
        reply = await session._open(node.inode, os.O_RDONLY)
        fh, flags, backing_id = struct.unpack("<QII", reply)
        assert (flags, backing_id) == (p.FOPEN_KEEP_CACHE, 0)
        assert len(files) == 1
        assert not _is_open(files[0])  # the descriptor handed over is closed
        assert session.fs._handles[fh].fetches
        await settle()
        assert backend.requests["get_bytes"] == 8 * MiB  # the prefetch on open
        session.fs.release(fh)
        nursery.cancel_scope.cancel()


def test_a_refusal_for_every_file_turns_passthrough_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache directory on overlayfs (the kernel's ELOOP) refuses every file alike: the
    first refusal turns passthrough off for the mount with one warning, and no later open
    asks the kernel again (before: a warning per file, every open refused)."""
    from objfs.kernel import passthrough

    tries: list[int] = []

    def too_deep(self: object, dev_fd: int, backing_fd: int) -> int:
        tries.append(backing_fd)
        raise OSError(errno.ELOOP, "Too many levels of symbolic links")

    monkeypatch.setattr(passthrough.Registrar, "open", too_deep)
    inodes = passthrough.OpenInodes()
    fds = [fd for _ in range(2) for fd in os.pipe()]
    with caplog.at_level("INFO", logger="objfs.kernel.session"):
        for inode, fd in enumerate(fds, start=10):
            assert inodes.opened(9, inode, fd) is None
            assert inodes.cached(inode)
            assert not _is_open(fd)
    assert len(tries) == 1
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "passthrough off for this mount" in warnings[0].getMessage()
    assert "put --cache-dir on a volume" in warnings[0].getMessage()
    assert inodes.refused is not None


def test_max_stack_depth_is_raised_for_a_cache_directory_on_overlayfs(tmp_path: Path) -> None:
    """A cache directory on overlayfs (a container's root): INIT asks for max_stack_depth 2,
    so that the kernel takes its files as backing files (with 1 it refuses them, ELOOP)."""
    from objfs.kernel.negotiation import negotiate
    from objfs.kernel.passthrough import backing_stack_depth
    from objfs.kernel.requests import Init

    dirs = {name: tmp_path / name for name in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir()
    options = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    made = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(dirs["merged"])],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount overlayfs here: {made.stderr.strip()}")
    try:
        assert backing_stack_depth(str(dirs["merged"])) == 1
    finally:
        subprocess.run(["umount", str(dirs["merged"])], check=True)
    init = Init(7, 45, 131072, p.PASSTHROUGH | p.INIT_EXT)
    for depth, expected in ((0, 1), (1, 2)):
        raw, _ = negotiate(
            init, pages_limit=256, max_background=64, passthrough=True, backing_depth=depth
        )
        assert struct.unpack_from("<I", raw, 36)[0] == expected
