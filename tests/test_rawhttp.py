"""objfs.rawhttp against a scripted HTTP server on loopback: bodies land byte-exact in the
caller's views, whole plain-HTTP views take one receive each and wake the receiver about
once per MiB (SO_RCVLOWAT), never waiting past the body's end, a connection is reused only
after a complete body, short, stalled and TLS bodies behave as the module says, and
``FilledViews`` are reported once each, with their bytes whole.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from objfs import rawhttp

MiB = 1 << 20


@dataclass
class Script:
    """How the server answers the next request: the body, sent in ``chunk``-byte sends,
    cut (connection closed) or stalled after ``stop_after`` bytes."""

    body: bytes
    chunk: int = 64 * 1024
    stop_after: int | None = None
    stall_s: float = 0.0  # at stop_after: sleep this long instead of closing
    with_headers: int = 0  # body bytes sent in the same send as the headers
    pause_s: float = 0.0  # between sends, so the body arrives over many wakeups


@dataclass
class Server:
    port: int
    scripts: list[Script] = field(default_factory=list)
    accepted: int = 0
    requests: int = 0
    tls: ssl.SSLContext | None = None
    _sock: socket.socket | None = None
    _threads: list[threading.Thread] = field(default_factory=list)

    def url(self, path: str = "/b/k") -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def serve(self, listener: socket.socket) -> None:
        self._sock = listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    try:
                        got = conn.recv(65536)
                    except OSError:
                        return
                    if not got:
                        return
                    pending += got
                _, _, pending = pending.partition(b"\r\n\r\n")
                self.requests += 1
                script = self.scripts.pop(0)
                body = script.body
                head = (
                    f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
                    f"Content-Range: bytes 0-{len(body) - 1}/{len(body)}\r\n\r\n"
                ).encode()
                try:
                    conn.sendall(head + body[: script.with_headers])
                    at = script.with_headers
                    end = len(body) if script.stop_after is None else script.stop_after
                    while at < end:
                        conn.sendall(body[at : min(end, at + script.chunk)])
                        at = min(end, at + script.chunk)
                        if script.pause_s:
                            time.sleep(script.pause_s)
                    if script.stop_after is not None:
                        if script.stall_s:
                            time.sleep(script.stall_s)
                        return  # the connection closes
                except OSError:
                    return


@pytest.fixture
def server() -> Iterator[Server]:
    yield from _server(None)


def _server(tls: ssl.SSLContext | None) -> Iterator[Server]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    srv = Server(listener.getsockname()[1], tls=tls)
    thread = threading.Thread(target=srv.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        listener.close()
        thread.join(5)


def _pool(read_timeout_s: float = 10.0, ca_file: str | None = None) -> rawhttp.ConnectionPool:
    return rawhttp.ConnectionPool(
        connect_timeout_s=5, read_timeout_s=read_timeout_s, ca_file=ca_file, max_idle=4
    )


def _views(sizes: list[int]) -> tuple[bytearray, list[memoryview]]:
    buf = bytearray(sum(sizes))
    views, at = [], 0
    for size in sizes:
        views.append(memoryview(buf)[at : at + size])
        at += size
    return buf, views


@pytest.fixture
def count_receives(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts socket.recv_into calls made by any thread from now on."""
    calls = [0]
    original = socket.socket.recv_into

    def counting(self: socket.socket, *args: object, **kwargs: object) -> int:
        calls[0] += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "recv_into", counting)
    return lambda: calls[0]


def test_bodies_fill_the_views_exactly_and_reuse_one_connection(
    server: Server, count_receives: Callable[[], int]
) -> None:
    sizes = [MiB, MiB, 12345, MiB - 7]
    bodies = [os.urandom(sum(sizes)) for _ in range(3)]
    # Small sends (many TCP wakeups), and part of the body sent with the headers.
    server.scripts = [
        Script(bodies[0], chunk=32 * 1024, pause_s=0.001),
        Script(bodies[1], chunk=1000, with_headers=5000),
        Script(bodies[2], chunk=300 * 1024, with_headers=100),
    ]
    pool = _pool()
    for body in bodies:
        buf, views = _views(sizes)
        before = count_receives()
        reply = pool.get_into(server.url(), {}, views)
        assert (reply.status, reply.received, bytes(buf)) == (206, len(body), body)
        # One blocking receive per view, not one per TCP wakeup (about 30 per MiB before);
        # the headers' reads (http.client's buffered reader) add a few.
        assert count_receives() - before <= len(sizes) + 3
    assert (server.accepted, server.requests) == (1, 3)
    pool.close()


