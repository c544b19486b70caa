"""Credential files re-read while mounted: rotated SAS tokens and access keys, no remount.

The mount tests run real mounts against real servers that enforce credentials: Azurite
(SAS expiry) and a moto server of its own with IAM enforcement switched on after the setup
(``/moto-api/reset-auth``), where a deleted access key answers 403 ``InvalidAccessKeyId``.
The backend tests drive the same path without the kernel and with a check interval of an
hour, so that only the re-read after an authentication failure can find the new credentials.
The :class:`CredentialWatch` tests cover the change detection: a Kubernetes Secret's
``..data`` symlink swap, a missing file, a half-written or invalid file.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from objfs.credentials import CredentialWatch
from objfs.demo import LocalServer
from objfs.errors import UsageError
from tests.conftest import Mount, mount_command, run_mount, sha256
from tests.helpers.iam_moto import enforce_auth, new_access_key
from tests.helpers.known_secrets import remember

MiB = 1 << 20
_bucket_ids = itertools.count()


# -- change detection (no servers) -----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A backend's ``prepare``: records the keys it was given; refuses an incomplete set."""

    def __init__(self) -> None:
        self.prepared: list[dict[str, str]] = []
        self.used: list[str] = []

    def __call__(self, environ: Mapping[str, str]) -> Callable[[], None]:
        key = environ.get("AWS_ACCESS_KEY_ID", "")
        if not key or not environ.get("AWS_SECRET_ACCESS_KEY"):
            raise UsageError("--credentials-file holds no complete key")
        self.prepared.append({"AWS_ACCESS_KEY_ID": key})
        return lambda: self.used.append(key)


def _creds(key: str, secret: str) -> str:
    return f"AWS_ACCESS_KEY_ID={key}\nAWS_SECRET_ACCESS_KEY={secret}\n"


def _secret_volume(root: Path, version: str, text: str) -> None:
    """Write ``text`` as the key ``credentials`` of a Secret volume, the way the kubelet's
    atomic writer does: a new timestamped folder, then ``..data`` swapped by a rename."""
    folder = root / f"..{version}"
    folder.mkdir()
    (folder / "credentials").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, root / "..data")
    if not (root / "credentials").is_symlink():
        (root / "credentials").symlink_to("..data/credentials")


@pytest.fixture
def env_without_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")


@pytest.mark.usefixtures("env_without_aws")
def test_secret_volume_symlink_swap_is_seen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _secret_volume(tmp_path, "2026_01_01", _creds("KEYONE", "first-secret-value"))
    path = str(tmp_path / "credentials")
    clock = FakeClock()
    watch = CredentialWatch([("--credentials-file", path)], credentials_file=path, clock=clock)
    assert watch.environ["AWS_ACCESS_KEY_ID"] == "KEYONE"
    backend = Recorder()
    watch.bind(backend)
    caplog.set_level(logging.INFO, logger="objfs")

    _secret_volume(tmp_path, "2026_01_02", _creds("KEYTWO", "second-secret-value"))
    assert watch.poll() == 0  # checked at most once a second...
    clock.now += 1.0
    assert watch.poll() == 1  # ...then the swapped link's target is read
    assert backend.used == ["KEYTWO"]
    assert watch.environ["AWS_ACCESS_KEY_ID"] == "KEYTWO"
    assert watch.poll(force=True) == 1  # unchanged: nothing read again
    assert backend.prepared == [{"AWS_ACCESS_KEY_ID": "KEYTWO"}]
    # The old folder goes away as the kubelet cleans up: the link still resolves.
    for leftover in (tmp_path / "..2026_01_01").iterdir():
        leftover.unlink()
    (tmp_path / "..2026_01_01").rmdir()
    assert watch.poll(force=True) == 1
    assert [r.getMessage() for r in caplog.records] == [f"credentials reloaded from {path}"]
    assert "secret-value" not in caplog.text


