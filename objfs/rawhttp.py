"""Ranged GETs received straight into caller-owned buffers, on kept-alive connections.

The data path of a cold load is one socket-to-buffer copy per byte. SDK response objects
read into fresh ``bytes`` (and urllib3 2 into its own queue first), which cost a copy, page
faults on fresh memory and per-request work that showed up in the profile of a cold load.

Plain HTTP bodies are received with one ``recv_into(view, MSG_WAITALL)`` per view (a block of
the cache), on a socket switched to blocking mode for the body, its read timeout kept by the
kernel (``SO_RCVTIMEO``). ``http.client``'s ``readinto`` returned whatever one wakeup brought,
about 30 KiB on loopback, so a 1 MiB block took some 30 calls, each with a ``poll`` (Python's
socket timeout), a ``recv`` and a hand-over of the GIL among the read-ahead threads; with
``MSG_WAITALL`` the kernel copies the segments as they arrive and returns once the view is
full. Measured on s3rver, 8 threads of 16 MiB GETs: 0.16 -> 0.08 user and 0.34 -> 0.29 system
CPU s per GB in the receiving process. The timeout then bounds one call rather than one
wakeup: a call that gets part of its view returns it when the timeout runs out, and the next
call's timeout starts afresh, so a body that stops is noticed after one to two read timeouts.
Even so, a blocking receive was woken for every segment that arrived (s3rver sends 64 KiB at a
time: about 16 wakeups and context switches per MiB), so while a body is read the socket's
``SO_RCVLOWAT`` is raised to 1 MiB: the kernel wakes the thread once that much is queued
(or earlier, when the receive window or buffer is nearly full).
It is never more than the body still has to deliver after the current view, plus one byte
(the wakeup compares what is queued with the mark, not with what the call still needs, so a
higher mark would leave the body's last view waiting for bytes that never come), and it is
set back to 1 before http.client reads the next reply's headers. Measured with 16 threads of
8 MiB GETs from s3rver into 1 MiB views (4 rounds): 0.67 -> 0.40 system CPU s per GB in the
receiving process, the same wall time.
A body received into :class:`FilledViews` reports each view as it is filled whole
(``filled(n, view)``, in the receiving thread), so a caller can hash the bytes while they are
still in the CPU's caches: the disk tier's XXH3-64 of a 1 MiB block there cost 0.8x what it
cost when the disk writer read the block back from memory later.
TLS records are decrypted in user space, so HTTPS bodies keep ``http.client``'s
``readinto`` (one call per TLS record, at most 16 KiB).

:class:`ConnectionPool` keeps idle HTTP/1.1 connections per origin (thread-safe; one
connection is used by one thread at a time). :meth:`ConnectionPool.get_into` sends one GET and
either fills the views (a 200/206 reply of the expected length) or returns the status, headers
and the (small) error body. It never retries: retrying is the caller's one retry layer.
Connection errors and timeouts raise :class:`ConnectionFailed`; a connection that saw any
error, or whose reply was not read to its end, is closed, never reused.
"""

from __future__ import annotations

import functools
import http.client
import socket
import ssl
import struct
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The receive low-water mark while a plain-HTTP body is read (see _receive): the kernel wakes the
# receiving thread once this much has arrived, not on every segment. 0 turns it off.
_RCVLOWAT = 1 << 20
# An error reply's body (an XML or JSON error document) is read up to this size.
_ERROR_BODY_MAX = 64 * 1024


class ConnectionFailed(Exception):
    """The request or its reply broke off (connect, reset, timeout, malformed reply)."""


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    error_body: bytes  # the body of a reply that did not fill the views, else b""
    received: int  # bytes put into the views

    def body_error(self, start: int, length: int) -> str | None:
        """For a 200/206 reply to a GET of ``length`` bytes from ``start``: why its body must
        not be used (the bytes of another range, from a broken proxy or server, or fewer bytes
        than asked for), or None when the views hold exactly that range."""
        got_range = self.headers.get("Content-Range", "")
        whole = self.status == 200 and start == 0
        if not (whole or got_range.startswith(f"bytes {start}-{start + length - 1}/")):
            return f"the reply is for {got_range!r}"
        if self.received != length:
            return f"got {self.received} bytes, expected {length}"
        return None


def uses_proxy(url: str) -> bool:
    """True when the environment routes ``url`` through a proxy (HTTP(S)_PROXY, NO_PROXY):
    this module speaks to the origin only, so such requests take the SDK's path. The
    environment is read once per origin (a scan of it cost some 60 us per GET): a process
    keeps the proxy settings it started with, as the SDK's clients keep theirs."""
    parts = urllib.parse.urlsplit(url)
    return _origin_uses_proxy(parts.scheme, parts.hostname or "")


