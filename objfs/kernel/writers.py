"""Writing FUSE replies: one ``writev`` per reply, READ replies on a pool of writer threads.

Contract: :func:`write_reply` writes one reply to the fd its request was read from (several
threads may write to one fd) and only logs a failure (never ENOENT, an interrupted or aborted
request, nor ENODEV, an unmounted one). :class:`ReplyWriters` writes READ replies on
``WRITERS`` threads, outside the GIL, so the copy into the page cache leaves the trio thread.
A reply's holds (what keeps its bytes valid and charged: ``FileSystem.read(holds=...)``) are
given back on the trio thread, and only after the reply's ``writev`` returned: the one path
that gives them back after :meth:`ReplyWriters.submit` is :meth:`ReplyWriters.run`, right
after the write, and :func:`give_back` asserts it runs on the trio thread.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence

import trio

# The transport's log lines keep one logger name (objfs.kernel.session).
log = logging.getLogger("objfs.kernel.session")

# Threads that write READ replies: the copy into the page cache runs there, in parallel.
WRITERS = 4

Parts = list[bytes | bytearray | memoryview]
Holds = list[Callable[[], None]]


def write_reply(fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """(Any thread) One reply, header and payload, with one ``writev``."""
    try:
        os.writev(fd, parts)
    except OSError as exc:
        # ENOENT: the request was interrupted or aborted meanwhile; ENODEV: unmounted.
        if exc.errno not in (errno.ENOENT, errno.ENODEV):
            log.error("FUSE: writing a reply failed (%s)", exc)


def give_back(holds: Holds) -> None:
    """(trio thread) Give back what a written reply held."""
    assert trio.lowlevel.in_trio_run(), "a reply's holds go back on the trio thread"
    for release in holds:
        try:
            release()
        except Exception:
            log.exception("giving back a reply's buffer failed")


class ReplyWriters:
    """The writer threads and their queue of READ replies (see the module's contract)."""

    def __init__(self) -> None:
        # READ replies for the writer threads: (fd, reply parts, holds), None to stop one.
        self._jobs: queue.SimpleQueue[tuple[int, Parts, Holds] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        """Start ``WRITERS`` threads, which give holds back through ``token``."""
        for i in range(WRITERS):
            t = threading.Thread(
                target=self.run, args=(token,), name=f"objfs-reply-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def submit(self, fd: int, parts: Parts, holds: Holds) -> None:
        """(trio thread) Queue a reply; its parts and holds are the writers' from now on."""
        self._jobs.put((fd, parts, holds))

    def run(self, token: trio.lowlevel.TrioToken) -> None:
        """(Thread) Write READ replies; give their holds back to the trio thread."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fd, parts, holds = job
            write_reply(fd, parts)
            del parts, job
            if holds:
                try:
                    token.run_sync_soon(give_back, holds)
                except trio.RunFinishedError:
                    return

    def end_one(self) -> None:
        """Make one :meth:`run` return, once the replies queued before are written."""
        self._jobs.put(None)

    def close(self) -> None:
        """End the started threads after the replies queued so far (waits up to 5 s each)."""
        for _ in self._threads:
            self.end_one()
        for t in self._threads:
            t.join(timeout=5)
