"""objfs.kernel.protocol: the FUSE kernel protocol's bytes, without a kernel.

Requests are "recorded" by hand: each is spelled out field by field from the layouts in the
kernel's ``include/uapi/linux/fuse.h`` (7.45), independently of the module's format strings,
and replies are read back at the header's offsets.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from objfs.kernel import protocol as p
from objfs.kernel import replies as rp
from objfs.kernel import requests as rq


def u16(v: int) -> bytes:
    return struct.pack("<H", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def request(
    opcode: int,
    body: bytes = b"",
    *,
    unique: int = 0x1234,
    nodeid: int = 7,
    uid: int = 1000,
    gid: int = 100,
    pid: int = 4242,
    extlen: int = 0,
    length: int | None = None,
) -> bytes:
    """struct fuse_in_header (40 bytes) followed by ``body``."""
    header = (
        u32(40 + len(body) if length is None else length)  # len
        + u32(opcode)  # opcode
        + u64(unique)  # unique
        + u64(nodeid)  # nodeid
        + u32(uid)  # uid
        + u32(gid)  # gid
        + u32(pid)  # pid
        + u16(extlen)  # total_extlen
        + u16(0)  # padding
    )
    assert len(header) == 40
    return header + body


def read_in(fh: int, offset: int, size: int, read_flags: int, lock_owner: int, flags: int) -> bytes:
    body = u64(fh) + u64(offset) + u32(size) + u32(read_flags) + u64(lock_owner)
    return body + u32(flags) + u32(0)


def init_in_64(major: int, minor: int, readahead: int, flags: int, flags2: int) -> bytes:
    body = u32(major) + u32(minor) + u32(readahead) + u32(flags) + u32(flags2) + bytes(44)
    assert len(body) == 64
    return body


# -- constants against the header ---------------------------------------------------------------

OPCODES = {
    "LOOKUP": 1, "FORGET": 2, "GETATTR": 3, "SETATTR": 4, "READLINK": 5, "SYMLINK": 6,
    "MKNOD": 8, "MKDIR": 9, "UNLINK": 10, "RMDIR": 11, "RENAME": 12, "LINK": 13, "OPEN": 14,
    "READ": 15, "WRITE": 16, "STATFS": 17, "RELEASE": 18, "FSYNC": 20, "SETXATTR": 21,
    "GETXATTR": 22, "LISTXATTR": 23, "REMOVEXATTR": 24, "FLUSH": 25, "INIT": 26,
    "OPENDIR": 27, "READDIR": 28, "RELEASEDIR": 29, "FSYNCDIR": 30, "GETLK": 31, "SETLK": 32,
    "SETLKW": 33, "ACCESS": 34, "CREATE": 35, "INTERRUPT": 36, "BMAP": 37, "DESTROY": 38,
    "IOCTL": 39, "POLL": 40, "NOTIFY_REPLY": 41, "BATCH_FORGET": 42, "FALLOCATE": 43,
    "READDIRPLUS": 44, "RENAME2": 45, "LSEEK": 46, "COPY_FILE_RANGE": 47, "SETUPMAPPING": 48,
    "REMOVEMAPPING": 49, "SYNCFS": 50, "TMPFILE": 51, "STATX": 52, "COPY_FILE_RANGE_64": 53,
    "CUSE_INIT": 4096,
}  # fmt: skip

INIT_FLAG_BITS = {
    "ASYNC_READ": 0, "POSIX_LOCKS": 1, "FILE_OPS": 2, "ATOMIC_O_TRUNC": 3, "EXPORT_SUPPORT": 4,
    "BIG_WRITES": 5, "DONT_MASK": 6, "SPLICE_WRITE": 7, "SPLICE_MOVE": 8, "SPLICE_READ": 9,
    "FLOCK_LOCKS": 10, "HAS_IOCTL_DIR": 11, "AUTO_INVAL_DATA": 12, "DO_READDIRPLUS": 13,
    "READDIRPLUS_AUTO": 14, "ASYNC_DIO": 15, "WRITEBACK_CACHE": 16, "NO_OPEN_SUPPORT": 17,
    "PARALLEL_DIROPS": 18, "HANDLE_KILLPRIV": 19, "POSIX_ACL": 20, "ABORT_ERROR": 21,
    "MAX_PAGES": 22, "CACHE_SYMLINKS": 23, "NO_OPENDIR_SUPPORT": 24, "EXPLICIT_INVAL_DATA": 25,
    "MAP_ALIGNMENT": 26, "SUBMOUNTS": 27, "HANDLE_KILLPRIV_V2": 28, "SETXATTR_EXT": 29,
    "INIT_EXT": 30, "INIT_RESERVED": 31, "SECURITY_CTX": 32, "HAS_INODE_DAX": 33,
    "CREATE_SUPP_GROUP": 34, "HAS_EXPIRE_ONLY": 35, "DIRECT_IO_ALLOW_MMAP": 36,
    "PASSTHROUGH": 37, "NO_EXPORT_SUPPORT": 38, "HAS_RESEND": 39, "ALLOW_IDMAP": 40,
    "OVER_IO_URING": 41, "REQUEST_TIMEOUT": 42,
}  # fmt: skip

FOPEN_BITS = {
    "FOPEN_DIRECT_IO": 0, "FOPEN_KEEP_CACHE": 1, "FOPEN_NONSEEKABLE": 2, "FOPEN_CACHE_DIR": 3,
    "FOPEN_STREAM": 4, "FOPEN_NOFLUSH": 5, "FOPEN_PARALLEL_DIRECT_WRITES": 6,
    "FOPEN_PASSTHROUGH": 7,
}  # fmt: skip


def test_opcodes_are_the_headers() -> None:
    assert {op.name: op.value for op in p.Opcode} == OPCODES


def test_init_and_open_flags_are_the_headers() -> None:
    for name, bit in {**INIT_FLAG_BITS, **FOPEN_BITS}.items():
        assert getattr(p, name) == 1 << bit, name
    assert len({getattr(p, name) for name in INIT_FLAG_BITS}) == len(INIT_FLAG_BITS)


def test_versions_sizes_and_ioctl_numbers() -> None:
    assert p.KERNEL_VERSION == 7
    assert p.KERNEL_MINOR_VERSION == 45
    assert p.MIN_READ_BUFFER == 8192
    assert (p.IN_HEADER_SIZE, p.OUT_HEADER_SIZE) == (40, 16)
    # _IOR(229, 0, uint32_t), _IOW(229, 1, struct fuse_backing_map), _IOW(229, 2, uint32_t)
    assert p.DEV_IOC_CLONE == 0x8004E500
    assert p.DEV_IOC_BACKING_OPEN == 0x4010E501
    assert p.DEV_IOC_BACKING_CLOSE == 0x4004E502


# -- requests objfs answers ---------------------------------------------------------------------


def test_header() -> None:
    raw = request(15, read_in(1, 2, 3, 4, 5, 6), unique=(1 << 63) | 99, nodeid=1 << 40)
    h = rq.parse_header(raw)
    assert h == rq.InHeader(
        length=80,
        opcode=15,
        unique=(1 << 63) | 99,
        nodeid=1 << 40,
        uid=1000,
        gid=100,
        pid=4242,
        total_extlen=0,
    )
    assert rq.parse(raw).header == h
    assert rq.parse(bytearray(raw)).header == h
    assert rq.parse(memoryview(raw)).header == h
    # A view into a larger read buffer, as the session reads into one.
    big = bytearray(raw + bytes(100))
    assert rq.parse(memoryview(big)[:80]).header == h


RECORDED: list[tuple[str, bytes, rq.Args]] = [
    ("lookup", request(1, b"config.json\0"), rq.Lookup(b"config.json")),
    ("lookup-utf8", request(1, "é\n".encode() + b"\0"), rq.Lookup("é\n".encode())),
    ("forget", request(2, u64(3)), rq.Forget(3)),
    (
        "batch-forget",
        request(42, u32(2) + u32(0) + u64(10) + u64(1) + u64(11) + u64(1 << 40)),
        rq.BatchForget(((10, 1), (11, 1 << 40))),
    ),
    ("batch-forget-none", request(42, u32(0) + u32(0)), rq.BatchForget(())),
    ("getattr", request(3, u32(1) + u32(0) + u64(77)), rq.GetAttr(flags=1, fh=77)),
    ("open", request(14, u32(0o100000) + u32(1)), rq.Open(flags=0o100000, open_flags=1)),
    ("opendir", request(27, u32(0o200000) + u32(0)), rq.Open(flags=0o200000, open_flags=0)),
    (
        "read",
        request(15, read_in(5, 1 << 33, 131072, 2, 0xDEAD, 0o100000)),
        rq.Read(fh=5, offset=1 << 33, size=131072, read_flags=2, flags=0o100000),
    ),
    ("readdir", request(28, read_in(6, 3, 4096, 0, 0, 0)), rq.Read(6, 3, 4096, 0, 0)),
    ("readdirplus", request(44, read_in(6, 0, 8192, 0, 0, 0)), rq.Read(6, 0, 8192, 0, 0)),
    (
        "release",
        request(18, u64(9) + u32(0o100000) + u32(1) + u64(0xBEEF)),
        rq.Release(fh=9, flags=0o100000, release_flags=1),
    ),
    ("releasedir", request(29, u64(8) + u32(0) + u32(0) + u64(0)), rq.Release(8, 0, 0)),
    ("flush", request(25, u64(9) + u32(0) + u32(0) + u64(0xBEEF)), rq.Flush(9)),
    ("fsync", request(20, u64(9) + u32(1) + u32(0)), rq.Fsync(fh=9, fsync_flags=1)),
    ("fsyncdir", request(30, u64(8) + u32(0) + u32(0)), rq.Fsync(8, 0)),
    ("interrupt", request(36, u64(0x1232), nodeid=0), rq.Interrupt(0x1232)),
    (
        "getxattr",
        request(22, u32(256) + u32(0) + b"user.objfs.etag\0"),
        rq.GetXattr(size=256, name=b"user.objfs.etag"),
    ),
    ("listxattr", request(23, u32(0) + u32(0)), rq.ListXattr(0)),
    ("access", request(34, u32(4) + u32(0)), rq.Access(4)),
    ("lseek", request(46, u64(5) + u64(4096) + u32(3) + u32(0)), rq.Lseek(5, 4096, 3)),
    ("statfs", request(17), rq.Empty()),
    ("destroy", request(38, nodeid=0), rq.Empty()),
    ("readlink", request(5), rq.Empty()),
    ("mkdir", request(9, u32(0o755) + u32(0o22) + b"new\0"), rq.Empty()),
    ("write", request(16, bytes(40) + b"data"), rq.Empty()),
    ("statx", request(52, bytes(24)), rq.Empty()),
    ("unknown", request(9999, b"whatever"), rq.Empty()),
    ("unknown-empty", request(0), rq.Empty()),
]


@pytest.mark.parametrize(
    ("raw", "args"), [(raw, args) for _, raw, args in RECORDED], ids=[n for n, _, _ in RECORDED]
)
def test_recorded_requests_parse(raw: bytes, args: rq.Args) -> None:
    req = rq.parse(raw)
    assert req.args == args
    assert type(req.args) is type(args)
    assert req.header.length == len(raw)


def test_init_in_the_64_byte_form() -> None:
    flags = (1 << 0) | (1 << 13) | (1 << 30)  # ASYNC_READ | DO_READDIRPLUS | INIT_EXT
    flags2 = (1 << (37 - 32)) | (1 << (41 - 32))  # PASSTHROUGH | OVER_IO_URING
    req = rq.parse(request(26, init_in_64(7, 45, 131072, flags, flags2), nodeid=0))
    assert req.header.opcode == p.Opcode.INIT
    assert req.args == rq.Init(major=7, minor=45, max_readahead=131072, flags=flags | flags2 << 32)
    assert isinstance(req.args, rq.Init)
    assert req.args.flags & p.PASSTHROUGH
    assert req.args.flags & p.OVER_IO_URING
    assert req.args.flags & p.DO_READDIRPLUS


def test_init_flags2_counts_only_with_init_ext() -> None:
    req = rq.parse(request(26, init_in_64(7, 45, 4096, 1, 0xFFFF_FFFF)))
    assert req.args == rq.Init(7, 45, 4096, 1)


def test_init_in_the_old_16_byte_form() -> None:
    body = u32(7) + u32(31) + u32(65536) + u32(0xFFFF_FFFF)
    req = rq.parse(request(26, body, nodeid=0))
    assert req.args == rq.Init(major=7, minor=31, max_readahead=65536, flags=0xFFFF_FFFF)


def test_extensions_after_the_arguments_are_skipped() -> None:
    ext = u32(16) + u32(32) + u32(1) + u32(1000)  # fuse_ext_header + fuse_supp_groups
    req = rq.parse(request(1, b"x\0" + bytes(6) + ext, extlen=2))
    assert req.args == rq.Lookup(b"x")
    assert req.header.total_extlen == 2
    # The name must end before the extensions do.
    with pytest.raises(rq.ProtocolError):
        rq.parse(request(1, b"xyzabcde" + b"\0" + bytes(7), extlen=1))


# -- malformed requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x28",
        request(17)[:39],
        request(1, b"name\0", length=44),  # header says less than was read
        request(1, b"name\0", length=46),  # header says more
        request(1, b"name\0", length=0),
        request(1, b"name\0", length=0xFFFF_FFFF),
        request(1, b"name"),  # no NUL
        request(1),  # no name at all
        request(1, b"\0"),  # an empty name
        request(22, u32(10) + u32(0) + b"user.x"),  # xattr name without NUL
        request(22, u32(10) + u32(0)),  # and with no name
        request(42, u32(3) + u32(0) + u64(10) + u64(1) + u64(11) + u64(1)),  # count 3, 2 items
        request(42, u32(1) + u32(0) + u64(10)),  # half an item
        request(42, u32(0xFFFF_FFFF) + u32(0)),
        request(42, u32(0)),
        request(26, u32(7) + u32(45) + u32(0)),  # INIT shorter than even the old form
        request(17, extlen=1),  # extensions longer than the request
        request(1, b"a\0" + bytes(6), extlen=2),
    ],
    ids=lambda raw: raw[:48].hex(),
)
def test_malformed_requests_raise_protocol_error(raw: bytes) -> None:
    with pytest.raises(rq.ProtocolError) as info:
        rq.parse(raw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "raw"),
    [(n, raw) for n, raw, args in RECORDED if not isinstance(args, (rq.Empty, rq.BatchForget))],
    ids=[n for n, _, args in RECORDED if not isinstance(args, (rq.Empty, rq.BatchForget))],
)
def test_every_truncated_argument_raises_protocol_error(name: str, raw: bytes) -> None:
    for cut in range(1, len(raw) - 40 + 1):
        short = bytearray(raw[:-cut])
        short[0:4] = u32(len(short))
        with pytest.raises(rq.ProtocolError):
            rq.parse(bytes(short))


def test_short_buffer_header() -> None:
    with pytest.raises(rq.ProtocolError):
        rq.parse_header(request(17)[:-1])
    with pytest.raises(rq.ProtocolError):
        rq.parse_header(request(17) + b"\0")


# -- any bytes: only ProtocolError --------------------------------------------------------------

KNOWN_OPCODES = st.sampled_from(sorted(OPCODES.values()))
ANY_OPCODE = st.one_of(KNOWN_OPCODES, st.integers(0, 0xFFFF_FFFF))


def _parse_or_protocol_error(raw: bytes | bytearray | memoryview) -> None:
    message = None
    try:
        req = rq.parse(raw)
    except rq.ProtocolError as exc:
        message = str(exc)
    if message is None:
        assert req.header.length == len(raw)
    else:
        assert message
        assert "\n" not in message


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_protocol_error(raw: bytes) -> None:
    _parse_or_protocol_error(raw)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    opcode=ANY_OPCODE,
    body=st.binary(max_size=200),
    extlen=st.one_of(st.just(0), st.integers(0, 0xFFFF)),
    unique=st.integers(0, 2**64 - 1),
    view=st.booleans(),
)
def test_valid_headers_with_random_bodies_raise_only_protocol_error(
    opcode: int, body: bytes, extlen: int, unique: int, view: bool
) -> None:
    raw = request(opcode, body, extlen=extlen, unique=unique)
    _parse_or_protocol_error(memoryview(raw) if view else raw)


@settings(max_examples=200, deadline=None)
@given(
    opcode=st.sampled_from([15, 28, 44]),
    fh=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    size=st.integers(0, 2**32 - 1),
    read_flags=st.integers(0, 2**32 - 1),
    flags=st.integers(0, 2**32 - 1),
    extra=st.binary(max_size=16),
)
def test_read_round_trips(
    opcode: int, fh: int, offset: int, size: int, read_flags: int, flags: int, extra: bytes
) -> None:
    raw = request(opcode, read_in(fh, offset, size, read_flags, 0, flags) + extra)
    assert rq.parse(raw).args == rq.Read(fh, offset, size, read_flags, flags)


# -- replies ------------------------------------------------------------------------------------

ATTR = rp.Attr(
    ino=42,
    size=9 * 2**20 + 123,
    blocks=(9 * 2**20 + 123 + 511) // 512,
    mtime_ns=1_700_000_000_123_456_789,
    mode=0o100644,
    nlink=1,
    uid=1000,
    gid=100,
    blksize=131072,
)


def decode_attr(raw: bytes) -> dict[str, int]:
    """struct fuse_attr read at the header's offsets."""
    assert len(raw) == 88
    q = lambda off: struct.unpack_from("<Q", raw, off)[0]  # noqa: E731
    s = lambda off: struct.unpack_from("<q", raw, off)[0]  # noqa: E731
    i = lambda off: struct.unpack_from("<I", raw, off)[0]  # noqa: E731
    return {
        "ino": q(0), "size": q(8), "blocks": q(16), "atime": s(24), "mtime": s(32),
        "ctime": s(40), "atimensec": i(48), "mtimensec": i(52), "ctimensec": i(56),
        "mode": i(60), "nlink": i(64), "uid": i(68), "gid": i(72), "rdev": i(76),
        "blksize": i(80), "flags": i(84),
    }  # fmt: skip