@functools.lru_cache(maxsize=256)
def _origin_uses_proxy(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    if scheme not in proxies:
        return False
    return not urllib.request.proxy_bypass(host)


class ConnectionPool:
    """Kept-alive connections to any number of origins, for one set of timeouts and CAs."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        ca_file: str | None,
        max_idle: int,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None  # made on first use (loading CAs costs ms)
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=self._ca_file)
        return self._ssl

    def _connection(self, origin: tuple[str, str, int]) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                return idle.pop()
        scheme, host, port = origin
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=self.connect_timeout_s, context=self._context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)
        conn.connect()
        sock = conn.sock
        assert sock is not None
        sock.settimeout(self.read_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not isinstance(sock, ssl.SSLSocket):
            # The read timeout of the body's blocking receives (see _receive).
            seconds = max(self.read_timeout_s, 0.001)
            whole = int(seconds)
            timeval = struct.pack("@ll", whole, int((seconds - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        return conn

    def _keep(self, origin: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def get_into(self, url: str, headers: dict[str, str], views: Sequence[memoryview]) -> Reply:
        """GET ``url``; a 200/206 reply's body fills ``views`` in order (its length must be
        their total, else the reply is returned with ``received`` short of it)."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname or "", port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        wanted = sum(len(v) for v in views)
        try:
            conn = self._connection(origin)
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionFailed(f"connect: {type(exc).__name__}: {exc}") from exc
        reusable = False
        try:
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionFailed(f"request: {type(exc).__name__}") from exc
            if resp.status not in (200, 206) or resp.length != wanted:
                body = resp.read(_ERROR_BODY_MAX) if resp.status >= 300 else b""
                return Reply(resp.status, resp.headers, body, 0)
            try:
                received = self._receive(resp, conn.sock, views)
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionFailed(f"body: {type(exc).__name__}") from exc
            reusable = received == wanted and resp.isclosed() and not resp.will_close
            return Reply(resp.status, resp.headers, b"", received)
        finally:
            if reusable:
                self._keep(origin, conn)
            else:
                conn.close()

    def _receive(
        self,
        resp: http.client.HTTPResponse,
        sock: socket.socket | None,
        views: Sequence[memoryview],
    ) -> int:
        """Fill ``views`` with ``resp``'s body (of exactly their total length); the bytes put
        into them, fewer if the peer closed the connection early."""
        total = sum(len(v) for v in views)
        if sock is None or isinstance(sock, ssl.SSLSocket):
            return _fill(views, 0, total, resp.readinto)
        # First the body's bytes that http.client's reader buffered with the headers (peek
        # returns them without touching the socket; only when it holds none does it read
        # once), then the rest straight from the socket.
        buffered = min(len(resp.fp.peek(1)), total)
        done = _fill(views, 0, buffered, resp.fp.readinto)
        if done < buffered:
            return done
        sock.settimeout(None)  # blocking; SO_RCVTIMEO bounds each receive
        lowat = _RCVLOWAT
        remaining = total - done  # bytes of the body not yet received
        current = 1  # the socket's SO_RCVLOWAT

        def receive(view: memoryview) -> int:
            nonlocal remaining, current
            if lowat:
                # At most what arrives after this view, plus one: a mark above what is still
                # to come would never be reached (see the module's docstring).
                want = max(1, min(lowat, remaining - len(view) + 1))
                if want != current:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    current = want
            got = sock.recv_into(view, 0, socket.MSG_WAITALL)
            remaining -= got
            return got

        try:
            done = _fill(views, done, total, receive)
        finally:
            if current != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            sock.settimeout(self.read_timeout_s)
        if done < total:
            return done
        # The body was read behind http.client's back: tell it so, which ends the response
        # and leaves the connection reusable.
        resp.length = 0
        resp.read(0)
        return done

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


class FilledViews(list[memoryview]):
    """Buffers a body fills in order, with ``filled(n, view)`` called in the receiving thread
    as soon as ``views[n]`` holds its bytes whole; a retried request fills and reports them
    again, so the last report of each view is of the bytes it holds when the read returns.
    Backends pass them on as they are; every path that fills them reports (``report_filled``
    where the bytes are not received here)."""

    def __init__(
        self, views: Sequence[memoryview], filled: Callable[[int, memoryview], None]
    ) -> None:
        super().__init__(views)
        self.filled = filled


def report_filled(views: Sequence[memoryview], n: int) -> None:
    """``views[n]`` now holds its bytes whole: tell a ``FilledViews``' owner (else nothing)."""
    if isinstance(views, FilledViews):
        views.filled(n, views[n])


def _fill(
    views: Sequence[memoryview], done: int, until: int, read: Callable[[memoryview], int]
) -> int:
    """Put bytes from ``read`` (a ``readinto``) into ``views``, taken as one buffer, from its
    byte ``done`` up to byte ``until``; where it stopped (short of ``until`` when ``read``
    returned 0: the peer closed). Reports each view it completes (``FilledViews``)."""
    start = 0  # where ``view`` begins in the body
    for n, view in enumerate(views):
        end = start + len(view)
        stop = min(end, until)
        completes = done < end <= until  # this call fills the view's last byte
        while start <= done < stop:
            got = read(view[done - start : stop - start])
            if not got:
                return done
            done += got
        if completes:
            report_filled(views, n)
        start = end
    return done
