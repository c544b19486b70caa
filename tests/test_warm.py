"""``objfs warm``: reads files ahead so a later load sends no request for their data."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import objfs.warm as warm_mod
from tests.conftest import Mount, cached_mount_command, put_many, run_mount, run_objfs, sha256
from tests.helpers.proxy import Proxy

MiB = 1024 * 1024


def test_warm_fills_the_caches(mount_s3: Any, proxy: Proxy, s3: Any, bucket: str) -> None:
    files = {
        "m/a.safetensors": os.urandom(5 * MiB + 3),
        "m/b.bin": os.urandom(2 * MiB),
        "m/sub/c.json": b"{}",
        "m/sub/d.txt": os.urandom(70_000),
    }
    put_many(s3, bucket, files)
    m: Mount = mount_s3(f"s3://{bucket}/m", "--endpoint-url", proxy.url)
    res = run_objfs("warm", str(m.path), "--jobs", "3")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[-1].startswith("warmed 4 files, 7.1 MiB in ")
    assert "ETA" in lines[-2]
    assert "files 4/4" in lines[-2]
    assert proxy.stats.count()["ranged_get"] > 0
    proxy.reset_stats()
    for key, data in files.items():
        assert sha256((m.path / key.removeprefix("m/")).read_bytes()) == sha256(data)
    assert proxy.stats.count()["ranged_get"] == 0  # every byte was already here


def test_warm_single_file_and_errors(mount_s3: Any, s3: Any, bucket: str, tmp_path: Path) -> None:
    s3.put_object(Bucket=bucket, Key="m/x.bin", Body=b"x" * 1000)
    m: Mount = mount_s3(f"s3://{bucket}/m")
    res = run_objfs("warm", str(m.path / "x.bin"))
    assert res.returncode == 0, res.stderr
    assert "warmed 1 files, 1000 B" in res.stderr

    res = run_objfs("warm", str(tmp_path))
    assert res.returncode == 2
    assert (
        res.stderr.strip()
        == f"objfs: error: {tmp_path} is not on an objfs mount: give a path under a mountpoint"
    )

    res = run_objfs("warm", str(m.path / "missing.bin"))
    assert res.returncode == 2
    assert "No such file or directory" in res.stderr
    assert len(res.stderr.splitlines()) == 1

    res = run_objfs("warm", str(m.path), "--jobs", "0")
    assert res.returncode == 2
    assert "--jobs" in res.stderr


def test_warm_cache_only_fills_the_disk_cache_and_sends_no_byte_to_the_kernel(
    proxy: Proxy, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """``--cache-only``: the daemon reads the files itself; nothing is served to the kernel
    (so no page cache is filled), and a remount on the same cache folder needs no GET."""
    files = {
        "m/a.safetensors": os.urandom(5 * MiB + 3),
        "m/b.bin": os.urandom(2 * MiB),
        "m/sub/c.json": b"{}",
    }
    put_many(s3, bucket, files)
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, proxy.url)
    with run_mount(cmd, mountpoint, tmp_path / "first.out") as first:
        res = run_objfs("warm", "--cache-only", str(first.path))
        assert res.returncode == 0, res.stderr
        last = res.stderr.splitlines()[-1]
        assert last.startswith("warmed 3 files into objfs's caches, 7.0 MiB in "), last
        assert proxy.stats.count()["ranged_get"] > 0
        # fsync of a file (what --cache-only sends) is what warms: nothing was read through
        # the kernel, and the whole version is on disk before the command returned.
        time.sleep(1.2)  # the status file is rewritten every second
        status = json.loads(run_objfs("status", "--json", str(first.path)).stdout)
        assert status["served"]["bytes"] == 0, status["served"]
    proxy.reset_stats()
    with run_mount(cmd, mountpoint, tmp_path / "second.out") as second:
        for key, data in files.items():
            assert sha256((second.path / key.removeprefix("m/")).read_bytes()) == sha256(data)
    assert proxy.stats.count()["ranged_get"] == 0, proxy.stats.requests


def test_warm_cache_only_fails_and_says_how_much_the_disk_cache_could_not_hold(
    proxy: Proxy, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """``--cache-only`` into a disk cache too small for what was asked exits 17 and says how
    much is missing and which option to raise: a file the cache could not keep whole, and
    files that each fit but not together. What fits exits 0."""
    files = {
        "m/one/big.bin": os.urandom(12 * MiB),  # over 90% of the cap: not cached whole
        "m/one/c.json": b"{}",
        "m/fits.bin": os.urandom(2 * MiB),
        **{f"m/many/{name}.bin": os.urandom(7 * MiB // 2) for name in "abc"},
    }
    put_many(s3, bucket, files)
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, proxy.url)
    cmd += ["--cache-size", "8M"]
    with run_mount(cmd, mountpoint, tmp_path / "mount.out") as m:
        time.sleep(1.2)  # the status file, which holds --cache-size, is rewritten every second
        # One file at a time (biggest first): side by side, the big file's blocks could
        # evict the small one's, and which is the luck of the timing.
        res = run_objfs(
            "warm", "--cache-only", "--jobs", "1", str(m.path / "one"), str(m.path / "fits.bin")
        )
        assert res.returncode == 17, res.stderr
        lines = res.stderr.splitlines()
        assert f"objfs: not stored whole in the disk cache: {m.path / 'one/big.bin'}" in lines
        assert lines[-1] == (
            "objfs: error: 12.0 MiB of 14.0 MiB could not be stored in the disk cache "
            "(--cache-size 8.0 MiB): raise --cache-size or warm fewer files"
        ), res.stderr
        assert any(line.startswith("warmed 2 files into objfs's caches, 2.0 MiB") for line in lines)

        res = run_objfs("warm", "--cache-only", str(m.path / "fits.bin"))
        assert res.returncode == 0, res.stderr
        assert res.stderr.splitlines()[-1].startswith("warmed 1 files into objfs's caches, 2.0")

        # One at a time, each fits when warmed, but the last evict the first.
        res = run_objfs("warm", "--cache-only", "--jobs", "1", str(m.path / "many"))
        assert res.returncode == 17, res.stderr
        assert res.stderr.splitlines()[-1] == (
            "objfs: error: 2.5 MiB of 10.5 MiB could not be stored in the disk cache "
            "(--cache-size 8.0 MiB): raise --cache-size or warm fewer files"
        ), res.stderr


def test_warm_cache_only_without_a_cache_dir_says_so(mount_s3: Any, s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="m/x.bin", Body=b"x" * 1000)
    m: Mount = mount_s3(f"s3://{bucket}/m")
    res = run_objfs("warm", "--cache-only", str(m.path))
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"objfs: error: --cache-only: the mount of {m.path / 'x.bin'} has no --cache-dir, so "
        "nothing would keep the bytes: mount with --cache-dir, or drop --cache-only to warm the "
        "page cache by reading through the mount"
    ]


def test_big_files_are_read_one_at_a_time_small_ones_alongside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shards (BIG_FILE_BYTES and up) are read one after another, biggest first, while the
    other workers read the small files; every file is read once."""
    big = warm_mod.BIG_FILE_BYTES
    files = [
        ("s1", big + 1),
        ("config.json", 900),
        ("s2", 3 * big),
        ("tokenizer.json", 5 * MiB),
        ("s3", big),
        ("vocab.txt", 70_000),
    ]
    assert warm_mod.plan(files) == [
        [("s2", 3 * big), ("s1", big + 1), ("s3", big)],
        [("tokenizer.json", 5 * MiB)],
        [("vocab.txt", 70_000)],
        [("config.json", 900)],
    ]
    assert warm_mod.plan([("a", 10)]) == [[("a", 10)]]

    lock = threading.Lock()
    reading: set[str] = set()
    big_at_once = 0
    small_beside_big = 0
    order: list[str] = []

    def fake_read(path: str, progress: warm_mod.Progress) -> None:
        nonlocal big_at_once, small_beside_big
        size = dict(files)[path]
        with lock:
            reading.add(path)
            order.append(path)
            big_now = [p for p in reading if dict(files)[p] >= big]
            big_at_once = max(big_at_once, len(big_now))
            if size < big and big_now:
                small_beside_big += 1
        time.sleep(0.05)
        progress.add(size)
        with lock:
            reading.discard(path)

    monkeypatch.setattr(warm_mod, "collect", lambda paths: list(files))
    monkeypatch.setattr(warm_mod, "_read_whole", fake_read)
    out = io.StringIO()
    assert warm_mod.warm(["unused"], jobs=3, out=out) == sum(size for _, size in files)
    assert sorted(order) == sorted(p for p, _ in files)  # each file once
    assert big_at_once == 1
    assert [p for p in order if dict(files)[p] >= big] == ["s2", "s1", "s3"]
    assert small_beside_big >= 1  # the small files did not wait for the shards
    assert out.getvalue().splitlines()[-1].startswith("warmed 6 files, ")