def test_attr_bytes() -> None:
    assert decode_attr(rp.attr_bytes(ATTR)) == {
        "ino": 42, "size": 9 * 2**20 + 123, "blocks": ATTR.blocks,
        "atime": 1_700_000_000, "mtime": 1_700_000_000, "ctime": 1_700_000_000,
        "atimensec": 123_456_789, "mtimensec": 123_456_789, "ctimensec": 123_456_789,
        "mode": 0o100644, "nlink": 1, "uid": 1000, "gid": 100, "rdev": 0,
        "blksize": 131072, "flags": 0,
    }  # fmt: skip


def test_attr_before_the_epoch() -> None:
    a = decode_attr(rp.attr_bytes(rp.Attr(1, 0, 0, -1_500_000_000, 0o40755, 2, 0, 0, 4096)))
    assert (a["mtime"], a["mtimensec"]) == (-2, 500_000_000)


def test_entry_out() -> None:
    raw = rp.entry_out(42, ATTR, 1.5, 0.25, generation=3)
    assert len(raw) == 128
    nodeid, gen, ev, av, evn, avn = struct.unpack_from("<QQQQII", raw)
    assert (nodeid, gen, ev, evn, av, avn) == (42, 3, 1, 500_000_000, 0, 250_000_000)
    assert raw[40:] == rp.attr_bytes(ATTR)


