"""objfs's own FUSE transport (``--fuse-transport kernel``) through real mounts of moto.

The semantics are those of the pyfuse3 transport (the same core answers): these tests check
what the transport itself owns: INIT (what it negotiated, shown by ``objfs status``; 8 MiB
requests as root), every request objfs answers with the same bytes and errnos, READDIRPLUS
over many entries, mmap, interrupted readers, and a clean end on unmount and on SIGTERM while
files are open; and passthrough: no READ reaches the daemon, a damaged cache file is served
normally and repaired, a held handle keeps its version through a replacement and an eviction
and after a kill -9, and an unmount (lazy or aborted) in the middle of a read.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from objfs.kernel import mounting
from tests.conftest import Mount, fresh_status, put_many, run_objfs, sha256

MiB = 1 << 20
KERNEL = ("--fuse-transport", "kernel")


@pytest.fixture
def tree(s3: Any, bucket: str) -> dict[str, bytes]:
    files = {
        "m/model.safetensors": os.urandom(9 * MiB + 123),
        "m/config.json": b'{"a": 1}',
        "m/empty": b"",
        "m/sub/deep/x.bin": os.urandom(70_000),
        **{f"m/many/f{i:04d}": str(i).encode() for i in range(300)},
    }
    put_many(s3, bucket, files)
    return files


def test_a_kernel_transport_mount_serves_the_tree(
    mount_s3: Any, bucket: str, tree: dict[str, bytes]
) -> None:
    m: Mount = mount_s3(f"s3://{bucket}/m", *KERNEL)
    for key, data in tree.items():
        path = m.path / key[2:]
        assert path.stat().st_size == len(data)
        assert sha256(path.read_bytes()) == sha256(data), key
    assert sorted(os.listdir(m.path)) == [
        "config.json",
        "empty",
        "many",
        "model.safetensors",
        "sub",
    ]
    # 300 entries take several READDIRPLUS replies; ls -l stats each one.
    assert sorted(os.listdir(m.path / "many")) == sorted(f"f{i:04d}" for i in range(300))
    listed = subprocess.run(
        ["ls", "-l", str(m.path / "many")], capture_output=True, text=True, check=True
    )
    assert len(listed.stdout.splitlines()) == 301
    st = os.stat(m.path / "model.safetensors")
    assert st.st_mode & 0o777 == 0o444
    assert os.stat(m.path / "sub").st_mode & 0o777 == 0o555
    with pytest.raises(FileNotFoundError):
        os.stat(m.path / "missing.json")
    with pytest.raises(FileNotFoundError):  # cached as a negative entry: same answer
        os.stat(m.path / "missing.json")
    # Random reads, and mmap (what safetensors does).
    data = tree["m/model.safetensors"]
    with open(m.path / "model.safetensors", "rb") as fp:
        rng = random.Random(7)
        for _ in range(50):
            off = rng.randrange(len(data))
            size = rng.choice([1, 4096, 65536, 3 * MiB])
            fp.seek(off)
            assert fp.read(size) == data[off : off + size]
        with mmap.mmap(fp.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert sha256(mapped[:]) == sha256(data)
    # statfs answers (df).
    vfs = os.statvfs(m.path)
    assert vfs.f_namemax == 255
    # What was negotiated is in objfs status.
    status = run_objfs("status", str(m.path), "--json")
    assert status.returncode == 0, status.stderr
    fuse = json.loads(status.stdout)["fuse"]
    assert fuse["transport"] == "kernel"
    assert fuse["protocol"].startswith("7.")
    assert "ASYNC_READ" in fuse["flags"]
    assert fuse["max_request_bytes"] >= MiB
    text = run_objfs("status", str(m.path))
    assert "kernel transport" in text.stdout
    assert "FUSE transport kernel: protocol 7." in m.log()


def _pages_limit_can_be_2048() -> bool:
    """fs.fuse.max_pages_limit (Linux 6.13+) is 2048 or more, or this root process may raise
    it (not in a container whose /proc/sys is read-only; without the sysctl the cap is 256)."""
    if mounting.max_pages_limit() >= 2048:
        return True
    return os.geteuid() == 0 and os.access(mounting._MAX_PAGES_LIMIT, os.W_OK)


@pytest.mark.skipif(
    not _pages_limit_can_be_2048(),
    reason="needs fs.fuse.max_pages_limit (Linux 6.13+) at 2048, or root to raise it",
)
def test_a_root_mount_takes_8_mib_requests(mount_s3: Any, s3: Any, bucket: str) -> None:
    """As root objfs raises the sysctl and asks for 8 MiB requests: a sequential read of a
    24 MiB file arrives in 3 to 4 READs (a cold load's READs are hand-offs between threads:
    half as many as with 4 MiB ones), and its bytes are the object's."""
    data = os.urandom(24 * MiB)
    put_many(s3, bucket, {"big/shard.bin": data})
    m: Mount = mount_s3(f"s3://{bucket}/big", *KERNEL)
    status = fresh_status(m.path)
    assert status["fuse"]["max_request_bytes"] == 8 * MiB
    before = status["served"]["reads"]
    assert sha256((m.path / "shard.bin").read_bytes()) == sha256(data)
    reads = fresh_status(m.path)["served"]["reads"] - before
    assert 3 <= reads <= 4, reads


