"""Long-lived mounts through real FUSE mounts against moto: versions, outages, empty sources.

The core side of the same behaviour (request counts, clocks) is in tests/test_long_lived.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from typing import Any

import pytest

from tests.conftest import Mount, run_objfs, sha256
from tests.helpers.proxy import FaultPlan, Proxy

MiB = 1 << 20
FAST_FAILURE = ("--read-timeout", "1.5", "--connect-timeout", "1", "--max-attempts", "2")


def make_store_unreachable(proxy: Proxy) -> None:
    """Every new connection reset, and every request on a kept-alive one too."""
    proxy.refuse(True)
    proxy.set_faults(FaultPlan(("reset",), every=1, target="all", cut_after=0))


def status(m: Mount) -> dict[str, Any]:
    time.sleep(1.2)  # the status file is rewritten every second
    result = run_objfs("status", "--json", str(m.path))
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_an_old_handle_never_reads_the_new_version(mount_s3: Any, s3: Any, bucket: str) -> None:
    """Handle A reads half, the object is replaced, handle B reads all of it after the TTL,
    then A reads the rest: A gets old bytes or ESTALE, never new ones (one inode per
    version: B's open cannot refill A's page cache with the new version)."""
    old, new = os.urandom(8 * MiB), os.urandom(8 * MiB)
    s3.put_object(Bucket=bucket, Key="m/w.bin", Body=old)
    m: Mount = mount_s3(f"s3://{bucket}/m", "--metadata-ttl", "1")
    path = m.path / "w.bin"
    fd_a = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd_a, 4 * MiB, 0) == old[: 4 * MiB]
        inode_a = os.fstat(fd_a).st_ino
        s3.put_object(Bucket=bucket, Key="m/w.bin", Body=new)
        time.sleep(1.5)  # past the TTL: a new open sees the new version
        with open(path, "rb") as b:
            assert os.fstat(b.fileno()).st_ino != inode_a
            assert sha256(b.read()) == sha256(new)
        rest = bytearray()
        failure = None
        try:
            while len(rest) < 4 * MiB:
                chunk = os.pread(fd_a, MiB, 4 * MiB + len(rest))
                if not chunk:
                    break
                rest += chunk
        except OSError as exc:
            failure = exc.errno
        assert failure in (None, errno.ESTALE)
        assert bytes(rest) == old[4 * MiB : 4 * MiB + len(rest)], "A got bytes of B's version"
        assert os.fstat(fd_a).st_size == len(old)
    finally:
        os.close(fd_a)
    assert sha256(path.read_bytes()) == sha256(new)


@pytest.mark.parametrize("outage", ["refused", "stopped"])
def test_cached_files_stay_readable_while_the_store_is_unreachable(
    mount_s3: Any, s3: Any, bucket: str, proxy: Proxy, tmp_path: Any, outage: str
) -> None:
    """``refused``: every new connection reset and every request on a kept-alive one too.
    ``stopped``: the store's address stops answering (the proxy closes its listener and every
    connection it carries), as when the store's process or host goes away."""
    data = os.urandom(6 * MiB)
    s3.put_object(Bucket=bucket, Key="model.safetensors", Body=data)
    s3.put_object(Bucket=bucket, Key="config.json", Body=b'{"a": 1}')
    s3.put_object(Bucket=bucket, Key="never-read.bin", Body=b"x" * 1000)
    m: Mount = mount_s3(
        f"s3://{bucket}",
        "--endpoint-url",
        proxy.url,
        "--metadata-ttl",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        *FAST_FAILURE,
    )
    model = m.path / "model.safetensors"
    assert sha256(model.read_bytes()) == sha256(data)
    assert (m.path / "config.json").read_bytes() == b'{"a": 1}'
    assert (m.path / "never-read.bin").stat().st_size == 1000
    if outage == "refused":
        make_store_unreachable(proxy)
    else:
        proxy.stop()
    time.sleep(3)  # every piece of metadata is past its TTL
    started = time.monotonic()
    assert model.stat().st_size == len(data)
    assert sha256(model.read_bytes()) == sha256(data)  # the page cache
    with open(model, "rb") as f:  # drop the page cache: objfs serves from its caches
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert sha256(f.read()) == sha256(data)
    assert (m.path / "config.json").read_bytes() == b'{"a": 1}'
    assert sorted(p.name for p in m.path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "never-read.bin",
    ]
    # Bytes nobody cached cannot be served: an error, bounded in time, never a hang.
    with pytest.raises(OSError, match="Input/output error") as info:
        (m.path / "never-read.bin").read_bytes()
    assert info.value.errno == errno.EIO
    assert time.monotonic() - started < 60
    figures = status(m)["metadata"]
    assert figures["outages"] == 1
    assert figures["stale_answers"] > 0
    assert figures["unreachable_for_s"] is not None
    text = run_objfs("status", str(m.path)).stdout
    assert "UNREACHABLE" in text
    assert m.log().count("the store is unreachable") == 1  # one warning per outage
    proxy.set_faults(None)
    proxy.refuse(False)


