"""Issue 30's items that cross the network, through real mounts against moto's S3 server.

* item 1 and 9: a handle pinned to one version never reads another's bytes, whatever the
  caches evict, even behind a gateway that ignores ``If-Match`` (the counting proxy drops the
  header): the reply's ETag is checked. With ``read`` and with ``mmap``.
* item 2: a known name in a directory of more than one listing page is served stale while
  the store is unreachable (no EIO), and a probe's directory check is a one-key listing.
* item 10: data GETs through an HTTP proxy from the environment (the SDK's path) are retried
  on broken and short bodies.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    EFFECTIVE_TRANSPORT,
    Mount,
    cached_mount_command,
    put_many,
    run_mount,
    run_objfs,
    sha256,
)
from tests.helpers.proxy import FaultPlan, Proxy

MiB = 1 << 20
SIZE = 16 * MiB
CHUNK = MiB

# Holds a handle on the old version: reports its inode and first page, waits for a line on
# stdin (the parent replaced the object and made the caches evict it), drops the file's
# pages from the page cache, then reads the rest chunk by chunk: a hash per chunk, or the
# errno of a failed read (read mode; with mmap a failed read is SIGBUS).
HOLDER = r"""
import hashlib, mmap, os, sys
path, mode, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
print("ino", os.fstat(fd).st_ino, flush=True)
m = mmap.mmap(fd, size, prot=mmap.PROT_READ) if mode == "mmap" else None
first = m[:4096] if m is not None else os.pread(fd, 4096, 0)
print("first", hashlib.sha256(first).hexdigest(), flush=True)
sys.stdin.readline()
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
for off in range(chunk, size, chunk):
    try:
        data = m[off:off + chunk] if m is not None else os.pread(fd, chunk, off)
        print("chunk", off, hashlib.sha256(data).hexdigest(), flush=True)
    except OSError as exc:
        print("errno", off, exc.errno, flush=True)
