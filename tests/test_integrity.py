"""Integrity when the daemon or the cache disk fails, through real mounts on moto's S3 server.

* A daemon killed with SIGKILL leaves a mount that answers ENOTCONN; ``objfs mount`` on the
  same mountpoint detaches it and serves again, from the persistent cache (no data GET).
* A cache disk that fills up, or that is read-only, turns the disk tier off with one warning;
  reads go on, with the right bytes.

The cache-disk cases mount small tmpfs file systems, so they need root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.disk_cache import cached_blocks
from tests.conftest import (
    force_unmount,
    mount_command,
    put_many,
    run_mount,
    sha256,
    wait_mounted,
)
from tests.helpers.proxy import Proxy

MiB = 1 << 20


def _read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _wait_for_blocks(cache: Path, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = cached_blocks(str(cache))
        if found >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"only {found} of {count} blocks reached {cache}")


def test_killed_daemon_gives_enotconn_and_mount_recovers_from_the_cache(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    data = os.urandom(6 * MiB + 123)
    put_many(s3, bucket, {"m/model.bin": data})
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    options = ("--endpoint-url", proxy.url, "--cache-dir", str(cache))
    cmd = mount_command(f"s3://{bucket}/m", mnt, tmp_path / "objfs1.log", *options)
    with open(tmp_path / "objfs1.out", "ab") as out:
        first = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        wait_mounted(mnt, first, tmp_path / "objfs1.out")
        assert sha256(_read(mnt / "model.bin")) == sha256(data)
        _wait_for_blocks(cache, 7)  # 7 blocks of 1 MiB
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        with pytest.raises(OSError, match="not connected") as info:
            open(mnt / "model.bin", "rb").close()  # not stat: the kernel may answer it from cache
        assert info.value.errno == errno.ENOTCONN
        proxy.reset_stats()
        cmd = mount_command(f"s3://{bucket}/m", mnt, tmp_path / "objfs2.log", *options)
        with run_mount(cmd, mnt, tmp_path / "objfs2.out") as m:
            # The dead mount's entry satisfied run_mount's wait: wait for the new one to serve.
            deadline = time.monotonic() + 30
            while True:
                try:
                    got = _read(m.path / "model.bin")
                    break
                except OSError as exc:
                    if (
                        exc.errno not in (errno.ENOTCONN, errno.ENOENT)
                        or time.monotonic() > deadline
                    ):
                        raise
                    time.sleep(0.1)
            assert sha256(got) == sha256(data)
            assert "dead" in (tmp_path / "objfs2.log").read_text()  # it said what it did
        counts = proxy.stats.count()
        assert counts["ranged_get"] == 0, f"the remount fetched data again: {counts}"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
        force_unmount(mnt)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "objfs-test", path],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.mark.parametrize("trouble", ["full", "read-only"])
def test_a_failing_cache_disk_turns_the_tier_off_with_one_warning(
    s3: Any, bucket: str, s3_server: Any, tmp_path: Path, trouble: str
) -> None:
    files = {f"m/f{i}.bin": os.urandom(3 * MiB) for i in range(3)}
    put_many(s3, bucket, files)
    with _tmpfs(tmp_path / "disk", "2m") as disk:
        cache = disk / "cache"
        cache.mkdir(mode=0o700)
        if trouble == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        log = tmp_path / "objfs.log"
        cmd = mount_command(
            f"s3://{bucket}/m",
            mnt,
            log,
            "--endpoint-url",
            s3_server.url,
            "--cache-dir",
            str(cache),
            "--cache-min-free",
            "0",
        )
        with run_mount(cmd, mnt, tmp_path / "objfs.out") as m:
            for name, blob in files.items():
                assert sha256(_read(m.path / name.removeprefix("m/"))) == sha256(blob)
            time.sleep(0.5)  # let queued disk writes fail
            for name, blob in files.items():  # again, with the tier off
                with open(m.path / name.removeprefix("m/"), "rb", buffering=0) as f:
                    assert f.read(MiB) == blob[:MiB]
        text = log.read_text()
        warnings = [line for line in text.splitlines() if "disk cache turned off" in line]
        assert len(warnings) == 1, text[-3000:]
        reason = "No space left" if trouble == "full" else "Read-only file system"
        assert reason in warnings[0]
