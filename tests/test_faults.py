"""Faults between objfs and a real S3 server: every read returns the right bytes or EIO.

objfs mounts moto's S3 server through the fault-injecting proxy of tests/helpers/proxy.py,
with short timeouts (``--read-timeout 1.5 --connect-timeout 2 --max-attempts 4``). For every
fault kind, several readers read large files while the proxy breaks every third data request;
then the store breaks every request (reads fail with EIO, within a bounded time, and the mount
stays up); then the faults stop and the same files read correctly again without a remount.

Every byte read is checked against the object's sha256; a read that does not finish within its
deadline counts as a hang and fails the test. The module keeps a tally (faults injected, reads
checked, wrong bytes, hangs) and prints it at the end (run with ``-s`` to see it).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, put_many, sha256
from tests.helpers.proxy import FaultPlan, Proxy

MiB = 1 << 20
FILE_SIZE = 20 * MiB
FAULT_OPTIONS = ("--read-timeout", "1.5", "--connect-timeout", "2", "--max-attempts", "4")
# A read that takes longer than this is a hang: the worst case of 4 attempts, each waiting out
# a 1.5 s timeout, with botocore's backoff between them, is well under it.
READ_DEADLINE_S = 90.0

TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_tally() -> Any:
    """After the module: print the counts quoted in the issue's closing note (``-s``)."""
    yield
    print(f"\nfault tally: {dict(TALLY)}")


def _objects(n: int) -> dict[str, bytes]:
    return {f"data/f{i}.bin": os.urandom(FILE_SIZE) for i in range(n)}


@pytest.fixture
def faulty(s3: Any, bucket: str, proxy: Proxy, mount_s3: Any) -> tuple[Mount, dict[str, bytes]]:
    objects = _objects(4)
    put_many(s3, bucket, objects)
    m: Mount = mount_s3(f"s3://{bucket}", "--endpoint-url", proxy.url, *FAULT_OPTIONS)
    return m, objects


