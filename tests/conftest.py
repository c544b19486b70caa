"""Shared fixtures: a real S3 server (moto) on loopback and real FUSE mounts in subprocesses.

A test never serves a mount from its own process (reading it would deadlock); mounts run as
``python -m objfs mount ... --foreground`` children, are unmounted in ``finally`` and their
exit status is checked.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from objfs.config import MountConfig
from objfs.demo import LocalServer, s3_client, start_moto_server
from objfs.mountinfo import mount_entry
from tests.helpers.proxy import Proxy

# Credentials for the local test servers only. Never read the developer's AWS config.
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "objfs-test",
    "AWS_SECRET_ACCESS_KEY": "objfs-test-secret",
    "AWS_CONFIG_FILE": "/nonexistent/objfs-test-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/objfs-test-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
}
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION"):
    os.environ.pop(_name, None)
os.environ.update(TEST_ENV)

# transformers reads these at import: offline, and its module cache in a throwaway folder.
_HF_HOME = tempfile.mkdtemp(prefix="objfs-test-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ.update(HF_HOME=_HF_HOME, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")

MOUNT_TIMEOUT_S = 30.0
_bucket_ids = itertools.count()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = start_moto_server(str(log))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def iam_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A moto server of the test module's own, whose IAM enforcement the module switches on
    and off (tests/helpers/iam_moto.py)."""
    server = start_moto_server(str(tmp_path_factory.mktemp("iam-moto") / "moto.log"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(s3_server: LocalServer) -> Any:
    return s3_client(s3_server.url)


@pytest.fixture
def bucket(s3: Any) -> str:
    """A fresh, empty bucket for one test."""
    name = f"objfs-test-{os.getpid()}-{next(_bucket_ids)}"
    s3.create_bucket(Bucket=name)
    return name


@dataclass
class Mount:
    path: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def cached_mount_command(source: str, tmp_path: Path, url: str) -> tuple[list[str], Path]:
    """A foreground mount of ``source`` through ``url`` with ``--cache-dir`` under
    ``tmp_path`` (mountpoint ``tmp_path/mnt``, created): (the command, the mountpoint), to
    run with ``run_mount`` once per mount on the same cache."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    cmd = mount_command(
        source,
        mountpoint,
        tmp_path / "objfs.log",
        *("--endpoint-url", url, "--cache-dir", str(tmp_path / "cache")),
    )
    return cmd, mountpoint


def wait_mounted(path: Path, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while mount_entry(str(path)) is None:
        if proc.poll() is not None:
            raise AssertionError(
                f"objfs exited with {proc.returncode} before mounting:\n"
                + log_path.read_text(errors="replace")
            )
        if time.monotonic() > deadline:
            raise AssertionError("objfs did not mount in time:\n" + log_path.read_text())
        time.sleep(0.05)


def force_unmount(path: Path) -> None:
    if mount_entry(str(path)) is not None:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def run_mount(
    cmd: list[str], mountpoint: Path, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[Mount]:
    """Run a foreground objfs command that mounts ``mountpoint``; unmount and reap it after.

    Its stdout/stderr go to ``log_path``; objfs's own ``--log-file`` should be another file.
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        wait_mounted(mountpoint, proc, log_path)
        yield Mount(mountpoint, proc, log_path)
        assert proc.poll() is None, "objfs died while the test ran:\n" + log_path.read_text()
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True, capture_output=True)
        assert proc.wait(timeout=30) == 0, "objfs did not exit cleanly:\n" + log_path.read_text()
    finally:
        force_unmount(mountpoint)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# The FUSE transport of the mounts tests make: OBJFS_TEST_FUSE_TRANSPORT adds it to every
# mount command; else $OBJFS_FUSE_TRANSPORT or the default applies (see objfs.options).
TRANSPORT = os.environ.get("OBJFS_TEST_FUSE_TRANSPORT", "")
EFFECTIVE_TRANSPORT = (
    TRANSPORT or os.environ.get("OBJFS_FUSE_TRANSPORT") or MountConfig.fuse_transport
)


def mount_command(source: str, mountpoint: Path, log_path: Path, *options: str) -> list[str]:
    """``objfs mount`` in the foreground, logging to ``log_path`` (later options win)."""
    return [
        sys.executable,
        "-m",
        "objfs",
        "mount",
        source,
        str(mountpoint),
        "--foreground",
        "--log-file",
        str(log_path),
        # The suite on another transport: OBJFS_TEST_FUSE_TRANSPORT=pyfuse3 make test.
        *(("--fuse-transport", TRANSPORT) if TRANSPORT else ()),
        *options,
    ]


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """An empty mountpoint that must be left unmounted (for commands expected to fail)."""
    path = tmp_path / "mnt"
    path.mkdir()
    yield path
    assert mount_entry(str(path)) is None, "an error left something mounted"


@pytest.fixture
def mount_s3(s3_server: LocalServer, tmp_path: Path) -> Iterator[Any]:
    """``mount_s3(source, *options)`` mounts with objfs in the foreground in a child."""
    stack = contextlib.ExitStack()
    counter = itertools.count()

    def mount(source: str, *options: str, env: dict[str, str] | None = None) -> Mount:
        n = next(counter)
        mountpoint = tmp_path / f"mnt{n}"
        mountpoint.mkdir()
        log_path = tmp_path / f"objfs{n}.log"
        out_path = tmp_path / f"objfs{n}.out"
        cmd = mount_command(source, mountpoint, log_path, "--endpoint-url", s3_server.url, *options)
        mounted = stack.enter_context(run_mount(cmd, mountpoint, out_path, env))
        return Mount(mounted.path, mounted.proc, log_path)

    with stack:
        yield mount


def run_objfs(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run the ``objfs`` command as a user would (no stdin); 120 s is a hang guard only."""
    return subprocess.run(
        [sys.executable, "-m", "objfs", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        **kwargs,
    )


def fresh_status(path: Path) -> dict[str, Any]:
    """``objfs status PATH --json`` once the daemon rewrote its status file (every second), so
    the figures include everything done before the call."""
    time.sleep(1.5)
    status = run_objfs("status", str(path), "--json")
    assert status.returncode == 0, status.stderr
    return dict(json.loads(status.stdout))


@pytest.fixture
def proxy(s3_server: LocalServer) -> Iterator[Proxy]:
    """A counting TCP proxy in front of the S3 server (see tests/helpers/proxy.py)."""
    with Proxy(int(s3_server.url.rsplit(":", 1)[1])) as p:
        yield p


def put_many(s3: Any, bucket: str, items: dict[str, bytes]) -> None:
    """Upload ``items`` with a few threads (moto answers one request per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    def put(item: tuple[str, bytes]) -> None:
        s3.put_object(Bucket=bucket, Key=item[0], Body=item[1])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, items.items()))


# ==============================================================================================
# Azure Blob Storage: Azurite on loopback and az:// mounts.
#
# No test may reach a real storage account or DefaultAzureCredential (whose probes go to the
# instance-metadata address): the developer's AZURE_* variables are dropped, identity is
# switched off for every objfs this process starts, and each test passes its own credentials.
# ==============================================================================================

for _name in [n for n in os.environ if n.startswith("AZURE_")]:
    del os.environ[_name]
os.environ["OBJFS_AZURE_NO_IDENTITY"] = "1"

_container_ids = itertools.count()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Azurite's blob service on a free loopback port (see tests/azurite.py)."""
    from tests.azurite import start_azurite

    log = tmp_path_factory.mktemp("azurite") / "azurite.log"
    server = start_azurite(str(log))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azure_service(azurite: Any) -> Iterator[Any]:
    """A BlobServiceClient for Azurite's dev account (tests set up data with it)."""
    from azure.storage.blob import BlobServiceClient

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    client = BlobServiceClient(
        azurite.account_url, credential={"account_name": DEV_ACCOUNT, "account_key": DEV_KEY}
    )
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def container(azure_service: Any) -> str:
    """A fresh, empty container for one test; returns its name."""
    name = f"objfs-test-{os.getpid()}-{next(_container_ids)}"
    azure_service.create_container(name)
    return name


def azure_env() -> dict[str, str]:
    """Environment of an objfs child signed with Azurite's dev key."""
    from tests.azurite import DEV_KEY

    return {"AZURE_STORAGE_KEY": DEV_KEY}


@pytest.fixture
def mount_az(azurite: Any, tmp_path: Path) -> Iterator[Any]:
    """``mount_az(source, *options, env=None)``: objfs mounts an az:// SOURCE of Azurite in the
    foreground in a child (dev account and key unless ``env`` overrides them)."""
    from tests.azurite import DEV_ACCOUNT

    stack = contextlib.ExitStack()
    counter = itertools.count()

    def mount(source: str, *options: str, env: dict[str, str] | None = None) -> Mount:
        n = next(counter)
        mountpoint = tmp_path / f"azmnt{n}"
        mountpoint.mkdir()
        log_path = tmp_path / f"objfs-az{n}.log"
        out_path = tmp_path / f"objfs-az{n}.out"
        cmd = [
            sys.executable,
            "-m",
            "objfs",
            "mount",
            source,
            str(mountpoint),
            "--foreground",
            "--account-name",
            DEV_ACCOUNT,
            "--account-url",
            azurite.account_url,
            "--log-file",
            str(log_path),
            *options,
        ]
        child_env = {**azure_env(), **(env or {})}
        mounted = stack.enter_context(run_mount(cmd, mountpoint, out_path, child_env))
        return Mount(mounted.path, mounted.proc, log_path)

    with stack:
        yield mount


def load_at_once(mounts: list[Mount], files: dict[str, bytes]) -> list[str]:
    """Every mount reads every file (path relative to the mount: bytes) whole, all at once, in
    threads; what did not match or failed, by path (empty when every byte was right)."""
    errors: list[str] = []

    def load(m: Mount) -> None:
        try:
            for rel, data in files.items():
                if sha256((m.path / rel).read_bytes()) != sha256(data):
                    errors.append(f"{m.path.name}/{rel}: wrong bytes")
        except OSError as exc:
            errors.append(f"{m.path.name}: {exc}")

    threads = [threading.Thread(target=load, args=(m,)) for m in mounts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return errors
