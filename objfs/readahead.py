"""Sequential-stream detection and the read-ahead window, per open file version.

One file may carry several streams: a loader that maps a file and touches tensors in order
is one stream, but several processes reading one file (diffusers, forked workers,
tensor-parallel ranks) are several, interleaved. The open handles of one version share one
:class:`Readahead` (see :mod:`objfs.fs`), which keeps up to ``MAX_STREAMS`` streams and
matches each read, whoever's, to the stream it continues. Tensor-parallel ranks each read
their part of every tensor: a rank's jump to its part of the next tensor is far from its own
last read but continues where another rank's reads ended, so together they are one stream
that grows its window, where streams per handle restarted small at every tensor:

* a read continues a stream when it starts between ``BACKWARD_TOLERANCE`` (or the stream's
  window, if larger) before and ``FORWARD_TOLERANCE`` after the stream's next expected offset
  (the kernel reorders and skips a little);
* a continued stream doubles its window, from ``initial_window`` up to its share of
  ``max_window`` (the version's read-ahead budget, split evenly among its streams: sixteen
  readers of one file must not each ask for the whole budget, or their prefetches evict each
  other's unread blocks);
* a read that continues no stream starts one; at offset 0 it is presumed sequential (files
  are read from the start), elsewhere it is random until its next read continues it, and a
  random read fetches only the blocks it touches. Only the reader that started a random
  stream continues it (``owner``): random readers side by side must not look sequential
  together.

This module only decides *what* to fetch; :mod:`objfs.scheduler` fetches it. Pure and
synchronous, so it is tested without I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024
# Mountpoint for S3 tolerates the same: the kernel's own read-ahead and concurrent page
# faults arrive slightly out of order.
FORWARD_TOLERANCE = 16 * MiB
BACKWARD_TOLERANCE = 1 * MiB
# More streams than this on one version are treated as random access (torch_io and
# safetensors-style loaders read one file from up to 16 threads).
MAX_STREAMS = 16


@dataclass
class Stream:
    next_offset: int
    window: int  # 0: started by a random read and not continued yet
    scheduled_until: int  # prefetch has been requested for [.., scheduled_until)
    last_used: int
    owner: int = 0  # the reader whose read started it


class Readahead:
    """Read-ahead state of one open file of ``size`` bytes."""

    def __init__(self, size: int, *, initial_window: int, max_window: int) -> None:
        self.size = size
        self.initial_window = initial_window
        self.max_window = max(max_window, initial_window)
        self.streams: list[Stream] = []
        self._clock = 0
        # The last read continued no stream and did not start at offset 0: random access.
        self.last_random = False
        # The stream the last read (or start_whole_file) continued or started: the owner of
        # the range just returned, so that a prefetch its reader has overtaken is dropped.
        self.last_stream: Stream | None = None

    def _match(self, offset: int, reader: int) -> Stream | None:
        for stream in self.streams:
            if stream.window == 0 and stream.owner != reader:
                # Random so far: only its own reader's next read makes it a stream (random
                # readers of one file side by side must not look sequential together).
                continue
            # Behind the stream: within the tolerance, or within its own window (requests the
            # kernel issued together may arrive a little out of order).
            behind = max(BACKWARD_TOLERANCE, stream.window)
            if stream.next_offset - behind <= offset <= stream.next_offset + FORWARD_TOLERANCE:
                return stream
        return None

    def on_read(self, offset: int, length: int, reader: int = 0) -> tuple[int, int] | None:
        """Record a read of ``length`` bytes at ``offset`` by ``reader`` (an open handle of
        the file); return the byte range ``(start, end)`` to prefetch now (never overlapping
        earlier requests), or None."""
        self._clock += 1
        end = min(offset + length, self.size)
        stream = self._match(offset, reader)
        self.last_random = stream is None and offset != 0
        if stream is None:
            window = self.initial_window if offset == 0 else 0
            stream = Stream(end, window, end, self._clock, reader)
            if len(self.streams) >= MAX_STREAMS:
                self.streams.remove(min(self.streams, key=lambda s: s.last_used))
            self.streams.append(stream)
        else:
            share = max(self.initial_window, self.max_window // len(self.streams))
            stream.window = min(max(stream.window * 2, self.initial_window), share)
            stream.next_offset = max(stream.next_offset, end)
            stream.last_used = self._clock
        self.last_stream = stream
        start = max(stream.scheduled_until, end)
        stop = min(self.size, stream.next_offset + stream.window)
        if stop <= start:
            return None
        stream.scheduled_until = stop
        return start, stop

    def overtaken(self, stream: Stream, offset: int) -> int:
        """Where a prefetch for ``stream`` should start now, given it was asked from
        ``offset``: past what the stream's reader has read already; the file's size if the
        stream is gone (its reader went elsewhere)."""
        if stream not in self.streams:
            return self.size
        return max(offset, stream.next_offset)

    def start_whole_file(self) -> tuple[int, int] | None:
        """Presume a sequential reader from offset 0 at full window (e.g. safetensors files,
        which every loader reads whole); return the first range to prefetch."""
        if self.size == 0:
            return None
        stop = min(self.size, self.max_window)
        self._clock += 1
        self.last_stream = Stream(0, self.max_window, stop, self._clock)
        self.streams.append(self.last_stream)
        return 0, stop
