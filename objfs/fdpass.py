"""Handing a mounted ``/dev/fuse`` fd from the privileged node plugin to the unprivileged sidecar.

The node plugin (``objfs csi``) mounts a FUSE file system with ``fd=N`` and *offers* that fd on
a Unix socket in the pod's ``objfs-fd`` emptyDir; the sidecar (``objfs sidecar --fd-dir``)
*takes* it and serves it. One socket per published target. The exchange on a connection:

1. the sidecar connects;
2. the node plugin sends one message: a 4-byte big-endian length, then that many bytes of UTF-8
   JSON (the :class:`Offer` payload: ``source``, ``options``, ``volume_id``, ``target_path``,
   ``version``, ``fds``), with the fds attached to the first byte as ``SCM_RIGHTS`` ancillary
   data: ``fds`` names them in order, the FUSE fd first (``fuse``); with the node cache
   (:mod:`objfs.csi.node_cache`) also ``cache-dir`` (the identity's cache folder, a directory
   fd) and ``backing`` (the sidecar's end of the passthrough broker, a SOCK_SEQPACKET socket);
3. the sidecar answers one line: ``ok`` once it serves the fd, or ``error MESSAGE`` only if
   nothing ever read the fd (the options were refused, or its server failed before it got as
   far as the FUSE session): the node plugin then keeps its copy and offers that same fd to
   the next connection. Whenever the fd may have been read (its server died or was stopped
   after it set up the session, or could not say), the sidecar closes the connection without
   an answer: the kernel's INIT request may be consumed and unanswered, so that connection is
   spoiled. The node plugin then drops its copy (the kernel ends the connection: ENOTCONN)
   and offers a fresh mount of the same target to the next connection. So: ``error`` means
   "the fd was never read"; no answer means "drop it";
4. the sidecar keeps the connection open for as long as it serves. The node plugin reads end
   of file on it when the sidecar is gone (exited, killed, or stopped serving).

Invariants: a payload is at most :data:`MAX_PAYLOAD_BYTES`; no credential ever travels in it
(the node plugin refuses credential-like keys before it gets here); every fd received is owned
by exactly one :class:`Offer` and closed by :meth:`Offer.close` unless :meth:`Offer.detach_fd`
took it (all of them: the FUSE fd and the extra ones). Nothing here blocks without a timeout:
sends give up after :data:`SEND_TIMEOUT_S`, receives after their caller's timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

#: Bumped when the payload changes incompatibly; a sidecar refuses versions it does not know.
#: 2: several fds, named by the payload's ``fds``.
PROTOCOL_VERSION = 2
#: The fds an offer may carry, by name, the FUSE fd first.
FD_NAMES = ("fuse", "cache-dir", "backing")
#: The options of one mount fit in a few KiB; anything larger is a bug or an attack.
MAX_PAYLOAD_BYTES = 64 * 1024
_LEN = struct.Struct(">I")
#: How long sending an offer or an answer may block (a few bytes into a fresh connection: only
#: a peer that stopped reading makes it wait at all).
SEND_TIMEOUT_S = 10.0
# The longest path connect(2) takes on Linux (sun_path is 108 bytes with its NUL).
_MAX_SUN_PATH = 107


class FdPassError(Exception):
    """The other side broke the protocol, went away, or took too long."""


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        data = conn.recv(size)
        if not data:
            raise FdPassError("the other side closed the connection mid-message")
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)


def send_offer(
    conn: socket.socket,
    fds: dict[str, int],
    payload: dict[str, Any],
    timeout_s: float = SEND_TIMEOUT_S,
) -> None:
    """Sends ``payload`` (JSON-able) with duplicates of ``fds`` attached (by name, see
    :data:`FD_NAMES`; ``fuse`` is required); the fds stay open here.

    Raises :class:`FdPassError` if the payload is too large or the send takes over
    ``timeout_s``; ``conn``'s own timeout is restored afterwards.
    """
    names = [name for name in FD_NAMES if name in fds]
    assert names[:1] == ["fuse"], sorted(fds)
    assert len(names) == len(fds), sorted(fds)
    body = json.dumps({"version": PROTOCOL_VERSION, **payload, "fds": names}).encode()
    if len(body) > MAX_PAYLOAD_BYTES:
        raise FdPassError(f"offer payload too large ({len(body)} bytes)")
    message = _LEN.pack(len(body)) + body
    previous = conn.gettimeout()
    conn.settimeout(timeout_s)
    try:
        sent = socket.send_fds(conn, [message], [fds[name] for name in names])
        if sent < len(message):
            conn.sendall(message[sent:])
    except TimeoutError as exc:
        raise FdPassError(f"the sidecar did not take the offer within {timeout_s:g} s") from exc
    finally:
        conn.settimeout(previous)


def read_reply(conn: socket.socket, timeout_s: float) -> str | None:
    """Waits up to ``timeout_s`` for the sidecar's answer line.

    Returns ``None`` for ``ok``; the error message for ``error MESSAGE``. Raises
    :class:`FdPassError` on a timeout, end of file or anything else.
    """
    conn.settimeout(timeout_s)
    line = b""
    try:
        while not line.endswith(b"\n"):
            data = conn.recv(1)
            if not data:
                raise FdPassError("the sidecar closed the connection before answering")
            line += data
            if len(line) > 4096:
                raise FdPassError("the sidecar's answer is too long")
    except TimeoutError as exc:
        raise FdPassError(f"no answer from the sidecar within {timeout_s:g} s") from exc
    finally:
        conn.settimeout(None)
    text = line.decode(errors="replace").strip()
    if text == "ok":
        return None
    if text.startswith("error"):
        return text.removeprefix("error").strip() or "unspecified error"
    raise FdPassError(f"unexpected answer from the sidecar: {text[:200]!r}")


@dataclass
class Offer:
    """One FUSE fd taken from a node plugin's socket, with what came with it: the payload and
    the extra fds by name (``cache-dir``, ``backing``)."""

    fd: int
    payload: dict[str, Any]
    conn: socket.socket
    extra: dict[str, int] = field(default_factory=dict)
    _answered: bool = field(default=False, repr=False)

    @property
    def source(self) -> str:
        return str(self.payload["source"])

    @property
    def options(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in dict(self.payload.get("options", {})).items()}

    def ready(self) -> None:
        """Tells the node plugin this fd is served; keep :attr:`conn` open while serving."""
        self._answer(b"ok\n")

    def fail(self, message: str) -> None:
        """Tells the node plugin why this fd will not be served (one line).

        Only for an fd that nothing has read: the node plugin offers the same fd again. If it
        may have been read, :meth:`close` without an answer instead.
        """
        self._answer(b"error " + " ".join(message.split()).encode()[:4000] + b"\n")

    @property
    def answered(self) -> bool:
        return self._answered

    def _answer(self, line: bytes) -> None:
        if self._answered:
            return
        self._answered = True
        with contextlib.suppress(OSError):
            self.conn.settimeout(SEND_TIMEOUT_S)
            try:
                self.conn.sendall(line)
            finally:
                self.conn.settimeout(None)

    def detach_fd(self) -> int:
        """Hands the FUSE fd to the caller (who must close it); :meth:`close` then leaves it
        alone."""
        fd, self.fd = self.fd, -1
        return fd

    def detach_extra(self) -> dict[str, int]:
        """Hands the extra fds to the caller (who must close them)."""
        extra, self.extra = self.extra, {}
        return extra

    def close(self) -> None:
        """Closes the fds (unless detached) and the connection: the node plugin sees end of
        file."""
        for fd in [self.fd, *self.extra.values()]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = -1
        self.extra = {}
        with contextlib.suppress(OSError):
            self.conn.close()


def _connect(conn: socket.socket, path: str) -> None:
    """``conn.connect(path)``, also for a path longer than a socket address takes.

    A long path is reached through its directory's fd (``/proc/self/fd/N/NAME``), as the node
    plugin binds it.
    """
    if len(os.fsencode(path)) <= _MAX_SUN_PATH:
        conn.connect(path)
        return
    directory, name = os.path.split(path)
    dir_fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        conn.connect(f"/proc/self/fd/{dir_fd}/{name}")
    finally:
        os.close(dir_fd)


def take(path: str, timeout_s: float = 10.0) -> Offer:
    """Connects to the node plugin's socket at ``path`` and receives its fd and payload.

    Raises :class:`FdPassError` (nobody listening, timeout, bad message, unknown version) or
    ``OSError`` from ``connect`` (``ENOENT`` for a missing socket or directory).
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout_s)
        _connect(conn, path)
        try:
            head, fds, _flags, _addr = socket.recv_fds(conn, _LEN.size, len(FD_NAMES) + 1)
        except TimeoutError as exc:
            raise FdPassError(f"no offer on {path} within {timeout_s:g} s") from exc
        try:
            if not head:
                raise FdPassError(f"{path}: the node plugin closed the connection")
            if len(head) < _LEN.size:
                head += _recv_exact(conn, _LEN.size - len(head))
            (size,) = _LEN.unpack(head)
            if size > MAX_PAYLOAD_BYTES:
                raise FdPassError(f"{path}: offer payload too large ({size} bytes)")
            if not fds:
                raise FdPassError(f"{path}: the offer came without an fd")
            try:
                payload = json.loads(_recv_exact(conn, size))
            except ValueError as exc:
                raise FdPassError(f"{path}: the offer is not JSON: {exc}") from exc
            if not isinstance(payload, dict) or "source" not in payload:
                raise FdPassError(f"{path}: the offer has no source")
            if payload.get("version") != PROTOCOL_VERSION:
                raise FdPassError(
                    f"{path}: offer protocol version {payload.get('version')!r}, this objfs "
                    f"speaks {PROTOCOL_VERSION}: run the same objfs version on both sides"
                )
            names = payload.get("fds")
            if (
                not isinstance(names, list)
                or len(names) != len(fds)
                or not names
                or names[0] != "fuse"
                or len(set(names)) != len(names)
                or not set(names) <= set(FD_NAMES)
            ):
                raise FdPassError(f"{path}: the offer's fds ({len(fds)}) do not match its names")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        conn.settimeout(None)
        extra = dict(zip(names[1:], fds[1:], strict=True))
        return Offer(fd=fds[0], payload=payload, conn=conn, extra=extra)
    except BaseException:
        conn.close()
        raise
