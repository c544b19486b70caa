"""Load on real mounts, bounded in size and time: many concurrent readers get every byte right
within the memory budget, and thousands of opens, reads and listings leak no file descriptor
and no thread in the daemon. Nothing here asserts a duration."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from objfs.demo import LocalServer
from tests.conftest import mount_command, put_many, run_mount
from tests.helpers.deploy import objfs, wait_for
from tests.helpers.load_reader import expected_sha256, plan
from tests.helpers.rss import PeakRss

MiB = 1024 * 1024
HELPERS = Path(__file__).parent / "helpers"

PROCESSES = 8
THREADS = 4  # per reader process: 32 readers in all


def test_32_concurrent_readers_get_every_byte_within_the_memory_budget(
    tmp_path: Path,
) -> None:
    """8 processes x 4 threads over 8 files (64-92 MiB) of a memory-backend mount: half read
    whole files (two readers per file at once) and check their sha256, half make seeded random
    reads of 4 KiB-1 MiB, each compared with the synthetic bytes of its range. The files add
    up to more than the memory budget, so blocks are evicted and fetched again while the
    daemon's RSS, sampled throughout, stays within the budget + 150 MiB."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    budget = 256 * MiB
    # Odd sizes: every file ends in a short block.
    sizes = {f"shard{i}.bin": 64 * MiB + i * 4 * MiB + 4097 * i + 1 for i in range(8)}
    assert sum(sizes.values()) > 2 * budget
    cmd = [
        sys.executable,
        str(HELPERS / "serve_memory.py"),
        str(mountpoint),
        *(f"{name}={size}" for name, size in sizes.items()),
        "--memory-limit",
        str(budget),
    ]
    with run_mount(cmd, mountpoint, tmp_path / "daemon.log") as m, PeakRss(m.proc.pid) as rss:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HELPERS / "load_reader.py"),
                    str(m.path),
                    str(p),
                    str(THREADS),
                    *(f"{name}={size}" for name, size in sizes.items()),
                ],
                stdout=subprocess.PIPE,
            )
            for p in range(PROCESSES)
        ]
        outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0] * PROCESSES
    results = [json.loads(line) for out in outputs for line in out.splitlines()]
    assert sorted(r["worker"] for r in results) == list(range(PROCESSES * THREADS))
    assert [r for r in results if "error" in r] == []

    names = list(sizes)
    with ThreadPoolExecutor(2) as pool:
        digests = dict(
            zip(names, pool.map(lambda n: expected_sha256(n, sizes[n]), names), strict=True)
        )
    sequential = [r for r in results if r["kind"] == "sequential"]
    random_reads = [r for r in results if r["kind"] == "random"]
    assert len(sequential) == len(random_reads) == PROCESSES * THREADS // 2
    for r in sequential:
        assert plan(r["worker"], THREADS, names).names == (r["name"],)
        assert r["bytes"] == sizes[r["name"]], r
        assert r["sha256"] == digests[r["name"]], r
    # Each file had two whole-file readers, in different processes.
    assert Counter(r["name"] for r in sequential) == dict.fromkeys(names, 2)
    for r in random_reads:
        assert r["wrong"] == 0, r
        assert r["reads"] > 0
        assert r["bytes"] > 0
    checked_reads = sum(r["reads"] for r in results)
    checked_bytes = sum(r["bytes"] for r in results)
    print(
        f"\nreads checked {checked_reads} ({sum(r['reads'] for r in random_reads)} random), "
        f"bytes checked {checked_bytes} ({checked_bytes / MiB:.0f} MiB); "
        f"peak RSS {rss.peak / MiB:.0f} MiB, budget {budget / MiB:.0f} MiB + 150 MiB"
    )
    assert rss.peak <= budget + 150 * MiB, f"peak RSS {rss.peak / MiB:.0f} MiB"


def _counts(pid: int) -> tuple[int, int]:
    """(open file descriptors, threads) of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _fd_targets(pid: int) -> list[str]:
    """What the open file descriptors of ``pid`` point to (for a failure message)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sorted(targets)


