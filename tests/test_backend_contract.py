"""One contract, every backend: the memory fake, S3 (moto's server) and Azure (Azurite).

The account root (objfs.backends.account) runs it too, for S3 and Azure: one bucket seen
through the account's ``BUCKET/KEY`` keys (:class:`_InAccount`), so the routing, the key
prefixes and the buckets' shared-connection backends meet the same contract.

The layers above a backend (listing cache, block cache, read-ahead) rely on exactly these
behaviours, so each test runs once per backend against a fresh bucket or container.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from objfs.backends.base import Backend, ListPage, ObjectInfo
from objfs.backends.memory import MemoryBackend
from objfs.errors import BucketNotFoundError, ObjectNotFoundError, StaleObjectError


@dataclass
class Store:
    """A backend under test, the blocking way to write to its bucket, and its page size."""

    backend: Backend
    put: Callable[[str, bytes], object]
    missing_bucket: Callable[[], Backend]
    # Entries of one listing page (keys and prefixes together) as the store pages them.
    page_size: int
    # Zero-byte blobs marked as directories (Azure's hdi_isfolder), where the store has them.
    put_folder: Callable[[str], None] | None = None


def _memory_store() -> Store:
    backend = MemoryBackend(page_size=50)

    def missing_fault(op: str, key: str) -> None:
        raise BucketNotFoundError("bucket 'missing' does not exist")

    return Store(
        backend=backend,
        put=backend.put,  # returns the ETag, which the contract ignores
        missing_bucket=lambda: MemoryBackend(fault=missing_fault),
        page_size=50,
    )


def _s3_store(request: pytest.FixtureRequest) -> Store:
    from objfs.backends.s3 import S3Backend
    from objfs.config import S3Options

    server = request.getfixturevalue("s3_server")
    s3 = request.getfixturevalue("s3")
    bucket = request.getfixturevalue("bucket")
    options = S3Options(endpoint_url=server.url)
    return Store(
        backend=S3Backend(bucket, options),
        put=lambda key, data: s3.put_object(Bucket=bucket, Key=key, Body=data),
        missing_bucket=lambda: S3Backend("no-such-bucket-objfs", options),
        page_size=1000,  # S3's (and moto's) ListObjectsV2 page
    )


def _azure_store(request: pytest.FixtureRequest) -> Store:
    from objfs.backends.azure import AzureBackend
    from objfs.config import AzureOptions, parse_source
    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    azurite = request.getfixturevalue("azurite")
    service = request.getfixturevalue("azure_service")
    container = request.getfixturevalue("container")
    client = service.get_container_client(container)
    options = AzureOptions(account_name=DEV_ACCOUNT, account_url=azurite.account_url)
    env = {"AZURE_STORAGE_KEY": DEV_KEY}
    page_size = 100  # well below the service's 5,000, to keep the test fast

    def make(name: str) -> Backend:
        return AzureBackend(parse_source(f"az://{name}"), options, env=env, page_size=page_size)

    return Store(
        backend=make(container),
        put=lambda key, data: client.upload_blob(key, data, overwrite=True),
        missing_bucket=lambda: make("no-such-container-objfs"),
        page_size=page_size,
        put_folder=lambda key: client.upload_blob(
            key, b"", overwrite=True, metadata={"hdi_isfolder": "true"}
        ),
    )


class _InAccount(Backend):
    """One bucket of an account-root backend, with the bucket's own keys (the contract's)."""

    def __init__(self, account: Backend, bucket: str) -> None:
        from objfs.backends.account import AccountBackend

        assert isinstance(account, AccountBackend)
        self.account = account
        self.bucket = bucket
        self.description = account.description

    def _info(self, info: ObjectInfo) -> ObjectInfo:
        assert info.key.startswith(f"{self.bucket}/"), info.key
        return dataclasses.replace(info, key=info.key[len(self.bucket) + 1 :])

    async def check(self, prefix: str) -> bool:
        # The bucket's backend as the account made it (a mount checks the account itself).
        return await (await self.account.bucket(self.bucket)).check(prefix)

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        cut = len(self.bucket) + 1
        async for page in self.account.list_prefix(f"{self.bucket}/{prefix}"):
            assert all(p.startswith(f"{self.bucket}/") for p in page.prefixes)
            yield ListPage(
                [self._info(o) for o in page.objects], [p[cut:] for p in page.prefixes], page.more
            )

    async def head(self, key: str) -> ObjectInfo:
        return self._info(await self.account.head(f"{self.bucket}/{key}"))

    async def has_keys_under(self, prefix: str) -> bool:
        return await self.account.has_keys_under(f"{self.bucket}/{prefix}")

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        return await self.account.read_range(f"{self.bucket}/{key}", etag, start, length)

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        await self.account.read_into(f"{self.bucket}/{key}", etag, start, views)

    async def aclose(self) -> None:
        await self.account.aclose()


def _in_account(store: Store, account: Callable[[], Backend], bucket: str) -> Store:
    """``store``'s bucket through the account root; its missing bucket too."""
    store.backend = _InAccount(account(), bucket)
    store.missing_bucket = lambda: _InAccount(account(), "no-such-bucket-objfs")
    return store