def test_entry_out_negative_entry() -> None:
    raw = rp.entry_out(0, None, 30.0, 30.0)
    assert len(raw) == 128
    assert struct.unpack_from("<QQQQII", raw) == (0, 0, 30, 30, 0, 0)
    assert raw[40:] == bytes(88)
    with pytest.raises(ValueError, match="without"):
        rp.entry_out(5, None, 1.0, 1.0)


@pytest.mark.parametrize(
    ("valid_s", "sec", "nsec"),
    [
        (0.0, 0, 0),
        (-3.0, 0, 0),
        (float("nan"), 0, 0),
        (1.0, 1, 0),
        (0.000000001, 0, 1),
        (2.9999999999, 3, 0),  # rounds up into the next second
        (86400.5, 86400, 500_000_000),
        (float("inf"), 2**64 - 1, 999_999_999),
    ],
)
def test_timeouts_split_into_seconds_and_nanoseconds(valid_s: float, sec: int, nsec: int) -> None:
    raw = rp.attr_out(ATTR, valid_s)
    assert len(raw) == 104
    assert struct.unpack_from("<QII", raw) == (sec, nsec, 0)
    assert raw[16:] == rp.attr_bytes(ATTR)


def test_open_out() -> None:
    raw = rp.open_out(77, p.FOPEN_KEEP_CACHE)
    assert raw == u64(77) + u32(2) + u32(0)
    raw = rp.open_out(78, p.FOPEN_PASSTHROUGH, backing_id=5)
    assert raw == u64(78) + u32(0x80) + struct.pack("<i", 5)
    assert len(rp.open_out(1, 0, -1)) == 16


