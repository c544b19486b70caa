"""The account root without a store: AccountBackend over in-memory buckets, through the
FUSE-free core, and the buckets' backends sharing the account's credentials.

The mount tests (tests/test_account_root.py) check the same against moto and Azurite; here
each bucket's requests are counted exactly and a bucket's failure is injected.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from objfs.backends.account import AccountBackend
from objfs.backends.base import Backend
from objfs.backends.memory import MemoryBackend
from objfs.config import AzureOptions, MountConfig, S3Options, parse_source
from objfs.errors import AccessDeniedError, ObjectNotFoundError
from objfs.fs import FileSystem
from tests.test_fs_core import names, resolve


class FakeAccount:
    """Buckets of MemoryBackends; ``listings`` counts the bucket-list requests."""

    description = "all buckets at memory://"

    def __init__(self, buckets: dict[str, MemoryBackend]) -> None:
        self.buckets = buckets
        self.listings = 0
        self.opened: list[str] = []

    async def bucket_names(self, *, check: bool = False) -> list[str]:
        self.listings += 1
        return list(self.buckets)

    async def open_bucket(self, name: str) -> Backend:
        self.opened.append(name)
        return self.buckets[name]

    async def aclose(self) -> None:
        pass


def _denied(op: str, key: str) -> None:
    raise AccessDeniedError(f"access denied: {op} s3://locked/{key} (AccessDenied)")


def _account() -> tuple[FakeAccount, FileSystem]:
    a, b = MemoryBackend(), MemoryBackend()
    a.put("m/config.json", b'{"a": 1}')
    b.put("m/config.json", b'{"b": 22}')  # the same key in another bucket, other bytes
    b.put("w.bin", os.urandom(3 << 20))
    account = FakeAccount({"alpha": a, "beta": b, "locked": MemoryBackend(fault=_denied)})
    config = MountConfig(source=parse_source("s3://"), mountpoint="/unused")
    return account, FileSystem(AccountBackend(account), config)


async def _read(fs: FileSystem, path: str) -> bytes:
    inode = await resolve(fs, path)
    fh, _ = await fs.open(inode, os.O_RDONLY)
    try:
        size = fs.attributes(fs.node(inode)).size
        return bytes(await fs.read(fh, 0, size)) if size else b""
    finally:
        fs.release(fh)


async def test_root_lists_buckets_and_enters_only_what_is_asked() -> None:
    account, fs = _account()
    assert await names(fs) == {"alpha", "beta", "locked"}
    assert account.listings == 1
    assert account.opened == []  # no bucket entered yet
    assert all(not b.requests for b in account.buckets.values())
    assert await _read(fs, "alpha/m/config.json") == b'{"a": 1}'
    assert await _read(fs, "beta/m/config.json") == b'{"b": 22}'
    assert account.opened == ["alpha", "beta"]  # each made once
    assert not account.buckets["locked"].requests
    assert await names(fs, await resolve(fs, "beta")) == {"m", "w.bin"}


async def test_a_denied_bucket_fails_inside_it_only() -> None:
    _, fs = _account()
    locked = await resolve(fs, "locked")  # a directory, from the bucket list
    assert fs.attributes(fs.node(locked)).mode & 0o040000
    for _ in range(2):
        with pytest.raises(AccessDeniedError):
            await fs.opendir(locked)
        with pytest.raises(AccessDeniedError):
            await fs.lookup(locked, b"anything")
        assert await _read(fs, "alpha/m/config.json") == b'{"a": 1}'
    assert await names(fs) == {"alpha", "beta", "locked"}


async def test_backend_keys_carry_the_bucket() -> None:
    account, _ = _account()
    backend = AccountBackend(account)
    assert await backend.check("") is True
    info = await backend.head("beta/w.bin")
    assert info.key == "beta/w.bin"
    pages = [p async for p in backend.list_prefix("alpha/m/")]
    assert [o.key for p in pages for o in p.objects] == ["alpha/m/config.json"]
    pages = [p async for p in backend.list_prefix("beta/")]
    assert [p for page in pages for p in page.prefixes] == ["beta/m/"]
    with pytest.raises(ObjectNotFoundError):
        await backend.head("alpha")  # the root holds buckets, not files
    assert await backend.has_keys_under("alpha/") is True
    assert await backend.has_keys_under("gone/") is False
    assert await backend.has_keys_under("beta/m/") is True
    etag = (await backend.head("beta/m/config.json")).etag
    assert await backend.read_range("beta/m/config.json", etag, 0, 4) == b'{"b"'


async def test_an_empty_account_checks_false() -> None:
    assert await AccountBackend(FakeAccount({})).check("") is False


def test_s3_buckets_share_the_account_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket's client, other regions' included, signs with the account's one
    (reloadable) credentials object, and shares its connection limit and data pool."""
    from objfs.backends.s3 import S3Backend

    root = S3Backend("", S3Options(endpoint_url="http://127.0.0.1:1", region="us-east-1"))
    try:
        same = root.for_bucket("a")
        other = root.for_bucket("b", "eu-west-1")
        again = root.for_bucket("c", "eu-west-1")
        assert (same.region, other.region) == ("us-east-1", "eu-west-1")
        assert same._client is root._client
        assert other._client is again._client is not root._client  # one client per region
        assert other._client.meta.region_name == "eu-west-1"
        creds = root._session.get_credentials()
        for b in (same, other):
            assert b._session.get_credentials() is creds
            assert b._limiter is root._limiter
            assert b._data is root._data
    finally:
        trio.run(root.aclose)


def test_azure_containers_follow_rotated_credentials(tmp_path: Path) -> None:
    """A container's backend made before a key rotation signs with the new key after it."""
    from objfs.backends.azure import AzureBackend
    from objfs.credentials import CredentialWatch

    creds = tmp_path / "azure.credentials"
    creds.write_text("AZURE_STORAGE_KEY=" + "a" * 86 + "==\n")
    watch = CredentialWatch.open(str(creds))
    assert watch is not None
    options = AzureOptions(account_name="acct", account_url="http://127.0.0.1:1/acct")
    root = AzureBackend(parse_source("az://"), options, credential_watch=watch)
    try:
        container = root.for_container("models")
        before = container._container
        creds.write_text("AZURE_STORAGE_KEY=" + "b" * 86 + "==\n")
        assert watch.poll(force=True) == 1
        assert container._signer is root._signer
        assert container._service is root._service
        assert container._container is not before
        assert container._container.container_name == "models"
        assert container._container.credential.account_key == "b" * 86 + "=="
    finally:
        trio.run(root.aclose)