@pytest.mark.usefixtures("env_without_aws")
def test_missing_or_invalid_file_keeps_the_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "creds.env"
    path.write_text(_creds("KEYONE", "first-secret-value"))
    clock = FakeClock()
    watch = CredentialWatch(
        [("--credentials-file", str(path))], credentials_file=str(path), clock=clock
    )
    backend = Recorder()
    watch.bind(backend)
    caplog.set_level(logging.INFO, logger="objfs")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    path.unlink()  # between a delete and a create
    assert watch.poll(force=True) == 0
    assert watch.poll(force=True) == 0
    assert len(warnings()) == 1  # one warning, not one per request
    assert "missing" in warnings()[0]
    assert str(path) in warnings()[0]

    path.write_text("AWS_ACCESS_KEY_ID=KEYTW")  # half-written: a line cut short
    assert watch.poll(force=True) == 0
    path.write_text("AWS_ACCESS_KEY_ID=KEYTWO\nAWS_SECRET_")  # not NAME=VALUE yet
    assert watch.poll(force=True) == 0
    path.write_text("AWS_SECRET_ACCESS_KEY=leaked-if-logged\nNOT_A_CREDENTIAL=x\n")
    assert watch.poll(force=True) == 0
    assert len(warnings()) == 4
    assert "line 2" in warnings()[3]
    assert backend.used == []
    assert watch.environ["AWS_ACCESS_KEY_ID"] == "KEYONE"

    path.write_text(_creds("KEYTWO", "second-secret-value"))
    assert watch.poll(force=True) == 1
    assert backend.used == ["KEYTWO"]
    path.write_bytes(b"\xff\xfe not text")
    assert watch.poll(force=True) == 1
    assert backend.used == ["KEYTWO"]
    assert len(warnings()) == 5
    for value in ("secret-value", "leaked-if-logged", "KEYTW", "KEYONE"):
        assert value not in caplog.text


@pytest.mark.usefixtures("env_without_aws")
def test_file_written_while_read_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "creds.env"
    path.write_text(_creds("KEYONE", "first-secret-value"))
    watch = CredentialWatch([("--credentials-file", str(path))], credentials_file=str(path))
    backend = Recorder()
    writes = iter([_creds("KEYTHREE", "third-secret-value-longer")])

    def prepare(environ: Mapping[str, str]) -> Callable[[], None]:
        commit = backend(environ)
        for text in writes:  # the writer is still at it while objfs reads
            path.write_text(text)
        return commit

    watch.bind(prepare)
    path.write_text(_creds("KEYTWO", "second-secret-value"))
    assert watch.poll(force=True) == 0  # read, but changed meanwhile: not used
    assert backend.used == []
    assert watch.poll(force=True) == 1
    assert backend.used == ["KEYTHREE"]


def test_sas_token_file_change_is_seen(tmp_path: Path) -> None:
    token = tmp_path / "sas.txt"
    token.write_text("sv=1&sig=first")
    watch = CredentialWatch([("--sas-token-file", str(token))])
    calls: list[int] = []
    watch.bind(lambda environ: lambda: calls.append(1))
    assert watch.poll(force=True) == 0
    token.write_text("sv=1&sig=second-one")
    assert watch.poll(force=True) == 1
    assert calls == [1]


# -- S3: a moto server that enforces IAM credentials -----------------------------------------


def _client(server: LocalServer, service: str, key: dict[str, str] | None = None) -> Any:
    import boto3

    extra = {}
    if key is not None:
        extra = {
            "aws_access_key_id": key["AccessKeyId"],
            "aws_secret_access_key": key["SecretAccessKey"],
        }
    return boto3.client(service, endpoint_url=server.url, region_name="us-east-1", **extra)