def test_init_out_round_trips_flags_into_flags_and_flags2() -> None:
    flags = p.ASYNC_READ | p.DO_READDIRPLUS | p.MAX_PAGES | p.INIT_EXT
    flags |= p.PASSTHROUGH | p.OVER_IO_URING | p.REQUEST_TIMEOUT
    raw = rp.init_out(
        minor=44,
        max_readahead=131072,
        flags=flags,
        max_background=64,
        congestion_threshold=48,
        max_write=1 << 20,
        max_pages=256,
        max_stack_depth=1,
    )
    assert len(raw) == 64
    fields = {
        "major": struct.unpack_from("<I", raw, 0)[0],
        "minor": struct.unpack_from("<I", raw, 4)[0],
        "max_readahead": struct.unpack_from("<I", raw, 8)[0],
        "flags": struct.unpack_from("<I", raw, 12)[0],
        "max_background": struct.unpack_from("<H", raw, 16)[0],
        "congestion_threshold": struct.unpack_from("<H", raw, 18)[0],
        "max_write": struct.unpack_from("<I", raw, 20)[0],
        "time_gran": struct.unpack_from("<I", raw, 24)[0],
        "max_pages": struct.unpack_from("<H", raw, 28)[0],
        "map_alignment": struct.unpack_from("<H", raw, 30)[0],
        "flags2": struct.unpack_from("<I", raw, 32)[0],
        "max_stack_depth": struct.unpack_from("<I", raw, 36)[0],
        "request_timeout": struct.unpack_from("<H", raw, 40)[0],
    }
    assert fields == {
        "major": 7,
        "minor": 44,
        "max_readahead": 131072,
        "flags": (1 << 0) | (1 << 13) | (1 << 22) | (1 << 30),
        "max_background": 64,
        "congestion_threshold": 48,
        "max_write": 1 << 20,
        "time_gran": 1,
        "max_pages": 256,
        "map_alignment": 0,
        "flags2": (1 << 5) | (1 << 9) | (1 << 10),
        "max_stack_depth": 1,
        "request_timeout": 0,
    }
    assert fields["flags"] | fields["flags2"] << 32 == flags
    assert raw[42:] == bytes(22)


