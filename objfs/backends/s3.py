"""Amazon S3 and S3-compatible stores (MinIO, Ceph RGW, ...) through botocore.

Concurrency: one botocore client (:mod:`objfs.backends.s3_client`) is shared by every worker
thread (clients are thread-safe, sessions are not). Calls run in ``trio.to_thread.run_sync``
under one CapacityLimiter sized to ``max_connections``, and botocore's HTTP pool is sized to
match, so no thread ever waits for a connection inside botocore.

Data GETs (the bytes of a load) do not go through botocore's request machinery: their URL is
resolved and signed with SigV4 headers by :mod:`objfs.backends.s3_signing` (botocore's
credential providers stay in charge), and :mod:`objfs.rawhttp` sends the GET on a kept-alive
connection and receives the body straight into the caller's buffers. Behind a proxy from the
environment they take botocore's path instead. With ``--cache-proxy`` each GET first goes to
the cache engine as a presigned URL, path-style whatever the addressing (the engine forwards
the path to one host: it must name the bucket; :mod:`objfs.cache_engine`); its bytes are used
only when they are the range asked of the pinned version.

Many buckets (the account root, :mod:`objfs.backends.account`): :meth:`S3Backend.for_bucket`
makes a backend for another bucket that shares this one's session (and so its credentials,
rotated ones included), its connection limit and its data connections; buckets in one region
share one client, a bucket in another region gets a client of its own for that region.

Retries: one layer per request. Data GETs: objfs's own loop (``max_attempts`` in all, jittered
backoff) retries connection failures, throttling and 5xx, short bodies and replies for the
wrong range. Listings and HEADs: botocore's "standard" mode, with the same ``max_attempts``.

Rotated credentials: with ``--credentials-file``, keys taken from the environment are
reloadable (:class:`~objfs.backends.s3_client.ReloadableResolver`). Requests poll the
:class:`CredentialWatch`; when the file changed, new requests are signed with its keys. A
request refused for its credentials (401/403, or an expired or unknown key) is sent once more
if the file now holds other keys. Errors are mapped by :mod:`objfs.backends.s3_errors`.
"""

from __future__ import annotations

import copy
import datetime as _dt
import email.utils
import os
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import botocore.exceptions
import trio

from objfs import rawhttp
from objfs.backends.base import (
    Backend,
    ListPage,
    ObjectInfo,
    content_range_total,
    if_match,
    reply_version_error,
    version_pin,
)
from objfs.backends.s3_client import ca_bundle, make_client, new_session
from objfs.backends.s3_errors import (
    BODY_ERRORS,
    CONNECTION_ERRORS,
    CREDENTIAL_CODES,
    client_error_code,
    is_refusal,
    map_error,
    reply_error,
)
from objfs.backends.s3_signing import ObjectUrls
from objfs.cache_engine import CacheEngine
from objfs.config import S3Options, redact_url
from objfs.credentials import CredentialWatch
from objfs.errors import (
    AccessDeniedError,
    ObjfsError,
    StaleObjectError,
    TransientStoreError,
    UsageError,
)
from objfs.retry import Tries, call_with_reload

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

# Retried replies (throttling and server errors); any other status is final.
_RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
_RETRY_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"}
# Backoff before a retry: full jitter from 0 to min(cap, base * 2**retry).
_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 5.0
# Attempts for the pre-mount check: fail a bad endpoint in seconds, not after a long backoff.
_CHECK_ATTEMPTS = 2
# Buckets per ListBuckets page (AWS's largest).
_LIST_BUCKETS_PAGE = 10000


def _mtime_ns(value: _dt.datetime) -> int:
    return int(value.timestamp()) * 1_000_000_000 + value.microsecond * 1000


def _info(key: str, size: int, etag: object, modified: _dt.datetime) -> ObjectInfo:
    """The version a listing entry or a HEAD reports (see base.version_pin)."""
    mtime_ns = _mtime_ns(modified)
    pin = version_pin(str(etag or ""), size, mtime_ns, key)
    return ObjectInfo(key=key, size=size, etag=pin, mtime_ns=mtime_ns)