def test_opens_reads_and_listings_leak_no_fd_and_no_thread(
    s3: Any, s3_server: LocalServer, bucket: str, tmp_path: Path
) -> None:
    """1,000 open / read a little / close cycles over 6 files, each read reaching the daemon
    (the page cache is dropped first) and many of them the store (the memory cache holds less
    than half of the data), and 334 directory listings: afterwards the daemon has no more open
    file descriptors and threads than after the warm-up, give or take a small constant."""
    files = {f"{d}/w{i}.bin": os.urandom(6 * MiB + 1000 * i) for d in "abc" for i in range(2)}
    put_many(s3, bucket, {f"m/{k}": v for k, v in files.items()})
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    runtime = {"OBJFS_RUNTIME_DIR": str(tmp_path / "run")}
    cmd = mount_command(
        f"s3://{bucket}/m",
        mountpoint,
        tmp_path / "objfs.log",
        *("--endpoint-url", s3_server.url),
        # Two connections: at most two pooled sockets and two store threads (see below).
        *("--max-connections", "2", "--memory-limit", "16M", "--part-size", "8M"),
    )
    rng = random.Random(1)
    dirs = {"": ["a", "b", "c"], **{d: sorted(f"w{i}.bin" for i in range(2)) for d in "abc"}}

    def cycle(m_path: Path, n: int) -> None:
        name = list(files)[n % len(files)]
        data = files[name]
        fd = os.open(m_path / name, os.O_RDONLY)
        try:
            # Drop the file's pages so that the read reaches objfs.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            length = rng.choice((4096, 65536, 300_000))
            offset = rng.randrange(len(data) - length)
            assert os.pread(fd, length, offset) == data[offset : offset + length]
        finally:
            os.close(fd)

    def listing(m_path: Path, n: int) -> None:
        d = list(dirs)[n % len(dirs)]
        assert sorted(os.listdir(m_path / d)) == dirs[d]

    def status() -> dict[str, Any]:
        """The daemon's figures, from a status file written after this call."""
        since = time.time()

        def fresh() -> dict[str, Any] | None:
            res = objfs("status", "--json", str(mountpoint), env=runtime)
            assert res.returncode == 0, res.stderr
            status: dict[str, Any] = json.loads(res.stdout)
            return status if status["updated_at"] > since else None

        return wait_for("a fresh status file", fresh)

    with run_mount(cmd, mountpoint, tmp_path / "objfs.out", runtime) as m:
        pid = m.proc.pid
        for n in range(200):  # warm-up: the same pattern as below
            cycle(m.path, n)
        for n in range(40):
            listing(m.path, n)
        time.sleep(0.5)
        before = status()
        fds_before, threads_before = _counts(pid)

        for n in range(1000):
            cycle(m.path, n)
            if n % 3 == 0:
                listing(m.path, n)

        # Slack of 2 each: with --max-connections 2, botocore's pool holds at most two
        # sockets and at most two trio worker threads run store calls; an idle worker thread
        # lives on for 10 s in trio's thread cache, so the warm-up may or may not have left
        # them open when the first count was taken. Anything that grows with the number of
        # cycles (a handle, a socket or a thread per open or per fetch) shows as hundreds.
        def settled() -> tuple[int, int] | None:
            fds, threads = _counts(pid)
            return (
                (fds, threads) if fds <= fds_before + 2 and threads <= threads_before + 2 else None
            )

        time.sleep(0.5)
        try:
            fds_after, threads_after = wait_for("the fd and thread counts", settled, timeout=15)
        except AssertionError:
            fds_after, threads_after = _counts(pid)
        after = status()
        reads = after["served"]["reads"] - before["served"]["reads"]
        gets = after["store"]["requests"]["get"] - before["store"]["requests"]["get"]
        print(
            f"\nfds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}; "
            f"during the cycles: {reads} FUSE reads served, {gets} GETs"
        )
        assert fds_after <= fds_before + 2, (fds_before, fds_after, _fd_targets(pid))
        assert threads_after <= threads_before + 2, (threads_before, threads_after)
        # Every cycle's read reached the daemon (not only the kernel's page cache), and the
        # fetch path to the store ran too.
        assert reads >= 1000
        assert gets > 0
