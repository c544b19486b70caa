"""``objfs warm``: reads files ahead so a later load sends no request for their data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.conftest import Mount, put_many, run_objfs, sha256
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
