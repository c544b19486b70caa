"""A small TCP proxy for tests and benchmarks: counts HTTP requests and shapes responses.

It sits between objfs (or any client) and a real object-store server on 127.0.0.1:

* counting: every HTTP request the client sends is parsed from the byte stream (request line
  and headers; a body is skipped by Content-Length), so a test can assert how many GETs, and
  how many ranged GETs, a mount sent;
* shaping: ``first_byte_delay_s`` is added before the first response bytes that follow each
  request, and ``bytes_per_s`` caps each connection's download rate (a token bucket), which
  makes a loopback server look like a real object store (10 ms, 50 MB/s per connection).

Threads, not async: one pair per connection keeps it simple and independent of the code under
test. Only loopback addresses are used.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

_CHUNK = 256 * 1024


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]


@dataclass
class ProxyStats:
    requests: list[Request] = field(default_factory=list)
    connections: int = 0

    def count(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for r in self.requests:
            c[r.method] += 1
            if r.method == "GET" and "range" in r.headers:
                c["ranged_get"] += 1
        return c


class Proxy:
    """``Proxy(upstream_port)``; ``start()``, then point clients at ``url``; ``stop()``."""

    def __init__(
        self,
        upstream_port: int,
        *,
        first_byte_delay_s: float = 0.0,
        bytes_per_s: float | None = None,
    ) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.first_byte_delay_s = first_byte_delay_s
        self.bytes_per_s = bytes_per_s
        self.stats = ProxyStats()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> Proxy:
        t = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = ProxyStats()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- plumbing --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, server))
                self.stats.connections += 1
            pending = threading.Event()  # a request was sent and its response not started
            up = threading.Thread(
                target=self._pump_requests, args=(client, server, pending), daemon=True
            )
            down = threading.Thread(
                target=self._pump_responses, args=(server, client, pending), daemon=True
            )
            up.start()
            down.start()

    def _close(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._sockets.discard(sock)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _pump_requests(
        self, client: socket.socket, server: socket.socket, pending: threading.Event
    ) -> None:
        buf = b""
        body_left = 0
        try:
            while True:
                data = client.recv(_CHUNK)
                if not data:
                    break
                buf += data
                # Parse complete request heads out of the stream; skip bodies.
                while True:
                    if body_left:
                        skip = min(body_left, len(buf))
                        buf, body_left = buf[skip:], body_left - skip
                        if body_left:
                            break
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    head, buf = buf[:end].decode("latin-1"), buf[end + 4 :]
                    request = _parse_head(head)
                    if request is not None:
                        with self._lock:
                            self.stats.requests.append(request)
                        body_left = int(request.headers.get("content-length", "0") or 0)
                pending.set()
                server.sendall(data)
        except OSError:
            pass
        finally:
            self._close(client, server)

    def _pump_responses(
        self, server: socket.socket, client: socket.socket, pending: threading.Event
    ) -> None:
        allowance = 0.0
        last = time.monotonic()
        try:
            while True:
                data = server.recv(_CHUNK)
                if not data:
                    break
                if pending.is_set():
                    pending.clear()
                    if self.first_byte_delay_s:
                        time.sleep(self.first_byte_delay_s)
                if self.bytes_per_s:
                    now = time.monotonic()
                    allowance = min(
                        allowance + (now - last) * self.bytes_per_s, self.bytes_per_s * 0.05
                    )
                    last = now
                    allowance -= len(data)
                    if allowance < 0:
                        time.sleep(-allowance / self.bytes_per_s)
                client.sendall(data)
        except OSError:
            pass
        finally:
            self._close(server, client)


def _parse_head(head: str) -> Request | None:
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Request(parts[0], parts[1], headers)
