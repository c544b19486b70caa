"""The peak resident set size of a process, sampled in a thread while a test runs; and one
mapping's fields in this process's /proc/self/smaps."""

from __future__ import annotations

import threading
from types import TracebackType

import psutil


class PeakRss:
    """``with PeakRss(pid) as rss: ...``; then ``rss.peak`` is the highest RSS seen (bytes),
    sampled every ``interval_s`` from entry to exit."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.peak = 0

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._process.memory_info().rss)
            if self._done.wait(self._interval_s):
                return

    def __enter__(self) -> PeakRss:
        self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()


def smaps_field(address: int, field: str) -> list[str]:
    """The words after ``field:`` in the /proc/self/smaps entry of the mapping that holds
    ``address`` (e.g. ``Rss`` -> ``["2048", "kB"]``, ``VmFlags`` -> the flags)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith(f"{field}:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}, or its entry has no {field}")
