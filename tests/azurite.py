"""Azurite, Microsoft's Azure Storage emulator, as a child process on 127.0.0.1 (blob service only).

Used by the test fixtures and by ``tests/benchmarks/azure_sdk_vs_raw.py``. ``make setup`` installs
Azurite with npm into ``.npm-tools/`` (git-ignored); ``OBJFS_AZURITE`` may name another
``azurite-blob`` executable.

Azurite is started with telemetry off (it would otherwise send usage data to the internet),
account names taken from the URL path only, and its data in memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from objfs.demo import LocalServer, free_port

REPO = Path(__file__).resolve().parent.parent
AZURITE_BIN = REPO / ".npm-tools" / "node_modules" / ".bin" / "azurite-blob"

#: Azurite's built-in development account. Its key is published in Azurite's documentation and
#: works only against the emulator; it is used by the tests and nowhere else.
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

_START_TIMEOUT_S = 30.0
# Azurite closes idle keep-alive connections after 5 s by default; a longer timeout spares the
# tests a retried request (with its backoff) after every pause of the SDK's connection pool.
_KEEP_ALIVE_S = 300
# Enough for every test's objects; Azurite's own default is half of the machine's memory.
_MEMORY_LIMIT_MB = 4096


def azurite_executable() -> str:
    """Path of ``azurite-blob``; raises RuntimeError with the fix when it is not installed."""
    path = os.environ.get("OBJFS_AZURITE") or str(AZURITE_BIN)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"Azurite is not installed at {path}: run `make setup` (needs npm)")
    return path


@dataclass
class Azurite(LocalServer):
    """A running Azurite blob service; ``account_url`` is the dev account's endpoint."""

    workdir: str = ""

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def account_url(self) -> str:
        return f"{self.url}/{DEV_ACCOUNT}"

    def connection_string(self, key: str = DEV_KEY) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={self.account_url};"
        )

    def stop(self) -> None:
        """Stop the server (by its PID) and remove its working folder."""
        super().stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/{DEV_ACCOUNT}?comp=list", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # 403 for an unsigned request: the server is up
    except OSError:
        return False


def start_azurite(log_path: str | None = None) -> Azurite:
    """Start Azurite's blob service on a free loopback port and wait until it answers."""
    executable = azurite_executable()
    last_error = "no attempt"
    for _ in range(3):  # another process may take the free port before Azurite binds it
        port = free_port()
        # In-memory data; the working folder catches anything Azurite still writes (logs).
        workdir = tempfile.mkdtemp(prefix="objfs-azurite-")
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(
            [
                executable,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--extentMemoryLimit",
                str(_MEMORY_LIMIT_MB),
                "--blobKeepAliveTimeout",
                str(_KEEP_ALIVE_S),
                "--disableTelemetry",
                "--disableProductStyleUrl",
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        if log_path:
            out.close()  # type: ignore[union-attr]
        server = Azurite(f"http://127.0.0.1:{port}", proc, workdir)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(server.url):
                return server
            time.sleep(0.1)
        last_error = (
            f"exited with status {proc.returncode}"
            if proc.poll() is not None
            else f"did not answer within {_START_TIMEOUT_S:.0f} s"
        )
        server.stop()
    raise RuntimeError(f"Azurite {last_error}" + (f"; see {log_path}" if log_path else ""))


def put_blobs(
    server: Azurite,
    container: str,
    items: dict[str, bytes],
    metadata: dict[str, dict[str, str]] | None = None,
) -> None:
    """Upload ``items`` (name -> bytes) to ``container`` with the dev account, 8 at a time.

    Names with ``.`` or ``..`` segments cannot go through the SDK (its HTTP stack removes dot
    segments from the URL, and the signature no longer matches); they are sent as raw PUTs
    with the dots percent-encoded, which Azurite stores as the literal name.
    """
    import datetime as _dt
    import http.client
    import urllib.parse
    from concurrent.futures import ThreadPoolExecutor

    from azure.storage.blob import (
        BlobServiceClient,
        ContainerSasPermissions,
        generate_container_sas,
    )

    service = BlobServiceClient(
        server.account_url, credential={"account_name": DEV_ACCOUNT, "account_key": DEV_KEY}
    )
    client = service.get_container_client(container)
    sas = generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(write=True, create=True),
        expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
    )

    def raw_put(name: str, data: bytes) -> None:
        path = "/".join(
            urllib.parse.quote(seg, safe="").replace(".", "%2E")
            if seg in (".", "..")
            else urllib.parse.quote(seg, safe="")
            for seg in name.split("/")
        )
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request(
                "PUT",
                f"/{DEV_ACCOUNT}/{container}/{path}?{sas}",
                body=data,
                headers={"x-ms-blob-type": "BlockBlob", "x-ms-version": "2021-08-06"},
            )
            resp = conn.getresponse()
            resp.read()
            if resp.status != 201:
                raise RuntimeError(f"PUT {name!r}: HTTP {resp.status}")
        finally:
            conn.close()

    def put(item: tuple[str, bytes]) -> None:
        name, data = item
        if any(seg in (".", "..") for seg in name.split("/")):
            raw_put(name, data)
        else:
            meta = (metadata or {}).get(name)
            client.upload_blob(name, data, overwrite=True, metadata=meta)

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, items.items()))
    finally:
        service.close()
