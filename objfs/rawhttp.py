"""Ranged GETs received straight into caller-owned buffers, on kept-alive connections.

The data path of a cold load is one socket-to-buffer copy per byte: ``http.client``'s
``readinto`` hands the caller's memoryview down to ``recv_into`` once the few header bytes
buffered with the status line are drained. SDK response objects read into fresh ``bytes``
(and urllib3 2 into its own queue first), which cost a copy, page faults on fresh memory and
per-request work that showed up in the profile of a cold load.

:class:`ConnectionPool` keeps idle HTTP/1.1 connections per origin (thread-safe; one
connection is used by one thread at a time). :meth:`ConnectionPool.get_into` sends one GET and
either fills the views (a 200/206 reply of the expected length) or returns the status, headers
and the (small) error body. It never retries: retrying is the caller's one retry layer.
Connection errors and timeouts raise :class:`ConnectionFailed`; a connection that saw any
error, or whose reply was not read to its end, is closed, never reused.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

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


def uses_proxy(url: str) -> bool:
    """True when the environment routes ``url`` through a proxy (HTTP(S)_PROXY, NO_PROXY):
    this module speaks to the origin only, so such requests take the SDK's path."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if parts.scheme not in proxies:
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


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
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout_s)
        # Big receives: one recv_into can fill much of a block.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
            received = 0
            try:
                for view in views:
                    filled = 0
                    while filled < len(view):
                        n = resp.readinto(view[filled:])
                        if not n:
                            return Reply(resp.status, resp.headers, b"", received + filled)
                        filled += n
                    received += filled
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionFailed(f"body: {type(exc).__name__}") from exc
            reusable = resp.isclosed() and not resp.will_close
            return Reply(resp.status, resp.headers, b"", received)
        finally:
            if reusable:
                self._keep(origin, conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