def test_statfs_out() -> None:
    raw = rp.statfs_out(
        blocks=1, bfree=2, bavail=3, files=4, ffree=5, bsize=4096, namelen=255, frsize=4096
    )
    assert len(raw) == 80
    assert raw == (
        u64(1) + u64(2) + u64(3) + u64(4) + u64(5) + u32(4096) + u32(255) + u32(4096) + u32(0)
    ) + bytes(24)


def test_small_replies() -> None:
    assert rp.lseek_out(1 << 40) == u64(1 << 40)
    assert rp.getxattr_size_out(33) == u32(33) + u32(0)
    assert p.backing_map(9) == struct.pack("<i", 9) + u32(0) + u64(0)


def test_reply_headers() -> None:
    assert rp.reply_error(0x55, 2) == u32(16) + struct.pack("<i", -2) + u64(0x55)
    assert rp.reply_error(1, 30) == u32(16) + struct.pack("<i", -30) + u64(1)
    for bad in (0, -2, 512):
        with pytest.raises(ValueError, match="errno"):
            rp.reply_error(1, bad)
    assert rp.reply(7) == u32(16) + u32(0) + u64(7)
    assert rp.reply(7, b"abc") == u32(19) + u32(0) + u64(7) + b"abc"
    assert rp.reply(7, memoryview(bytearray(b"xyz"))) == u32(19) + u32(0) + u64(7) + b"xyz"
    assert rp.out_header(2**64 - 1, 1 << 20) == u32(16 + (1 << 20)) + u32(0) + u64(2**64 - 1)