def _s3_account_store(request: pytest.FixtureRequest) -> Store:
    from objfs.backends.account import open_account
    from objfs.config import MountConfig, S3Options, parse_source

    store = _s3_store(request)
    trio.run(store.backend.aclose)
    server = request.getfixturevalue("s3_server")
    config = MountConfig(
        source=parse_source("s3://"), mountpoint="/", s3=S3Options(endpoint_url=server.url)
    )
    return _in_account(store, lambda: open_account(config, None), request.getfixturevalue("bucket"))


def _azure_account_store(request: pytest.FixtureRequest) -> Store:
    from objfs.backends.account import AccountBackend, AzureAccount
    from objfs.backends.azure import AzureBackend
    from objfs.config import AzureOptions, parse_source
    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    store = _azure_store(request)
    trio.run(store.backend.aclose)
    azurite = request.getfixturevalue("azurite")
    options = AzureOptions(account_name=DEV_ACCOUNT, account_url=azurite.account_url)
    env = {"AZURE_STORAGE_KEY": DEV_KEY}

    def account() -> Backend:
        root = AzureBackend(parse_source("az://"), options, env=env, page_size=store.page_size)
        return AccountBackend(AzureAccount(root))

    return _in_account(store, account, request.getfixturevalue("container"))


@pytest.fixture(params=["memory", "s3", "azure", "s3-account", "azure-account"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    kind = request.param
    made = {
        "memory": lambda: _memory_store(),
        "s3": lambda: _s3_store(request),
        "azure": lambda: _azure_store(request),
        "s3-account": lambda: _s3_account_store(request),
        "azure-account": lambda: _azure_account_store(request),
    }[kind]()
    yield made
    trio.run(made.backend.aclose)


def put_many(store: Store, items: dict[str, bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: store.put(*item), items.items()))


async def listing(backend: Backend, prefix: str) -> tuple[list[ListPage], dict[str, ObjectInfo]]:
    pages = [page async for page in backend.list_prefix(prefix)]
    return pages, {o.key: o for page in pages for o in page.objects}


async def test_listing_pages_through_keys_and_common_prefixes(store: Store) -> None:
    # Files and sub-prefixes, interleaved in key order, 10% more than one page of each.
    n = store.page_size * 11 // 20 + 1
    items = {f"big/f{i:04d}.bin": f"file {i}".encode() for i in range(n)}
    items.update({f"big/d{i:04d}/leaf.txt": f"leaf {i}".encode() for i in range(n)})
    items["big/d0000/deeper/x"] = b"deeper keys roll up into their first-level prefix"
    items["bigger/not-under-the-prefix.txt"] = b"x"
    items["big.txt"] = b"a sibling whose name starts like the prefix"
    await trio.to_thread.run_sync(put_many, store, items)

    pages, objects = await listing(store.backend, "big/")
    assert len(pages) > 1, "expected more than one page"
    assert set(objects) == {f"big/f{i:04d}.bin" for i in range(n)}
    prefixes = [p for page in pages for p in page.prefixes]
    assert sorted(prefixes) == [f"big/d{i:04d}/" for i in range(n)]  # each exactly once
    assert objects["big/f0007.bin"].size == len(b"file 7")

    _, deeper = await listing(store.backend, "big/d0000/")
    assert set(deeper) == {"big/d0000/leaf.txt"}
    root_pages, root_objects = await listing(store.backend, "")
    assert set(root_objects) == {"big.txt"}
    assert sorted(p for page in root_pages for p in page.prefixes) == ["big/", "bigger/"]
    empty_pages, empty = await listing(store.backend, "nothing-here/")
    assert empty == {}
    assert all(not page.prefixes for page in empty_pages)


async def test_directory_markers_list_as_prefixes(store: Store) -> None:
    items = {"m/": b"", "m/empty/": b"", "m/full/": b"", "m/full/a.txt": b"a", "m/file": b"f"}
    await trio.to_thread.run_sync(put_many, store, items)
    expected_prefixes = {"m/empty/", "m/full/"}
    if store.put_folder is not None:
        # hdi_isfolder blobs carry no trailing slash, and may stand beside their contents.
        for key in ("m/hns-empty", "m/hns-full"):
            await trio.to_thread.run_sync(store.put_folder, key)
        await trio.to_thread.run_sync(store.put, "m/hns-full/b.txt", b"b")
        expected_prefixes |= {"m/hns-empty/", "m/hns-full/"}

    pages, objects = await listing(store.backend, "m/")
    prefixes = [p for page in pages for p in page.prefixes]
    assert sorted(prefixes) == sorted(expected_prefixes)  # each exactly once
    # The listed prefix's own marker comes back as an object named like the prefix; fs skips it.
    assert set(objects) - {"m/"} == {"m/file"}
    if store.put_folder is not None:
        with pytest.raises(ObjectNotFoundError):
            await store.backend.head("m/hns-empty")  # a directory, not a file


async def test_head_reports_size_etag_and_mtime(store: Store) -> None:
    data = os.urandom(70_001)
    await trio.to_thread.run_sync(store.put, "h/obj.bin", data)
    info = await store.backend.head("h/obj.bin")
    assert info.key == "h/obj.bin"
    assert info.size == len(data)
    assert info.etag
    assert abs(info.mtime_ns - time.time_ns()) < 600 * 10**9  # within minutes: same clock
    _, objects = await listing(store.backend, "h/")
    assert objects["h/obj.bin"] == info  # the listing and HEAD agree, ETag format included


async def test_read_range_returns_exact_bytes(store: Store) -> None:
    data = os.urandom(3 * 1024 * 1024 + 12345)
    await trio.to_thread.run_sync(store.put, "r/obj.bin", data)
    etag = (await store.backend.head("r/obj.bin")).etag
    size = len(data)
    for start, length in [
        (0, 1),
        (0, size),  # the whole object
        (1024 * 1024 - 7, 2 * 1024 * 1024 + 3),  # unaligned, from the middle
        (size // 2, 4096),
        (size - 1, 1),  # the last byte
        (size - 100_000, 100_000),  # up to the end
    ]:
        got = await store.backend.read_range("r/obj.bin", etag, start, length)
        assert type(got) is bytes
        assert got == data[start : start + length], (start, length)


async def test_read_after_overwrite_is_stale(store: Store) -> None:
    await trio.to_thread.run_sync(store.put, "s/obj.bin", b"version one " * 1000)
    old = await store.backend.head("s/obj.bin")
    await trio.to_thread.run_sync(store.put, "s/obj.bin", b"version two!" * 1000)
    with pytest.raises(StaleObjectError):
        await store.backend.read_range("s/obj.bin", old.etag, 0, 100)
    new = await store.backend.head("s/obj.bin")
    assert new.etag != old.etag
    assert await store.backend.read_range("s/obj.bin", new.etag, 0, 12) == b"version two!"


async def test_missing_key_is_not_found(store: Store) -> None:
    await trio.to_thread.run_sync(store.put, "x/present.txt", b"here")
    with pytest.raises(ObjectNotFoundError):
        await store.backend.head("x/absent.txt")
    etag = (await store.backend.head("x/present.txt")).etag
    with pytest.raises(ObjectNotFoundError):
        await store.backend.read_range("x/absent.txt", etag, 0, 1)


async def test_check_passes_and_a_missing_bucket_fails(store: Store) -> None:
    await trio.to_thread.run_sync(store.put, "c/d/present.txt", b"here")
    # It answers whether anything lies under the prefix (an empty one mounts, with a warning).
    assert await store.backend.check("") is True
    assert await store.backend.check("c/") is True  # only a deeper "directory" under it
    assert await store.backend.check("no/such/prefix/") is False
    missing = store.missing_bucket()
    try:
        with pytest.raises(BucketNotFoundError):
            await missing.check("")
    finally:
        await missing.aclose()


async def test_has_keys_under_is_one_request_at_any_depth(store: Store) -> None:
    """Issue 30 item 15: a probe's directory check is one listing of at most one key (the
    memory fake counts requests; the real stores' page sizes are checked by the mount test
    through a counting proxy)."""
    for i in range(3):
        await trio.to_thread.run_sync(store.put, f"h/deep/er/k{i}", b"x")
    await trio.to_thread.run_sync(store.put, "h/file", b"x")
    assert await store.backend.has_keys_under("h/") is True
    assert await store.backend.has_keys_under("h/deep/") is True  # only deeper keys
    assert await store.backend.has_keys_under("h/fil/") is False
    assert await store.backend.has_keys_under("h/nothing/") is False
    if isinstance(store.backend, MemoryBackend):
        before = store.backend.requests["list"]
        await store.backend.has_keys_under("h/")
        assert store.backend.requests["list"] - before == 1


def test_every_backend_is_covered() -> None:
    """A new backend must join the contract (add it to the ``store`` fixture): every module
    of objfs/backends/ that defines a Backend is one the contract runs."""
    import importlib
    import inspect

    import objfs.backends
    from objfs.backends.base import Backend

    defining = set()
    for name in os.listdir(os.path.dirname(objfs.backends.__file__)):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        module = importlib.import_module(f"objfs.backends.{name[:-3]}")
        if any(
            issubclass(cls, Backend) and cls is not Backend and cls.__module__ == module.__name__
            for _, cls in inspect.getmembers(module, inspect.isclass)
        ):
            defining.add(name[:-3])
    assert defining == {"memory", "s3", "azure", "account"}


async def test_azure_read_into_and_stored_bytes(request: pytest.FixtureRequest) -> None:
    """Azure only: read_into fills exact blocks from one GET, received by rawhttp straight into
    them, and a blob stored with Content-Encoding: gzip is served as stored, never
    decompressed."""
    import gzip

    from azure.storage.blob import ContentSettings

    from objfs import rawhttp

    raw_gets: list[int] = []
    original = rawhttp.ConnectionPool.get_into

    def counting(self: Any, url: str, headers: dict[str, str], views: Any) -> Any:
        raw_gets.append(sum(len(v) for v in views))
        return original(self, url, headers, views)

    request.getfixturevalue("monkeypatch").setattr(rawhttp.ConnectionPool, "get_into", counting)

    store = _azure_store(request)
    client = request.getfixturevalue("azure_service").get_container_client(
        request.getfixturevalue("container")
    )
    data = os.urandom(5 * 1024 * 1024 + 3)
    packed = gzip.compress(b"text that a browser would unpack " * 1000)

    def upload() -> None:
        client.upload_blob("b/data.bin", data)
        client.upload_blob(
            "b/packed.json", packed, content_settings=ContentSettings(content_encoding="gzip")
        )

    await trio.to_thread.run_sync(upload)
    try:
        etag = (await store.backend.head("b/data.bin")).etag
        n = len(data) - 7
        blocks = [bytearray(min(1 << 20, n - i)) for i in range(0, n, 1 << 20)]
        await store.backend.read_into("b/data.bin", etag, 7, [memoryview(b) for b in blocks])
        assert b"".join(blocks) == data[7:]
        assert raw_gets == [n]  # one GET, through rawhttp
        small = bytearray(10)
        await store.backend.read_into("b/data.bin", etag, 0, [memoryview(small)])
        assert small == data[:10]
        info = await store.backend.head("b/packed.json")
        assert info.size == len(packed)
        assert await store.backend.read_range("b/packed.json", info.etag, 0, info.size) == packed
    finally:
        await store.backend.aclose()


async def test_s3_resolves_each_object_url_once(request: pytest.FixtureRequest) -> None:
    """S3 only: botocore resolves an object's URL once per (bucket, key) and client, not per
    GET; the same key in another bucket (a backend of for_bucket) is that bucket's object."""
    store = _s3_store(request)
    backend = store.backend
    s3 = request.getfixturevalue("s3")
    bucket = request.getfixturevalue("bucket")
    other_bucket = f"{bucket}-other"
    one, two, three = os.urandom(3000), os.urandom(2000), os.urandom(1000)

    def upload() -> None:
        s3.put_object(Bucket=bucket, Key="m/one.bin", Body=one)
        s3.put_object(Bucket=bucket, Key="m/two.bin", Body=two)
        s3.create_bucket(Bucket=other_bucket)
        s3.put_object(Bucket=other_bucket, Key="m/one.bin", Body=three)

    await trio.to_thread.run_sync(upload)
    from objfs.backends.s3 import S3Backend

    assert isinstance(backend, S3Backend)
    client = backend._client
    calls: list[dict[str, object]] = []
    resolve = client.generate_presigned_url

    def counting(*args: object, **kwargs: object) -> str:
        calls.append(dict(kwargs.get("Params", {})))  # type: ignore[arg-type]
        return resolve(*args, **kwargs)  # type: ignore[arg-type]

    client.generate_presigned_url = counting  # type: ignore[method-assign]
    try:
        for _ in range(3):
            for key, data in (("m/one.bin", one), ("m/two.bin", two)):
                etag = (await backend.head(key)).etag
                assert await backend.read_range(key, etag, 5, 100) == data[5:105]
        other = backend.for_bucket(other_bucket)
        etag = (await other.head("m/one.bin")).etag
        assert await other.read_range("m/one.bin", etag, 0, 1000) == three
    finally:
        client.generate_presigned_url = resolve  # type: ignore[method-assign]
        await backend.aclose()
    assert sorted((c["Bucket"], c["Key"]) for c in calls) == [
        (bucket, "m/one.bin"),
        (bucket, "m/two.bin"),
        (other_bucket, "m/one.bin"),
    ]


async def test_s3_backend_loads_botocore_models_without_their_documentation(
    s3_server: object, bucket: str
) -> None:
    """The S3 backend's session loads botocore's data as plain dicts with every documentation
    text emptied (the key kept): the model the client works from is the lean one, it still
    lists, HEADs and reads (the contract above), and loading it holds far less memory."""
    import tracemalloc
    from collections import OrderedDict

    from botocore.loaders import JSONFileLoader

    from objfs.backends.s3 import S3Backend
    from objfs.backends.s3_client import _LeanJSONFileLoader
    from objfs.config import S3Options

    backend = S3Backend(bucket, S3Options(endpoint_url=s3_server.url))  # type: ignore[attr-defined]
    try:
        loader = backend._session.get_component("data_loader")
        assert isinstance(loader.file_loader, _LeanJSONFileLoader)
        model = loader.load_service_model("s3", "service-2")
        # The client's model is the very object the lean loader produced (botocore caches it).
        assert backend._client.meta.service_model._service_description is model
        texts: list[str] = []
        dicts = 0

        def walk(node: object) -> None:
            nonlocal dicts
            if isinstance(node, dict):
                dicts += 1
                assert not isinstance(node, OrderedDict)
                if isinstance(node.get("documentation"), str):
                    texts.append(node["documentation"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(model)
        # The whole model, its documentation keys kept.
        assert dicts > 1000
        assert len(texts) > 500
        assert set(texts) == {""}
        assert backend._client.meta.service_model.operation_model("GetObject").documentation == ""
        assert (await backend.check("")) is False  # an empty bucket, listed through the model
    finally:
        await backend.aclose()

    import botocore

    path = os.path.join(os.path.dirname(botocore.__file__), "data", "s3", "2006-03-01", "service-2")
    held = {}
    for file_loader in (JSONFileLoader(), _LeanJSONFileLoader()):
        tracemalloc.start()
        try:
            data = file_loader.load_file(path)
            held[type(file_loader).__name__] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert data["metadata"]["endpointPrefix"] == "s3"
        del data
    assert held["_LeanJSONFileLoader"] < 0.5 * held["JSONFileLoader"]
