"""A DNS server on loopback for tests: answers A queries for the names it is given (AAAA with
no records, anything else with NXDOMAIN), over UDP, in a thread. Enough for nginx's resolver
to find the cache engine's peers by the names they have in a cluster.

Invariant: every answer echoes the query's id and question, and a name's A record is the
address given for it (names compare case-insensitively, without the trailing dot); the
server counts the queries it answered per name (``asked``).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter
from types import TracebackType

A, AAAA = 1, 28
NOERROR, FORMERR, NXDOMAIN = 0, 1, 3


def _read_name(packet: bytes, offset: int) -> tuple[str, int]:
    labels: list[str] = []
    while True:
        length = packet[offset]
        offset += 1
        if length == 0:
            return ".".join(labels).lower(), offset
        if length >= 0xC0:  # compression is not used in questions
            raise ValueError("compressed name in a question")
        labels.append(packet[offset : offset + length].decode("ascii"))
        offset += length


def answer(query: bytes, records: dict[str, str]) -> tuple[bytes, str | None]:
    """The reply to one query, and the name asked (None when the query is malformed)."""
    if len(query) < 12:
        return b"", None
    ident, flags, qdcount = struct.unpack("!HHH", query[:6])
    try:
        if qdcount != 1:
            raise ValueError("one question expected")
        name, end = _read_name(query, 12)
        qtype, _qclass = struct.unpack("!HH", query[end : end + 4])
    except (ValueError, IndexError, struct.error, UnicodeDecodeError):
        header = struct.pack("!HHHHHH", ident, 0x8180 | FORMERR, 0, 0, 0, 0)
        return header, None
    question = query[12 : end + 4]
    address = records.get(name.rstrip("."))
    rd = flags & 0x0100
    answers = b""
    count = 0
    if address is None:
        rcode = NXDOMAIN
    else:
        rcode = NOERROR
        if qtype == A:
            # A pointer to the question's name (offset 12), type A, class IN, TTL 5 s.
            answers = struct.pack("!HHHIH", 0xC00C, A, 1, 5, 4) + socket.inet_aton(address)
            count = 1
    header = struct.pack("!HHHHHH", ident, 0x8080 | rd | rcode, 1, count, 0, 0)
    return header + question + answers, name


class DnsServer:
    """Serves ``records`` (name -> IPv4 address) on ``host``:``port`` (UDP) until closed."""

    def __init__(self, records: dict[str, str], host: str = "127.0.0.1", port: int = 53) -> None:
        self.records = {k.lower().rstrip("."): v for k, v in records.items()}
        self.asked: Counter[str] = Counter()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            reply, name = answer(query, self.records)
            if name is not None:
                self.asked[name] += 1
            if reply:
                self.sock.sendto(reply, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def __enter__(self) -> DnsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
