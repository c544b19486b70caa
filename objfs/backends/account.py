"""The account root: every bucket (container) the credentials can list, as one tree.

``objfs mount s3:// MNT`` (``az://`` with an account, ``azure://ACCOUNT``) serves this
backend. Its keys are ``BUCKET/KEY``; the FUSE-free core sees one bucket whose top level
holds one directory per bucket.

Invariants:

* Listing the root (``""``) is the only request that names every bucket: ListBuckets
  (S3) or List Containers (Azure), all its pages, answered as one page of common prefixes
  ``BUCKET/``, so the core never probes names at the root. No bucket's contents are listed
  until something inside that bucket is asked for ("a bucket is listed when it is
  entered"). The root holds no files: a HEAD of a key without ``/`` is ObjectNotFoundError
  without a request.
* Every request under ``BUCKET/`` goes to that bucket's own backend, made on first use
  (single-flight) and kept for the mount. The bucket's backends share one session,
  credentials (rotation included), connection limit and data connections with the
  account's: ``--max-connections`` bounds the whole mount, not each bucket.
* A bucket's failure stays in the bucket: its backend's errors (AccessDeniedError for a
  403, BucketNotFoundError, ...) are raised unchanged for requests under ``BUCKET/`` only;
  the root listing and the other buckets are unaffected. The errors' messages name the
  bucket and the store's error code, and the core logs them.
* S3 regions: a bucket is signed for its own region. The region comes from ListBuckets
  when the store names it (AWS does for the paginated requests sent here), else from one
  HeadBucket when the bucket is entered (its ``x-amz-bucket-region`` header, which AWS
  also sends with redirects and refusals); a store that names neither gets the mount's
  region (``--region``).
* Keys from a bucket's backend come back prefixed with ``BUCKET/``, so that two buckets'
  equal keys are different keys for every cache (the disk cache's namespace is this
  backend's description, one per endpoint and account).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from objfs.backends.base import Backend, ListPage, ObjectInfo
from objfs.config import MountConfig
from objfs.errors import ObjectNotFoundError
from objfs.singleflight import SingleFlight

if TYPE_CHECKING:
    from objfs.backends.azure import AzureBackend
    from objfs.backends.s3 import S3Backend
    from objfs.credentials import CredentialWatch

log = logging.getLogger(__name__)


class Account(Protocol):
    """One store account: its buckets' names, and a backend per bucket."""

    description: str

    async def bucket_names(self, *, check: bool = False) -> list[str]:
        """Every bucket the credentials can list; ``check``: the pre-mount check (few
        attempts, the clear startup errors)."""
        ...

    async def open_bucket(self, name: str) -> Backend:
        """A backend for bucket ``name`` (may send a request, e.g. for its region)."""
        ...

    async def aclose(self) -> None: ...


def split_key(key: str) -> tuple[str, str]:
    """``"bucket/rest"`` into ``("bucket", "rest")``; a key without ``/`` has rest ``""``."""
    bucket, _, rest = key.partition("/")
    return bucket, rest


