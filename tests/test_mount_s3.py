"""Real FUSE mounts of a real S3 server (moto): the semantics in the README, end to end."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from objfs.backends.memory import SyntheticData
from objfs.kernel_setup import _mount_devnum
from objfs.mountinfo import mount_entry
from tests.conftest import Mount, put_many, run_mount, run_objfs, sha256

# Keys under the mounted prefix "data" and what each must become. Every rule of the README's
# Semantics section has at least one key here.
TREE: dict[str, bytes] = {
    "data/": b"",  # marker of the mounted prefix itself: not a file
    "data/readme.txt": b"hello objfs\n",
    "data/empty.bin": b"",  # empty object: empty file
    "data/multi-block.bin": os.urandom(9 * 1024 * 1024 + 4321),  # spans three 4 MiB blocks
    "data/emptydir/": b"",  # zero-byte directory marker: an empty directory
    "data/nested/deep/file.bin": os.urandom(70_000),  # implied directories
    "data/nested/marker/": b"",  # a marker beside real content
    "data/nested/marker/x.txt": b"x",
    "data/clash": b"hidden file",  # a key and a prefix of the same name: the directory wins
    "data/clash/inner.txt": b"inner",
    "data/a//b.txt": b"empty segment",  # cannot be a POSIX path: skipped
    "data/dots/./x.txt": b"dot segment",
    "data/dots/../y.txt": b"dot-dot segment",
    "data/../escape.txt": b"tries to escape the mount",
    "data/long/" + "x" * 256: b"name of 256 bytes: too long",
    "data/long/" + "y" * 255: b"name of 255 bytes: fine",
    "data/names/ünïcødé 文件.txt": b"unicode",
    "data/names/space name.txt": b"space",
    "data/names/a+b.txt": b"plus",
    "data/names/100%.txt": b"percent",
    "data/names/hash#tag.txt": b"hash",
    "data/names/what?.txt": b"question",
    "dataset/not-in-prefix.txt": b"a sibling whose name starts like the prefix",
    "other/file.txt": b"outside the prefix",
}

EXPECTED_FILES = {
    "readme.txt": TREE["data/readme.txt"],
    "empty.bin": b"",
    "multi-block.bin": TREE["data/multi-block.bin"],
    "nested/deep/file.bin": TREE["data/nested/deep/file.bin"],
    "nested/marker/x.txt": b"x",
    "clash/inner.txt": b"inner",
    "long/" + "y" * 255: TREE["data/long/" + "y" * 255],
    "names/ünïcødé 文件.txt": b"unicode",
    "names/space name.txt": b"space",
    "names/a+b.txt": b"plus",
    "names/100%.txt": b"percent",
    "names/hash#tag.txt": b"hash",
    "names/what?.txt": b"question",
}
EXPECTED_DIRS = {
    "emptydir",
    "nested",
    "nested/deep",
    "nested/marker",
    "clash",
    "a",
    "dots",
    "long",
    "names",
}


def walk(root: Path) -> tuple[set[str], set[str]]:
    files, dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirs.update((rel / d).as_posix() for d in dirnames)
        files.update((rel / f).as_posix() for f in filenames)
    return files, dirs


@pytest.fixture
def tree_bucket(s3: Any, bucket: str) -> str:
    put_many(s3, bucket, TREE)
    return bucket


@pytest.mark.parametrize("slash", ["", "/"], ids=["no-slash", "trailing-slash"])
def test_tree_listing_and_content(mount_s3: Any, tree_bucket: str, s3: Any, slash: str) -> None:
    m: Mount = mount_s3(f"s3://{tree_bucket}/data{slash}", "--metadata-ttl", "0")
    files, dirs = walk(m.path)
    assert files == set(EXPECTED_FILES)
    assert dirs == EXPECTED_DIRS
    for rel, data in EXPECTED_FILES.items():
        assert sha256((m.path / rel).read_bytes()) == sha256(data), rel
    # Listing twice (TTL 0 re-lists) still warns once per hidden/skipped key.
    walk(m.path)
    log = m.log()
    assert log.count("is hidden by the directory") == 1
    assert log.count("'data/clash'") == 1
    for bad in ("data/a//", "data/dots/./", "data/dots/../", "data/../", "x" * 256):
        assert sum(bad in line for line in log.splitlines()) == 1, bad


def test_stat_attributes_and_stable_inodes(mount_s3: Any, tree_bucket: str, s3: Any) -> None:
    m: Mount = mount_s3(
        f"s3://{tree_bucket}/data", "--metadata-ttl", "0", "--uid", "1234", "--gid", "5678"
    )
    st = os.stat(m.path / "readme.txt")
    head = s3.head_object(Bucket=tree_bucket, Key="data/readme.txt")
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o444
    assert st.st_size == len(TREE["data/readme.txt"])
    assert st.st_mtime == head["LastModified"].timestamp()
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    dst = os.stat(m.path / "nested")
    assert stat.S_ISDIR(dst.st_mode)
    assert stat.S_IMODE(dst.st_mode) == 0o555
    assert (dst.st_uid, dst.st_gid) == (1234, 5678)
    assert os.stat(m.path / "empty.bin").st_size == 0
    # Inode numbers: distinct per path, unchanged after re-listing (TTL 0).
    paths = [m.path / p for p in ("readme.txt", "nested", "nested/deep/file.bin", "clash")]
    first = [os.stat(p).st_ino for p in paths]
    walk(m.path)
    assert [os.stat(p).st_ino for p in paths] == first
    assert len(set(first)) == len(first)


def test_default_owner_is_mounting_user(mount_s3: Any, tree_bucket: str) -> None:
    m: Mount = mount_s3(f"s3://{tree_bucket}/data")
    st = os.stat(m.path / "readme.txt")
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


def test_pagination_over_1000_keys_and_prefixes(mount_s3: Any, s3: Any, bucket: str) -> None:
    items = {f"big/f{i:04d}.txt": f"{i}".encode() for i in range(1050)}
    items.update({f"big/d{i:04d}/leaf.txt": f"d{i}".encode() for i in range(1050)})
    put_many(s3, bucket, items)
    m: Mount = mount_s3(f"s3://{bucket}/big")
    names = set(os.listdir(m.path))
    assert names == {f"f{i:04d}.txt" for i in range(1050)} | {f"d{i:04d}" for i in range(1050)}
    assert (m.path / "f1049.txt").read_bytes() == b"1049"
    assert (m.path / "d1049" / "leaf.txt").read_bytes() == b"d1049"


def test_every_mutation_fails_with_erofs(mount_s3: Any, tree_bucket: str, s3: Any) -> None:
    m: Mount = mount_s3(f"s3://{tree_bucket}/data")
    f = m.path / "readme.txt"
    before = {(o["Key"], o["ETag"]) for o in s3.list_objects_v2(Bucket=tree_bucket)["Contents"]}
    attempts = [
        lambda: open(f, "r+b"),  # noqa: SIM115
        lambda: open(f, "ab"),  # noqa: SIM115
        lambda: open(m.path / "new.txt", "wb"),  # noqa: SIM115
        lambda: os.truncate(f, 0),
        lambda: os.mkdir(m.path / "newdir"),
        lambda: os.rmdir(m.path / "emptydir"),
        lambda: os.unlink(f),
        lambda: os.rename(f, m.path / "renamed.txt"),
        lambda: os.symlink("readme.txt", m.path / "link"),
        lambda: os.link(f, m.path / "hardlink"),
        lambda: os.chmod(f, 0o644),
        lambda: os.utime(f, (0, 0)),
        lambda: os.setxattr(f, "user.test", b"1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError, match="Read-only file system") as info:
            attempt()
        assert info.value.errno == errno.EROFS, (attempt, info.value)
    after = {(o["Key"], o["ETag"]) for o in s3.list_objects_v2(Bucket=tree_bucket)["Contents"]}
    assert after == before, "the bucket was modified"
    assert {key for key, _ in before} <= set(TREE) | {"data/a/"}
    assert (m.path / "readme.txt").read_bytes() == TREE["data/readme.txt"]


def test_open_handle_is_pinned_to_its_etag(mount_s3: Any, s3: Any, bucket: str) -> None:
    old = os.urandom(9 * 1024 * 1024)
    new = os.urandom(5 * 1024 * 1024 + 17)
    s3.put_object(Bucket=bucket, Key="m/weights.bin", Body=old)
    s3.put_object(Bucket=bucket, Key="m/other.bin", Body=old)
    m: Mount = mount_s3(f"s3://{bucket}/m", "--metadata-ttl", "0")

    # Opened before the replacement, read after: ESTALE, never bytes of the new version.
    fd = os.open(m.path / "weights.bin", os.O_RDONLY)
    try:
        s3.put_object(Bucket=bucket, Key="m/weights.bin", Body=new)
        with pytest.raises(OSError, match="Stale file handle") as info:
            os.pread(fd, 4096, 0)
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(fd)

    # Partly read before the replacement: every byte that comes back is the old version's.
    fd = os.open(m.path / "other.bin", os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0) == old[:65536]
        s3.put_object(Bucket=bucket, Key="m/other.bin", Body=new)
        error = None
        for offset in range(0, len(old), 1024 * 1024):
            try:
                chunk = os.pread(fd, 1024 * 1024, offset)
            except OSError as exc:
                error = exc.errno
                break
            # Pages the kernel still caches are the old version's; once it learns the new
            # size it may end the file early. Either way no byte of the new version appears.
            assert chunk == old[offset : offset + len(chunk)], offset
            if len(chunk) < 1024 * 1024:
                break
        assert error in (None, errno.ESTALE)
    finally:
        os.close(fd)

    # A later open sees the new version, size included.
    for name in ("weights.bin", "other.bin"):
        assert os.stat(m.path / name).st_size == len(new)
        assert sha256((m.path / name).read_bytes()) == sha256(new)


def test_reads_past_4gib_through_a_real_mount(tmp_path: Path) -> None:
    """A 5 GiB synthetic object from the memory backend: offsets past 2**32 read right."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    helper = Path(__file__).parent / "helpers" / "serve_memory.py"
    size = 5 * 2**30 + 12345
    log_path = tmp_path / "objfs.log"
    cmd = [sys.executable, str(helper), str(mountpoint), f"huge.bin={size}"]
    with run_mount(cmd, mountpoint, log_path) as m:
        path = m.path / "huge.bin"
        assert os.stat(path).st_size == size
        expected = SyntheticData(size, seed=b"huge.bin")
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in (0, 2**32 - 1000, 2**32, 2**32 + 4_000_003, size - 5000):
                assert os.pread(fd, 100_000, offset) == expected.read(offset, 100_000), offset
        finally:
            os.close(fd)


