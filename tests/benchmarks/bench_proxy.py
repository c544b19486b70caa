"""The shaping proxy as a child process of the benchmark (``bench_env.start_proxy``).

``python -m tests.benchmarks.bench_proxy UPSTREAM_PORT FIRST_BYTE_DELAY_S BYTES_PER_S`` prints
``{"port": N}``, then answers one JSON line per command read from stdin: ``stats`` (requests by
method, ranged GETs, the bytes those asked for, connections opened, and the peak number of
connections open at once, sampled every 10 ms) and ``reset``. It stops at the end of its input.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from tests.helpers.proxy import Proxy

_SAMPLE_S = 0.01


def _range_size(header: str) -> int:
    """Bytes a ``Range: bytes=A-B`` header asks for (0 when it is open-ended or odd)."""
    first, _, last = header.partition("=")[2].partition("-")
    try:
        return int(last) - int(first) + 1
    except ValueError:
        return 0


def main() -> int:
    upstream, delay, rate = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    proxy = Proxy(upstream, first_byte_delay_s=delay, bytes_per_s=rate or None).start()
    peak = [0]
    stopping = threading.Event()

    def sample() -> None:
        while not stopping.wait(_SAMPLE_S):
            # Two sockets (client and upstream) per proxied connection.
            peak[0] = max(peak[0], len(proxy._sockets) // 2)

    threading.Thread(target=sample, daemon=True).start()
    print(json.dumps({"port": proxy.port}), flush=True)
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "stats":
                counts = proxy.stats.count()
                sizes = sorted(
                    _range_size(r.headers["range"])
                    for r in proxy.stats.requests
                    if r.method == "GET" and "range" in r.headers
                )
                out = {
                    "connections": proxy.stats.connections,
                    "peak_open_connections": peak[0],
                    "requests": sum(v for k, v in counts.items() if k != "ranged_get"),
                    **counts,
                    "ranged_bytes": sum(sizes),
                    "median_range_bytes": sizes[len(sizes) // 2] if sizes else 0,
                }
            elif command == "reset":
                proxy.reset_stats()
                peak[0] = 0
                out = {}
            else:
                out = {"error": f"unknown command {command!r}"}
            print(json.dumps(out), flush=True)
    finally:
        stopping.set()
        proxy.stop()
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