def _read_whole(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(4 * MiB):
            chunks.append(chunk)
    return b"".join(chunks)


def _read_random(path: Path, expected: bytes, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "rb", buffering=0) as f:
        for _ in range(count):
            length = rng.choice([4096, 65536, MiB])
            offset = rng.randrange(0, len(expected) - length)
            got = os.pread(f.fileno(), length, offset)
            TALLY["reads checked"] += 1
            if got != expected[offset : offset + length]:
                TALLY["wrong bytes"] += 1
                raise AssertionError(f"wrong bytes at {offset}+{length} of {path.name}")


def _run_readers(m: Mount, objects: dict[str, bytes]) -> list[BaseException]:
    """Two whole-file readers and two random readers at once; returns their errors."""
    errors: list[BaseException] = []
    names = sorted(objects)

    def whole(name: str) -> None:
        data = _read_whole(m.path / name)
        TALLY["reads checked"] += 1
        if sha256(data) != sha256(objects[name]):
            TALLY["wrong bytes"] += 1
            raise AssertionError(f"{name}: sha256 mismatch")

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [
        threading.Thread(target=guarded, args=(whole, names[0])),
        threading.Thread(target=guarded, args=(whole, names[1])),
        threading.Thread(
            target=guarded, args=(_read_random, m.path / names[2], objects[names[2]], 24, 1)
        ),
        threading.Thread(
            target=guarded, args=(_read_random, m.path / names[3], objects[names[3]], 24, 2)
        ),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + READ_DEADLINE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            TALLY["hangs"] += 1
            errors.append(AssertionError(f"a reader hung for over {READ_DEADLINE_S} s"))
    return errors


def _expect_eio(path: Path) -> None:
    """Reading ``path`` (not cached yet) fails with EIO, in bounded time."""
    result: list[BaseException | bytes] = []

    def read() -> None:
        try:
            result.append(_read_whole(path))
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=read)
    t.start()
    t.join(READ_DEADLINE_S)
    if t.is_alive():
        TALLY["hangs"] += 1
        raise AssertionError(f"reading {path.name} hung while every request failed")
    (outcome,) = result
    TALLY["reads checked"] += 1
    assert isinstance(outcome, OSError), f"expected EIO, got {outcome!r:.200}"
    assert outcome.errno == errno.EIO


# Every fault kind a data GET can meet (bad_xml is a listing's, refusal a connection's).
DATA_FAULTS = ["reset", "truncate", "stall", "500", "503", "short_length", "wrong_range"]


def _survive_every_third(m: Mount, objects: dict[str, bytes], proxy: Proxy, kind: str) -> None:
    """Readers read while every third data GET meets ``kind``: all bytes right, mount up."""
    proxy.set_faults(FaultPlan((kind,), every=3))
    errors = _run_readers(m, objects)
    proxy.set_faults(None)
    TALLY["faults injected"] += proxy.injected[kind]
    assert not errors, errors
    assert proxy.injected[kind] > 0, f"no {kind} fault was injected"
    assert m.proc.poll() is None


@pytest.mark.parametrize("kind", DATA_FAULTS)
def test_reads_survive_every_third_request_failing(
    faulty: tuple[Mount, dict[str, bytes]], proxy: Proxy, kind: str
) -> None:
    m, objects = faulty
    _survive_every_third(m, objects, proxy, kind)


@pytest.mark.parametrize("kind", ["reset", "truncate", "503", "wrong_range"])
def test_a_store_that_always_fails_gives_eio_and_the_mount_recovers(
    faulty: tuple[Mount, dict[str, bytes]], proxy: Proxy, kind: str
) -> None:
    m, objects = faulty
    name = sorted(objects)[0]
    proxy.set_faults(FaultPlan((kind,), every=1))
    _expect_eio(m.path / name)
    TALLY["faults injected"] += proxy.injected[kind]
    assert proxy.injected[kind] > 0
    assert m.proc.poll() is None, "the daemon died"
    assert "bytes" in m.log() or "GET" in m.log()  # the failure was logged with its request
    proxy.set_faults(None)  # the store recovers: the same file reads right, no remount
    data = _read_whole(m.path / name)
    TALLY["reads checked"] += 1
    assert sha256(data) == sha256(objects[name])


@pytest.mark.parametrize("kind", DATA_FAULTS)
def test_azure_reads_survive_every_third_request_failing(
    azurite: Any, azure_service: Any, container: str, mount_az: Any, kind: str
) -> None:
    """The same faults between objfs and Azurite (503 as Azure's ServerBusy would be)."""
    from tests.azurite import DEV_ACCOUNT

    objects = _objects(4)
    client = azure_service.get_container_client(container)
    for name, data in objects.items():
        client.upload_blob(name, data)
    with Proxy(azurite.port) as proxy:
        m: Mount = mount_az(
            f"az://{container}", "--account-url", f"{proxy.url}/{DEV_ACCOUNT}", *FAULT_OPTIONS
        )
        _survive_every_third(m, objects, proxy, kind)


def test_refused_connections_then_recovery(
    faulty: tuple[Mount, dict[str, bytes]], proxy: Proxy
) -> None:
    """Every connection reset and every new one refused: EIO; then service resumes."""
    m, objects = faulty
    name = sorted(objects)[1]
    proxy.refuse(True)
    proxy.set_faults(FaultPlan(("reset",), every=1, target="all", cut_after=0))
    _expect_eio(m.path / name)
    assert proxy.injected["refused"] > 0
    TALLY["faults injected"] += proxy.injected["refused"] + proxy.injected["reset"]
    proxy.refuse(False)
    proxy.set_faults(None)
    data = _read_whole(m.path / name)
    TALLY["reads checked"] += 1
    assert sha256(data) == sha256(objects[name])
    assert m.proc.poll() is None


def test_malformed_listing_xml_is_eio_not_a_crash(
    s3: Any, bucket: str, proxy: Proxy, mount_s3: Any
) -> None:
    put_many(s3, bucket, {"a/x.txt": b"x", "b/y.txt": b"yy"})
    m: Mount = mount_s3(f"s3://{bucket}", "--endpoint-url", proxy.url, *FAULT_OPTIONS)
    proxy.set_faults(FaultPlan(("bad_xml",), every=1, target="list"))
    with pytest.raises(OSError, match="Input/output error") as info:
        os.listdir(m.path / "a")
    assert info.value.errno == errno.EIO
    TALLY["faults injected"] += proxy.injected["bad_xml"]
    assert proxy.injected["bad_xml"] > 0
    proxy.set_faults(None)
    assert os.listdir(m.path / "b") == ["y.txt"]
    assert (m.path / "b" / "y.txt").read_bytes() == b"yy"
    assert m.proc.poll() is None
