"""Serve a memory-backend bucket holding one synthetic object through a real FUSE mount.

Usage: serve_memory.py MOUNTPOINT SIZE. Mounts ``huge.bin`` of SIZE bytes (content from
:class:`objfs.backends.memory.SyntheticData`) read-only in the foreground, the same way
``objfs mount`` does, so tests can read multi-GiB offsets without a multi-GiB upload.
"""

from __future__ import annotations

import sys

from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.config import MountConfig, parse_source
from objfs.mount import serve, setup_logging


def main() -> int:
    mountpoint, size = sys.argv[1], int(sys.argv[2])
    backend = MemoryBackend()
    backend.put("big/huge.bin", SyntheticData(size))
    config = MountConfig(
        source=parse_source("s3://memory/big"), mountpoint=mountpoint, foreground=True
    )
    setup_logging("info", None, daemon=False)
    return serve(config, lambda: backend, None)


if __name__ == "__main__":
    sys.exit(main())
