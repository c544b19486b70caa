"""Azure Blob Storage through azure-storage-blob, with the same semantics as the S3 backend.

Listing: one ``/``-delimited level per request (``walk_blobs``), page by page until the
service returns no continuation marker. A blob that carries the metadata ``hdi_isfolder=true``
(the directory blobs of accounts with a hierarchical namespace, and of tools that imitate
them) is a directory, also when its name has no trailing slash.

Concurrency: one SDK client and requests session (:mod:`objfs.backends.azure_client`) serve
every worker thread. Calls run in ``trio.to_thread.run_sync`` under one CapacityLimiter sized
to ``max_connections``; the pool holds two connections more, so no thread waits inside urllib3.

Retries, one layer per request: listings and HEADs use the SDK's retry policy; data GETs
bypass the SDK and retry the same cases in ``_get`` (same attempts and backoff), plus a body
that breaks off or ends early and a reply for another range.

Data path: a read is one GET of exactly the range, conditional on the ETag the handle pinned
(``If-Match``: a replaced blob is StaleObjectError, a deleted one ObjectNotFoundError), signed
by :class:`~objfs.backends.azure_auth.Signer` and sent by :mod:`objfs.rawhttp`, the body
received straight into the caller's buffers; behind a proxy from the environment it goes
through the session's urllib3 pool instead.

Cache engine (``--cache-proxy``, :mod:`objfs.cache_engine`): each data GET first goes to the
engine as ``GET URL/<blob URL's path>?<SAS>`` with ``Range``, ``If-Match`` and
``x-ms-version``, the SAS a read-only one for that blob (signed by the account key or a user
delegation key); the mount's own SAS token only with ``--cache-proxy-send-sas-token`` (a
mount with a SAS token credential and ``--cache-proxy`` is refused without it). Invariant:
bytes from the engine are used only when the reply is for exactly the range asked and its ETag
is the pin; anything else reads that range from the store directly. The SAS, and the URL
that carries it, are never logged, raised or reported.

Rotated credentials: with ``--sas-token-file`` or ``--credentials-file``, requests poll the
:class:`CredentialWatch`; a changed file's credential replaces the current one (a SAS in place,
a key with a new client). A request refused for its credentials (401/403) is sent once more if
the files now hold another credential.

Many containers (:mod:`objfs.backends.account`): :meth:`AzureBackend.for_container` shares
this backend's signing state, HTTP session and connection limit.

Secrets never reach a log, an error or a process title: errors are built from codes only
(:mod:`objfs.backends.azure_errors`) and the SDK's loggers are limited to warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import requests
import trio
import urllib3
from azure.core.credentials import AzureSasCredential
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import (
    BlobPrefix,
    BlobProperties,
    BlobServiceClient,
    ContainerClient,
)

from objfs import rawhttp
from objfs.backends.azure_auth import (
    API_VERSION,
    FILE_KINDS,
    AccountAuth,
    Credentials,
    Signer,
    resolve_credentials,
)
from objfs.backends.azure_client import backoff_s, ca_bundle, send_get, service_client, session
from objfs.backends.azure_errors import (
    AUTH_RETRY_STATUSES,
    AUTHENTICATION_CODES,
    ErrorContext,
    error_code,
    is_refusal,
    map_error,
    map_status,
)
from objfs.backends.base import Backend, ListPage, ObjectInfo, reply_version_error
from objfs.cache_engine import CacheEngine
from objfs.config import AzureOptions, Source, redact_url
from objfs.credentials import CredentialWatch
from objfs.errors import (
    AccessDeniedError,
    ObjectNotFoundError,
    ObjfsError,
    StaleObjectError,
    TransientStoreError,
    UsageError,
)
from objfs.retry import Tries, call_with_reload

log = logging.getLogger(__name__)

T = TypeVar("T")

# Attempts for the pre-mount check: fail a bad endpoint in seconds, not after a long backoff.
_CHECK_ATTEMPTS = 2
# Retried on the data path: throttling and server errors (ServerBusy is a 503).
_RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
_RETRY_CODES = {"ServerBusy", "OperationTimedOut", "InternalError"}


def _content_length(resp: urllib3.BaseHTTPResponse) -> int:
    try:
        return int(resp.headers.get("Content-Length", "-1"))
    except ValueError:
        return -1


def _mtime_ns(value: _dt.datetime) -> int:
    return int(value.timestamp()) * 1_000_000_000 + value.microsecond * 1000


def _check_version(what: str, pin: str, etag: str | None) -> None:
    """Raise StaleObjectError when a data reply's ETag is not the pinned one (a gateway that
    ignored If-Match): its bytes are never passed on."""
    problem = reply_version_error(pin, etag, None, None)
    if problem is not None:
        raise StaleObjectError(f"{what}: {problem}")


def _etag(value: object) -> str:
    """The ETag in its HTTP form, quoted: listings report it bare, HEAD and GET quoted."""
    text = str(value or "")
    return text if text.startswith('"') or not text else f'"{text}"'


def _is_folder(metadata: Mapping[str, str] | None) -> bool:
    """True for a directory blob (``hdi_isfolder=true``; metadata names are case-insensitive)."""
    return any(
        k.lower() == "hdi_isfolder" and str(v).lower() == "true"
        for k, v in (metadata or {}).items()
    )


def _next_page(pages: Iterator[Iterator[Any]]) -> list[Any] | None:
    """Fetch the next page of a listing (blocking), or None when the listing is complete."""
    try:
        return list(next(pages))
    except StopIteration:
        return None


class AzureBackend(Backend):
    """One Azure Blob Storage container. ``page_size`` caps a listing page (None: the
    service's 5,000); tests use small pages to exercise continuation."""

    def __init__(
        self,
        source: Source,
        options: AzureOptions,
        *,
        env: Mapping[str, str] | None = None,
        page_size: int | None = None,
        credential_watch: CredentialWatch | None = None,
    ) -> None:
        self.container = source.bucket
        self.options = options
        self.page_size = page_size
        self._source = source
        self._watch = credential_watch
        if env is None and credential_watch is not None:
            env = credential_watch.environ  # the credentials file as the watch read it
        creds = resolve_credentials(source, options, env)
        if (
            options.cache_proxy
            and isinstance(creds.credential, AzureSasCredential)
            and not options.cache_proxy_send_sas_token
        ):
            raise UsageError(
                f"--cache-proxy with a SAS token credential ({creds.kind}) would send that SAS "
                "to the engine: give the account key or a token credential (objfs then signs a "
                "read-only SAS per blob), or add --cache-proxy-send-sas-token"
            )
        self.account_url = creds.account_url
        self.account_name = creds.account_name
        self.credential_kind = creds.kind
        anonymous = creds.credential is None
        self._identity = creds.kind == "DefaultAzureCredential"
        self.description = f"container {self.container!r} at {redact_url(self.account_url)}"
        # What this backend's errors name (see azure_errors).
        self._errors = ErrorContext(
            container=self.container,
            account_name=self.account_name,
            where=redact_url(self.account_url),
            anonymous=anonymous,
            implicit_anonymous=anonymous and not options.no_sign_request,
        )
        # The SDK logs every request at INFO (headers included); objfs logs its own events.
        logging.getLogger("azure").setLevel(logging.WARNING)
        log.info("Azure credentials: %s", creds.kind)
        # +2: listings and HEADs run beside a full set of ranged GETs.
        self._ca_file = ca_bundle()  # the session's, the SDK client's and the data path's
        self._session = session(self.account_url, options.max_connections + 2, self._ca_file)
        # Data GETs go through rawhttp (bodies received straight into the cache's buffers)
        # unless a proxy from the environment is in the way, with the CA requests would use.
        self._proxied = bool(
            self._session.proxies.get("http") or self._session.proxies.get("https")
        )
        self._data = rawhttp.ConnectionPool(
            connect_timeout_s=options.connect_timeout_s,
            read_timeout_s=options.read_timeout_s,
            ca_file=self._ca_file,
            max_idle=options.max_connections,
        )
        # --cache-proxy: data GETs through a cache engine with a SAS (shared with the
        # backends for_container made, as the signer that makes the SAS is).
        self._engine = CacheEngine(options.cache_proxy) if options.cache_proxy else None
        self._use_credentials(creds)
        self._limiter = trio.CapacityLimiter(options.max_connections)
        parsed = urllib.parse.urlsplit(self.account_url)
        self._origin = f"{parsed.scheme}://{parsed.netloc}"
        # The account URL's own path (Azurite: /ACCOUNT), then the container.
        self._container_path = f"{parsed.path.rstrip('/')}/{urllib.parse.quote(self.container)}"
        self._container_client: tuple[BlobServiceClient, ContainerClient] | None = None
        if credential_watch is not None:
            credential_watch.bind(self._prepare_credentials)

    @property
    def _credential(self) -> Any:
        return self._auth.credential

    @property
    def _signer(self) -> Signer:
        return self._auth.signer

    @property
    def _service(self) -> BlobServiceClient:
        return self._auth.service

    @property
    def _container(self) -> ContainerClient:
        """The SDK's client of this container, made from the current service client."""
        service = self._auth.service
        cached = self._container_client
        if cached is None or cached[0] is not service:
            cached = (service, service.get_container_client(self.container))
            self._container_client = cached  # a race makes two equal clients: harmless
        return cached[1]

    def for_container(self, container: str) -> AzureBackend:
        """A backend for another container of this account, sharing this one's signing state
        (rotated credentials included), HTTP session and connection limit. Only this
        backend's :meth:`aclose` releases what they share."""
        other = copy.copy(self)
        other.container = container
        other._source = Source(scheme="az", bucket=container, prefix="")
        other.description = f"container {container!r} at {redact_url(self.account_url)}"
        other._errors = dataclasses.replace(self._errors, container=container)
        parsed = urllib.parse.urlsplit(self.account_url)
        other._container_path = f"{parsed.path.rstrip('/')}/{urllib.parse.quote(container)}"
        other._container_client = None
        return other

    async def list_containers(self, *, check: bool = False) -> list[str]:
        """The names of every container the credentials can list, page by page. ``check``:
        the pre-mount check's few attempts."""
        where = redact_url(self.account_url)
        what = f"listing the containers at {where}"
        retries: dict[str, Any] = {"retry_total": _CHECK_ATTEMPTS - 1} if check else {}
        pages = self._service.list_containers(**retries).by_page()
        names: list[str] = []
        try:
            while True:
                page = await self._call(what, lambda: _next_page(pages))
                if page is None:
                    return names
                names.extend(str(item["name"]) for item in page)
        except AccessDeniedError as exc:
            cause = exc.__context__  # the SDK's error (raised "from None": never shown)
            if not isinstance(cause, HttpResponseError) or self._errors.anonymous:
                raise
            code = error_code(cause)
            if code in AUTHENTICATION_CODES or cause.status_code == 401:
                raise  # the credentials themselves were rejected: that message says so
            raise AccessDeniedError(
                f"access denied: {what} ({code or cause.status_code}): the credentials must "
                "be allowed to list the account's containers (the account key, an account SAS "
                "with srt=s and sp=l, or a role on the account), or mount one container with "
                "az://CONTAINER"
            ) from None

    def _use_credentials(self, creds: Credentials) -> None:
        """Sign with ``creds`` from now on: a new signer and SDK client (listings in progress
        go on with it from their next page), for every backend that shares this one's
        signing state."""
        service = service_client(
            self.account_url, creds.credential, self._session, self._ca_file, self.options
        )
        auth: AccountAuth | None = getattr(self, "_auth", None)
        if auth is None:
            self._auth = AccountAuth(creds, service)
        else:  # in place: the containers' backends share it
            auth.use(creds, service)

    # -- rotated credentials -----------------------------------------------------------------

    def _prepare_credentials(self, environ: Mapping[str, str]) -> Callable[[], None]:
        """(CredentialWatch) The credential the files now give, to be put in use by the
        returned function; raises UsageError if they give none or another account's."""
        if self.credential_kind not in FILE_KINDS:
            return lambda: None  # identity or anonymous: no file to take a credential from
        creds = resolve_credentials(self._source, self.options, environ)
        if creds.kind not in FILE_KINDS:
            raise UsageError(
                "the credential files hold no account key, connection string or SAS token"
            )
        if creds.account_url != self.account_url or creds.account_name != self.account_name:
            raise UsageError("the new credentials are for another account or endpoint")
        current, new = self._credential, creds.credential

        def commit() -> None:
            if isinstance(current, AzureSasCredential) and isinstance(new, AzureSasCredential):
                # In place: the SDK's clients (listings in progress too) and the signer read
                # the token from this object on every request.
                current.update(new.signature)
            else:
                # The SDK copies an account key into its signing policy: a new client.
                self._use_credentials(creds)
            self.credential_kind = creds.kind

        return commit

    # -- error mapping ---------------------------------------------------------------------

    def _map_error(self, exc: Exception, what: str) -> ObjfsError:
        """Turn an SDK exception into an objfs error built from codes only (never its text)."""
        return map_error(exc, what, self._errors)

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        def call() -> T:
            return call_with_reload(self._watch, fn, is_refusal)

        try:
            return await trio.to_thread.run_sync(call, limiter=self._limiter)
        except Exception as exc:
            raise self._map_error(exc, what) from None

    def _url(self, key: str) -> str:
        return f"az://{self.container}/{key}"

    # -- Backend ---------------------------------------------------------------------------

    async def check(self, prefix: str) -> bool:
        pages = self._container.walk_blobs(
            name_starts_with=prefix or None,
            delimiter="/",
            results_per_page=1,
            retry_total=_CHECK_ATTEMPTS - 1,
        ).by_page()
        return bool(await self._call(f"listing {self._url(prefix)}", lambda: _next_page(pages)))

    async def has_keys_under(self, prefix: str) -> bool:
        """One flat listing of at most one blob under ``prefix`` (any depth)."""
        pages = self._container.list_blobs(name_starts_with=prefix, results_per_page=1).by_page()
        return bool(await self._call(f"listing {self._url(prefix)}", lambda: _next_page(pages)))

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        what = f"listing {self._url(prefix)}"

        def open_pages(token: str | None) -> Any:
            return self._container.walk_blobs(
                name_starts_with=prefix or None,
                delimiter="/",
                include=["metadata"],
                results_per_page=self.page_size,
            ).by_page(continuation_token=token)

        client = self._container
        pages = open_pages(None)

        def next_page() -> list[Any] | None:
            nonlocal client, pages
            if client is not self._container:
                # New credentials, new client: go on from the same page with it.
                client, pages = self._container, open_pages(pages.continuation_token)
            return _next_page(pages)

        seen: set[str] = set()  # a directory blob and its contents name one prefix twice
        while True:
            items = await self._call(what, next_page)
            if items is None:
                return
            objects: list[ObjectInfo] = []
            prefixes: list[str] = []
            for item in items:
                if isinstance(item, BlobPrefix):
                    name = str(item.name)
                elif isinstance(item, BlobProperties) and _is_folder(item.metadata):
                    name = str(item.name).rstrip("/") + "/"
                    if name == prefix:
                        continue  # the listed directory's own blob
                else:
                    objects.append(
                        ObjectInfo(
                            key=str(item.name),
                            size=int(item.size),
                            etag=_etag(item.etag),
                            mtime_ns=_mtime_ns(item.last_modified),
                        )
                    )
                    continue
                if name not in seen:
                    seen.add(name)
                    prefixes.append(name)
            more = bool(getattr(pages, "continuation_token", None))
            yield ListPage(objects=objects, prefixes=prefixes, more=more)

    async def head(self, key: str) -> ObjectInfo:
        what = f"HEAD {self._url(key)}"
        props = await self._call(
            what, lambda: self._container.get_blob_client(key).get_blob_properties()
        )
        if _is_folder(props.metadata):
            raise ObjectNotFoundError(f"{what}: a directory blob, not a file")
        return ObjectInfo(
            key=key,
            size=int(props.size),
            etag=_etag(props.etag),
            mtime_ns=_mtime_ns(props.last_modified),
        )

    def _get(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        """One conditional ranged GET (blocking), retried; its bytes fill ``views``. A
        refusal of the credentials is tried once more, at once, if the credential files now
        hold newer ones."""
        length = sum(len(v) for v in views)
        what = f"GET {self._url(key)} bytes {start}-{start + length - 1}"
        path = f"{self._container_path}/{urllib.parse.quote(key, safe='~/')}"
        expected_range = f"bytes {start}-{start + length - 1}/"
        timeout = (self.options.connect_timeout_s, self.options.read_timeout_s)
        tries = Tries(self.options.max_attempts, self._watch, backoff_s)
        while True:
            if self._engine is not None and self._get_via_engine(
                what, etag, key, path, start, views
            ):
                return
            headers = {"x-ms-range": f"bytes={start}-{start + length - 1}"}
            if etag:
                headers["If-Match"] = etag
            url, headers = self._signer.sign("GET", self._origin, path, headers)
            if not self._proxied:
                outcome = self._get_raw(what, key, etag, url, headers, start, length, views, tries)
                if outcome is True:
                    return
                if isinstance(outcome, Exception):
                    tries.failed(outcome)  # may sleep
                continue
            try:
                resp = send_get(self._session, self._origin, url, headers, timeout)
            except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
                # connect, timeout, reset
                tries.failed(
                    TransientStoreError(f"{what}: connection failed ({type(exc).__name__})")
                )
                continue
            error: Exception | None = None  # a retryable failure of this try
            try:
                status = resp.status
                if status in (200, 206):
                    got_range = resp.headers.get("Content-Range", "")
                    whole = status == 200 and start == 0 and _content_length(resp) == length
                    if not (whole or got_range.startswith(expected_range)):
                        # Bytes of another range (a broken proxy or server): never pass them on.
                        error = TransientStoreError(f"{what}: the reply is for {got_range!r}")
                    else:
                        got = 0
                        for n, view in enumerate(views):
                            piece = resp.read(len(view), decode_content=False)
                            view[: len(piece)] = piece
                            got += len(piece)
                            if len(piece) < len(view):
                                break
                            rawhttp.report_filled(views, n)
                        if got == length:
                            _check_version(what, etag, resp.headers.get("ETag"))
                            return
                        error = TransientStoreError(f"{what}: got {got} bytes, expected {length}")
                else:
                    code = resp.headers.get("x-ms-error-code", "")
                    if status in _RETRY_STATUSES or code in _RETRY_CODES:
                        error = TransientStoreError(f"{what}: store error {code or status}")
                    elif status == 412 and self._deleted(key):
                        # If-Match fails for a deleted blob too: "deleted" is ENOENT, as on S3.
                        raise ObjectNotFoundError(f"{what}: not found")
                    elif not (status in AUTH_RETRY_STATUSES and tries.refused()):
                        raise map_status(code, status, what, self._errors)
                    # else: refused, and newer credentials are there: once more, at once
            except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
                error = TransientStoreError(f"{what}: body broke off ({type(exc).__name__})")
            finally:
                resp.release_conn() if resp.length_remaining == 0 else resp.close()
            if error is not None:
                tries.failed(error)  # after the reply went back: it may sleep

    def _get_via_engine(
        self, what: str, etag: str, key: str, path: str, start: int, views: Sequence[memoryview]
    ) -> bool:
        """(Worker thread) One try of the GET through the cache engine (``--cache-proxy``):
        True when ``views`` hold the range of the pinned version; False when the caller must
        read from the store directly (the engine is left alone after a failure or failed now,
        or no SAS can be made: see objfs.cache_engine and :meth:`Signer.engine_query`).

        The GET is the raw path's, as a reverse proxy forwards it: the blob URL's path and a
        SAS as its query on the engine, the standard ``Range`` (not ``x-ms-range``, which
        Azure would prefer to the engine's slice ranges), ``If-Match`` with the pin and
        ``x-ms-version``; the reply's ETag is checked against the pin. Neither the SAS nor
        the URL appears in what is logged or raised."""
        engine = self._engine
        assert engine is not None
        length = sum(len(v) for v in views)
        routed = engine.route(self._origin + path)
        if routed is None:
            engine.direct(length)
            return False
        query, minted = self._signer.engine_query(
            self.container,
            key,
            self.options.cache_proxy_url_lifetime_s,
            self._service,
            send_sas_token=self.options.cache_proxy_send_sas_token,
        )
        if minted:
            engine.signed()
        if query is None:
            engine.direct(length)
            return False
        if query:
            routed = f"{routed}?{query}"
        headers = {
            "Range": f"bytes={start}-{start + length - 1}",
            "x-ms-version": API_VERSION,
            "User-Agent": "objfs",
        }
        if etag:
            headers["If-Match"] = etag
        return engine.fetch(
            self._data,
            routed,
            headers,
            start,
            views,
            lambda reply: _check_version(what, etag, reply.headers.get("ETag")),
        )

    def cache_engine_statistics(self) -> dict[str, int] | None:
        return self._engine.statistics() if self._engine is not None else None

    def _get_raw(
        self,
        what: str,
        key: str,
        etag: str,
        url: str,
        headers: dict[str, str],
        start: int,
        length: int,
        views: Sequence[memoryview],
        tries: Tries,
    ) -> Exception | bool:
        """One try of :meth:`_get` through :mod:`objfs.rawhttp`, the body received straight
        into ``views``: True when they hold the range, the retryable failure of this try, or
        False for a refusal of the credentials that newer ones may cure (try again at once).
        A final error is raised."""
        try:
            reply = self._data.get_into(url, headers, views)
        except rawhttp.ConnectionFailed as exc:
            return TransientStoreError(f"{what}: connection failed ({exc})")
        status = reply.status
        if status in (200, 206):
            problem = reply.body_error(start, length)
            if problem is not None:
                return TransientStoreError(f"{what}: {problem}")
            _check_version(what, etag, reply.headers.get("ETag"))
            return True
        code = reply.headers.get("x-ms-error-code", "")
        if status in _RETRY_STATUSES or code in _RETRY_CODES:
            return TransientStoreError(f"{what}: store error {code or status}")
        if status == 412 and self._deleted(key):
            # If-Match fails for a deleted blob too: "deleted" is ENOENT, as on S3.
            raise ObjectNotFoundError(f"{what}: not found")
        if status in AUTH_RETRY_STATUSES and tries.refused():
            return False
        raise map_status(code, status, what, self._errors)

    def _deleted(self, key: str) -> bool:
        try:
            self._container.get_blob_client(key).get_blob_properties()
        except HttpResponseError as exc:
            return int(exc.status_code or 0) == 404
        return False

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        buf = bytearray(length)
        await self.read_into(key, etag, start, [memoryview(buf)])
        return bytes(buf)

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        """One GET, its body read into ``views`` (see Backend)."""
        length = sum(len(v) for v in views)
        what = f"GET {self._url(key)} bytes {start}-{start + length - 1}"
        await self._call(what, lambda: self._get(key, etag, start, views))

    async def aclose(self) -> None:
        self._data.close()
        await trio.to_thread.run_sync(self._service.close)