# -- directory entries --------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 20))
def test_dirent_alignment(n: int) -> None:
    name = b"n" * n
    buf = bytearray(b"prefix!!")
    rp.pack_dirent(buf, 42, 7, 8, name)
    size = len(buf) - 8
    assert size == rp.dirent_size(name)
    assert size % 8 == 0
    assert 24 + n <= size < 24 + n + 8
    ino, off, namelen, dtype = struct.unpack_from("<QQII", buf, 8)
    assert (ino, off, namelen, dtype) == (42, 7, n, 8)
    assert buf[32 : 32 + n] == name
    assert buf[32 + n :] == bytes(size - 24 - n)


@pytest.mark.parametrize("n", range(1, 20))
def test_direntplus_alignment(n: int) -> None:
    name = bytes(range(65, 65 + n))
    entry = rp.entry_out(42, ATTR, 1.0, 1.0)
    buf = bytearray()
    rp.pack_direntplus(buf, entry, 42, 1, 4, name)
    rp.pack_direntplus(buf, entry, 43, 2, 4, name)
    one = rp.dirent_size_plus(name)
    assert one % 8 == 0
    assert 128 + 24 + n <= one < 128 + 24 + n + 8
    assert len(buf) == 2 * one
    assert buf[:128] == entry
    assert struct.unpack_from("<QQII", buf, 128) == (42, 1, n, 4)
    assert buf[152 : 152 + n] == name
    assert buf[one : one + 128] == entry
    assert struct.unpack_from("<QQII", buf, one + 128) == (43, 2, n, 4)