class AccountBackend(Backend):
    """Every bucket of ``account`` as a top-level directory (see the module docstring)."""

    def __init__(self, account: Account) -> None:
        self.account = account
        self.description = account.description
        self._buckets: dict[str, Backend] = {}
        self._opening: SingleFlight[str, Backend] = SingleFlight()

    async def bucket(self, name: str) -> Backend:
        """The backend of bucket ``name`` (keys relative to the bucket), made on first use."""
        backend = self._buckets.get(name)
        if backend is not None:
            return backend

        async def open_bucket() -> Backend:
            opened = await self.account.open_bucket(name)
            self._buckets[name] = opened
            return opened

        return await self._opening.run(name, open_bucket)

    async def check(self, prefix: str) -> bool:
        if prefix:
            raise ValueError("the account root has no prefix")
        names = await self.account.bucket_names(check=True)
        log.info("%s: %d buckets listed", self.description, len(names))
        return bool(names)

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        if not prefix:
            names = await self.account.bucket_names()
            yield ListPage(objects=[], prefixes=[f"{name}/" for name in sorted(set(names))])
            return
        bucket, rest = split_key(prefix)
        backend = await self.bucket(bucket)
        pages = backend.list_prefix(rest)
        try:
            async for page in pages:
                yield ListPage(
                    objects=[_prefixed(bucket, info) for info in page.objects],
                    prefixes=[f"{bucket}/{p}" for p in page.prefixes],
                    more=page.more,
                )
        finally:
            await pages.aclose()  # type: ignore[attr-defined]

    async def has_keys_under(self, prefix: str) -> bool:
        bucket, rest = split_key(prefix)
        if not rest:  # a bucket's own directory: it exists when it is listed
            return bucket in await self.account.bucket_names()
        return await (await self.bucket(bucket)).has_keys_under(rest)

    async def head(self, key: str) -> ObjectInfo:
        bucket, rest = split_key(key)
        if not rest:
            raise ObjectNotFoundError(f"{key!r}: the account root holds buckets, not files")
        return _prefixed(bucket, await (await self.bucket(bucket)).head(rest))

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        bucket, rest = split_key(key)
        return await (await self.bucket(bucket)).read_range(rest, etag, start, length)

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        bucket, rest = split_key(key)
        await (await self.bucket(bucket)).read_into(rest, etag, start, views)

    def cache_engine_statistics(self) -> dict[str, int] | None:
        # The buckets' backends share one engine (S3Backend.for_bucket).
        for backend in self._buckets.values():
            found = backend.cache_engine_statistics()
            if found is not None:
                return found
        return None

    async def aclose(self) -> None:
        # The buckets' backends share the account's connections: closing it closes them.
        await self.account.aclose()


def _prefixed(bucket: str, info: ObjectInfo) -> ObjectInfo:
    return dataclasses.replace(info, key=f"{bucket}/{info.key}")


class S3Account:
    """Every bucket at one S3 endpoint, through one :class:`S3Backend` whose session,
    credentials, connection limit and data connections every bucket's backend shares."""

    def __init__(self, root: S3Backend) -> None:
        self.root = root
        self.description = f"all buckets at {root.description.split(' at ', 1)[1]}"
        self._regions: dict[str, str | None] = {}  # from the last ListBuckets

    async def bucket_names(self, *, check: bool = False) -> list[str]:
        found = await self.root.list_buckets(check=check)
        self._regions = dict(found)
        return [name for name, _ in found]

    async def open_bucket(self, name: str) -> Backend:
        region = self._regions.get(name)
        if region is None:
            region = await self.root.for_bucket(name).bucket_region()
        backend = self.root.for_bucket(name, region)
        if backend.region != self.root.region:
            log.info("bucket %r is in region %s: signing its requests for it", name, region)
        return backend

    async def aclose(self) -> None:
        await self.root.aclose()


class AzureAccount:
    """Every container of one storage account, through one :class:`AzureBackend` whose
    signing state, session and connection limit every container's backend shares."""

    def __init__(self, root: AzureBackend) -> None:
        self.root = root
        self.description = f"all containers at {root.description.split(' at ', 1)[1]}"

    async def bucket_names(self, *, check: bool = False) -> list[str]:
        return await self.root.list_containers(check=check)

    async def open_bucket(self, name: str) -> Backend:
        return self.root.for_container(name)

    async def aclose(self) -> None:
        await self.root.aclose()


def open_account(config: MountConfig, watch: CredentialWatch | None) -> AccountBackend:
    """The account-root backend for ``config.source`` (``s3://``, ``az://``, ...), with the
    same credentials, options and credential rotation as a one-bucket mount."""
    source = config.source
    if not source.account_root:
        raise ValueError(f"{source.url()} is not an account root")
    if source.store == "azure":
        from objfs.backends.azure import AzureBackend

        return AccountBackend(
            AzureAccount(AzureBackend(source, config.azure, credential_watch=watch))
        )
    from objfs.backends.s3 import S3Backend

    return AccountBackend(S3Account(S3Backend("", config.s3, credential_watch=watch)))
