"""A small TCP proxy for tests and benchmarks: counts HTTP requests and shapes responses.

It sits between objfs (or any client) and a real object-store server on 127.0.0.1:

* counting: every HTTP request the client sends is parsed from the byte stream (request line
  and headers; a body is skipped by Content-Length), so a test can assert how many GETs, and
  how many ranged GETs, a mount sent;
* shaping: ``first_byte_delay_s`` is added before the first response bytes that follow each
  request, and ``bytes_per_s`` caps each connection's download rate (a token bucket), which
  makes a loopback server look like a real object store (10 ms, 50 MB/s per connection).

* faults: a :class:`FaultPlan` breaks every n-th matching response in one of these ways:
  ``reset`` (a TCP reset after part of the body), ``truncate`` (the connection closed cleanly
  after part of the body), ``stall`` (nothing sent for ``stall_s``), ``500``/``503`` (an error
  answered by the proxy itself, 503 as S3's ``SlowDown``), ``short_length`` (a Content-Length
  smaller than the body, so the rest poisons the connection), ``wrong_range`` (a Content-Range
  that names other bytes than those asked for) and ``bad_xml`` (a 200 whose XML body is cut
  in half); ``refuse(True)`` resets every new connection until ``refuse(False)``.
* answers: ``answer(Answer(...))`` makes the proxy reply itself to every request an
  :class:`Answer` matches (e.g. a 403 for one bucket's paths), the server never seeing it.
* dropped headers: ``drop_request_headers({"if-match"})`` removes those header lines from the
  requests it forwards (a gateway that ignores ``If-Match``), counted in ``injected`` as
  ``"dropped <name>"``. A line split across two TCP segments would pass; on loopback a small
  GET's head arrives in one.

Threads, not async: one pair per connection keeps it simple and independent of the code under
test. Only loopback addresses are used.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
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
    response_bytes: int = 0  # bytes the server sent, heads and bodies, as forwarded

    def count(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for r in self.requests:
            c[r.method] += 1
            if r.method == "GET" and "range" in r.headers:
                c["ranged_get"] += 1
        return c


FAULT_KINDS = (
    "reset",
    "truncate",
    "stall",
    "500",
    "503",
    "short_length",
    "wrong_range",
    "bad_xml",
)
_SYNTHETIC = {
    "500": (
        "500 Internal Server Error",
        b"<?xml version='1.0'?><Error><Code>InternalError</Code>"
        b"<Message>injected</Message></Error>",
    ),
    "503": (
        "503 Slow Down",
        b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>",
    ),
}


@dataclass
class FaultPlan:
    """Break every ``every``-th request that ``applies`` to, cycling through ``kinds``."""

    kinds: tuple[str, ...]
    every: int = 1
    # "data": ranged GETs only; "list": bucket listings (GET with list-type or restype=container
    # &comp=list); "all": every request.
    target: str = "data"
    stall_s: float = 30.0
    cut_after: int = 100_000  # body bytes sent before a reset or truncation

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")

    def applies(self, request: Request) -> bool:
        if self.target == "all":
            return True
        is_list = request.method == "GET" and (
            "list-type=" in request.target or "comp=list" in request.target
        )
        if self.target == "list":
            return is_list
        ranged = "range" in request.headers or "x-ms-range" in request.headers  # S3, Azure
        return request.method == "GET" and ranged and not is_list


@dataclass
class Answer:
    """A reply the proxy sends itself to every request that ``matches`` (no body for HEAD)."""

    matches: Callable[[Request], bool]
    status: str  # "403 Forbidden"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def reply(self, request: Request) -> bytes:
        head = f"HTTP/1.1 {self.status}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in self.headers.items()
        )
        body = b"" if request.method == "HEAD" else self.body
        return (head + f"Content-Length: {len(self.body)}\r\n\r\n").encode("latin-1") + body


@dataclass
class _Conn:
    """What the response pump must do to the response now on its way."""

    fault: str | None = None
    request: Request | None = None


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
        self._plan: FaultPlan | None = None
        self._matching = itertools.count(1)
        self._refusing = False
        self.injected: Counter[str] = Counter()  # faults injected, by kind
        self._answers: list[Answer] = []
        self._drop: re.Pattern[bytes] | None = None

    def set_faults(self, plan: FaultPlan | None) -> None:
        """Start (or, with None, stop) breaking responses."""
        with self._lock:
            self._plan = plan
            self._matching = itertools.count(1)

    def answer(self, answer: Answer | None) -> None:
        """Reply with ``answer`` to the requests it matches (None: stop answering)."""
        with self._lock:
            self._answers = [] if answer is None else [*self._answers, answer]

    def _answer_for(self, request: Request) -> Answer | None:
        with self._lock:
            for answer in self._answers:
                if answer.matches(request):
                    self.injected["answered"] += 1
                    return answer
        return None

    def drop_request_headers(self, names: set[str]) -> None:
        """Remove these headers (case-insensitive) from forwarded requests; empty: none."""
        alternatives = b"|".join(re.escape(n.encode("latin-1")) for n in sorted(names))
        self._drop = re.compile(rb"(?im)^(" + alternatives + rb"):[^\r\n]*\r\n") if names else None

    def _strip(self, data: bytes) -> bytes:
        drop = self._drop
        if drop is None:
            return data

        def count(match: re.Match[bytes]) -> bytes:
            with self._lock:
                self.injected["dropped " + match.group(1).decode("latin-1").lower()] += 1
            return b""

        return drop.sub(count, data)

    def refuse(self, on: bool) -> None:
        """Reset every new connection while ``on``."""
        self._refusing = on

    def _fault_for(self, request: Request) -> str | None:
        with self._lock:
            plan = self._plan
            if plan is None or not plan.applies(request):
                return None
            n = next(self._matching)
            if n % plan.every:
                return None
            kind = plan.kinds[(n // plan.every - 1) % len(plan.kinds)]
            self.injected[kind] += 1
            return kind

    def start(self) -> Proxy:
        t = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop answering: the listener closes (a blocked ``accept`` is woken by the shutdown,
        not by ``close``) and every connection carried so far is cut."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
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
            if self._stopping.is_set():
                _reset(client)
                return
            if self._refusing:
                with self._lock:
                    self.injected["refused"] += 1
                _reset(client)
                continue
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
            conn = _Conn()
            up = threading.Thread(
                target=self._pump_requests, args=(client, server, pending, conn), daemon=True
            )
            down = threading.Thread(
                target=self._pump_responses, args=(server, client, pending, conn), daemon=True
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
        self,
        client: socket.socket,
        server: socket.socket,
        pending: threading.Event,
        conn: _Conn,
    ) -> None:
        buf = b""
        body_left = 0
        try:
            while True:
                data = client.recv(_CHUNK)
                if not data:
                    break
                buf += data
                fault: str | None = None
                answered: bytes | None = None
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
                        fault = self._fault_for(request)
                        conn.request = request
                        answer = self._answer_for(request)
                        answered = None if answer is None else answer.reply(request)
                if answered is not None and not buf and not body_left:
                    client.sendall(answered)  # the server never sees this request
                    continue
                if fault in _SYNTHETIC and not buf and not body_left:
                    # Answer it here; the server never sees this request.
                    status, body = _SYNTHETIC[fault]
                    client.sendall(
                        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    continue
                conn.fault = fault if fault not in _SYNTHETIC else None
                pending.set()
                server.sendall(self._strip(data))
        except OSError:
            pass
        finally:
            self._close(client, server)

    def _pump_responses(
        self,
        server: socket.socket,
        client: socket.socket,
        pending: threading.Event,
        conn: _Conn,
    ) -> None:
        allowance = 0.0
        last = time.monotonic()
        fault: str | None = None
        cut: int | None = None  # close the connection after this many body bytes
        sent_body = -1  # body bytes of the current response sent; -1: head not complete
        head = b""
        try:
            while True:
                data = server.recv(_CHUNK)
                if not data:
                    break
                if pending.is_set():
                    pending.clear()
                    fault, conn.fault = conn.fault, None
                    sent_body, head, cut = -1, b"", None
                    if fault == "stall":
                        plan = self._plan
                        self._sleep(plan.stall_s if plan else 30.0)
                        fault = None
                    if self.first_byte_delay_s:
                        time.sleep(self.first_byte_delay_s)
                if fault is not None:
                    if sent_body < 0:
                        head += data
                        end = head.find(b"\r\n\r\n")
                        if end < 0:
                            continue
                        new_head, cut = self._rewrite(head[: end + 4], fault)
                        data = new_head + head[end + 4 :]
                        sent_body = len(head) - end - 4
                    else:
                        sent_body += len(data)
                    if cut is not None and sent_body >= cut:
                        data = data[: len(data) - (sent_body - cut)]
                        client.sendall(data)
                        if fault == "reset":
                            _reset(client)
                        break
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
                with self._lock:
                    self.stats.response_bytes += len(data)
        except OSError:
            pass
        finally:
            self._close(server, client)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _rewrite(self, head: bytes, fault: str) -> tuple[bytes, int | None]:
        """The response head with the fault's lie in it, and after how many body bytes to
        close the connection (None: send it all)."""
        text = head.decode("latin-1")
        length = re.search(r"(?im)^content-length:\s*(\d+)", text)
        plan = self._plan
        if fault in ("reset", "truncate"):
            return head, plan.cut_after if plan else 100_000
        if fault in ("short_length", "bad_xml") and length and int(length.group(1)) > 1:
            half = int(length.group(1)) // 2
            text = text[: length.start(1)] + str(half) + text[length.end(1) :]
            # short_length: the other half stays on the connection and poisons the next
            # response; bad_xml: the client gets an honest length but half a document.
            return text.encode("latin-1"), half if fault == "bad_xml" else None
        if fault == "wrong_range":
            m = re.search(r"(?im)^content-range:\s*bytes (\d+)-(\d+)/(\d+)", text)
            if m:
                first, last, total = (int(g) for g in m.groups())
                shift = 4096 if first >= 4096 else -4096 if first else 1
                new = f"Content-Range: bytes {first + shift}-{last + shift}/{total}"
                text = text[: m.start()] + new + text[m.end() :]
        return text.encode("latin-1"), None


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


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