def _check_version(
    what: str, pin: str, etag: object, last_modified: str | None, total: int | None
) -> None:
    """Raise StaleObjectError when a data reply is of another version than ``pin``."""
    problem = reply_version_error(pin, None if etag is None else str(etag), last_modified, total)
    if problem is not None:
        raise StaleObjectError(f"{what}: {problem}")


def _backoff_s(retry: int) -> float:
    """Sleep before retry ``retry`` (from 0): full jitter, capped."""
    return random.uniform(0.0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retry))


class S3Backend(Backend):
    def __init__(
        self,
        bucket: str,
        options: S3Options,
        *,
        credential_watch: CredentialWatch | None = None,
    ) -> None:
        self.bucket = bucket
        self.options = options
        endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self.endpoint = endpoint
        where = redact_url(endpoint) if endpoint else "AWS"
        self.description = f"s3://{bucket} at {where}"
        if options.ca_bundle is not None and not os.path.isfile(options.ca_bundle):
            raise UsageError(
                f"--ca-bundle: {options.ca_bundle!r} is not a file: give the PEM file of the "
                "CA that signed the endpoint's certificate"
            )
        core, self._resolver = new_session(options, reloadable=credential_watch is not None)
        self._watch = credential_watch
        self._session = core
        # One CA choice for every request: listings and HEADs (botocore) and data GETs
        # (rawhttp) trust the same certificates.
        self._ca_file = ca_bundle(options, core)
        self._client = make_client(core, options, endpoint, options.max_attempts, self._ca_file)
        self._check_client = make_client(core, options, endpoint, _CHECK_ATTEMPTS, self._ca_file)
        #: The region requests are signed for.
        self.region: str = self._client.meta.region_name
        # Clients of other regions, shared with the backends for_bucket made (trio thread).
        self._regional: dict[str, tuple[S3Client, S3Client]] = {
            self.region: (self._client, self._check_client)
        }
        self._limiter = trio.CapacityLimiter(options.max_connections)
        # The data GETs' object URLs, signed (shared with the backends for_bucket made).
        self._urls = ObjectUrls(core, options.no_sign_request)
        # Data GETs go straight to the endpoint on their own connections (see rawhttp), with
        # the CAs botocore's clients use.
        # --cache-proxy: data GETs through a cache engine as presigned URLs (shared with the
        # backends for_bucket made). The engine forwards path and query to one host, which
        # the signature covers: its URLs are presigned path-style (the path names the bucket)
        # whatever the data path's addressing, by a client per region (trio thread).
        self._engine = CacheEngine(options.cache_proxy) if options.cache_proxy else None
        self._engine_clients: dict[str, S3Client] = {}
        self._engine_client = self._path_style_client(self.region) if self._engine else None
        self._data = rawhttp.ConnectionPool(
            connect_timeout_s=options.connect_timeout_s,
            read_timeout_s=options.read_timeout_s,
            ca_file=self._ca_file,
            max_idle=options.max_connections,
        )
        if credential_watch is not None:
            credential_watch.bind(self._prepare_credentials)
            if self._resolver is not None and self._session.get_credentials() is not None:
                # The keys as the watch read the file (it may have changed since the start).
                self._prepare_credentials(credential_watch.environ)()

    def _prepare_credentials(self, environ: Mapping[str, str]) -> Callable[[], None]:
        """(CredentialWatch) Keys from ``environ`` (the credentials file's values), to be put
        in use by the returned function; raises NoCredentialsError if they are incomplete."""
        if self._resolver is None:
            return lambda: None  # not signed with keys from the environment: nothing to swap
        return self._resolver.prepare(environ)

    # -- other buckets (the account root) ------------------------------------------------

    def for_bucket(self, bucket: str, region: str | None = None) -> S3Backend:
        """A backend for ``bucket`` that shares this one's session, credentials, connection
        limit and data connections, signing for ``region`` (None: this backend's region).
        Call on the trio thread; only this backend's :meth:`aclose` releases what they
        share."""
        other = copy.copy(self)
        other.bucket = bucket
        where = redact_url(self.endpoint) if self.endpoint else "AWS"
        other.description = f"s3://{bucket} at {where}"
        if region is not None and region != self.region:
            clients = self._regional.get(region)
            if clients is None:
                clients = (
                    self._new_client(region, self.options.max_attempts),
                    self._new_client(region, _CHECK_ATTEMPTS),
                )
                self._regional[region] = clients
            other._client, other._check_client = clients
            other.region = region
            if self._engine is not None:
                other._engine_client = self._path_style_client(region)
        return other

    def _path_style_client(self, region: str) -> S3Client:
        """(Trio thread) The client that presigns engine URLs for ``region``: path-style."""
        client = self._engine_clients.get(region)
        if client is None:
            if self.options.path_style():
                client = self._regional[region][0]
            else:
                client = self._new_client(region, self.options.max_attempts, path_style=True)
            self._engine_clients[region] = client
        return client

    def _new_client(
        self, region: str, attempts: int, *, path_style: bool | None = None
    ) -> S3Client:
        """A client of this backend's session, endpoint and CAs for ``region`` (``path_style``:
        see make_client)."""
        return make_client(
            self._session,
            self.options,
            self.endpoint,
            attempts,
            self._ca_file,
            region,
            path_style=path_style,
        )

    async def list_buckets(self, *, check: bool = False) -> list[tuple[str, str | None]]:
        """Every bucket the credentials can list (ListBuckets, page by page), with its region
        where the store tells it (AWS does for a paginated request), else None. ``check``:
        the pre-mount check's few attempts. AccessDenied says to grant s3:ListAllMyBuckets."""
        client = self._check_client if check else self._client
        where = redact_url(self.endpoint) if self.endpoint else "AWS"
        what = f"listing the buckets at {where}"
        found: list[tuple[str, str | None]] = []
        token: str | None = None
        while True:
            # MaxBuckets makes the request paginated: AWS then names each bucket's region (and
            # refuses unpaginated ones for accounts allowed more than 10,000 buckets).
            kwargs: dict[str, Any] = {"MaxBuckets": _LIST_BUCKETS_PAGE}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                resp = await self._call(what, client.list_buckets, **kwargs)
            except AccessDeniedError as exc:
                code = client_error_code(exc.__cause__)
                if code in CREDENTIAL_CODES:
                    raise
                raise AccessDeniedError(
                    f"access denied: {what} ({code or 403}): grant s3:ListAllMyBuckets to "
                    "these credentials, or mount one bucket with s3://BUCKET"
                ) from None
            for entry in resp.get("Buckets", ()):
                region = entry.get("BucketRegion")
                found.append((str(entry["Name"]), str(region) if region else None))
            token = resp.get("ContinuationToken")
            if not token:
                return found

    async def bucket_region(self) -> str | None:
        """The region the store says this bucket is in (HeadBucket's x-amz-bucket-region,
        sent with refusals and redirects too), or None when it does not say (most
        S3-compatible stores, a failed request). One request."""

        def head() -> str | None:
            try:
                resp: Any = self._check_client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as exc:
                resp = exc.response
            except Exception:
                return None
            headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            region = headers.get("x-amz-bucket-region")
            return str(region) if region else None

        return await trio.to_thread.run_sync(head, limiter=self._limiter)

    # -- error mapping ---------------------------------------------------------------------

    def _map_error(self, exc: Exception, what: str) -> ObjfsError:
        """Turn a botocore exception into an objfs error; ``what`` names the request."""
        return map_error(exc, what, self.bucket, self.description)

    async def _call(self, what: str, fn: Any, /, **kwargs: Any) -> Any:
        def call() -> Any:
            return call_with_reload(self._watch, lambda: fn(**kwargs), is_refusal)

        try:
            return await trio.to_thread.run_sync(
                call, limiter=self._limiter, abandon_on_cancel=False
            )
        except Exception as exc:
            raise self._map_error(exc, what) from exc

    # -- Backend ---------------------------------------------------------------------------

    async def check(self, prefix: str) -> bool:
        resp = await self._call(
            f"listing s3://{self.bucket}/{prefix}",
            self._check_client.list_objects_v2,
            Bucket=self.bucket,
            Prefix=prefix,
            Delimiter="/",
            MaxKeys=1,
        )
        return bool(resp.get("Contents") or resp.get("CommonPrefixes"))

    async def has_keys_under(self, prefix: str) -> bool:
        """One listing of at most one key under ``prefix`` (no delimiter: any depth)."""
        resp = await self._call(
            f"listing s3://{self.bucket}/{prefix}",
            self._client.list_objects_v2,
            Bucket=self.bucket,
            Prefix=prefix,
            MaxKeys=1,
        )
        return bool(resp.get("Contents") or resp.get("CommonPrefixes"))

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        token: str | None = None
        what = f"listing s3://{self.bucket}/{prefix}"
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            resp = await self._call(what, self._client.list_objects_v2, **kwargs)
            yield ListPage(
                objects=[
                    _info(o["Key"], int(o.get("Size", 0)), o.get("ETag"), o["LastModified"])
                    for o in resp.get("Contents", ())
                ],
                prefixes=[p["Prefix"] for p in resp.get("CommonPrefixes", ())],
                more=bool(resp.get("IsTruncated") and resp.get("NextContinuationToken")),
            )
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return

    async def head(self, key: str) -> ObjectInfo:
        resp = await self._call(
            f"HEAD s3://{self.bucket}/{key}", self._client.head_object, Bucket=self.bucket, Key=key
        )
        return _info(key, int(resp["ContentLength"]), resp.get("ETag"), resp["LastModified"])

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        buf = bytearray(length)
        await self.read_into(key, etag, start, [memoryview(buf)])
        return bytes(buf)

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        length = sum(len(v) for v in views)
        what = f"GET s3://{self.bucket}/{key} bytes {start}-{start + length - 1}"
        try:
            await trio.to_thread.run_sync(
                self._get_into, what, key, etag, start, views, limiter=self._limiter
            )
        except Exception as exc:
            raise self._map_error(exc, what) from exc

    def _get_into(
        self, what: str, key: str, etag: str, start: int, views: Sequence[memoryview]
    ) -> None:
        """(Worker thread) One ranged GET into ``views``, with objfs's one retry layer:
        connection failures, 5xx/throttling, short bodies and wrong ranges are retried
        ``max_attempts`` times in all, with jittered backoff; a refusal of the credentials
        is tried once more, at once, if the credential files now hold newer ones; a reply of
        another version than ``etag`` pins is StaleObjectError; any other reply is final."""
        length = sum(len(v) for v in views)
        headers = {"Range": f"bytes={start}-{start + length - 1}", "User-Agent": "objfs"}
        condition = if_match(etag)
        if condition:
            headers["If-Match"] = condition
        tries = Tries(self.options.max_attempts, self._watch, _backoff_s)
        while True:
            if self._engine is not None and self._get_via_engine(what, key, etag, start, views):
                return
            url, signed = self._urls.signed_get(self._client, self.bucket, key, headers)
            if rawhttp.uses_proxy(url):
                try:
                    self._get_into_via_sdk(what, key, etag, start, views)
                except botocore.exceptions.ClientError as exc:
                    if is_refusal(exc) and tries.refused():
                        continue
                    raise
                except (TransientStoreError, *BODY_ERRORS, *CONNECTION_ERRORS) as exc:
                    # A failed connection, a short, broken or misplaced body: the same retries
                    # as below.
                    tries.failed(self._map_error(exc, what))
                    continue
                return
            try:
                reply = self._data.get_into(url, signed, views)
            except rawhttp.ConnectionFailed as exc:
                tries.failed(TransientStoreError(f"{what}: connection failed ({exc})"))
                continue
            if reply.status in (200, 206):
                problem = reply.body_error(start, length)
                if problem is None:
                    total = content_range_total(reply.headers.get("Content-Range"))
                    if total is None and reply.status == 200:
                        total = length
                    _check_version(
                        what,
                        etag,
                        reply.headers.get("ETag"),
                        reply.headers.get("Last-Modified"),
                        total,
                    )
                    return
                tries.failed(TransientStoreError(f"{what}: {problem}"))
                continue
            # The SDK's error shape, so that one table (map_error) maps every request's errors.
            error = reply_error(reply.status, reply.error_body, "GetObject")
            code = client_error_code(error)
            if reply.status in _RETRY_STATUSES or code in _RETRY_CODES:
                tries.failed(self._map_error(error, what))
                continue
            if not (is_refusal(error) and tries.refused()):
                raise error

    def _get_via_engine(
        self, what: str, key: str, etag: str, start: int, views: Sequence[memoryview]
    ) -> bool:
        """(Worker thread) One try of the GET through the cache engine (``--cache-proxy``):
        True when ``views`` hold the range of the pinned version; False when the caller must
        read from the store directly (the engine is off for a while after a failure, or
        failed now: see objfs.cache_engine). A URL never appears in what is logged."""
        engine = self._engine
        assert engine is not None
        assert self._engine_client is not None
        length = sum(len(v) for v in views)
        url, minted = self._urls.presigned(
            self._engine_client, self.bucket, key, self.options.cache_proxy_url_lifetime_s
        )
        if minted:
            engine.signed()
        routed = engine.route(url)
        if routed is None:
            engine.direct(length)
            return False
        headers = {"Range": f"bytes={start}-{start + length - 1}", "User-Agent": "objfs"}
        condition = if_match(etag)
        if condition:
            headers["If-Match"] = condition

        def check(reply: rawhttp.Reply) -> None:
            total = content_range_total(reply.headers.get("Content-Range"))
            _check_version(
                what,
                etag,
                reply.headers.get("ETag"),
                reply.headers.get("Last-Modified"),
                total if total is not None else length,
            )

        return engine.fetch(self._data, routed, headers, start, views, check)

    def cache_engine_statistics(self) -> dict[str, int] | None:
        return self._engine.statistics() if self._engine is not None else None

    def _get_into_via_sdk(
        self, what: str, key: str, etag: str, start: int, views: Sequence[memoryview]
    ) -> None:
        """(Worker thread) One try of the same GET through botocore, for endpoints behind a
        proxy from the environment (botocore retries the request; the caller retries a short,
        broken or misplaced body; the body is copied once more)."""
        length = sum(len(v) for v in views)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Range": f"bytes={start}-{start + length - 1}",
        }
        condition = if_match(etag)
        if condition:
            kwargs["IfMatch"] = condition
        resp = self._client.get_object(**kwargs)
        got_range = str(resp.get("ContentRange", ""))
        body: Any = resp["Body"]
        try:
            if not (
                (not got_range and start == 0)
                or got_range.startswith(f"bytes {start}-{start + length - 1}/")
            ):
                raise TransientStoreError(f"{what}: the reply is for {got_range!r}")
            modified = resp.get("LastModified")
            _check_version(
                what,
                etag,
                resp.get("ETag"),
                email.utils.format_datetime(modified.astimezone(_dt.UTC), usegmt=True)
                if isinstance(modified, _dt.datetime)
                else None,
                content_range_total(got_range) if got_range else int(resp.get("ContentLength", 0)),
            )
            for n, view in enumerate(views):
                data = body.read(len(view))
                if len(data) != len(view):
                    raise TransientStoreError(f"{what}: the body ended early")
                view[:] = data
                rawhttp.report_filled(views, n)
        finally:
            body.close()

    async def aclose(self) -> None:
        self._data.close()
