"""The fd hand-over protocol between the node plugin and the sidecar (objfs/fdpass.py)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from objfs import fdpass


def _bind(listener: socket.socket, path: str) -> None:
    """Binds ``path`` through its directory's fd, as the node plugin does for a long path."""
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        listener.bind(f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}")
    finally:
        os.close(dir_fd)


def _serve_once(
    path: str, fd: int, payload: dict[str, object], replies: list[object]
) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _bind(listener, path)
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        fdpass.send_offer(conn, {"fuse": fd}, payload)
        try:
            replies.append(fdpass.read_reply(conn, 5))
        except fdpass.FdPassError as exc:
            replies.append(exc)
        # End of file once the sidecar closes.
        replies.append(conn.recv(1))
        conn.close()

    threading.Thread(target=run, daemon=True).start()
    return listener


def test_the_fd_and_payload_arrive_and_the_answer_goes_back(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "v.sock")
    r, w = os.pipe()
    replies: list[object] = []
    listener = _serve_once(path, w, {"source": "s3://b/p", "options": {"region": "x"}}, replies)
    try:
        offer = fdpass.take(path, timeout_s=5)
        assert offer.source == "s3://b/p"
        assert offer.options == {"region": "x"}
        # The received fd is a duplicate of the pipe's write end.
        os.write(offer.fd, b"hello")
        assert os.read(r, 5) == b"hello"
        offer.ready()
        offer.close()
        for _ in range(100):
            if len(replies) == 2:
                break
            threading.Event().wait(0.05)
        assert replies == [None, b""]
    finally:
        listener.close()
        os.close(r)
        os.close(w)


def test_an_error_answer_carries_its_message(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "v.sock")
    r, w = os.pipe()
    replies: list[object] = []
    listener = _serve_once(path, w, {"source": "s3://b"}, replies)
    try:
        offer = fdpass.take(path, timeout_s=5)
        offer.fail("bucket\nnot found")
        offer.close()
        for _ in range(100):
            if replies:
                break
            threading.Event().wait(0.05)
        assert replies[0] == "bucket not found"
    finally:
        listener.close()
        os.close(r)
        os.close(w)


def test_a_wrong_protocol_version_is_refused_and_the_fd_closed(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "v.sock")
    r, w = os.pipe()
    listener = _serve_once(path, w, {"source": "s3://b", "version": 99}, [])
    try:
        with pytest.raises(fdpass.FdPassError, match="protocol version 99"):
            fdpass.take(path, timeout_s=5)
        # The received duplicate of the write end was closed: with ours closed too, the pipe
        # reads end of file instead of blocking.
        os.close(w)
        assert os.read(r, 1) == b""
    finally:
        listener.close()
        os.close(r)


def test_nobody_offering_times_out(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "v.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with pytest.raises(fdpass.FdPassError, match="no offer"):
            fdpass.take(path, timeout_s=0.3)
    finally:
        listener.close()


def test_a_socket_in_a_long_directory_is_reached(tmp_path: object) -> None:
    # Longer than a socket address takes (108 bytes): reached through the directory's fd.
    directory = os.path.join(str(tmp_path), *["d" * 60] * 3)
    os.makedirs(directory)
    path = os.path.join(directory, "0123456789abcdef-volume.sock")
    assert len(path) > 200
    r, w = os.pipe()
    replies: list[object] = []
    listener = _serve_once(path, w, {"source": "s3://b/p"}, replies)
    try:
        offer = fdpass.take(path, timeout_s=5)
        assert offer.source == "s3://b/p"
        offer.ready()
        offer.close()
        for _ in range(100):
            if len(replies) == 2:
                break
            threading.Event().wait(0.05)
        assert replies == [None, b""]
        # Nobody listening there any more: the same errors as for a short path.
        listener.close()
        with pytest.raises(ConnectionRefusedError):
            fdpass.take(path, timeout_s=1)
        os.unlink(path)
        with pytest.raises(FileNotFoundError):
            fdpass.take(path, timeout_s=1)
    finally:
        listener.close()
        os.close(r)
        os.close(w)


def _fill(conn: socket.socket) -> None:
    """Fills ``conn``'s send buffer: the peer never reads."""
    conn.setblocking(False)
    try:
        while True:
            conn.send(b"x" * 65536)
    except BlockingIOError:
        pass
    conn.setblocking(True)


def test_sends_to_a_peer_that_never_reads_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        _fill(a)
        a.settimeout(7.0)
        with pytest.raises(fdpass.FdPassError, match=r"within 0\.3 s"):
            fdpass.send_offer(a, {"fuse": w}, {"source": "s3://b"}, timeout_s=0.3)
        assert a.gettimeout() == 7.0  # the caller's timeout is back

        # The sidecar's answer gives up too, quietly: the offer is closed next anyway.
        monkeypatch.setattr(fdpass, "SEND_TIMEOUT_S", 0.3)
        offer = fdpass.Offer(fd=-1, payload={"source": "s3://b"}, conn=a)
        started = time.monotonic()
        offer.fail("refused")
        assert time.monotonic() - started < 5
        assert offer.answered
    finally:
        a.close()
        b.close()
        os.close(r)
        os.close(w)
