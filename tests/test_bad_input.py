"""Bad input: hostile or odd bucket contents through real FUSE mounts, and malformed CLI values.

The keys come from a memory backend served by a child (``tests/helpers/serve_keys.py``), and
the ones moto stores (all but one) from a real S3 bucket too.
Whatever the keys, nothing outside the mountpoint is reachable, names POSIX cannot hold are
skipped with one warning each, their legal siblings read right, and the daemon stays up.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, put_many, run_mount, run_objfs, sha256
from tests.helpers.serve_keys import generated_bytes
from tests.test_cli_errors import assert_one_line_error

HELPER = Path(__file__).parent / "helpers" / "serve_keys.py"
PATH_MAX = 4096  # bytes, the Linux limit for a path handed to a system call (NUL included)


@contextlib.contextmanager
def serve_keys(tmp_path: Path, spec: dict[str, Any], name: str = "keys") -> Iterator[Mount]:
    """Mount a memory bucket built from ``spec`` (see serve_keys.py) in a child; unmount after,
    asserting the child is still alive then and exits 0."""
    mountpoint = tmp_path / f"mnt-{name}"
    mountpoint.mkdir()
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(HELPER), str(mountpoint), str(spec_path)]
    with run_mount(cmd, mountpoint, tmp_path / f"{name}.log") as m:
        yield m


def content(key: str) -> bytes:
    """Distinct bytes for every key."""
    return f"bytes of {key!r}\n".encode() * 3


def hexed(keys: list[str]) -> dict[str, str]:
    return {k: content(k).hex() for k in keys}


def walk_checked(root: Path) -> tuple[dict[str, str], set[str], list[OSError]]:
    """``os.walk`` the mount; assert every path it yields is a plain path inside it, on the
    mount's own device; return (file -> sha256 of its bytes, dirs, errors met)."""
    errors: list[OSError] = []
    files: dict[str, str] = {}
    dirs: set[str] = set()
    top = str(root)
    device = os.stat(top).st_dev
    for dirpath, dirnames, filenames in os.walk(top, onerror=errors.append):
        for name in dirnames + filenames:
            encoded = os.fsencode(name)
            assert name not in ("", ".", ".."), (dirpath, name)
            assert b"/" not in encoded, (dirpath, name)
            assert b"\0" not in encoded, (dirpath, name)
            assert len(encoded) <= 255, (dirpath, name)
            path = os.path.join(dirpath, name)
            # Nothing can lead out of the mount: no "." or ".." or empty segment anywhere.
            assert os.path.normpath(path) == path, path
            assert os.path.commonpath([top, path]) == top, path
            if len(os.fsencode(path)) < PATH_MAX:
                st = os.lstat(path)
                assert st.st_dev == device, path
            rel = os.path.relpath(path, top)
            if name in dirnames:
                dirs.add(rel)
            elif len(os.fsencode(path)) < PATH_MAX:
                with open(path, "rb") as f:
                    files[rel] = sha256(f.read())
            else:
                files[rel] = ""
    return files, dirs, errors