print("done", flush=True)
"""


def _chunk_hashes(data: bytes) -> dict[int, str]:
    return {
        off: hashlib.sha256(data[off : off + CHUNK]).hexdigest()
        for off in range(CHUNK, len(data), CHUNK)
    }


@pytest.mark.parametrize("mode", ["read", "mmap"])
def test_item1_a_handle_never_reads_another_versions_bytes_after_eviction(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, mode: str
) -> None:
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    fillers = {f"m/fill{i}.bin": os.urandom(SIZE) for i in range(2)}
    put_many(s3, bucket, {"m/a.bin": old, **fillers})
    cmd, mountpoint = cached_mount_command(f"s3://{bucket}/m", tmp_path, proxy.url)
    # A disk cache that holds one of the three files, memory that holds few of their blocks.
    cmd += ["--cache-size", "24M", "--memory-limit", "64M", "--metadata-ttl", "1"]
    with run_mount(cmd, mountpoint, tmp_path / "mount.out"):
        warmed = run_objfs("warm", "--cache-only", str(mountpoint / "a.bin"))
        assert warmed.returncode == 0, warmed.stderr
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(mountpoint / "a.bin"), mode, str(CHUNK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdin is not None
            ino = int(holder.stdout.readline().split()[1])
            assert holder.stdout.readline().split()[1] == hashlib.sha256(old[:4096]).hexdigest()
            # A gateway that ignores If-Match from now on; the object is replaced.
            proxy.drop_request_headers({"if-match"})
            s3.put_object(Bucket=bucket, Key="m/a.bin", Body=new)
            time.sleep(1.5)  # past the metadata TTL
            assert os.stat(mountpoint / "a.bin").st_ino != ino  # a new inode for the new one
            assert sha256((mountpoint / "a.bin").read_bytes()) == sha256(new)
            for key, data in fillers.items():  # the caches must make room
                assert sha256((mountpoint / key[2:]).read_bytes()) == sha256(data)
            proxy.reset_stats()
            holder.stdin.write("go\n")
            holder.stdin.flush()
            out, _ = holder.communicate(timeout=120)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        old_chunks, new_chunks = _chunk_hashes(old), _chunk_hashes(new)
        lines = [line.split() for line in out.splitlines()]
        read = {int(w[1]): w[2] for w in lines if w[0] == "chunk"}
        failed = {int(w[1]): int(w[2]) for w in lines if w[0] == "errno"}
        from_new = [off for off, digest in read.items() if digest == new_chunks[off]]
        assert from_new == [], f"offsets {from_new} returned the new version's bytes"
        assert all(digest == old_chunks[off] for off, digest in read.items())
        assert set(failed.values()) <= {errno.ESTALE, errno.EIO}, failed
        if mode == "mmap":
            assert holder.returncode in (0, -signal.SIGBUS), holder.returncode
        else:
            assert holder.returncode == 0
            assert set(read) | set(failed) == set(old_chunks)
        gets = [r for r in proxy.stats.requests if r.method == "GET" and "a.bin" in r.target]
        if EFFECTIVE_TRANSPORT == "kernel":
            # Passthrough: the holder opened the warmed version's disk-cache file, which the
            # kernel reads itself; eviction unlinks it, and the holder reads its own version
            # whole from the unlinked file, with no GET.
            assert failed == {}
            assert gets == []
            return
        # The old version's blocks were evicted: the holder's reads reached the store, whose
        # replies (the If-Match dropped on the way) were of the new version.
        assert gets, "the holder's reads never reached the store: nothing was evicted"
        assert proxy.injected["dropped if-match"] > 0


def test_item2_a_known_name_in_a_big_directory_is_served_during_an_outage(
    s3: Any, bucket: str, proxy: Proxy, mount_s3: Any
) -> None:
    put_many(s3, bucket, {f"big/k{i:04d}": b"x" * (i % 7) for i in range(1100)})
    m: Mount = mount_s3(f"s3://{bucket}/big", "--endpoint-url", proxy.url, "--metadata-ttl", "1")
    assert os.stat(m.path / "k0042").st_size == 42 % 7
    # The lookup probed (the directory takes two pages): a HEAD and a one-key listing.
    probes = [r.target for r in proxy.stats.requests if "prefix=big%2Fk0042%2F" in r.target]
    assert probes, [r.target for r in proxy.stats.requests]
    assert all("max-keys=1" in t and "delimiter" not in t for t in probes), probes
    proxy.refuse(True)
    time.sleep(1.5)  # past the TTL: the kernel asks again, the store is unreachable
    assert os.stat(m.path / "k0042").st_size == 42 % 7
    with open(m.path / "k0042", "rb") as fp:
        assert fp.read() == b"x" * (42 % 7)
    proxy.refuse(False)
    assert "serving cached metadata" in m.log()


def test_item10_reads_through_an_http_proxy_are_retried(
    s3: Any, s3_server: Any, bucket: str, mount_s3: Any
) -> None:
    objects = {f"p/f{i}.bin": os.urandom(3 * MiB + i) for i in range(3)}
    put_many(s3, bucket, objects)
    port = int(s3_server.url.rsplit(":", 1)[1])
    with Proxy(port) as forward:
        env = {"HTTP_PROXY": forward.url, "http_proxy": forward.url, "NO_PROXY": "", "no_proxy": ""}
        m: Mount = mount_s3(f"s3://{bucket}/p", "--part-size", "1M", env=env)
        forward.set_faults(FaultPlan(("truncate", "wrong_range"), every=3))
        for key, data in objects.items():
            assert sha256((m.path / key[2:]).read_bytes()) == sha256(data)
        forward.set_faults(None)
        # The GETs went through the proxy (the SDK's path), and faults met them.
        assert any(r.target.startswith("http://") for r in forward.stats.requests)
        assert sum(forward.injected[k] for k in ("truncate", "wrong_range")) > 0