def _sleeps() -> int:
    """Voluntary context switches of the calling thread so far: it sleeps in each blocking
    receive and is woken when data arrives. (Preemption by other load on the machine counts
    as involuntary and is left out.)"""
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")


# A sender in its own process, so the count holds only the receiving thread's waits for data
# (a sender thread here would add its waits for this process's GIL). It answers one request
# with the file's bytes in 16 KiB sends with a pause after each.
_SENDER = """
import socket, sys, time
body = open(sys.argv[1], "rb").read()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
pending = b""
while b"\\r\\n\\r\\n" not in pending:
    pending += conn.recv(65536)
n = len(body)
conn.sendall(
    f"HTTP/1.1 206 Partial Content\\r\\nContent-Length: {n}\\r\\n"
    f"Content-Range: bytes 0-{n - 1}/{n}\\r\\n\\r\\n".encode()
)
for at in range(0, n, 16384):
    conn.sendall(body[at : at + 16384])
    time.sleep(0.0002)
conn.recv(1)  # until the receiver closes
"""


def _receive_from_sender(body_file: Path, size: int) -> tuple[bytes, int]:
    """(the body as received, the receiving thread's sleeps while it was received)."""
    with subprocess.Popen(
        [sys.executable, "-c", _SENDER, str(body_file)], stdout=subprocess.PIPE, text=True
    ) as sender:
        try:
            assert sender.stdout is not None
            port = int(sender.stdout.readline())
            pool = _pool()
            buf, views = _views([MiB] * (size // MiB))
            before = _sleeps()
            reply = pool.get_into(f"http://127.0.0.1:{port}/b/k", {}, views)
            slept = _sleeps() - before
            assert reply.received == size
            pool.close()
            sender.wait(10)
            return bytes(buf), slept
        finally:
            if sender.poll() is None:
                sender.kill()


def test_a_body_wakes_the_receiver_once_per_mib_not_per_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SO_RCVLOWAT while the body is read: 8 MiB sent in 16 KiB pieces with pauses (a wakeup
    each without the mark) wake the receiving thread a few times per MiB, not dozens."""
    size = 8 * MiB
    woken = {}
    for lowat in (0, rawhttp._RCVLOWAT):
        monkeypatch.setattr(rawhttp, "_RCVLOWAT", lowat)
        body = os.urandom(size)
        body_file = tmp_path / f"body-{lowat}"
        body_file.write_bytes(body)
        received, woken[lowat] = _receive_from_sender(body_file, size)
        assert received == body
    # Without the mark, one wakeup per 16 KiB piece or two: 240-512 sleeps here. With it,
    # 8-68 in 35 runs (10 of them beside two busy processes), about 25 mostly: more when the
    # kernel wakes the reader early because the receive window or buffer is nearly full,
    # which the mark does not stop.
    assert woken[0] > 200, woken
    assert woken[rawhttp._RCVLOWAT] < 100, woken


def test_the_mark_never_waits_for_bytes_the_body_does_not_have(server: Server) -> None:
    """Views smaller than the mark at the body's end, a body trickling in, and the next
    reply's headers on the same connection: each arrives without waiting for the read
    timeout (a mark above what is still to come would stall until it runs out)."""
    sizes = [MiB, MiB // 2, 12345, 3 * MiB // 4, 100]
    bodies = [os.urandom(sum(sizes)) for _ in range(3)]
    server.scripts = [
        Script(bodies[0], chunk=8 * 1024, pause_s=0.0005),
        Script(bodies[1], chunk=MiB // 3),
        Script(bodies[2], chunk=4096, pause_s=0.0001, with_headers=777),
    ]
    pool = _pool(read_timeout_s=6.0)
    started = time.monotonic()
    for body in bodies:
        buf, views = _views(sizes)
        reply = pool.get_into(server.url(), {}, views)
        assert (reply.status, reply.received, bytes(buf)) == (206, len(body), body)
    assert time.monotonic() - started < 6.0  # no receive ran into the read timeout
    assert (server.accepted, server.requests) == (1, 3)
    pool.close()


def test_a_body_cut_short_is_reported_short_and_its_connection_dropped(server: Server) -> None:
    body = os.urandom(3 * MiB)
    server.scripts = [Script(body, stop_after=MiB + 4321), Script(body)]
    pool = _pool()
    buf, views = _views([MiB] * 3)
    reply = pool.get_into(server.url(), {}, views)
    assert reply.received == MiB + 4321
    assert bytes(buf[: reply.received]) == body[: reply.received]
    buf, views = _views([MiB] * 3)
    reply = pool.get_into(server.url(), {}, views)
    assert (reply.received, bytes(buf)) == (len(body), body)
    assert server.accepted == 2  # the cut connection was not reused
    pool.close()


def _reporting(views: list[memoryview]) -> tuple[rawhttp.FilledViews, list[tuple[int, bytes]]]:
    """FilledViews over ``views`` that record each report: (index, the view's bytes then)."""
    reports: list[tuple[int, bytes]] = []
    return rawhttp.FilledViews(views, lambda n, v: reports.append((n, v.tobytes()))), reports


def test_filled_views_are_reported_once_each_as_their_bytes_land(server: Server) -> None:
    sizes = [5000, MiB, 12345, MiB - 7]
    bodies = [os.urandom(sum(sizes)) for _ in range(3)]
    # The first view whole in the headers' read, the second begun there (http.client's
    # buffered bytes, then the socket); TLS: test_https_bodies_are_received_through_tls.
    server.scripts = [
        Script(bodies[0], chunk=1000, with_headers=5000),
        Script(bodies[1], chunk=300 * 1024, with_headers=7000),
        Script(bodies[2], chunk=32 * 1024),
    ]
    pool = _pool()
    for body in bodies:
        buf, views = _views(sizes)
        filled, reports = _reporting(views)
        reply = pool.get_into(server.url(), {}, filled)
        assert (reply.received, bytes(buf)) == (len(body), body)
        at = [sum(sizes[:n]) for n in range(len(sizes) + 1)]
        assert reports == [(n, body[at[n] : at[n + 1]]) for n in range(len(sizes))]
    pool.close()


def test_a_view_a_short_body_leaves_unfilled_is_not_reported(server: Server) -> None:
    body = os.urandom(3 * MiB)
    server.scripts = [Script(body, stop_after=MiB + 4321)]
    pool = _pool()
    _, views = _views([MiB] * 3)
    filled, reports = _reporting(views)
    assert pool.get_into(server.url(), {}, filled).received == MiB + 4321
    assert reports == [(0, body[:MiB])]
    pool.close()


def test_a_stalled_body_raises_connection_failed(server: Server) -> None:
    body = os.urandom(2 * MiB)
    server.scripts = [Script(body, stop_after=MiB // 2, stall_s=8.0), Script(body)]
    pool = _pool(read_timeout_s=0.4)
    _, views = _views([MiB, MiB])
    started = time.monotonic()
    with pytest.raises(rawhttp.ConnectionFailed, match="body"):
        pool.get_into(server.url(), {}, views)
    # Noticed after one to two read timeouts, not when the server gives up (8 s).
    assert time.monotonic() - started < 4.0
    buf, views = _views([MiB, MiB])
    reply = pool.get_into(server.url(), {}, views)
    assert (reply.received, bytes(buf)) == (len(body), body)
    pool.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_bodies_are_received_through_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make_cert = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [*make_cert, *subject, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    for srv in _server(tls):
        bodies = [os.urandom(2 * MiB + 17) for _ in range(2)]
        srv.scripts = [Script(b, chunk=50_000, with_headers=3000) for b in bodies]
        pool = _pool(ca_file=str(cert))
        for body in bodies:
            buf, views = _views([MiB, MiB, 17])
            filled, reports = _reporting(views)
            reply = pool.get_into(srv.url(), {}, filled)
            assert (reply.received, bytes(buf)) == (len(body), body)
            assert reports == [(0, body[:MiB]), (1, body[MiB : 2 * MiB]), (2, body[-17:])]
        assert srv.accepted == 1
        pool.close()


def test_a_body_is_used_only_for_the_range_asked_and_whole() -> None:
    """Reply.body_error, the check both backends make before a 200/206 body counts: another
    range (a broken proxy or server) or a short body is an error, never bytes passed on."""

    def reply(status: int, content_range: str | None, received: int) -> rawhttp.Reply:
        headers = http.client.HTTPMessage()
        if content_range is not None:
            headers["Content-Range"] = content_range
        return rawhttp.Reply(status, headers, b"", received)

    assert reply(206, "bytes 10-19/100", 10).body_error(10, 10) is None
    assert reply(200, None, 10).body_error(0, 10) is None  # the whole object, from 0
    assert reply(206, "bytes 0-9/100", 10).body_error(10, 10) == "the reply is for 'bytes 0-9/100'"
    assert reply(200, None, 10).body_error(10, 10) == "the reply is for ''"
    assert reply(206, "bytes 10-19/100", 4).body_error(10, 10) == "got 4 bytes, expected 10"