class IamBucket:
    """A bucket of ``iam_s3`` with objects, and a user allowed everything, signing with
    ``key``; IAM enforcement is on once it is made."""

    def __init__(self, server: LocalServer, name: str, objects: dict[str, bytes]) -> None:
        self.server = server
        self.name = name
        self.user = f"{name}-user"
        enforce_auth(server, False)
        s3 = _client(server, "s3")
        s3.create_bucket(Bucket=name)
        for key, data in objects.items():
            s3.put_object(Bucket=name, Key=key, Body=data)
        iam = _client(server, "iam")
        iam.create_user(UserName=self.user)
        policy = iam.create_policy(
            PolicyName=f"{name}-all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        iam.attach_user_policy(UserName=self.user, PolicyArn=policy["Policy"]["Arn"])
        self.key = new_access_key(iam, self.user)
        enforce_auth(server, True)

    def rotate(self, credentials_file: Path) -> dict[str, str]:
        """Make a second key, write it to ``credentials_file``, delete the first; checks that
        the server refuses the first one from then on."""
        iam = _client(self.server, "iam", self.key)
        old, new = self.key, new_access_key(iam, self.user)
        _write_credentials(credentials_file, new)
        iam.delete_access_key(UserName=self.user, AccessKeyId=old["AccessKeyId"])
        self.key = new
        import botocore.exceptions

        with pytest.raises(botocore.exceptions.ClientError, match="InvalidAccessKeyId"):
            _client(self.server, "s3", old).list_objects_v2(Bucket=self.name, MaxKeys=1)
        return new


def _write_credentials(path: Path, key: dict[str, str]) -> None:
    """Rewrite the file in place (as an editor or a config tool would), mode 600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"AWS_ACCESS_KEY_ID={key['AccessKeyId']}\n")
        f.write(f"AWS_SECRET_ACCESS_KEY={key['SecretAccessKey']}\n")


@pytest.fixture
def iam_bucket(iam_s3: LocalServer) -> Iterator[Callable[[dict[str, bytes]], IamBucket]]:
    """``iam_bucket(objects)`` makes an IamBucket; enforcement is off again after the test."""

    def make(objects: dict[str, bytes]) -> IamBucket:
        return IamBucket(iam_s3, f"rotation-{os.getpid()}-{next(_bucket_ids)}", objects)

    yield make
    enforce_auth(iam_s3, False)


def test_s3_mount_follows_a_rotated_access_key(
    iam_s3: LocalServer, iam_bucket: Any, tmp_path: Path
) -> None:
    objects = {f"m/{name}.bin": os.urandom(3 * MiB + 17) for name in ("a", "b", "c")}
    bucket: IamBucket = iam_bucket(objects)
    creds = tmp_path / "objfs.credentials"
    _write_credentials(creds, bucket.key)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "objfs.log"
    cmd = mount_command(
        f"s3://{bucket.name}/m",
        mountpoint,
        log_path,
        "--endpoint-url",
        iam_s3.url,
        "--credentials-file",
        str(creds),
        "--metadata-ttl",
        "0",
        "--part-size",
        "1M",
    )
    with run_mount(cmd, mountpoint, tmp_path / "objfs.out") as m:
        assert sha256((m.path / "a.bin").read_bytes()) == sha256(objects["m/a.bin"])
        bucket.rotate(creds)
        # Uncached objects (listed, headed and read) with the new key only, no remount.
        assert sorted(os.listdir(m.path)) == ["a.bin", "b.bin", "c.bin"]
        assert sha256((m.path / "b.bin").read_bytes()) == sha256(objects["m/b.bin"])
        with open(m.path / "c.bin", "rb") as f:
            assert f.read(MiB) == objects["m/c.bin"][:MiB]
            f.seek(2 * MiB)
            assert f.read() == objects["m/c.bin"][2 * MiB :]
        assert m.proc.poll() is None  # the same daemon served it all: no remount
    log = log_path.read_text()
    assert f"credentials reloaded from {creds}" in log
    assert "Traceback" not in log
    out = (tmp_path / "objfs.out").read_text()
    for value in (bucket.key["SecretAccessKey"],):
        assert value not in log
        assert value not in out


async def test_s3_request_refused_after_rotation_rereads_the_file_and_retries(
    iam_s3: LocalServer,
    iam_bucket: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check interval is an hour: only the re-read after the 403 can find the new key."""
    from objfs.backends.s3 import S3Backend
    from objfs.config import S3Options

    data = {"k/a.bin": os.urandom(MiB), "k/b.bin": os.urandom(MiB + 5)}
    bucket: IamBucket = iam_bucket(data)
    creds = tmp_path / "objfs.credentials"
    _write_credentials(creds, bucket.key)
    # The environment as load_credentials_file leaves it.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bucket.key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bucket.key["SecretAccessKey"])
    watch = CredentialWatch(
        [("--credentials-file", str(creds))], credentials_file=str(creds), interval_s=3600
    )
    backend = S3Backend(
        bucket.name,
        S3Options(endpoint_url=iam_s3.url, region="us-east-1"),
        credential_watch=watch,
    )
    caplog.set_level(logging.INFO, logger="objfs")
    try:
        info = await backend.head("k/a.bin")
        assert sha256(await backend.read_range("k/a.bin", info.etag, 0, MiB)) == sha256(
            data["k/a.bin"]
        )
        bucket.rotate(creds)
        # A data GET (signed by objfs): 403, re-read, one more try with the new key.
        assert sha256(await backend.read_range("k/a.bin", info.etag, 0, MiB)) == sha256(
            data["k/a.bin"]
        )
        assert watch.generation == 1
        bucket.rotate(creds)
        # A HEAD and a listing (botocore's client) after the next rotation.
        info_b = await backend.head("k/b.bin")
        assert info_b.size == MiB + 5
        assert watch.generation == 2
        bucket.rotate(creds)
        pages = [page async for page in backend.list_prefix("k/")]
        assert sorted(o.key for p in pages for o in p.objects) == ["k/a.bin", "k/b.bin"]
        assert sha256(await backend.read_range("k/b.bin", info_b.etag, 0, MiB + 5)) == sha256(
            data["k/b.bin"]
        )
        assert watch.generation == 3
    finally:
        await backend.aclose()
    assert caplog.text.count(f"credentials reloaded from {creds}") == 3
    assert bucket.key["SecretAccessKey"] not in caplog.text


# -- Azure: SAS tokens that expire ----------------------------------------------------------


def _sas(container: str, expiry: _dt.datetime, key: str | None = None) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    sas: str = generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=key or DEV_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        start=_dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5),
        expiry=expiry,
    )
    remember("a test SAS token", sas)
    remember("a test SAS signature", dict(p.split("=", 1) for p in sas.split("&"))["sig"])
    return sas


