"""The receiving process's CPU per GB for objfs's data GETs, with and without SO_RCVLOWAT.

A development tool, not part of ``make bench``::

    python -m tests.benchmarks.receive_cpu [--runs N] [--marks 0,262144,1048576]

Starts s3rver (data on /dev/shm), uploads the bench model, and fetches its shards with
:class:`objfs.rawhttp.ConnectionPool` as objfs's read-ahead does: 16 threads of 8 MiB ranged
GETs (presigned URLs), each body received into 1 MiB views of buffers faulted in beforehand,
so neither FUSE nor the page cache nor new memory is measured. Each round tries every
receive low-water mark (``rawhttp._RCVLOWAT``; 0 is off), in a rotating order, and prints
this process's user and system CPU seconds per GB, its context switches per GB, s3rver's CPU
seconds per GB (what serving these GETs cost the server) and the wall time; then the medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from objfs import rawhttp
from tests.benchmarks import bench_env as env

PART = 8 << 20
VIEW = 1 << 20
THREADS = 16


def context_switches() -> int:
    """This process's context switches so far, its ended threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--marks", default=f"0,262144,{rawhttp._RCVLOWAT}")
    args = p.parse_args()
    marks = [int(x) for x in args.marks.split(",")]
    env.setup_process_env()
    work = Path(tempfile.mkdtemp(prefix="objfs-recv-"))
    model = env.build_model(env.FULL_MODEL, env.REPO / ".bench" / "data")
    server = env.start_s3rver(work / "s3rver.log")
    try:
        client = env.s3_client(server.url)
        env.upload_tree(client, model, env.MODEL_BUCKET)
        sizes = {f.name: f.stat().st_size for f in sorted(model.glob("*.safetensors"))}
        urls = {
            key: client.generate_presigned_url(
                "get_object", Params={"Bucket": env.MODEL_BUCKET, "Key": key}, ExpiresIn=3600
            )
            for key in sizes
        }
        buffers = {key: bytearray(n) for key, n in sizes.items()}
        for buf in buffers.values():
            buf[:: env.PAGE_SIZE] = b"\1" * len(range(0, len(buf), env.PAGE_SIZE))
        items = [
            (k, off, min(PART, n - off)) for k, n in sizes.items() for off in range(0, n, PART)
        ]
        gb = sum(sizes.values()) / 1e9
        results: dict[int, list[tuple[float, float, float, float, float]]] = {m: [] for m in marks}
        for rnd in range(args.runs):
            for mark in marks[rnd % len(marks) :] + marks[: rnd % len(marks)]:
                rawhttp._RCVLOWAT = mark
                pool = rawhttp.ConnectionPool(
                    connect_timeout_s=10, read_timeout_s=30, ca_file=None, max_idle=THREADS
                )

                def get(item: tuple[str, int, int], pool: rawhttp.ConnectionPool = pool) -> None:
                    key, off, n = item
                    view = memoryview(buffers[key])[off : off + n]
                    views = [view[i : i + VIEW] for i in range(0, n, VIEW)]
                    reply = pool.get_into(urls[key], {"Range": f"bytes={off}-{off + n - 1}"}, views)
                    if reply.received != n:
                        raise RuntimeError(f"GET {key} at {off}: {reply.status}, {reply.received}")

                s0 = env.process_cpu(server.pid)
                t0, c0, w0 = os.times(), context_switches(), time.perf_counter()
                with ThreadPoolExecutor(THREADS) as ex:
                    list(ex.map(get, items))
                wall = time.perf_counter() - w0
                t1, c1, s1 = os.times(), context_switches(), env.process_cpu(server.pid)
                pool.close()
                row = (
                    (t1.user - t0.user) / gb,
                    (t1.system - t0.system) / gb,
                    (c1 - c0) / gb,
                    (s1 - s0) / gb,
                    wall,
                )
                results[mark].append(row)
                print(
                    f"mark {mark:8d}: user {row[0]:.3f} system {row[1]:.3f} CPU s/GB, "
                    f"{row[2]:.0f} context switches/GB, s3rver {row[3]:.2f} CPU s/GB, "
                    f"{wall:.2f} s",
                    flush=True,
                )
        for mark, rows in results.items():
            med = [statistics.median(r[i] for r in rows) for i in range(5)]
            print(
                f"median, mark {mark:8d}: user {med[0]:.3f} system {med[1]:.3f} CPU s/GB, "
                f"{med[2]:.0f} context switches/GB, s3rver {med[3]:.2f} CPU s/GB, {med[4]:.2f} s"
            )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