def _daemons_for(source: str) -> list[psutil.Process]:
    """The objfs daemons serving ``source`` (each test mounts its own bucket)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if source in cmdline and "--daemon-ready-fd" in cmdline:
            found.append(proc)
    return found


def test_daemon_mode_returns_once_serving(s3_server: Any, tree_bucket: str, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "daemon.log"
    try:
        res = run_objfs(  # relative paths, as a user types them
            "mount",
            f"s3://{tree_bucket}/data",
            "mnt",
            "--endpoint-url",
            s3_server.url,
            "--log-file",
            "daemon.log",
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout == ""
        assert res.stderr == ""
        # Live the moment the command returned: no polling.
        assert mount_entry(str(mountpoint)) == ("fuse.objfs", f"s3://{tree_bucket}/data/")
        if os.geteuid() == 0:
            # Tuned before READY: a file opened now already gets the raised read-ahead.
            dev = _mount_devnum(str(mountpoint))
            assert dev is not None
            bdi = Path(f"/sys/class/bdi/{dev[0]}:{dev[1]}/read_ahead_kb")
            assert bdi.read_text().strip() == "16384"
        assert (mountpoint / "readme.txt").read_bytes() == TREE["data/readme.txt"]
        daemons = _daemons_for(f"s3://{tree_bucket}/data")
        assert len(daemons) == 1
        assert daemons[0].cwd() == "/"
        options = Path("/proc/self/mountinfo").read_text()
        line = next(ln for ln in options.splitlines() if f" {mountpoint} " in ln)
        assert " ro," in line or " ro " in line
        res = run_objfs("unmount", str(mountpoint))
        assert res.returncode == 0, res.stderr
        assert mount_entry(str(mountpoint)) is None
        _, alive = psutil.wait_procs(daemons, timeout=15)
        assert not alive, "the daemon kept running after unmount"
        log = log_path.read_text()
        assert "was unmounted" in log
        assert "objfs stopped" in log
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_signal_unmounts_cleanly(
    s3_server: Any, tree_bucket: str, tmp_path: Path, sig: signal.Signals
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "fg.log"
    cmd = [
        sys.executable,
        "-m",
        "objfs",
        "mount",
        f"s3://{tree_bucket}/data",
        str(mountpoint),
        "-f",
        "--endpoint-url",
        s3_server.url,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while mount_entry(str(mountpoint)) is None:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (mountpoint / "readme.txt").read_bytes() == TREE["data/readme.txt"]
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert mount_entry(str(mountpoint)) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def test_unmount_force_detaches_a_busy_mount(
    s3_server: Any, tree_bucket: str, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        res = run_objfs(
            "mount", f"s3://{tree_bucket}/data", str(mountpoint), "--endpoint-url", s3_server.url
        )
        assert res.returncode == 0, res.stderr
        daemons = _daemons_for(f"s3://{tree_bucket}/data")
        assert len(daemons) == 1
        fd = os.open(mountpoint / "readme.txt", os.O_RDONLY)
        try:
            res = run_objfs("unmount", str(mountpoint))
            assert res.returncode == 16
            assert "busy" in res.stderr
            assert len(res.stderr.splitlines()) == 1
            res = run_objfs("unmount", "--force", str(mountpoint))
            assert res.returncode == 0, res.stderr
            assert mount_entry(str(mountpoint)) is None
        finally:
            os.close(fd)
        _, alive = psutil.wait_procs(daemons, timeout=15)
        assert not alive
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