def stat_errno(path: Path) -> int:
    """The errno of ``lstat(path)``, 0 if it succeeds."""
    try:
        os.lstat(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


def warning_count(log: str, kind: str, name: str) -> int:
    """Lines of the mount's log that skip ``name`` (a key, or a prefix ending in "/")."""
    return log.count(f"skipping {kind} {name!r}:")


# -- keys that attack the namespace ------------------------------------------------------------

# Skipped keys, each with the key or prefix its one warning names.
NAMESPACE_ATTACKS: dict[str, tuple[str, str]] = {
    "../x": ("prefix", "../"),
    "a/../../b": ("prefix", "a/../"),
    "./y": ("prefix", "./"),
    "a/./c": ("prefix", "a/./"),
    "/abs": ("prefix", "/"),
    "a//b": ("prefix", "a//"),
    "dir/.": ("key", "dir/."),
    "dir/..": ("key", "dir/.."),
    "nul\x00name": ("key", "nul\x00name"),
    "sub/nul\x00dir/f": ("prefix", "sub/nul\x00dir/"),
    "x" * 4096: ("key", "x" * 4096),
    "long/" + "x" * 256: ("key", "long/" + "x" * 256),
    "long/" + "é" * 128: ("key", "long/" + "é" * 128),  # 128 characters, 256 bytes
}

# Legal siblings: every one is a file at this path, with these bytes.
LEGAL_KEYS = [
    "ok.txt",
    "a/ok.txt",
    "dir/ok.txt",
    "sub/fine.txt",
    "ctl\x01.bin",
    "tab\tname",
    "nl\nname",
    "cr\rname",
    "del\x7f",
    "esc\x1b[31mred",
    "back\\slash",
    "-rf",
    "...",
    ".hidden",
    "..x/in.txt",
    "long/" + "y" * 255,
    "long/" + "é" * 127 + "z",  # 255 bytes
]
LEGAL_DIRS = {"a", "dir", "sub", "..x", "long"}


def check_attacked_tree(m: Mount, attacks: dict[str, tuple[str, str]], legal: list[str]) -> None:
    """The mount of a bucket holding ``attacks`` and ``legal`` keys (metadata TTL 0)."""
    files, dirs, errors = walk_checked(m.path)
    assert errors == []
    assert dirs == LEGAL_DIRS
    assert files == {k: sha256(content(k)) for k in legal}
    # The skipped keys' bytes are nowhere in the mount.
    assert not {sha256(content(k)) for k in attacks} & set(files.values())
    assert sorted(os.listdir(m.path / "a")) == ["ok.txt"]
    assert sorted(os.listdir(m.path / "dir")) == ["ok.txt"]
    assert sorted(os.listdir(m.path / "sub")) == ["fine.txt"]
    # ".." inside the mount is the kernel's: from any directory it leads back up the mount's
    # own tree, to the mount's root at most.
    root = os.stat(m.path)
    for below in ("a", "dir", "sub"):
        up = os.stat(m.path / below / "..")
        assert (up.st_dev, up.st_ino) == (root.st_dev, root.st_ino), below
    # Names objfs skipped are absent (a 4 KiB path is too long to ask for), and nothing is at
    # the names a "normalized" or truncated key would have.
    assert stat_errno(m.path / ("x" * 4096)) == errno.ENAMETOOLONG
    assert stat_errno(m.path / "long" / ("x" * 256)) == errno.ENOENT
    assert stat_errno(m.path / "long" / ("é" * 128)) == errno.ENOENT
    for absent in ("x", "y", "b", "abs", "nul", "nulname", "a/b", "a/c", "sub/nul"):
        assert stat_errno(m.path / absent) == errno.ENOENT, absent
    # Listed again (TTL 0): still one warning per skipped key, and no error at all.
    assert walk_checked(m.path) == (files, dirs, [])
    log = m.log()
    for key, (kind, name) in attacks.items():
        assert warning_count(log, kind, name) == 1, key
    assert "Traceback" not in log
    assert " ERROR " not in log


def test_namespace_attacks_through_a_memory_mount(tmp_path: Path) -> None:
    spec = {"objects": hexed([*NAMESPACE_ATTACKS, *LEGAL_KEYS]), "metadata_ttl_s": 0}
    with serve_keys(tmp_path, spec) as m:
        check_attacked_tree(m, NAMESPACE_ATTACKS, LEGAL_KEYS)


def deep_key(top: str, segment: int, total: int = PATH_MAX) -> tuple[list[str], str]:
    """A key of exactly ``total`` bytes: ``top/`` then directories of ``segment`` bytes, then
    a file name that fills the rest; returns (directories, file name)."""
    dirs = [top]
    length = len(top) + 1
    while length + segment + 1 + 8 <= total:
        dirs.append(f"{len(dirs):0{segment}d}")
        length += segment + 1
    leaf = "L" * (total - length)
    assert 1 <= len(leaf) <= 255
    return dirs, leaf


def read_deep(root: Path, dirs: list[str], leaf: str) -> bytes:
    """Read ``root/dirs.../leaf`` one directory at a time (the whole path is over PATH_MAX),
    asserting each directory lists exactly the next name."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, name in enumerate(dirs):
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            listed = os.listdir(fd)
            assert (dirs[i + 1] if i + 1 < len(dirs) else leaf) in listed
            assert i == 0 or len(listed) == 1, listed
        file_fd = os.open(leaf, os.O_RDONLY, dir_fd=fd)
        try:
            with os.fdopen(file_fd, "rb") as f:
                return f.read()
        except BaseException:
            os.close(file_fd)
            raise
    finally:
        os.close(fd)


def test_4kib_keys(tmp_path: Path) -> None:
    """A 4096-byte name is skipped; 4096-byte keys of short and of 255-byte segments are served
    to the last byte, and os.walk stops where paths outgrow PATH_MAX."""
    short_dirs, short_leaf = deep_key("short", 15)
    wide_dirs, wide_leaf = deep_key("wide", 255)
    short = "/".join([*short_dirs, short_leaf])
    wide = "/".join([*wide_dirs, wide_leaf])
    assert len(short) == len(wide) == 4096
    assert len(short_dirs) > 200
    big = "n" * 4096
    spec = {"objects": hexed([big, short, wide, "sibling.txt", "short/sibling.txt"])}
    with serve_keys(tmp_path, spec) as m:
        files, dirs, errors = walk_checked(m.path)
        assert errors, "the deepest directories are beyond PATH_MAX"
        assert {e.errno for e in errors} == {errno.ENAMETOOLONG}
        assert files["sibling.txt"] == sha256(content("sibling.txt"))
        assert files["short/sibling.txt"] == sha256(content("short/sibling.txt"))
        assert sorted(os.listdir(m.path)) == ["short", "sibling.txt", "wide"]
        # Besides the siblings, the walk finds at most the deep keys (where their directory's
        # path still fits in PATH_MAX), and every directory it finds is on their chains.
        assert set(files) - {"sibling.txt", "short/sibling.txt"} <= {short, wide}
        for rel in dirs:
            assert f"{short}/".startswith(f"{rel}/") or f"{wide}/".startswith(f"{rel}/"), rel
        assert read_deep(m.path, short_dirs, short_leaf) == content(short)
        assert read_deep(m.path, wide_dirs, wide_leaf) == content(wide)
        log = m.log()
        assert warning_count(log, "key", big) == 1
        assert "Traceback" not in log


# moto stores every one of these keys (NUL and 4 KiB keys included) but one with a newline
# (its routes do not match it). Mounted at the bucket's root, where "../" and "/" would be the
# first segment.
S3_ATTACKS = NAMESPACE_ATTACKS
S3_LEGAL = [k for k in LEGAL_KEYS if "\n" not in k]


def test_namespace_attacks_through_an_s3_mount(mount_s3: Any, s3: Any, bucket: str) -> None:
    put_many(s3, bucket, {k: content(k) for k in [*S3_ATTACKS, *S3_LEGAL]})
    stored = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert stored == {*S3_ATTACKS, *S3_LEGAL}
    m: Mount = mount_s3(f"s3://{bucket}", "--metadata-ttl", "0")
    check_attacked_tree(m, S3_ATTACKS, S3_LEGAL)


# -- a big directory ------------------------------------------------------------------------


def test_100k_keys_in_one_directory(tmp_path: Path) -> None:
    count = 100_000
    spec = {"generate": [{"prefix": "many/f", "count": count}], "objects": hexed(["top.txt"])}
    with serve_keys(tmp_path, spec) as m:
        started = time.monotonic()
        names = os.listdir(m.path / "many")
        listed_s = time.monotonic() - started
        assert len(names) == count
        assert set(names) == {f"f{i:06d}" for i in range(count)}
        for i in (0, 1, 4_999, 50_000, 77_777, count - 1):
            path = m.path / "many" / f"f{i:06d}"
            assert os.stat(path).st_size == len(generated_bytes(i))
            assert path.read_bytes() == generated_bytes(i), i
        assert sorted(os.listdir(m.path)) == ["many", "top.txt"]
        assert len(os.listdir(m.path / "many")) == count  # again, from the cache
        print(f"listing {count} keys through the mount took {listed_s:.2f} s")


# -- a listing that changes between its pages ----------------------------------------------

V1 = {
    "chg/a-keep": b"a" * 100,
    "chg/b-gone-early": b"b" * 100,
    "chg/b2-dir-becomes-file/x": b"x" * 100,
    "chg/c-replaced-early": os.urandom(256 * 1024),
    "chg/d-becomes-dir": b"d" * 100,
    # --- end of page 1 (page size 5); the bucket changes here ---
    "chg/e-gone-late": b"e" * 100,
    "chg/f-keep": b"f" * 100,
    "chg/g-replaced-late": os.urandom(10_000),
    "chg/h-dir/x": b"h" * 100,
    "chg/i-keep": b"i" * 100,
    "chg/j-keep": b"j" * 100,
}
PUT = {
    "chg/a0-added-early": b"new before the continuation point",
    "chg/b2-dir-becomes-file": b"was a directory",
    "chg/c-replaced-early": os.urandom(256 * 1024),  # same size: the kernel's i_size holds
    "chg/d-becomes-dir/child": b"child",
    "chg/g-replaced-late": os.urandom(20_000),
    "chg/k-added-late": b"new after the continuation point",
}
DELETE = ["chg/b-gone-early", "chg/b2-dir-becomes-file/x", "chg/e-gone-late"]
TTL_S = 3.0


def outcome(path: Path) -> bytes | int:
    """The file's bytes, or the errno of the failed open or read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc.errno or -1


def test_listing_that_changes_between_pages(tmp_path: Path) -> None:
    """Keys added, deleted and replaced between page 1 and 2 of a listing, and page 2 repeating
    page 1's last entry: one readdir has no duplicate, every name it returns resolves or is
    ENOENT (a replaced file read through an open of the old version: ESTALE), and the listing
    after the TTL is the bucket as it is."""
    spec = {
        "objects": {k: v.hex() for k, v in V1.items()},
        "page_size": 5,
        "metadata_ttl_s": TTL_S,
        "mutate": {
            "prefix": "chg/",
            "after_page": 1,
            "put": {k: v.hex() for k, v in PUT.items()},
            "delete": DELETE,
            "repeat_last": True,  # page 2 starts with d-becomes-dir again
        },
    }
    now = {**V1, **PUT}
    for key in DELETE:
        del now[key]
    with serve_keys(tmp_path, spec) as m:
        chg = m.path / "chg"
        names = os.listdir(chg)
        assert len(names) == len(set(names)), names
        # Page 1 as it was, page 2 as it is: what sorts before the continuation point and was
        # added is missed, what was deleted after it is gone.
        assert set(names) == {
            "a-keep",
            "b-gone-early",
            "b2-dir-becomes-file",
            "c-replaced-early",
            "d-becomes-dir",
            "f-keep",
            "g-replaced-late",
            "h-dir",
            "i-keep",
            "j-keep",
            "k-added-late",
        }
        log = m.log()
        assert "changed the bucket after page 1 of 'chg/'" in log
        assert "page 2 of 'chg/' repeats ObjectInfo(key='chg/d-becomes-dir'" in log
        for name in names:
            assert stat_errno(chg / name) in (0, errno.ENOENT), name
        assert os.path.isdir(chg / "d-becomes-dir")  # a directory and a file: the directory
        assert os.listdir(chg / "d-becomes-dir") == ["child"]
        assert os.path.isdir(chg / "b2-dir-becomes-file")  # listed before its keys went
        assert os.listdir(chg / "b2-dir-becomes-file") == []
        dirs = {"d-becomes-dir", "h-dir", "b2-dir-becomes-file"}
        for name in set(names) - dirs - {"c-replaced-early"}:
            key = f"chg/{name}"
            # Every listed name reads as it is now, or is gone: ENOENT, never EIO.
            assert outcome(chg / name) == (errno.ENOENT if key in DELETE else now[key]), name
        # Listed (and pinned at open) as the old version, replaced since. A random read first
        # (the kernel asks at 128 KiB, not 0): stale, or the new bytes, never the old ones.
        fd = os.open(chg / "c-replaced-early", os.O_RDONLY)
        try:
            chunk: bytes | int = os.pread(fd, 4096, 128 * 1024)
        except OSError as exc:
            chunk = exc.errno or -1
        finally:
            os.close(fd)
        assert chunk in (errno.ESTALE, now["chg/c-replaced-early"][128 * 1024 : 132 * 1024])
        # Once a read has seen the replacement, the next open gets the new version.
        assert outcome(chg / "c-replaced-early") == now["chg/c-replaced-early"]

        # After the TTL a new listing shows the bucket as it is now.
        time.sleep(TTL_S + 0.5)
        names = os.listdir(chg)
        assert len(names) == len(set(names)), names
        expected = {k.removeprefix("chg/").split("/")[0] for k in now}
        assert set(names) == expected
        for key, data in now.items():
            if key.count("/") == 1 and key != "chg/d-becomes-dir":
                assert sha256((m.path / key).read_bytes()) == sha256(data), key
        assert os.path.isfile(chg / "b2-dir-becomes-file")
        assert (chg / "d-becomes-dir" / "child").read_bytes() == b"child"
        assert (chg / "h-dir" / "x").read_bytes() == V1["chg/h-dir/x"]
        log = m.log()
        assert log.count("'chg/d-becomes-dir' is hidden by the directory") == 1
        assert "Traceback" not in log


# -- malformed command lines -----------------------------------------------------------------

# Digits beyond a float's range (parse_size once turned them into inf, then OverflowError).
HUGE = "9" * 400


def case(args: list[str], *words: str, marks: Any = ()) -> Any:
    """One malformed command line: its arguments and the words its error must contain."""
    shown = " ".join(a if len(a) < 20 else f"{a[:8]}...({len(a)})" for a in args)
    return pytest.param(args, list(words), id=shown or "nothing", marks=marks)


def assert_usage_error(res: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, nothing on stdout, one ``objfs: error:`` line naming what is wrong."""
    assert_one_line_error(res, 2, *words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        case(["--memory-limit", "1.5.G"], "--memory-limit", "'1.5.G' is not a size"),
        case(["--memory-limit", ""], "--memory-limit", "is not a size"),
        case(["--memory-limit", "1M"], "--memory-limit", "below two parts"),
        case(["--memory-limit", "0"], "--memory-limit", "below two parts"),
        case(["--memory-limit", HUGE], "--memory-limit", "too large"),
        case(["--cache-size", "-5G"], "--cache-size", "expected one argument"),
        case(["--cache-size=-5G"], "--cache-size", "'-5G' is not a size"),
        case(["--cache-size", "5X"], "--cache-size", "is not a size"),
        case(["--cache-size", "1e3"], "--cache-size", "is not a size"),
        case(["--cache-size", HUGE], "--cache-size", "too large"),
        case(["--cache-min-free", "lots"], "--cache-min-free", "is not a size"),
        case(["--part-size", "0"], "--part-size", "out of range", "1M to 1G"),
        case(["--part-size", "2G"], "--part-size", "out of range"),
        case(["--part-size", "8Q"], "--part-size", "is not a size"),
        case(["--part-size"], "--part-size", "expected one argument"),
        case(["--max-connections", "abc"], "--max-connections", "invalid int value: 'abc'"),
        case(["--max-connections", "1.5"], "--max-connections", "invalid int value"),
        case(["--max-connections", "-1"], "--max-connections", "1 to 1024"),
        case(["--max-connections", "1025"], "--max-connections", "1 to 1024"),
        case(["--read-ahead-kb", "-1"], "--read-ahead-kb", "out of range"),
        case(["--read-ahead-kb", "lots"], "--read-ahead-kb", "invalid int value"),
        case(["--connect-timeout", "0"], "--connect-timeout", "0.1 to 3600"),
        case(["--connect-timeout", "nan"], "--connect-timeout", "out of range"),
        case(["--read-timeout", "fast"], "--read-timeout", "invalid float value"),
        case(["--max-attempts", "0"], "--max-attempts", "1 to 100"),
        case(["--metadata-ttl", "nan"], "--metadata-ttl", "zero or more"),
        case(["--metadata-ttl", ""], "--metadata-ttl", "not a duration"),
        case(["--uid", "-1"], "--uid", "out of range"),
        case(["--gid", "4294967295"], "--gid", "out of range"),
        case(["--gid", "1.0"], "--gid", "not a number"),
        case(["--log-format", "xml"], "--log-format", "invalid choice"),
        case(["--metrics-addr", "127.0.0.1:99999"], "--metrics-addr", "not HOST:PORT"),
        case(["--metrics-addr", ":9101"], "--metrics-addr", "not HOST:PORT"),
        case(["--block-size", "3M"], "unrecognized arguments: --block-size"),
        case(["--foreground=yes"], "--foreground", "ignored explicit argument"),
    ],
)
def test_malformed_mount_option(mnt: Path, args: list[str], words: list[str]) -> None:
    assert_usage_error(run_objfs("mount", "s3://bucket/p", str(mnt), *args), *words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        case(["mount"], "required", "SOURCE", "MOUNTPOINT"),
        case(["mount", "s3://bucket/p"], "required", "MOUNTPOINT"),
        case(["unmount"], "required", "MOUNTPOINT"),
        case(["status"], "required", "MOUNTPOINT"),
        case(["warm"], "required", "PATH"),
        case(["no-such-command"], "invalid choice", "'no-such-command'"),
        case(["warm", "--jobs", "x", "."], "--jobs", "invalid int value"),
        case(["status", "--max-age", "0", "/"], "--max-age", "more than 0"),
        case(["status", "--max-age", "nan", "/"], "--max-age", "more than 0"),
        case(["status", "--json", "--probe", "/"], "--probe", "not allowed with"),
        case(["unmount", "--force", "--if-dead", "/"], "--if-dead", "not allowed with"),
    ],
)
def test_malformed_command_line(args: list[str], words: list[str]) -> None:
    assert_usage_error(run_objfs(*args), *words)
