"""Helpers for the deployment tests: run objfs commands, scrape metrics, wait for a state."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from objfs.mountinfo import mount_entry

T = TypeVar("T")

# Hang guards, never speed assertions.
WAIT_S = 60.0
COMMAND_TIMEOUT_S = 90.0


def objfs(
    *args: str, env: dict[str, str] | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m objfs ARGS`` to completion (stdin closed)."""
    return subprocess.run(
        [sys.executable, "-m", "objfs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        check=False,
    )


def wait_for(what: str, check: Callable[[], T | None], timeout: float = WAIT_S) -> T:
    """Poll ``check`` until it returns something other than None/False; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus endpoint: {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def sha256_file(path: Path) -> str:
    """Read ``path`` in a separate process (never the test's own) and return its sha256."""
    code = (
        "import hashlib, sys\n"
        "h = hashlib.sha256()\n"
        "with open(sys.argv[1], 'rb') as f:\n"
        "    for chunk in iter(lambda: f.read(1 << 20), b''):\n"
        "        h.update(chunk)\n"
        "print(h.hexdigest())\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=True,
    )
    return res.stdout.strip()


def unmount_quietly(path: Path) -> None:
    if mount_entry(str(path)) is not None:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[bytes], *mountpoints: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Make sure ``proc`` is gone and ``mountpoints`` are unmounted when the block ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)
        for path in mountpoints:
            unmount_quietly(path)
