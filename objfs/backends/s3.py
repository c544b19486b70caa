"""Amazon S3 and S3-compatible stores (MinIO, Ceph RGW, ...) through botocore.

Concurrency: one botocore client is shared by every worker thread (clients are thread-safe,
sessions are not). Calls run in ``trio.to_thread.run_sync`` under one CapacityLimiter sized to
``max_connections``, and botocore's HTTP pool is sized to match, so no thread ever waits for a
connection inside botocore (its default pool is only 10).

Data GETs (the bytes of a load) do not go through botocore's request machinery: botocore
resolves the URL (endpoint and addressing) and signs the request with SigV4 headers (its
credential providers stay in charge, refreshed credentials included), and
:mod:`objfs.rawhttp` sends the GET on a kept-alive connection and receives the body
straight into the memory tier's buffers. Behind a proxy from the environment they take
botocore's path instead.

Many buckets (the account root, :mod:`objfs.backends.account`): :meth:`S3Backend.for_bucket`
makes a backend for another bucket that shares this one's session (and so its credentials,
rotated ones included), its connection limit and its data connections; buckets in one region
share one client, a bucket in another region gets a client of its own for that region.

Retries: one layer per request. Data GETs: objfs's own loop (``max_attempts`` in all, jittered
backoff) retries connection failures, throttling and 5xx, short bodies and replies for the
wrong range. Listings and HEADs: botocore's "standard" mode, with the same ``max_attempts``.

Rotated credentials: with ``--credentials-file``, keys taken from the environment (botocore's
``env`` provider, which the file feeds) sit in a :class:`_ReloadableCredentials` shared by
the clients and the data path's signer. Requests poll the :class:`CredentialWatch` (a stat at
most once a second); when the file changed, new requests are signed with its keys. A request
refused for its credentials (401/403, or an expired or unknown key) re-reads the file at once
and, if it now holds other keys, is sent once more with them: one extra try of the same
loop (listings and HEADs: one more call of the SDK, whose retries never repeat a 403).
"""

from __future__ import annotations

import copy
import datetime as _dt
import email.utils
import gzip
import json
import logging
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import botocore.credentials
import botocore.exceptions
import botocore.httpsession
import botocore.loaders
import botocore.session
import trio
from botocore import UNSIGNED
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config

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
from objfs.cache_engine import CacheEngine
from objfs.config import S3Options, redact_url
from objfs.credentials import CredentialWatch
from objfs.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    NoCredentialsError,
    ObjectNotFoundError,
    ObjfsError,
    StaleObjectError,
    TransientStoreError,
    UsageError,
)
from objfs.retry import Tries, call_with_reload

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

log = logging.getLogger(__name__)

# Data GETs take their URL from a presigned one (then signed in headers, see _signed_get).
_URL_EXPIRY_S = 900
# Object URLs remembered (a model's files many times over); the table is emptied when full.
_URL_CACHE_KEYS = 4096
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

_ACCESS_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
# Refusals that fresher credentials may cure: re-read the credential files and try once more.
_AUTH_RETRY_CODES = _CREDENTIAL_CODES | _ACCESS_CODES
_AUTH_RETRY_STATUSES = {401, 403}
_NETWORK_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.SSLError,
    botocore.exceptions.ProxyConnectionError,
)
# Connection failures of the SDK's path that the data path's own loop retries (TLS errors are
# not: they do not go away by themselves).
_CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
)
_CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
)
_BODY_ERRORS = (
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.ConnectionClosedError,
)


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


class _ReloadableCredentials:
    """Credentials (botocore's interface) whose source can be replaced while clients use
    them. botocore signs each request with one ``get_frozen_credentials()`` call, so a request
    is never signed with half of the old keys and half of the new ones."""

    def __init__(self, inner: botocore.credentials.Credentials) -> None:
        self._inner = inner
        self.method = inner.method

    def replace(self, inner: botocore.credentials.Credentials) -> None:
        self._inner = inner  # one reference swap: atomic for the signing threads

    def get_frozen_credentials(self) -> botocore.credentials.ReadOnlyCredentials:
        return self._inner.get_frozen_credentials()

    def get_deferred_property(self, name: str) -> Callable[[], Any]:
        return lambda: getattr(self.get_frozen_credentials(), name, None)

    @property
    def access_key(self) -> str | None:
        return self.get_frozen_credentials().access_key

    @property
    def secret_key(self) -> str | None:
        return self.get_frozen_credentials().secret_key

    @property
    def token(self) -> str | None:
        return self.get_frozen_credentials().token

    @property
    def account_id(self) -> str | None:
        return self.get_frozen_credentials().account_id


