"""The peak resident set size of a process, sampled in a thread while a test runs."""

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