def _refused(azurite: Any, container: str, sas: str) -> bool:
    url = f"{azurite.account_url}/{container}?restype=container&comp=list&{sas}"
    try:
        with urllib.request.urlopen(url, timeout=10):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 403


def test_azure_mount_follows_a_replaced_sas_token(
    mount_az: Any, azurite: Any, azure_service: Any, container: str, tmp_path: Path
) -> None:
    client = azure_service.get_container_client(container)
    blobs = {f"m/{name}.bin": os.urandom(3 * MiB + 17) for name in ("a", "b", "c")}
    for name, data in blobs.items():
        client.upload_blob(name, data)
    lifetime_s = 8.0  # long enough to mount and read once on a slow machine
    expiry = _dt.datetime.now(_dt.UTC) + _dt.timedelta(seconds=lifetime_s)
    first = _sas(container, expiry)
    token_file = tmp_path / "sas.txt"
    token_file.write_text(first + "\n")
    m: Mount = mount_az(
        f"az://{container}/m",
        "--sas-token-file",
        str(token_file),
        "--metadata-ttl",
        "0",
        "--part-size",
        "1M",
        env={"AZURE_STORAGE_KEY": ""},  # only the SAS
    )
    assert sha256((m.path / "a.bin").read_bytes()) == sha256(blobs["m/a.bin"])
    assert _dt.datetime.now(_dt.UTC) < expiry, "too slow: the first token expired already"
    second = _sas(container, _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1))
    token_file.write_text(second + "\n")
    time.sleep(max(0.0, (expiry - _dt.datetime.now(_dt.UTC)).total_seconds()) + 1.5)
    assert _refused(azurite, container, first)  # the server no longer takes the first one
    assert sorted(os.listdir(m.path)) == ["a.bin", "b.bin", "c.bin"]
    assert sha256((m.path / "b.bin").read_bytes()) == sha256(blobs["m/b.bin"])
    with open(m.path / "c.bin", "rb") as f:
        f.seek(MiB + 3)
        assert f.read(MiB) == blobs["m/c.bin"][MiB + 3 : 2 * MiB + 3]
    log = m.log()
    assert f"credentials reloaded from {token_file}" in log
    assert "Traceback" not in log
    for secret in (first, second):
        assert secret not in log


async def test_azure_request_refused_rereads_the_sas_file_and_retries(
    azurite: Any, azure_service: Any, container: str, tmp_path: Path
) -> None:
    """The check interval is an hour: only the re-read after the 403 can find the token."""
    from objfs.backends.azure import AzureBackend
    from objfs.config import AzureOptions, parse_source
    from tests.azurite import DEV_ACCOUNT

    data = os.urandom(MiB + 9)
    client = azure_service.get_container_client(container)
    client.upload_blob("k/a.bin", data)
    client.upload_blob("k/b.bin", data[::-1])
    info_etag = (
        '"' + str(client.get_blob_client("k/a.bin").get_blob_properties().etag).strip('"') + '"'
    )
    token_file = tmp_path / "sas.txt"
    wrong_key = "V3Jvbmcga2V5IGZvciBhIFNBUyB0aGF0IEF6dXJpdGUgcmVmdXNlcw=="
    token_file.write_text(
        _sas(container, _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1), key=wrong_key)
    )
    watch = CredentialWatch([("--sas-token-file", str(token_file))], interval_s=3600)
    options = AzureOptions(
        account_name=DEV_ACCOUNT, account_url=azurite.account_url, sas_token_file=str(token_file)
    )
    backend = AzureBackend(parse_source(f"az://{container}"), options, credential_watch=watch)
    try:
        from objfs.errors import AccessDeniedError

        with pytest.raises(AccessDeniedError):  # the token is refused, the file unchanged
            await backend.read_range("k/a.bin", info_etag, 0, MiB)
        token_file.write_text(_sas(container, _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1)))
        got = await backend.read_range("k/a.bin", info_etag, 0, MiB + 9)
        assert sha256(got) == sha256(data)
        assert watch.generation == 1
        token_file.write_text(_sas(container, _dt.datetime.now(_dt.UTC) - _dt.timedelta(hours=1)))
        assert watch.poll(force=True) == 2  # an expired but well-formed token is taken...
        token_file.write_text(_sas(container, _dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1)))
        pages = [page async for page in backend.list_prefix("k/")]  # ...and replaced on a 403
        assert sorted(o.key for p in pages for o in p.objects) == ["k/a.bin", "k/b.bin"]
        assert (await backend.head("k/b.bin")).size == MiB + 9
        assert watch.generation == 3
    finally:
        await backend.aclose()