def test_strict_mount_fails_when_the_store_is_unreachable(
    mount_s3: Any, s3: Any, bucket: str, proxy: Proxy
) -> None:
    s3.put_object(Bucket=bucket, Key="config.json", Body=b"{}")
    m: Mount = mount_s3(
        f"s3://{bucket}",
        "--endpoint-url",
        proxy.url,
        "--metadata-ttl",
        "1",
        "--max-stale",
        "0",
        *FAST_FAILURE,
    )
    assert (m.path / "config.json").read_bytes() == b"{}"
    make_store_unreachable(proxy)
    time.sleep(1.5)
    with pytest.raises(OSError, match="Input/output error") as info:
        (m.path / "config.json").stat()
    assert info.value.errno == errno.EIO


def test_an_empty_source_warns_at_mount(mount_s3: Any, s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="models/llama/config.json", Body=b"{}")
    m: Mount = mount_s3(f"s3://{bucket}/models/Llama")  # wrong case: nothing is there
    assert list(m.path.iterdir()) == []
    assert "holds no objects" in m.log()
    assert status(m)["metadata"]["empty_source"] is True
    assert "mistyped" in run_objfs("status", str(m.path)).stdout
    fine: Mount = mount_s3(f"s3://{bucket}/models/llama")
    assert (fine.path / "config.json").read_bytes() == b"{}"
    assert "holds no objects" not in fine.log()


def test_a_stat_in_a_prefix_of_100k_keys_costs_three_requests(tmp_path: Any) -> None:
    """Through a real mount of a 100,000-key prefix (a memory bucket served by a child: moto
    would take minutes to fill): a fresh mount's stat of one name costs at most 3 store
    requests (the first listing page shows the directory is big; then one HEAD and one
    one-key listing under the name), and ``ls -l`` of the whole prefix still lists it all."""
    from tests.helpers.serve_keys import generated_bytes
    from tests.test_bad_input import serve_keys

    count = 100_000
    spec = {"generate": [{"prefix": "many/f", "count": count}], "source": "s3://memory/many"}
    with serve_keys(tmp_path, spec) as m:
        at_mount = status(m)["store"]["requests"]  # the mount's own check: one listing
        assert os.stat(m.path / "f054321").st_size == len(generated_bytes(54_321))
        after = status(m)["store"]["requests"]
        cost = {op: after.get(op, 0) - at_mount.get(op, 0) for op in after}
        assert sum(cost.values()) <= 3, (at_mount, after)
        assert cost.get("get", 0) == 0, cost
        listing = subprocess.run(
            ["ls", "-l", str(m.path)], capture_output=True, text=True, timeout=300, check=True
        ).stdout.splitlines()
        assert listing[0].startswith("total")
        assert len(listing) == count + 1
        assert listing[-1].endswith(" f099999")
        assert (m.path / "f099999").read_bytes() == generated_bytes(99_999)


def test_an_empty_account_root_warns_about_the_account(tmp_path: Any) -> None:
    """``s3://`` with no bucket visible: the warning and ``status`` ask which account, not
    whether a prefix is mistyped (a memory store with nothing in it, served by a child)."""
    from tests.test_bad_input import serve_keys

    with serve_keys(tmp_path, {"source": "s3://", "objects": {}}) as m:
        assert os.listdir(m.path) == []
        assert m.log().count("the credentials see no bucket or container") == 1
        assert "mistyped" not in m.log()
        figures = status(m)["metadata"]
        assert figures["empty_source"] is True
        assert figures["account_root"] is True
        assert "which account?" in run_objfs("status", str(m.path)).stdout