class _ReloadableResolver:
    """botocore's credential resolver, with credentials from the environment made
    reloadable (the others, profiles and roles, refresh themselves or are left alone)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.credentials: _ReloadableCredentials | None = None

    def load_credentials(self) -> Any:
        found: botocore.credentials.Credentials | None = self._inner.load_credentials()
        if found is not None and found.method == "env":
            self.credentials = _ReloadableCredentials(found)
            return self.credentials
        return found


def _ca_bundle(options: S3Options, session: botocore.session.Session) -> str:
    """The CA certificates file that every request of a backend trusts, chosen once as
    botocore chooses for its clients: --ca-bundle, else the session's ``ca_bundle``
    ($AWS_CA_BUNDLE, else the profile's ``ca_bundle`` in the config file), else botocore's
    own bundle (certifi's; not the system store, which rawhttp would use by default). Raises
    UsageError if the file chosen is not there."""
    if options.ca_bundle is not None:
        return options.ca_bundle  # checked by S3Backend
    configured = session.get_config_variable("ca_bundle")
    if not configured:
        return str(botocore.httpsession.get_cert_path(True))
    if not os.path.isfile(configured):
        where = "AWS_CA_BUNDLE" if os.environ.get("AWS_CA_BUNDLE") else "the profile's ca_bundle"
        raise UsageError(
            f"{where}: {configured!r} is not a file: give the PEM file of the CA that signed "
            "the endpoint's certificate (or --ca-bundle)"
        )
    return str(configured)


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
        # botocore's session directly: boto3 adds nothing objfs uses (resources, transfers)
        # and 3 MiB to the daemon's memory.
        core = botocore.session.Session()
        _use_lean_models(core)
        self._resolver: _ReloadableResolver | None = None
        self._watch = credential_watch
        if credential_watch is not None and not options.no_sign_request and not options.profile:
            # (With --profile, botocore skips the environment: nothing here to reload.)
            self._resolver = _ReloadableResolver(core.get_component("credential_provider"))
            core.register_component("credential_provider", self._resolver)
        try:
            if options.profile is not None:
                core.set_config_variable("profile", options.profile)
            core.get_scoped_config()  # raises ProfileNotFound now rather than at the first call
        except botocore.exceptions.ProfileNotFound:
            raise NoCredentialsError(
                f"AWS profile {options.profile!r} not found: check --profile and "
                "~/.aws/config (or AWS_CONFIG_FILE)"
            ) from None
        self._session = core
        # One CA choice for every request: listings and HEADs (botocore) and data GETs
        # (rawhttp) trust the same certificates.
        self._ca_file = _ca_bundle(options, core)
        self._client = self._make_client(core, endpoint, options.max_attempts)
        self._check_client = self._make_client(core, endpoint, _CHECK_ATTEMPTS)
        #: The region requests are signed for.
        self.region: str = self._client.meta.region_name
        # Clients of other regions, shared with the backends for_bucket made (trio thread).
        self._regional: dict[str, tuple[S3Client, S3Client]] = {
            self.region: (self._client, self._check_client)
        }
        self._limiter = trio.CapacityLimiter(options.max_connections)
        # (bucket, key) -> (the client that resolved it, the object's URL without query);
        # shared with the backends for_bucket made, any thread (single dict operations).
        self._urls: dict[tuple[str, str], tuple[S3Client, str]] = {}
        # Data GETs go straight to the endpoint on their own connections (see rawhttp), with
        # the CAs botocore's clients use.
        # --cache-proxy: data GETs through a cache engine as presigned URLs (shared with the
        # backends for_bucket made); (bucket, key) -> (client, presigned URL, when to renew).
        self._engine = CacheEngine(options.cache_proxy) if options.cache_proxy else None
        self._presigned: dict[tuple[str, str], tuple[S3Client, str, float]] = {}
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
        current = None if self._resolver is None else self._resolver.credentials
        if current is None:
            return lambda: None  # not signed with keys from the environment: nothing to swap
        try:
            found = botocore.credentials.EnvProvider(environ=environ).load()
        except botocore.exceptions.PartialCredentialsError as exc:
            raise NoCredentialsError(
                f"--credentials-file: {exc.kwargs.get('cred_var', 'a variable')} is missing"
            ) from None
        if found is None:
            raise NoCredentialsError(
                "--credentials-file holds no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        return lambda: current.replace(found)

    @staticmethod
    def _is_refusal(exc: Exception) -> bool:
        """A refusal that fresher credentials may cure."""
        if not isinstance(exc, botocore.exceptions.ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        return code in _AUTH_RETRY_CODES or status in _AUTH_RETRY_STATUSES

    def _make_client(
        self,
        session: botocore.session.Session,
        endpoint: str | None,
        attempts: int,
        region: str | None = None,
    ) -> S3Client:
        opts = self.options
        config_kwargs: dict[str, Any] = {
            "connect_timeout": opts.connect_timeout_s,
            "read_timeout": opts.read_timeout_s,
            "retries": {"mode": "standard", "max_attempts": attempts},
            # +2: head and list requests run beside a full set of ranged GETs.
            "max_pool_connections": opts.max_connections + 2,
            "s3": {"addressing_style": "path" if opts.path_style() else "auto"},
            "user_agent_extra": "objfs",
        }
        # SigV4 also for presigned URLs (--cache-proxy), which botocore would otherwise sign
        # with SigV2 where it still can; SigV2 is refused in newer AWS regions.
        config_kwargs["signature_version"] = UNSIGNED if opts.no_sign_request else "s3v4"
        if region is None:
            region = (
                opts.region
                or session.get_config_variable("region")
                or ("us-east-1" if endpoint else None)
            )
        try:
            client: S3Client = session.create_client(  # type: ignore[assignment]
                "s3",
                endpoint_url=endpoint,
                region_name=region,
                config=Config(**config_kwargs),
                verify=self._ca_file,  # the data path's too (see _ca_bundle)
            )
        except ValueError as exc:  # botocore rejects a malformed endpoint URL this way
            raise UsageError(
                f"--endpoint-url: {redact_url(endpoint or '')!r} is not a valid URL ({exc}): "
                "give it as http(s)://HOST[:PORT]"
            ) from None
        return client

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
                    self._make_client(
                        self._session, self.endpoint, self.options.max_attempts, region
                    ),
                    self._make_client(self._session, self.endpoint, _CHECK_ATTEMPTS, region),
                )
                self._regional[region] = clients
            other._client, other._check_client = clients
            other.region = region
        return other

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
                code = _client_error_code(exc.__cause__)
                if code in _CREDENTIAL_CODES:
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
        if isinstance(exc, ObjfsError):
            return exc
        if isinstance(
            exc,
            botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError,
        ):
            return NoCredentialsError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "pass --profile, or use --no-sign-request for a public bucket"
            )
        if isinstance(exc, _NETWORK_ERRORS):
            return EndpointUnreachableError(
                f"cannot reach {self.description} ({type(exc).__name__}): check --endpoint-url, "
                "the network and, for TLS, --ca-bundle"
            )
        if isinstance(exc, _BODY_ERRORS):
            return TransientStoreError(f"{what}: connection failed ({type(exc).__name__})")
        if isinstance(exc, botocore.exceptions.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code == "NoSuchBucket":
                return BucketNotFoundError(
                    f"bucket {self.bucket!r} does not exist at {self.description.split(' at ')[1]}"
                    ": check the bucket name, --endpoint-url and --region"
                )
            if code in _CREDENTIAL_CODES:
                return AccessDeniedError(
                    f"{self.description} rejected the credentials ({code}): check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile"
                )
            if code in _ACCESS_CODES or status == 403:
                return AccessDeniedError(
                    f"access denied: {what} ({code or status}): grant s3:ListBucket and "
                    "s3:GetObject on the bucket and prefix to these credentials"
                )
            if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "301"):
                return EndpointUnreachableError(
                    f"bucket {self.bucket!r} is in another region ({code}): pass --region"
                )
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFoundError(f"{what}: not found")
            if code in ("PreconditionFailed", "412"):
                return StaleObjectError(f"{what}: the object changed while it was open")
            return TransientStoreError(f"{what}: store error {code or status}")
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return TransientStoreError(f"{what}: {type(exc).__name__}")
        return TransientStoreError(f"{what}: unexpected {type(exc).__name__}")

    async def _call(self, what: str, fn: Any, /, **kwargs: Any) -> Any:
        def call() -> Any:
            return call_with_reload(self._watch, lambda: fn(**kwargs), self._is_refusal)

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
            url, signed = self._signed_get(key, headers)
            if rawhttp.uses_proxy(url):
                try:
                    self._get_into_via_sdk(what, key, etag, start, views)
                except botocore.exceptions.ClientError as exc:
                    if self._is_refusal(exc) and tries.refused():
                        continue
                    raise
                except (TransientStoreError, *_BODY_ERRORS, *_CONNECTION_ERRORS) as exc:
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
            code = _error_code(reply.error_body) or str(reply.status)
            # The SDK's error shape, so that one table (_map_error) maps every request's errors.
            response: Any = {
                "Error": {"Code": code, "Message": ""},
                "ResponseMetadata": {"HTTPStatusCode": reply.status},
            }
            error = botocore.exceptions.ClientError(response, "GetObject")
            if reply.status in _RETRY_STATUSES or code in _RETRY_CODES:
                tries.failed(self._map_error(error, what))
                continue
            if not (self._is_refusal(error) and tries.refused()):
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
        length = sum(len(v) for v in views)
        routed = engine.route(self._presigned_url(key))
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

    def _presigned_url(self, key: str) -> str:
        """A presigned GET URL for ``key`` (query authentication: the engine may re-range
        the request), valid --cache-proxy-url-lifetime; signed again once half of that has
        passed, so a GET never carries a URL about to expire. With --no-sign-request, the
        plain URL."""
        assert self._engine is not None
        lifetime = self.options.cache_proxy_url_lifetime_s
        client = self._client
        now = time.monotonic()
        known = self._presigned.get((self.bucket, key))
        if known is not None and known[0] is client and now < known[2]:
            return known[1]
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=lifetime
        )
        self._engine.signed()
        if self.options.no_sign_request:
            url = url.split("?", 1)[0]
        if len(self._presigned) >= _URL_CACHE_KEYS:
            self._presigned.clear()
        self._presigned[(self.bucket, key)] = (client, url, now + lifetime / 2)
        return url

    def cache_engine_statistics(self) -> dict[str, int] | None:
        return self._engine.statistics() if self._engine is not None else None

    def _signed_get(self, key: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The object's URL as botocore resolves it (endpoint, addressing style) and
        ``headers`` plus a SigV4 Authorization header, signed now: refreshed credentials
        apply, and no credential ever sits in a URL (servers and proxies log URLs)."""
        client = self._client
        known = self._urls.get((self.bucket, key))
        if known is not None and known[0] is client:
            url = known[1]
        else:
            # botocore's resolution costs a quarter of a millisecond: once per key and client.
            presigned = client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=_URL_EXPIRY_S
            )
            url = presigned.split("?", 1)[0]  # the query holds only the presigning parameters
            if len(self._urls) >= _URL_CACHE_KEYS:
                self._urls.clear()
            self._urls[(self.bucket, key)] = (client, url)
        if self.options.no_sign_request:
            return url, headers
        credentials = self._session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        request = AWSRequest(method="GET", url=url, headers=dict(headers))
        S3SigV4Auth(
            credentials.get_frozen_credentials(), "s3", self._client.meta.region_name
        ).add_auth(request)
        return url, dict(request.headers.items())

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
            for view in views:
                data = body.read(len(view))
                if len(data) != len(view):
                    raise TransientStoreError(f"{what}: the body ended early")
                view[:] = data
        finally:
            body.close()

    async def aclose(self) -> None:
        self._data.close()


class _LeanJSONFileLoader(botocore.loaders.JSONFileLoader):
    """botocore's JSON data files loaded as plain dicts, without their documentation texts.

    botocore keeps what it loads for a client as long as the client lives: the endpoints
    table, the S3 model and its endpoint rules, 11.2 MiB of Python objects, as ``OrderedDict``
    (a third bigger than a dict) with every operation's and shape's documentation (half of
    the S3 model). objfs never renders documentation: each text becomes "" while the file is
    parsed (the key stays: botocore indexes some of them). tracemalloc: the endpoints 6.7 ->
    3.9 MiB, the S3 model 3.2 -> 1.2, its endpoint rules 1.3 -> 0.8; the daemon's RSS with
    its S3 clients 6 MiB less."""

    def load_file(self, file_path: str) -> Any:
        """The data of ``file_path`` + ``.json`` (or ``.json.gz``), None if neither exists."""
        for ext, opener in ((".json", open), (".json.gz", gzip.open)):
            if os.path.isfile(file_path + ext):
                with opener(file_path + ext, "rb") as fp:
                    payload = fp.read()
                return json.loads(payload.decode("utf-8"), object_pairs_hook=_without_documentation)
        return None


def _without_documentation(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # The key stays (botocore indexes some of them), its text becomes the shared "".
    return {k: "" if k == "documentation" and isinstance(v, str) else v for k, v in pairs}


def _use_lean_models(session: botocore.session.Session) -> None:
    """Make ``session`` load botocore's data files with :class:`_LeanJSONFileLoader` (an
    unexpected loader, from a botocore that changed, is left as it is)."""
    loader = session.get_component("data_loader")
    if type(getattr(loader, "file_loader", None)) is botocore.loaders.JSONFileLoader:
        loader.file_loader = _LeanJSONFileLoader()


def _backoff_s(retry: int) -> float:
    """Sleep before retry ``retry`` (from 0): full jitter, capped."""
    return random.uniform(0.0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retry))


def _client_error_code(exc: BaseException | None) -> str:
    """The error code of a botocore ClientError, else ""."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _error_code(body: bytes) -> str:
    """The ``<Code>`` of an S3 error document, or ""."""
    match = re.search(rb"<Code>([^<]{1,100})</Code>", body)
    return match.group(1).decode("ascii", "replace") if match else ""
