"""Serve a memory-backend bucket of synthetic objects through a real FUSE mount.

Usage: serve_memory.py MOUNTPOINT NAME=SIZE [NAME=SIZE ...] [--memory-limit BYTES]

Mounts each NAME (content from :class:`objfs.backends.memory.SyntheticData` seeded with the
name) read-only in the foreground, the way ``objfs mount`` does, so tests can read multi-GiB
files and offsets without a multi-GiB upload.
"""

from __future__ import annotations

import argparse
import sys

from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.config import MountConfig, parse_source
from objfs.logsetup import setup_logging
from objfs.mount import serve


def synthetic(name: str, size: int) -> SyntheticData:
    return SyntheticData(size, seed=name.encode())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("objects", nargs="+", metavar="NAME=SIZE")
    parser.add_argument("--memory-limit", type=int, default=1 << 30)
    args = parser.parse_args()
    backend = MemoryBackend()
    for spec in args.objects:
        name, _, size = spec.partition("=")
        backend.put(f"big/{name}", synthetic(name, int(size)))
    config = MountConfig(
        source=parse_source("s3://memory/big"),
        mountpoint=args.mountpoint,
        foreground=True,
        memory_limit_bytes=args.memory_limit,
    )
    setup_logging("info", None, daemon=False)
    return serve(config, lambda: backend, None)


if __name__ == "__main__":
    sys.exit(main())