def test_the_kernel_transport_is_read_only_with_the_same_errnos(
    mount_s3: Any, bucket: str, tree: dict[str, bytes]
) -> None:
    m: Mount = mount_s3(f"s3://{bucket}/m", *KERNEL)
    target = m.path / "config.json"
    attempts = [
        lambda: open(target, "w"),  # noqa: SIM115
        lambda: open(m.path / "new", "w"),  # noqa: SIM115
        lambda: os.mkdir(m.path / "d"),
        lambda: os.unlink(target),
        lambda: os.rename(target, m.path / "y"),
        lambda: os.chmod(target, 0o600),
        lambda: os.truncate(target, 0),
        lambda: os.symlink("x", m.path / "link"),
        lambda: os.setxattr(target, "user.x", b"1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError, match="Read-only file system") as caught:
            attempt()
        assert caught.value.errno == errno.EROFS
    # No extended attributes: ENOSYS from objfs, which the kernel reports as unsupported.
    with pytest.raises(OSError, match=r"not supported|No data") as caught:
        os.getxattr(target, "user.x")
    assert caught.value.errno in (errno.EOPNOTSUPP, errno.ENODATA)
    assert target.read_bytes() == tree["m/config.json"]


def test_32_readers_with_mmap_get_their_bytes_and_none_hangs(
    mount_s3: Any, bucket: str, tree: dict[str, bytes]
) -> None:
    m: Mount = mount_s3(f"s3://{bucket}/m", *KERNEL)
    data = tree["m/model.safetensors"]
    errors: list[str] = []

    def reader(n: int) -> None:
        try:
            with open(m.path / "model.safetensors", "rb") as fp:
                if n % 2:
                    with mmap.mmap(fp.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                        got = mapped[n * 4096 : n * 4096 + MiB]
                else:
                    fp.seek(n * 4096)
                    got = fp.read(MiB)
            if got != data[n * 4096 : n * 4096 + MiB]:
                errors.append(f"reader {n}: wrong bytes")
        except OSError as exc:
            errors.append(f"reader {n}: {exc}")

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert errors == []


def test_sigterm_with_files_open_ends_the_daemon_cleanly(
    s3_server: Any, bucket: str, tree: dict[str, bytes], tmp_path: Path
) -> None:
    """The readers wait in poll: a stop ends them even while a file keeps the detached mount
    alive, and the daemon exits 0."""
    from tests.conftest import mount_command, wait_mounted

    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "objfs.log"
    cmd = mount_command(
        f"s3://{bucket}/m", mountpoint, log_path, "--endpoint-url", s3_server.url, *KERNEL
    )
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    try:
        wait_mounted(mountpoint, proc, log_path)
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, time; f = open(sys.argv[1], 'rb'); f.read(10);"
                " print('open', flush=True); time.sleep(60)",
                str(mountpoint / "config.json"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "open"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert "received SIGTERM" in log_path.read_text()
    finally:
        _end(holder, mountpoint, proc)


def test_passthrough_serves_a_version_whole_in_the_disk_cache(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """Warmed into the disk cache, a file is read by the kernel from the cache file itself:
    the daemon answers no READ while it is read whole and through mmap, bytes exact. A file
    open before it was whole stays cached until its last close."""
    from tests.conftest import cached_mount_command, run_mount

    data = os.urandom(6 * MiB + 4097)
    other = os.urandom(3 * MiB + 1)
    put_many(s3, bucket, {"m/w.safetensors": data, "m/other.bin": other})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
    with run_mount([*cmd, *KERNEL], mountpoint, tmp_path / "mount.out") as m:
        assert "FUSE passthrough off" not in (tmp_path / "objfs.log").read_text()

        def reads() -> int:
            return int(fresh_status(m.path)["served"]["reads"])

        # other.bin: opened (cached mode) before it is whole; stays cached while open.
        held = open(m.path / "other.bin", "rb")  # noqa: SIM115
        try:
            warmed = run_objfs("warm", "--cache-only", str(m.path / "w.safetensors"))
            assert warmed.returncode == 0, warmed.stderr
            before = reads()
            assert sha256((m.path / "w.safetensors").read_bytes()) == sha256(data)
            with open(m.path / "w.safetensors", "rb") as fp:
                with mmap.mmap(fp.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                    assert sha256(mapped[:]) == sha256(data)
                fp.seek(5 * MiB + 3)
                assert fp.read(MiB) == data[5 * MiB + 3 : 6 * MiB + 3]
            assert os.stat(m.path / "w.safetensors").st_size == len(data)
            assert reads() == before  # the kernel read the cache file, not the daemon
            fuse = fresh_status(m.path)["fuse"]
            assert "PASSTHROUGH" in fuse["flags"]
            assert fuse["passthrough_opens"] == 2  # read_bytes, and the mmap's and seek's open
            assert held.read() == other
        finally:
            held.close()
        # other.bin was served in cached mode: its bytes are in the kernel's page cache of
        # the inode, so it stays cached even once whole on disk (a passthrough open would
        # read them from the disk again).
        warmed = run_objfs("warm", "--cache-only", str(m.path / "other.bin"))
        assert warmed.returncode == 0, warmed.stderr
        assert (m.path / "other.bin").read_bytes() == other
        assert fresh_status(m.path)["fuse"]["passthrough_opens"] == 2


def test_passthrough_serves_from_a_cache_directory_on_overlayfs(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """The cache directory on overlayfs (a container's root file system): the kernel takes
    its files as backing files (INIT asks for max_stack_depth 2), so a warmed file is read by
    the kernel with no READ reaching the daemon, bytes exact, and nothing is refused (before:
    every open refused with ELOOP, a warning per file)."""
    from tests.conftest import cached_mount_command, run_mount

    layers = {name: tmp_path / f"ovl-{name}" for name in ("lower", "upper", "work")}
    for d in layers.values():
        d.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    options = f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}"
    made = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(cache)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount overlayfs here: {made.stderr.strip()}")
    try:
        files = {f"m/s{i}.bin": os.urandom(2 * MiB + 4097 * i) for i in range(3)}
        put_many(s3, bucket, files)
        cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
        with run_mount([*cmd, *KERNEL], mountpoint, tmp_path / "mount.out") as m:
            for key in files:
                warmed = run_objfs("warm", "--cache-only", str(m.path / key[2:]))
                assert warmed.returncode == 0, warmed.stderr
            before = int(fresh_status(m.path)["served"]["reads"])
            for key, data in files.items():
                assert sha256((m.path / key[2:]).read_bytes()) == sha256(data), key
            status = fresh_status(m.path)
            assert int(status["served"]["reads"]) == before  # the kernel read the cache files
            assert status["fuse"]["passthrough_opens"] == len(files)
            assert status["fuse"]["passthrough_refused"] is None
        log_text = (tmp_path / "objfs.log").read_text()
        assert "refused" not in log_text
        assert "max_stack_depth 2" in log_text
    finally:
        subprocess.run(["umount", str(cache)], check=False)


def test_a_killed_daemon_leaves_passthrough_readers_reading_their_version(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """kill -9 of the daemon while a file is open by passthrough: the FUSE connection ends,
    but the kernel reads that file from its backing file and needs no daemon, so the open
    handle goes on reading the right bytes; a new open fails (ENOTCONN)."""
    from tests.conftest import cached_mount_command, wait_mounted

    data = os.urandom(4 * MiB + 17)
    put_many(s3, bucket, {"m/k.bin": data})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
    log_path = tmp_path / "objfs.log"
    proc = subprocess.Popen([*cmd, *KERNEL], stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    try:
        wait_mounted(mountpoint, proc, log_path)
        warmed = run_objfs("warm", "--cache-only", str(mountpoint / "k.bin"))
        assert warmed.returncode == 0, warmed.stderr
        code = (
            "import hashlib, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "print(hashlib.sha256(os.pread(fd, 1 << 20, 0)).hexdigest(), flush=True)\n"
            "sys.stdin.readline()\n"
            "try:\n"
            "    rest = os.pread(fd, 1 << 30, 1 << 20)\n"
            "    print(hashlib.sha256(rest).hexdigest(), flush=True)\n"
            "except OSError as exc:\n"
            "    print('errno', exc.errno, flush=True)\n"
        )
        holder = subprocess.Popen(
            [sys.executable, "-c", code, str(mountpoint / "k.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdin is not None
        assert holder.stdout.readline().strip() == sha256(data[:MiB])
        proc.kill()
        proc.wait(timeout=30)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, _ = holder.communicate(timeout=60)
        assert out.strip() == sha256(data[MiB:])
        with pytest.raises(OSError, match="not connected") as caught:
            os.open(mountpoint / "k.bin", os.O_RDONLY)
        assert caught.value.errno == errno.ENOTCONN
    finally:
        _end(holder, mountpoint, proc)


def _end(
    holder: subprocess.Popen[str] | None, mountpoint: Path, proc: subprocess.Popen[bytes]
) -> None:
    """Stop the reader, detach the mount, stop the daemon (what a test started)."""
    if holder is not None and holder.poll() is None:
        holder.kill()
    if holder is not None:
        holder.communicate()
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _served_reads(path: Path) -> tuple[int, int]:
    """(READs the daemon answered, opens it answered by passthrough) on the mount at path."""
    status = fresh_status(path)
    return int(status["served"]["reads"]), int(status["fuse"]["passthrough_opens"])


def _version_file(cache: Path, size: int) -> Path:
    """The one disk-cache data file that holds an object of ``size`` bytes (an O_DIRECT
    write may have padded its end to a page)."""
    found = [
        f
        for f in cache.rglob("*")
        if f.is_file() and f.suffix != ".idx" and size <= f.stat().st_size < size + 4096
    ]
    assert len(found) == 1, found
    return found[0]


def test_a_damaged_block_in_the_disk_cache_is_read_normally_then_repaired_then_passthrough(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """The kernel checks no hash: a version whose cache file has a damaged block is never
    offered by passthrough. A version not recorded as checked (its writer was killed before
    it could record it) is read and verified before its first passthrough open; the damage is
    found, the file is served by normal reads, which fetch the block again and write it
    back, and that mount records it at its end; the next mount offers the repaired file by
    passthrough with no check."""
    from tests.conftest import cached_mount_command, run_mount, wait_mounted

    data = os.urandom(5 * MiB + 4097)
    put_many(s3, bucket, {"m/d.bin": data})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
    cmd = [*cmd, *KERNEL]
    log_path = tmp_path / "objfs.log"
    first = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_mounted(mountpoint, first, log_path)
        assert sha256((mountpoint / "d.bin").read_bytes()) == sha256(data)
        deadline = time.monotonic() + 30
        while fresh_status(mountpoint)["disk"]["writes"] < 6:  # all 6 blocks on disk
            assert time.monotonic() < deadline, "the blocks never reached the disk cache"
        first.kill()  # before the end of the mount, where it would record them as checked
        first.wait(timeout=30)
    finally:
        _end(None, mountpoint, first)
    damaged = _version_file(tmp_path / "cache", len(data))
    with open(damaged, "r+b") as f:
        f.seek(2 * MiB + 10)
        byte = f.read(1)
        f.seek(2 * MiB + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        before, _ = _served_reads(m.path)
        assert sha256((m.path / "d.bin").read_bytes()) == sha256(data)
        reads, passthrough = _served_reads(m.path)
        assert passthrough == 0  # the damaged version was not offered
        assert reads > before  # the daemon served it
        assert "before its first passthrough" in log_path.read_text()
    assert damaged.read_bytes()[: len(data)] == data  # repaired
    checks = log_path.read_text().count("before its first passthrough")
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        before, _ = _served_reads(m.path)
        assert sha256((m.path / "d.bin").read_bytes()) == sha256(data)
        reads, passthrough = _served_reads(m.path)
        assert passthrough == 1
        assert reads == before
    assert log_path.read_text().count("before its first passthrough") == checks  # no re-read
    assert damaged.read_bytes() == data  # and cut to the object's size for passthrough


def test_a_remount_serves_what_the_last_mount_fetched_by_passthrough_with_no_check(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """Blocks a mount fetched and wrote were hashed as they went out: at its end it records
    the versions whole on disk as checked, and the next mount opens them by passthrough
    without reading them first."""
    from tests.conftest import cached_mount_command, run_mount

    data = os.urandom(7 * MiB + 3)
    put_many(s3, bucket, {"m/r.bin": data})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
    cmd = [*cmd, *KERNEL]
    log_path = tmp_path / "objfs.log"
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        assert sha256((m.path / "r.bin").read_bytes()) == sha256(data)
    assert "1 file versions whole in the disk cache recorded as checked" in log_path.read_text()
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        before, _ = _served_reads(m.path)
        with (
            open(m.path / "r.bin", "rb") as fp,
            mmap.mmap(fp.fileno(), 0, prot=mmap.PROT_READ) as mapped,
        ):
            assert sha256(mapped[:]) == sha256(data)
        reads, passthrough = _served_reads(m.path)
        assert passthrough == 1
        assert reads == before
    assert "before its first passthrough" not in log_path.read_text()


def test_a_passthrough_handle_keeps_its_version_through_a_replacement_and_an_eviction(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """A handle open by passthrough reads the cache file it was given: replacing the object
    gives the new version its own file (a new open reads it), and evicting the old version
    unlinks its file, which the kernel keeps reading: the old handle reads its own version
    whole, with no READ reaching the daemon."""
    from tests.conftest import cached_mount_command, run_mount

    old, new = os.urandom(12 * MiB + 5), os.urandom(12 * MiB + 7)
    filler = os.urandom(12 * MiB)
    put_many(s3, bucket, {"m/a.bin": old, "m/fill.bin": filler})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, s3_server.url)
    # A disk cache that holds one of the versions, not two.
    cmd = [*cmd, *KERNEL, "--cache-size", "20M", "--metadata-ttl", "1"]
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        warmed = run_objfs("warm", "--cache-only", str(m.path / "a.bin"))
        assert warmed.returncode == 0, warmed.stderr
        old_file = _version_file(tmp_path / "cache", len(old))
        with open(m.path / "a.bin", "rb", buffering=0) as held:
            assert held.read(MiB) == old[:MiB]
            status = fresh_status(m.path)
            assert status["fuse"]["passthrough_opens"] == 1
            served = int(status["served"]["bytes"])
            s3.put_object(Bucket=bucket, Key="m/a.bin", Body=new)
            time.sleep(1.5)  # past the metadata TTL
            assert sha256((m.path / "a.bin").read_bytes()) == sha256(new)
            assert sha256((m.path / "fill.bin").read_bytes()) == sha256(filler)
            assert not old_file.exists(), "the old version was not evicted"
            assert sha256(held.read()) == sha256(old[MiB:])
            with mmap.mmap(held.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                assert sha256(mapped[:]) == sha256(old)
        # The daemon served the new version and the filler (once each: the page cache keeps
        # them), and none of the held handle's old bytes.
        assert int(fresh_status(m.path)["served"]["bytes"]) - served == len(new) + len(filler)


@pytest.mark.parametrize("how", ["lazy", "abort"])
def test_unmount_while_reading(
    s3: Any, s3_server: Any, bucket: str, tmp_path: Path, how: str
) -> None:
    """An unmount in the middle of reads: ``objfs unmount --force`` (a lazy detach) lets
    the open handle read on, byte-exact, then the daemon exits 0; aborting the connection
    fails the next read with ENOTCONN and the daemon still exits 0. No reader hangs."""
    from tests.conftest import mount_command, wait_mounted

    data = os.urandom(24 * MiB + 3)
    put_many(s3, bucket, {"m/u.bin": data})
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "objfs.log"
    cmd = mount_command(
        f"s3://{bucket}/m", mountpoint, log_path, "--endpoint-url", s3_server.url, *KERNEL
    )
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    try:
        wait_mounted(mountpoint, proc, log_path)
        code = (
            "import hashlib, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "print(hashlib.sha256(os.pread(fd, 1 << 20, 0)).hexdigest(), flush=True)\n"
            "sys.stdin.readline()\n"
            "h = hashlib.sha256()\n"
            "try:\n"
            "    while chunk := os.read(fd, 1 << 20):\n"
            "        h.update(chunk)\n"
            "    print(h.hexdigest(), flush=True)\n"
            "except OSError as exc:\n"
            "    print('errno', exc.errno, flush=True)\n"
        )
        holder = subprocess.Popen(
            [sys.executable, "-c", code, str(mountpoint / "u.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdin is not None
        assert holder.stdout.readline().strip() == sha256(data[:MiB])
        if how == "lazy":
            done = run_objfs("unmount", "--force", str(mountpoint))
            assert done.returncode == 0, done.stderr
        else:
            dev = os.stat(mountpoint).st_dev
            conn = Path("/sys/fs/fuse/connections") / str(dev)
            (conn / "abort").write_text("1")
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, _ = holder.communicate(timeout=60)
        if how == "lazy":
            assert out.strip() == sha256(data)  # read() starts at 0: pread moved nothing
        else:
            assert out.strip() == f"errno {errno.ENOTCONN}"
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        from objfs.mountinfo import mount_entry

        assert mount_entry(str(mountpoint)) is None  # the daemon removed what was left
    finally:
        _end(holder, mountpoint, proc)


# Runs `python -m objfs ...` with objfs.kernel.mounting seeing a non-root effective uid, so it
# mounts through fusermount3 and unmounts with `fusermount3 -u`. (The interpreter here lives
# under /root, which another user cannot run: the path is what this checks, not permissions.)
AS_USER = """
import os, runpy, sys, types
import objfs.kernel.mounting as mounting
fake = types.ModuleType("os")
fake.__dict__.update(os.__dict__)
fake.geteuid = lambda: 65534
mounting.os = fake
sys.argv = ["objfs", *sys.argv[1:]]
runpy.run_module("objfs", run_name="__main__", alter_sys=True)
"""


def test_without_root_the_kernel_transport_mounts_through_fusermount3(
    s3: Any, s3_server: Any, bucket: str, tree: dict[str, bytes], tmp_path: Path
) -> None:
    """Without root the kernel transport asks fusermount3 to mount and takes the fd it
    sends back (``_FUSE_COMMFD``), serves the same bytes, and on SIGTERM unmounts through
    fusermount3 and exits 0."""
    from objfs.mountinfo import mount_entry
    from tests.conftest import mount_command, wait_mounted

    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "objfs.log"
    cmd = mount_command(
        f"s3://{bucket}/m", mountpoint, log_path, "--endpoint-url", s3_server.url, *KERNEL
    )
    assert cmd[1:3] == ["-m", "objfs"]
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_USER, *cmd[3:]],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_mounted(mountpoint, proc, log_path)
        lines = [
            line
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if f" {mountpoint} " in line
        ]
        assert len(lines) == 1, lines
        assert " fuse.objfs " in lines[0]
        for key, data in tree.items():
            assert sha256((mountpoint / key[2:]).read_bytes()) == sha256(data), key
        log = log_path.read_text()
        assert f"mounted {mountpoint} through fusermount3" in log
        assert "FUSE transport kernel" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert mount_entry(str(mountpoint)) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
