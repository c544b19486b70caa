"""make bench's "READ cost from memory" row: what one FUSE READ costs each transport.

A file held whole in objfs's memory cache is read with ``O_DIRECT`` preads, so every pread is
one READ request that reaches the daemon (no page cache in between, no store): 4 KiB at random
page-aligned offsets from 4 threads, and 128 KiB and 1 MiB sequential reads from 1 and from 4
threads (each thread its own quarter of the file). For each workload and transport (objfs's
own ``kernel`` and ``pyfuse3``, one mount each, alternating run by run): READs per second and
the daemon's CPU per READ (user + system of the mount's process over the workload, divided by
the READs), and the CPUs the whole machine kept busy meanwhile (``/proc/stat``: where they are
all busy, more readers of ``/dev/fuse`` cannot raise READs/s, only a cheaper READ can). Medians
of ``--runs``; results in ``.bench/read_cost.json`` and a table.

``--threads 1,4,16`` changes the thread counts of the rows that have several (for a machine
with more cores).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tests.benchmarks import bench_env as env

MiB = 1 << 20
KiB = 1 << 10
OUT = Path(".bench/read_cost.json")
BUCKET = "read-cost"
FILE_BYTES = 64 * MiB
TRANSPORTS = ("kernel", "pyfuse3")


def workloads(threads: list[int]) -> list[tuple[str, int, int, bool]]:
    """(name, request size, threads, random)"""
    rows = [(f"4 KiB random, {n} threads", 4 * KiB, n, True) for n in threads if n > 1]
    for size, label in ((128 * KiB, "128 KiB"), (MiB, "1 MiB")):
        rows += [
            (f"{label} sequential, {n} thread{'s' if n > 1 else ''}", size, n, False)
            for n in sorted({1, *threads})
        ]
    return rows


def run_workload(path: Path, size: int, threads: int, rand: bool, seconds: float) -> int:
    """O_DIRECT preads of ``size`` from ``threads`` threads for ``seconds``; returns how many."""
    counts = [0] * threads
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
            try:
                rng = random.Random(i)
                span = FILE_BYTES // threads
                base, pos, n = span * i, 0, 0
                pages = FILE_BYTES // 4096 - size // 4096
                while not stop.is_set():
                    if rand:
                        offset = rng.randrange(pages) * 4096
                    else:
                        offset = base + pos
                        pos = pos + size if pos + 2 * size <= span else 0
                    if os.preadv(fd, [buf], offset) != size:
                        raise RuntimeError(f"short read at {offset}")
                    n += 1
                counts[i] = n
            finally:
                buf.close()
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def measure(
    store_url: str, work: Path, transport: str, rows: list[tuple[str, int, int, bool]], secs: float
) -> dict[str, tuple[float, float, float]]:
    """{row: (READs per second, daemon CPU microseconds per READ, machine CPUs busy)} for
    one mount."""
    mnt = work / f"mnt-{transport}"
    cmd = env.objfs_cmd(
        f"s3://{BUCKET}",
        mnt,
        None,
        work / f"objfs-{transport}.log",
        ["--endpoint-url", store_url, "--fuse-transport", transport, "--memory-limit", "512M"],
    )
    out: dict[str, tuple[float, float, float]] = {}
    with env.mounted(f"objfs ({transport})", cmd, mnt, work / f"mount-{transport}.log") as m:
        path = mnt / "data.bin"
        with open(path, "rb") as f:  # the whole file into objfs's memory cache
            while f.read(8 * MiB):
                pass
        proc = psutil.Process(m.proc.pid)
        run_workload(path, 4 * KiB, 1, True, 0.3)  # warm up the handles and the threads
        for name, size, threads, rand in rows:
            before, busy = cpu_s(proc), env.machine_cpu()[0]
            started = time.perf_counter()
            count = run_workload(path, size, threads, rand, secs)
            elapsed = time.perf_counter() - started
            used, busy = cpu_s(proc) - before, env.machine_cpu()[0] - busy
            out[name] = (count / elapsed, used / count * 1e6, busy / elapsed)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per transport (default 3)")
    p.add_argument("--seconds", type=float, default=2.0, help="per workload (default 2)")
    p.add_argument("--threads", default="4", help="thread counts besides 1 (default 4)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    threads = [int(n) for n in args.threads.split(",") if n.strip()]
    rows = workloads(threads)
    env.setup_process_env()
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {t: {} for t in TRANSPORTS}
    with tempfile.TemporaryDirectory(prefix="objfs-read-cost-") as tmp:
        work = Path(tmp)
        store = env.start_s3rver(work / "s3rver.log")
        try:
            client = env.s3_client(store.url)
            client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key="data.bin", Body=os.urandom(FILE_BYTES))
            for run in range(args.runs):
                order = TRANSPORTS if run % 2 == 0 else TRANSPORTS[::-1]
                for transport in order:
                    got = measure(store.url, work, transport, rows, args.seconds)
                    for name, value in got.items():
                        results[transport].setdefault(name, []).append(value)
                    print(f"  read cost run {run}, {transport}: done", flush=True)
        finally:
            store.stop()
    medians = {
        t: {
            name: tuple(statistics.median(v[i] for v in values) for i in range(3))
            for name, values in by_row.items()
        }
        for t, by_row in results.items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": results, "medians": medians}, indent=1))
    print(f"READ cost from memory ({os.cpu_count()} CPUs, medians of {args.runs} runs)")
    print("| request | kernel READs/s | kernel us/READ | kernel: CPUs busy | pyfuse3 READs/s "
          "| pyfuse3 us/READ | kernel/pyfuse3 READs/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, *_ in rows:
        k, y = medians["kernel"][name], medians["pyfuse3"][name]
        print(f"| {name} | {k[0]:,.0f} | {k[1]:.0f} | {k[2]:.2f} of {os.cpu_count()} "
              f"| {y[0]:,.0f} | {y[1]:.0f} | {k[0] / y[0]:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
