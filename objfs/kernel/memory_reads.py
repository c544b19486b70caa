"""READs answered from memory without a task: in the reader thread, or on arrival.

A READ whose bytes are all in objfs's memory tier needs no await, so the kernel transport
answers it without the trio task, cancel scope and read turn every other request gets (those
cost far more than the read itself: 280 us of daemon CPU per 4 KiB READ before, against 60 for
pyfuse3, measured by ``tests/benchmarks/read_cost.py``):

* **in the reader thread** (:meth:`MemoryReads.in_reader`), right after it read the request,
  when the trio thread is idle: under the core's lock (:class:`CoreLock`, held by the trio
  thread during every task step, so no objfs code runs there meanwhile; taken only if free at
  once, so a busy trio thread keeps the READs it would have had), only where reading the
  blocks wakes nobody (``ReadPath.read_locked``: no trio object is touched off the trio
  thread), the reply written under the same lock, so nothing is pinned; the read-ahead it asks
  for is queued on the trio thread afterwards;
* **on arrival in the trio thread** (:meth:`MemoryReads.on_arrival`) otherwise, through
  ``FileSystem.read_nowait`` (pinned blocks, holds given back once written): a reply of at
  most :data:`INLINE_REPLY_BYTES` is written there, a larger one by the writer threads.

Invariants: READs enter the core in arrival order: either path runs only when no READ waits
for its turn (``ReadTurns.idle``) and, in the reader thread, when no READ it handed to the trio
thread is still on its way (:attr:`MemoryReads.handed` against :attr:`MemoryReads.arrived`).
A READ either path declines is untouched (no hit, no read-ahead, nothing pinned) and goes the
usual way, which answers errors too. No view of a block outlives the lock it was taken under.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time

import trio

from objfs.fs import FileSystem
from objfs.kernel import protocol as p
from objfs.kernel import replies as rp
from objfs.kernel.read_turns import ReadTurns
from objfs.kernel.writers import Holds, ReplyWriters, give_back, write_reply
from objfs.readahead import Stream

log = logging.getLogger("objfs.kernel.session")

# A READ's fh, offset and size: the first fields of fuse_read_in, after the header.
_READ_ARGS = struct.Struct("<QQI")
_READ_ARGS_END = p.IN_HEADER_SIZE + 40  # the whole fuse_read_in
#: READ replies up to this size answered on arrival are written by the trio thread itself: a
#: hand-off to a writer thread and back costs more than the copy.
INLINE_REPLY_BYTES = 256 * 1024
# How often READs answered in the reader thread tell the core the mount is not idle.
_TOUCH_S = 0.1


def _read_args(data: bytes) -> tuple[int, int, int, int] | None:
    """A READ request's unique, fh, offset and size, or None if it is too short to hold them
    (the task's own parse then answers it)."""
    if len(data) < _READ_ARGS_END:
        return None
    return (struct.unpack_from("<Q", data, 8)[0], *_READ_ARGS.unpack_from(data, p.IN_HEADER_SIZE))


class CoreLock(trio.abc.Instrument):
    """The core's lock: the trio thread holds it during every task step (every line of
    objfs that runs there runs in one), so another thread that holds it runs while no objfs
    code runs on the trio thread, as if it were a step itself. Installed while
    ``KernelSession.serve`` runs, from inside a step: hence the lock is taken when it is
    installed (that step's end releases it) and let go when it is removed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.lock.acquire()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.lock.release()


class MemoryReads:
    """The two ways a READ of memory is answered without a task (see the module's text)."""

    def __init__(
        self,
        fs: FileSystem,
        writers: ReplyWriters,
        turns: ReadTurns,
    ) -> None:
        self.fs = fs
        self.core = CoreLock()
        self._writers = writers
        self._turns = turns
        #: READs the reader thread handed to the trio thread, and those that arrived there:
        #: the reader thread answers a READ itself only when none is on its way.
        self.handed = 0
        self.arrived = 0
        self.reads_in_reader = 0
        self.reads_on_arrival = 0
        self.bytes_served = 0  # changed under the core's lock only
        #: Set (under the lock) when serve ends: the core is no longer the reader's.
        self.closed = False
        self._touched_at = 0.0  # when the reader thread last told the core it reads

    def in_reader(self, fd: int, data: bytes, token: trio.lowlevel.TrioToken) -> bool:
        """(Reader thread) Answer the READ ``data`` here if the trio thread is idle (the core's
        lock is free at once), memory holds it and reading it wakes nobody; False, with
        nothing done, otherwise (also when a READ is on its way to the trio thread or waits
        for its turn)."""
        args = _read_args(data)
        if args is None:
            return False
        unique, fh, offset, size = args
        lock = self.core.lock
        if not lock.acquire(blocking=False):
            # The trio thread is in a step: busy (a cold load's fetches), so this READ goes
            # its way rather than waiting for the step's end (which made four ranks loading
            # a model cold take 1.96x one loader's time, against 1.5x before).
            return False
        try:
            if self.closed or self.arrived != self.handed or not self._turns.idle():
                return False
            try:
                answer = self.fs.read_locked(fh, offset, size)
            except Exception:
                return False  # the trio thread answers it (its errno)
            if answer is None:
                return False
            got, window, stream = answer
            reply, nbytes = rp.data_reply(unique, got)
            write_reply(fd, reply)
            del got, reply, answer  # no view of a block outlives the lock
            self.bytes_served += nbytes
            self.reads_in_reader += 1
        finally:
            lock.release()
        now = time.monotonic()
        if window is not None or now - self._touched_at > _TOUCH_S:
            # The read-ahead, and a sign of life for the backfill, on the trio thread.
            self._touched_at = now
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._read_ahead, fh, window, stream)
        return True

    def _read_ahead(self, fh: int, window: tuple[int, int] | None, stream: Stream | None) -> None:
        """(trio thread, a run_sync_soon callback, whose exception would end the run) What a
        READ answered in the reader thread leaves to do."""
        try:
            if window is None:
                self.fs.fetcher.writes.touch()
            else:
                self.fs.read_ahead(fh, window, stream)
        except Exception:
            log.exception("queueing the read-ahead of a READ answered from memory failed")

    def on_arrival(self, fd: int, data: bytes) -> bool:
        """(trio thread, as the READ ``data`` arrives, none waiting for its turn) Answer it
        if memory holds it; False, with nothing done, otherwise: it becomes a task."""
        args = _read_args(data)
        if args is None:
            return False
        unique, fh, offset, size = args
        holds: Holds = []
        try:
            got = self.fs.read_nowait(fh, offset, size, holds=holds)
        except Exception:
            give_back(holds)
            return False  # the task's own read answers it (its errno)
        if got is None:
            return False
        reply, nbytes = rp.data_reply(unique, got)
        self.bytes_served += nbytes
        self.reads_on_arrival += 1
        if nbytes <= INLINE_REPLY_BYTES:
            write_reply(fd, reply)
            del reply, got
            give_back(holds)
        else:
            self._writers.submit(fd, reply, holds)
        return True