@pytest.mark.parametrize("name", [b"", b"a/b", b"a\0b"])
def test_dirent_names_the_kernel_refuses(name: bytes) -> None:
    with pytest.raises(ValueError, match="name"):
        rp.pack_dirent(bytearray(), 1, 1, 8, name)
    with pytest.raises(ValueError, match="name"):
        rp.pack_direntplus(bytearray(), bytes(128), 1, 1, 8, name)


def test_direntplus_needs_a_whole_entry() -> None:
    with pytest.raises(ValueError, match="128"):
        rp.pack_direntplus(bytearray(), bytes(120), 1, 1, 8, b"x")


def test_every_builder_has_the_headers_size() -> None:
    sizes = {
        "fuse_out_header": (len(rp.out_header(1, 0)), 16),
        "fuse_attr": (len(rp.attr_bytes(ATTR)), 88),
        "fuse_entry_out": (len(rp.entry_out(1, ATTR, 1, 1)), 128),
        "fuse_attr_out": (len(rp.attr_out(ATTR, 1)), 104),
        "fuse_open_out": (len(rp.open_out(1, 0)), 16),
        "fuse_init_out": (
            len(
                rp.init_out(
                    minor=45,
                    max_readahead=0,
                    flags=0,
                    max_background=0,
                    congestion_threshold=0,
                    max_write=4096,
                )
            ),
            64,
        ),
        "fuse_statfs_out": (
            len(
                rp.statfs_out(
                    blocks=0, bfree=0, bavail=0, files=0, ffree=0, bsize=0, namelen=0, frsize=0
                )
            ),
            80,
        ),
        "fuse_lseek_out": (len(rp.lseek_out(0)), 8),
        "fuse_getxattr_out": (len(rp.getxattr_size_out(0)), 8),
        "fuse_backing_map": (len(p.backing_map(0)), 16),
        "fuse_dirent (name 'a')": (rp.dirent_size(b"a"), 32),
        "fuse_direntplus (name 'a')": (rp.dirent_size_plus(b"a"), 160),
    }
    assert {k: got for k, (got, _) in sizes.items()} == {k: want for k, (_, want) in sizes.items()}
