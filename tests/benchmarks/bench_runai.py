"""One Run:ai Model Streamer load, in a child process of the benchmark.

``python -m tests.benchmarks.bench_runai s3://BUCKET/KEY...`` streams the files with
``SafetensorsStreamer`` (the endpoint comes from ``AWS_ENDPOINT_URL``, set by the parent) and
touches one byte in every 4 KiB page of every tensor it yields, then prints one JSON line:
``{"seconds": ..., "bytes": ..., "tensors": ...}`` (the time excludes Python's start and the
imports), or ``{"error": "..."}``. The package is installed by ``make bench`` into
``.bench/runai-site`` (put on ``PYTHONPATH`` for this process only), so the main virtual
environment and its torch stay as they are.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    try:
        import torch
        from runai_model_streamer import SafetensorsStreamer
    except ImportError as exc:
        print(json.dumps({"error": f"runai-model-streamer is not importable: {exc}"}), flush=True)
        return 0
    page = 4096
    nbytes = count = 0
    start = time.perf_counter()
    try:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(sys.argv[1:])
            for _name, tensor in streamer.get_tensors():
                raw = tensor.reshape(-1).view(torch.uint8)
                if raw.numel():
                    int(raw[::page].sum()) + int(raw[-1])
                nbytes += raw.numel()
                count += 1
    except Exception as exc:  # reported in the table instead of failing the benchmark
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 0
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "tensors": count}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
