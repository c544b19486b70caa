"""Observability of a real mount: the Prometheus endpoint, `objfs status`, JSON logs.

Every figure is checked against what the test did: bytes read (by sha256), blocks, errors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from objfs.config import default_memory_ceiling, default_memory_limit
from objfs.demo import LocalServer, free_port
from objfs.mountinfo import mount_entry
from tests.conftest import mount_command, run_mount, sha256
from tests.helpers.deploy import (
    objfs,
    reaped,
    sample,
    scrape,
    sha256_file,
    wait_for,
)

MiB = 1 << 20
SIZE = 5 * MiB + 123  # six 1 MiB blocks, the last one short
BLOCKS = 6


@pytest.fixture
def runtime_env(tmp_path: Path) -> dict[str, str]:
    """Status files of this test's mounts in a folder of its own."""
    folder = tmp_path / "run"
    return {"OBJFS_RUNTIME_DIR": str(folder)}


def status_json(mnt: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    res = objfs("status", "--json", *extra, str(mnt), env=env)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def test_metrics_counters_follow_reads(
    mount_s3: Any, s3: Any, bucket: str, runtime_env: dict[str, str]
) -> None:
    weights = os.urandom(SIZE)
    s3.put_object(Bucket=bucket, Key="m/model.bin", Body=weights)
    s3.put_object(Bucket=bucket, Key="m/config.json", Body=b'{"layers": 2}')
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    m = mount_s3(
        f"s3://{bucket}/m",
        "--metrics-addr",
        f"127.0.0.1:{port}",
        "--memory-limit",
        "256M",
        env=runtime_env,
    )

    before = scrape(url)
    assert sample(before, "objfs_served_bytes_total") == 0
    assert sample(before, "objfs_store_fetched_bytes_total") == 0
    assert sample(before, "objfs_store_requests_total", operation="get") == 0
    assert sample(before, "objfs_memory_limit_bytes") == 256 * MiB
    assert sample(before, "objfs_memory_ceiling_bytes") == 256 * MiB  # given: never grows
    info = [k for k in before if k[0] == "objfs_info"]
    assert dict(info[0][1])["source"] == f"s3://{bucket}/m/"
    assert dict(info[0][1])["mountpoint"] == str(m.path)

    assert sha256_file(m.path / "model.bin") == sha256(weights)
    after = scrape(url)
    assert sample(after, "objfs_served_bytes_total") == SIZE
    assert sample(after, "objfs_served_reads_total") >= 1
    assert sample(after, "objfs_store_fetched_bytes_total") == SIZE
    gets = sample(after, "objfs_store_requests_total", operation="get")
    assert gets >= 1
    assert sample(after, "objfs_store_request_duration_seconds_count", operation="get") == gets
    assert (
        sample(after, "objfs_store_request_duration_seconds_bucket", operation="get", le="+Inf")
        == gets
    )
    assert sample(after, "objfs_store_request_duration_seconds_sum", operation="get") > 0
    assert sample(after, "objfs_store_requests_in_flight") == 0
    assert sample(after, "objfs_cache_hits_total", tier="memory") >= BLOCKS
    assert sample(after, "objfs_cache_misses_total", tier="memory") >= 1
    assert sample(after, "objfs_memory_used_bytes") == SIZE  # every block, nothing in flight
    assert sample(after, "objfs_memory_evicted_unread_blocks_total") == 0  # room enough
    errors = {dict(k[1])["kind"]: v for k, v in after.items() if k[0] == "objfs_store_errors_total"}
    assert set(errors.values()) == {0}
    assert {"stale", "not_found", "access_denied", "transient", "unreachable"} <= set(errors)

    # The second read comes from the kernel's page cache: no FUSE read, no GET.
    assert sha256_file(m.path / "model.bin") == sha256(weights)
    again = scrape(url)
    assert sample(again, "objfs_served_bytes_total") == SIZE
    assert sample(again, "objfs_store_fetched_bytes_total") == SIZE

    # A small file adds exactly its size to both.
    assert (m.path / "config.json").read_bytes() == b'{"layers": 2}'
    last = scrape(url)
    assert sample(last, "objfs_served_bytes_total") == SIZE + 13
    assert sample(last, "objfs_store_fetched_bytes_total") == SIZE + 13

    # `objfs status` reports the same figures (its file is rewritten every second).
    figures = wait_for(
        "the status file to show the reads",
        lambda: (s := status_json(m.path, runtime_env))["served"]["bytes"] == SIZE + 13 and s,
    )
    assert figures["store"]["bytes_fetched"] == SIZE + 13
    assert figures["store"]["requests"]["get"] == sample(
        last, "objfs_store_requests_total", operation="get"
    )
    assert figures["source"] == f"s3://{bucket}/m/"
    assert figures["pid"] == m.proc.pid
    assert figures["memory"]["limit_bytes"] == 256 * MiB
    text = objfs("status", str(m.path), env=runtime_env)
    assert text.returncode == 0, text.stderr
    assert f"s3://{bucket}/m/" in text.stdout
    assert "5.0 MiB in" in text.stdout  # served
    assert f"http://127.0.0.1:{port}/metrics" in text.stdout
    assert objfs("status", "--probe", str(m.path), env=runtime_env).returncode == 0


def test_the_default_budget_grows_while_processes_share_a_file_and_shrinks_after(
    mount_s3: Any, s3: Any, bucket: str, runtime_env: dict[str, str]
) -> None:
    """Three processes with the same 24 MiB file open (more than a part): the default budget
    is three times its base until they close it; each reads the whole file, byte for byte."""
    weights = os.urandom(24 * MiB)
    s3.put_object(Bucket=bucket, Key="m/model.bin", Body=weights)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    m = mount_s3(f"s3://{bucket}/m", "--metrics-addr", f"127.0.0.1:{port}", env=runtime_env)
    base = sample(scrape(url), "objfs_memory_limit_bytes")
    ceiling = sample(scrape(url), "objfs_memory_ceiling_bytes")
    assert base == default_memory_limit()
    assert ceiling == default_memory_ceiling()
    # Each process opens the file, says so, waits for a line, then reads it whole.
    reader = (
        "import hashlib, sys\n"
        "f = open(sys.argv[1], 'rb')\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"
        "print(hashlib.sha256(f.read()).hexdigest(), flush=True)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", reader, str(m.path / "model.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == "open\n"
        assert sample(scrape(url), "objfs_memory_limit_bytes") == min(ceiling, 3 * base)
        wait_for(
            "`objfs status` to show the grown budget",
            lambda: (
                status_json(m.path, runtime_env)["memory"]["limit_bytes"] == min(ceiling, 3 * base)
            ),
        )
        shown = objfs("status", str(m.path), env=runtime_env).stdout
        assert (f"(grows to {ceiling / MiB:.1f} MiB)" in shown) == (ceiling > 3 * base), shown
        digests = [p.communicate("go\n", timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert digests == [sha256(weights)] * 3
    wait_for(
        "the budget to shrink back",
        lambda: sample(scrape(url), "objfs_memory_limit_bytes") == base,
    )
    assert sample(scrape(url), "objfs_store_fetched_bytes_total") == len(weights)


def test_errors_are_counted_by_kind(
    mount_s3: Any, s3_server: LocalServer, s3: Any, bucket: str, runtime_env: dict[str, str]
) -> None:
    s3.put_object(Bucket=bucket, Key="x/small.bin", Body=b"a" * 1000)
    port = free_port()
    m = mount_s3(f"s3://{bucket}/x", "--metrics-addr", f"127.0.0.1:{port}", env=runtime_env)
    code = (
        "import errno, os, sys, boto3\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "c = boto3.client('s3', endpoint_url=sys.argv[2], region_name='us-east-1')\n"
        "c.put_object(Bucket=sys.argv[3], Key='x/small.bin', Body=b'b' * 1000)\n"
        "try:\n"
        "    os.read(fd, 1000)\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(m.path / "small.bin"), s3_server.url, bucket],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    assert res.stdout.strip() == "ESTALE"
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    errors = {
        dict(k[1])["kind"]: v for k, v in samples.items() if k[0] == "objfs_store_errors_total"
    }
    assert errors["stale"] >= 1
    assert sum(v for kind, v in errors.items() if kind != "stale") == 0
    assert sample(samples, "objfs_served_bytes_total") == 0


def test_disk_tier_metrics_after_remount(
    mount_s3: Any,
    s3_server: LocalServer,
    s3: Any,
    bucket: str,
    tmp_path: Path,
    runtime_env: dict[str, str],
) -> None:
    weights = os.urandom(SIZE)
    s3.put_object(Bucket=bucket, Key="d/w.bin", Body=weights)
    cache = tmp_path / "cache"
    port = free_port()
    first_mnt = tmp_path / "first"
    first_mnt.mkdir()
    cmd = mount_command(
        f"s3://{bucket}/d",
        first_mnt,
        tmp_path / "first.log",
        "--endpoint-url",
        s3_server.url,
        "--cache-dir",
        str(cache),
    )
    # run_mount unmounts on exit and checks the daemon exits 0 (it flushes its disk writes).
    with run_mount(cmd, first_mnt, tmp_path / "first.out", runtime_env) as first:
        assert sha256_file(first.path / "w.bin") == sha256(weights)

    # The daemon's own disk-tier reads: on the kernel transport a version whole on disk is
    # read by the kernel itself (passthrough; tests/test_kernel_transport.py), not counted.
    second = mount_s3(
        f"s3://{bucket}/d",
        "--cache-dir",
        str(cache),
        "--metrics-addr",
        f"127.0.0.1:{port}",
        "--fuse-transport",
        "pyfuse3",
        env=runtime_env,
    )
    assert sha256_file(second.path / "w.bin") == sha256(weights)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert sample(samples, "objfs_cache_hits_total", tier="disk") == BLOCKS
    assert sample(samples, "objfs_cache_misses_total", tier="disk") == 0
    assert sample(samples, "objfs_store_requests_total", operation="get") == 0
    assert sample(samples, "objfs_store_fetched_bytes_total") == 0
    assert sample(samples, "objfs_served_bytes_total") == SIZE
    assert sample(samples, "objfs_disk_cache_bytes") >= SIZE
    assert sample(samples, "objfs_disk_cache_enabled") == 1
    figures = wait_for(
        "the status file to show the disk hits",
        lambda: (f := status_json(second.path, runtime_env))["disk"]["hits"] == BLOCKS and f,
    )
    assert figures["store"]["requests"]["get"] == 0
    # The second mount wrote its own status file; the first removed its own on exit.
    files = sorted(p.name for p in Path(runtime_env["OBJFS_RUNTIME_DIR"]).iterdir())
    assert len(files) == 1, files


def start_foreground(
    s3_server: LocalServer, source: str, mnt: Path, log: Path, env: dict[str, str], *opts: str
) -> subprocess.Popen[bytes]:
    cmd = mount_command(source, mnt, log, "--endpoint-url", s3_server.url, *opts)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    wait_for("the mount", lambda: proc.poll() is not None or mount_entry(str(mnt)) is not None)
    assert proc.poll() is None, log.read_text()
    return proc


def test_status_answers_while_the_daemon_hangs_and_after_it_died(
    s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    s3.put_object(Bucket=bucket, Key="h/a.txt", Body=b"hello")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = start_foreground(s3_server, f"s3://{bucket}/h", mnt, tmp_path / "log", runtime_env)
    with reaped(proc, mnt):
        wait_for(
            "the status file",
            lambda: objfs("status", "--probe", str(mnt), env=runtime_env).returncode == 0,
        )
        os.kill(proc.pid, signal.SIGSTOP)  # a hung daemon: the mount answers nothing now
        try:
            # status never touches the mount: it answers at once, from the file.
            res = objfs("status", str(mnt), env=runtime_env)
            assert res.returncode == 0, res.stderr
            assert f"pid {proc.pid}" in res.stdout
            # Once the file is older than --max-age, the probe fails with 18.
            res = wait_for(
                "the probe to see a silent daemon",
                lambda: (
                    (
                        r := objfs("status", "--probe", "--max-age", "1", str(mnt), env=runtime_env)
                    ).returncode
                    == 18
                    and r
                ),
            )
            assert res.stdout == ""
            assert res.stderr.startswith("objfs: error: the objfs daemon of ")
            assert "has not reported" in res.stderr
            assert len(res.stderr.splitlines()) == 1
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_for(
            "the probe to pass again",
            lambda: (
                objfs("status", "--probe", "--max-age", "3", str(mnt), env=runtime_env).returncode
                == 0
            ),
        )

        assert (mnt / "a.txt").read_bytes() == b"hello"  # the kernel now caches attributes
        proc.kill()  # a crash: the mount stays, dead (ENOTCONN)
        proc.wait(timeout=30)
        assert mount_entry(str(mnt)) is not None
        res = objfs("status", str(mnt), env=runtime_env)
        assert res.returncode == 18, res.stderr
        assert f"(pid {proc.pid}) is gone" in res.stderr
        assert f"objfs unmount --force {mnt}" in res.stderr

        # unmount --if-dead detaches exactly such a mount.
        res = objfs("unmount", "--if-dead", str(mnt), env=runtime_env)
        assert res.returncode == 0, res.stderr
        assert mount_entry(str(mnt)) is None
        res = objfs("status", str(mnt), env=runtime_env)
        assert res.returncode == 15
        assert res.stderr == f"objfs: error: {mnt} is not mounted\n"


def _reaped_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_status_files_of_daemons_that_are_gone_are_removed(tmp_path: Path) -> None:
    """Only a status file both old and of a pid that no longer runs (or holding no pid) is
    removed, and old temporary files; anything else in the folder stays."""
    from objfs.status_files import STALE_STATUS_S, remove_stale_status_files, status_file_name

    folder = tmp_path / "run"
    folder.mkdir()
    dead = _reaped_pid()
    old = time.time() - STALE_STATUS_S - 5

    def status(name: str, pid: object, *, age_old: bool, text: str | None = None) -> Path:
        path = folder / status_file_name(name)
        path.write_text(text if text is not None else json.dumps({"pid": pid}))
        if age_old:
            os.utime(path, (old, old))
        return path

    gone = status("/gone", dead, age_old=True)
    garbage = status("/garbage", None, age_old=True, text="{not json")
    fresh_dead = status("/fresh", dead, age_old=False)  # a daemon of another pid namespace
    old_alive = status("/stuck", os.getpid(), age_old=True)  # a daemon whose loop hangs
    other = folder / "notes.json"
    other.write_text("{}")
    os.utime(other, (old, old))
    old_tmp = folder / ".status-abc123"
    old_tmp.write_text("{")
    os.utime(old_tmp, (old, old))
    new_tmp = folder / ".status-def456"
    new_tmp.write_text("{")

    assert remove_stale_status_files(str(folder)) == 3
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (fresh_dead, old_alive, other, new_tmp)
    )
    assert not gone.exists()
    assert not garbage.exists()
    assert remove_stale_status_files(str(folder)) == 0
    assert remove_stale_status_files(str(tmp_path / "missing")) == 0


def test_a_mount_removes_the_status_files_of_daemons_that_are_gone(
    mount_s3: Any, s3: Any, bucket: str, runtime_env: dict[str, str]
) -> None:
    from objfs.status_files import STALE_STATUS_S, status_file_name

    folder = Path(runtime_env["OBJFS_RUNTIME_DIR"])
    folder.mkdir()
    stale = folder / status_file_name("/a/mount/of/a/killed/daemon")
    stale.write_text(json.dumps({"pid": _reaped_pid(), "mountpoint": "/a/mount"}))
    old = time.time() - STALE_STATUS_S - 5
    os.utime(stale, (old, old))
    s3.put_object(Bucket=bucket, Key="g/a.txt", Body=b"here")
    m = mount_s3(f"s3://{bucket}/g", env=runtime_env)
    assert (m.path / "a.txt").read_bytes() == b"here"
    wait_for(
        "the daemon's own status file",
        lambda: objfs("status", "--probe", str(m.path), env=runtime_env).returncode == 0,
    )
    assert not stale.exists()
    assert [p.name for p in folder.iterdir()] == [status_file_name(str(m.path))]
    assert "removed 1 status files of daemons that are gone" in m.log()


def test_unmount_if_dead_leaves_a_live_mount_alone(
    mount_s3: Any, s3: Any, bucket: str, runtime_env: dict[str, str]
) -> None:
    s3.put_object(Bucket=bucket, Key="l/a.txt", Body=b"alive")
    m = mount_s3(f"s3://{bucket}/l", env=runtime_env)
    res = objfs("unmount", "--if-dead", str(m.path))
    assert res.returncode == 0, res.stderr
    assert mount_entry(str(m.path)) is not None
    assert (m.path / "a.txt").read_bytes() == b"alive"
    not_mounted = m.path.parent / "never-mounted"
    not_mounted.mkdir()
    assert objfs("unmount", "--if-dead", str(not_mounted)).returncode == 0


def test_status_of_a_path_that_is_not_an_objfs_mount(tmp_path: Path) -> None:
    res = objfs("status", str(tmp_path))
    assert (res.returncode, res.stdout) == (15, "")
    assert res.stderr == f"objfs: error: {tmp_path} is not mounted\n"
    other = tmp_path / "tmpfs"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(other)], check=True)
    try:
        res = objfs("status", str(other))
        assert res.returncode == 15
        assert res.stderr == f"objfs: error: {other} is not an objfs mount (it is tmpfs)\n"
    finally:
        subprocess.run(["umount", str(other)], check=True)


def test_json_logs_with_request_lines_and_no_secrets(
    s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    s3.put_object(Bucket=bucket, Key="j/w.bin", Body=os.urandom(3 * MiB))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "objfs.log"
    secrets = {"AWS_ACCESS_KEY_ID": "AKIDJSONLOGTEST", "AWS_SECRET_ACCESS_KEY": "s3cr3t-Js0n-L0g"}
    proc = start_foreground(
        s3_server,
        f"s3://{bucket}/j",
        mnt,
        log,
        {**runtime_env, **secrets},
        "--log-format",
        "json",
        "--log-level",
        "debug",
    )
    with reaped(proc, mnt):
        sha256_file(mnt / "w.bin")
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        assert proc.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert records
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record)
        assert record["level"] in ("debug", "info", "warning", "error")
    gets = [r for r in records if r["logger"] == "objfs.store" and r["message"].startswith("GET ")]
    assert gets
    assert all(r["level"] == "debug" for r in gets)
    assert sum(int(r["message"].split(": ")[1].split()[0]) for r in gets) == 3 * MiB
    assert any(r["message"].startswith("mounted s3://") for r in records)
    text = log.read_text()
    for secret in secrets.values():
        assert secret not in text


def test_metrics_addr_errors_are_one_line_and_mount_nothing(
    s3_server: LocalServer, bucket: str, tmp_path: Path
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    source = f"s3://{bucket}"
    res = objfs("mount", source, str(mnt), "--metrics-addr", "9101")
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.startswith("objfs: error: --metrics-addr: '9101' is not HOST:PORT")
    assert len(res.stderr.splitlines()) == 1
    # A port that is taken: the daemon fails before mounting and says why.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = objfs(
            "mount",
            source,
            str(mnt),
            "--endpoint-url",
            s3_server.url,
            "--metrics-addr",
            f"127.0.0.1:{port}",
        )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"objfs: error: --metrics-addr 127.0.0.1:{port}: cannot listen")
    assert len(res.stderr.splitlines()) == 1
    assert mount_entry(str(mnt)) is None
