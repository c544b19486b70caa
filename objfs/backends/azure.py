"""Azure Blob Storage through azure-storage-blob, with the same semantics as the S3 backend.

Listing: one ``/``-delimited level per request (``walk_blobs``), page by page until the
service returns no continuation marker (5,000 entries a page by default). A blob that carries
the metadata ``hdi_isfolder=true`` (the directory blobs of accounts with a hierarchical
namespace, and of tools that imitate them) is a directory, also when its name has no trailing
slash.

Credentials, first match wins (:func:`resolve_credentials`): ``AZURE_STORAGE_CONNECTION_STRING``;
``AZURE_STORAGE_KEY`` (the account key); a SAS token (``--sas-token-file``, else
``AZURE_STORAGE_SAS_TOKEN``); ``DefaultAzureCredential`` when azure-identity is installed
(managed identity, workload identity, az CLI; skipped when ``OBJFS_AZURE_NO_IDENTITY`` is set);
anonymous. ``--no-sign-request`` goes straight to anonymous.

Concurrency: one client (and so one ``requests.Session`` and its urllib3 pool) is shared by
every worker thread: the Azure SDK documents its clients as immutable and safe to share
across threads, and urllib3's pool is thread-safe. Calls run in ``trio.to_thread.run_sync``
under one CapacityLimiter sized to ``max_connections``, and the pool holds two connections
more, so no thread waits for a connection inside urllib3 (requests' default pool holds 10).

Retries, one layer per request: listings and HEADs use the SDK's retry policy (configured here:
bounded attempts, backoff with full jitter) for throttling, 5xx, timeouts and connection
errors. Data GETs bypass the SDK (see below) and retry the same cases in ``_get``, with the
same attempts and backoff, plus the ones only a reader sees: a body that breaks off or ends
early, and a reply for another range.

Data path: a read is one GET of exactly the range, conditional on the ETag the handle pinned
(``If-Match``; a replaced blob answers 412, which becomes StaleObjectError), signed here
(:class:`_Signer`) instead of going through the SDK's pipeline, whose per-request CPU cost
showed in single-stream throughput, and sent by :mod:`objfs.rawhttp` as S3's are: kept-alive
connections of its own, the body received straight into the memory tier's buffers (no bytes
object per block, no copy, no content decoding), with the CA bundle requests would use. Behind
a proxy from the environment the GET goes through the session's urllib3 pool (via requests'
adapter), the body read into block-sized ``bytes``.
``tests/benchmarks/azure_sdk_vs_raw.py`` measures the SDK against plain ranged GETs.

Cache engine (``--cache-proxy URL``, see :mod:`objfs.cache_engine`): each data GET first goes
to the engine as ``GET URL/<blob URL's path>?<SAS>`` (Azurite: ``/ACCOUNT/CONTAINER/BLOB``;
Azure: ``/CONTAINER/BLOB``), which the engine forwards to the account's endpoint unchanged (a
SAS signs the path, not the host: one engine fronts one account endpoint, its Host). The SAS
is the mount's own SAS token when that is the credential; with the account key, a read-only
SAS for that blob signed here; with a token credential, one signed by a user delegation key
(none while the service refuses that key: the GET goes to the store directly). A SAS signed
here lives ``--cache-proxy-url-lifetime`` and is signed again at half of it
(:meth:`_Signer.engine_query`). The GET carries ``Range`` (not ``x-ms-range``: the engine
re-ranges it into its slices), ``If-Match`` with the pinned ETag and ``x-ms-version``.
Invariant: bytes from the engine are used only when the reply is for exactly the range asked
and its ETag is the pin; anything else (refused, reset, 5xx, a short or misplaced body,
another ETag) makes that range come from the store directly by the path above, the engine
left alone for a while; a 412 goes to the direct path without blaming the engine (the pinned
version is gone). The SAS, and the URL that carries it, are never logged, raised or reported:
only the engine's base URL is.

Rotated credentials: with ``--sas-token-file`` or ``--credentials-file``, requests poll the
:class:`CredentialWatch` (a stat at most once a second); when a file changed, the credential
is resolved again from it and replaces the current one (a SAS in place, in the credential
object the SDK and the data path's signer share; a key with a new client). A request refused
for its credentials (401/403) re-reads the files at once and, if they now hold another
credential, is sent once more: one extra try of the same loop (listings and HEADs: one more
call of the SDK, whose retry policy never repeats a 403).

Many containers (the account root, :mod:`objfs.backends.account`):
:meth:`AzureBackend.for_container` makes a backend for another container of the same account
that shares this one's signing state (:class:`_Auth`: credential, signer, SDK client, replaced
in place when credentials rotate), its HTTP session and its connection limit.

Secrets never reach a log, an error or a process title: SDK exception texts can hold request
URLs with SAS signatures, so errors are built from the error code and status only, and the
SDK's own loggers are limited to warnings.
"""

from __future__ import annotations

import base64
import binascii
import copy
import datetime as _dt
import email.utils
import enum
import hashlib
import hmac
import logging
import os
import random
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
import trio
import urllib3
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import (
    BlobPrefix,
    BlobProperties,
    BlobSasPermissions,
    BlobServiceClient,
    ContainerClient,
    ExponentialRetry,
    UserDelegationKey,
    generate_blob_sas,
)
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from objfs import rawhttp
from objfs.backends.base import Backend, ListPage, ObjectInfo, reply_version_error
from objfs.cache_engine import CacheEngine
from objfs.config import ACCOUNT_NAME_RE, AzureOptions, Source, redact_url
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

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Set (to anything) to skip DefaultAzureCredential: for tests and hosts where its probes of
#: the instance-metadata endpoint must not happen.
NO_IDENTITY_ENV = "OBJFS_AZURE_NO_IDENTITY"

# Attempts for the pre-mount check: fail a bad endpoint in seconds, not after a long backoff.
_CHECK_ATTEMPTS = 2
# Backoff before retry n (from 0): uniform in [0, min(cap, base * 2**n)] ("full jitter"),
# instead of ExponentialRetry's 15 s + 3**n, which would stall a read for minutes.
_BACKOFF_BASE_S = 0.25
_BACKOFF_CAP_S = 8.0
# One GET per read, whatever its size: objfs asks for ranges of at most --part-size (1 GiB
# at most), and the SDK would otherwise split anything over 32 MiB into sequential 4 MiB GETs.
_MAX_GET_BYTES = 1 << 30
# The body is read from the socket in one piece per GET up to this size, straight into the
# bytes object that is returned (smaller pieces are joined by the SDK: one more copy).
_READ_BLOCK_BYTES = 64 << 20
_DEFAULT_SUFFIX = "core.windows.net"
# REST version of the data path's own GETs (Azure and Azurite accept it).
_API_VERSION = "2021-08-06"
_TOKEN_SCOPE = "https://storage.azure.com/.default"
# Retried on the data path: throttling and server errors (ServerBusy is a 503).
_RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
_RETRY_CODES = {"ServerBusy", "OperationTimedOut", "InternalError"}

# Service error codes (https://learn.microsoft.com/rest/api/storageservices/blob-service-error-codes).
_AUTHENTICATION_CODES = {"AuthenticationFailed", "InvalidAuthenticationInfo"}
# Credential sources a changed file can replace (the kinds resolve_credentials names).
_FILE_KINDS = {
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_KEY",
    "--sas-token-file",
    "AZURE_STORAGE_SAS_TOKEN",
}
# Refusals that fresher credentials may cure: re-read the credential files and try once more.
_AUTH_RETRY_STATUSES = {401, 403}
_ANONYMOUS_REFUSED_CODES = {
    "NoAuthenticationInformation",
    "PublicAccessNotPermitted",
    "ResourceNotFound",
    "AuthorizationFailure",
}
# --cache-proxy: blob SAS remembered (a model's blobs many times over); emptied when full.
_SAS_CACHE_BLOBS = 4096
# A SAS minted for the engine starts this long before now: a store whose clock is behind ours
# still accepts it.
_SAS_CLOCK_SKEW_S = 300
# A user delegation key lives at most 7 days (the service's limit), at least a day here (one
# key serves every blob's SAS); see _Signer._delegation_key for when it is replaced.
_DELEGATION_KEY_MAX_S = 7 * 86400
_DELEGATION_KEY_MIN_S = 86400
# After a refused user delegation key: data GETs go to the store directly, asked again later.
_DELEGATION_RETRY_S = 300


# -- credentials -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """How to reach and sign for one storage account. ``credential`` is what the SDK takes
    (None: anonymous); ``kind`` names its source for logs and never holds a secret."""

    account_url: str
    account_name: str | None
    credential: Any
    kind: str


@dataclass(frozen=True)
class _ConnectionString:
    account_name: str | None
    account_key: str | None
    sas_token: str | None
    account_url: str | None


def _parse_connection_string(text: str) -> _ConnectionString:
    """Parse ``Key=Value;...`` as the portal shows it. Errors never echo the text."""
    fields: dict[str, str] = {}
    for part in text.strip().split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise UsageError(
                "AZURE_STORAGE_CONNECTION_STRING is malformed: expected Key=Value pairs "
                "separated by ';' (copy it from the storage account's Access keys page)"
            )
        fields[name.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        raise UsageError(
            "AZURE_STORAGE_CONNECTION_STRING: UseDevelopmentStorage is not supported: give "
            "AccountName, AccountKey and BlobEndpoint instead"
        )
    account = fields.get("accountname") or None
    url = fields.get("blobendpoint") or None
    if url is not None:
        url = _check_account_url(url, "the connection string's BlobEndpoint")
    elif account is not None:
        protocol = fields.get("defaultendpointsprotocol", "https").lower()
        suffix = fields.get("endpointsuffix") or _DEFAULT_SUFFIX
        url = f"{protocol}://{account}.blob.{suffix}"
    key = fields.get("accountkey") or None
    sas = fields.get("sharedaccesssignature") or None
    if key is None and sas is None:
        raise UsageError(
            "AZURE_STORAGE_CONNECTION_STRING holds neither AccountKey nor "
            "SharedAccessSignature: copy the full connection string"
        )
    if key is not None and account is None:
        raise UsageError("AZURE_STORAGE_CONNECTION_STRING has an AccountKey but no AccountName")
    return _ConnectionString(account, key, sas.lstrip("?") if sas else None, url)


def _check_account_url(url: str, what: str) -> str:
    """Validate an endpoint URL; errors never echo it (it could carry a SAS)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{what} is not a URL: give it as https://HOST[:PORT][/ACCOUNT]")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise UsageError(
            f"{what} must not contain credentials or a query string: give a SAS token with "
            "AZURE_STORAGE_SAS_TOKEN or --sas-token-file"
        )
    return url.strip().rstrip("/")


def _account_from_url(url: str) -> str | None:
    """The account an endpoint URL names: ``ACCOUNT.blob.<suffix>``, else (Azurite, IP-style
    endpoints) the first path segment."""
    parts = urllib.parse.urlsplit(url)
    labels = (parts.hostname or "").split(".")
    if len(labels) >= 3 and "blob" in labels[1:]:
        return labels[0]
    first = parts.path.strip("/").split("/")[0]
    return first or None


def _read_sas_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not text"
        raise UsageError(f"--sas-token-file: cannot read {path!r} ({reason})") from None
    return token


def _check_sas(token: str, where: str) -> str:
    token = token.strip().lstrip("?")
    if "sig=" not in token:
        raise UsageError(
            f"{where} does not hold a SAS token (expected the query string sv=...&sig=...)"
        )
    return token


def _check_key(key: str) -> str:
    try:
        base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(
            "AZURE_STORAGE_KEY is not an account key (base64): copy key1 or key2 from the "
            "storage account's Access keys page"
        ) from None
    return key


def resolve_credentials(
    source: Source, options: AzureOptions, env: Mapping[str, str] | None = None
) -> Credentials:
    """Decide endpoint and credential from SOURCE, the options and ``env`` (default
    ``os.environ``), in the documented precedence. Raises UsageError for contradictory or
    malformed settings; never contacts anything and never constructs DefaultAzureCredential
    unless every earlier source is absent."""
    env = os.environ if env is None else env
    conn: _ConnectionString | None = None
    conn_text = env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    if conn_text and not options.no_sign_request:
        conn = _parse_connection_string(conn_text)

    option_account = options.account_name
    if option_account is not None and not ACCOUNT_NAME_RE.match(option_account):
        raise UsageError(
            f"--account-name: {option_account!r} is not a storage account name: use 3-24 "
            "lowercase letters and digits"
        )
    if source.account and option_account and source.account != option_account:
        raise UsageError(
            f"SOURCE names account {source.account!r} but --account-name says "
            f"{option_account!r}: give one of them"
        )
    env_account = env.get("AZURE_STORAGE_ACCOUNT", "").strip() or None
    account = source.account or option_account or env_account or (conn and conn.account_name)

    if options.account_url is not None:
        account_url = _check_account_url(options.account_url, "--account-url")
    elif source.account_url is not None:
        account_url = source.account_url
    elif conn is not None and conn.account_url is not None:
        account_url = conn.account_url
    elif account:
        account_url = f"https://{account}.blob.{_DEFAULT_SUFFIX}"
    else:
        raise UsageError(
            f"{source.url()} needs a storage account: pass --account-name, set "
            "AZURE_STORAGE_ACCOUNT, or write SOURCE as azure://ACCOUNT/CONTAINER/PREFIX"
        )
    if not account:
        account = _account_from_url(account_url)
    if (
        conn is not None
        and conn.account_name
        and source.account
        and conn.account_name != source.account
    ):
        raise UsageError(
            f"AZURE_STORAGE_CONNECTION_STRING is for account {conn.account_name!r} but SOURCE "
            f"names {source.account!r}"
        )

    def found(credential: Any, kind: str) -> Credentials:
        return Credentials(account_url, account, credential, kind)

    if options.no_sign_request:
        return found(None, "anonymous (--no-sign-request)")
    ignored_sas_file = options.sas_token_file is not None
    if conn is not None:
        if conn.account_key is not None:
            key = _check_key(conn.account_key)
            cred: Any = AzureNamedKeyCredential(conn.account_name or "", key)
        else:
            cred = AzureSasCredential(_check_sas(conn.sas_token or "", "the connection string"))
        kind = "AZURE_STORAGE_CONNECTION_STRING"
    elif env.get("AZURE_STORAGE_KEY", "").strip():
        if not account:
            raise UsageError(
                "AZURE_STORAGE_KEY needs the account name: pass --account-name or set "
                "AZURE_STORAGE_ACCOUNT"
            )
        cred = AzureNamedKeyCredential(account, _check_key(env["AZURE_STORAGE_KEY"].strip()))
        kind = "AZURE_STORAGE_KEY"
    elif options.sas_token_file is not None:
        token = _read_sas_file(options.sas_token_file)
        return found(AzureSasCredential(_check_sas(token, "--sas-token-file")), "--sas-token-file")
    elif env.get("AZURE_STORAGE_SAS_TOKEN", "").strip():
        token = _check_sas(env["AZURE_STORAGE_SAS_TOKEN"], "AZURE_STORAGE_SAS_TOKEN")
        return found(AzureSasCredential(token), "AZURE_STORAGE_SAS_TOKEN")
    else:
        identity = _default_azure_credential(env)
        if identity is not None:
            return found(identity, "DefaultAzureCredential")
        return found(None, "anonymous (no credentials found)")
    if ignored_sas_file:
        log.warning("--sas-token-file is ignored: %s takes precedence", kind)
    return found(cred, kind)


def _default_azure_credential(env: Mapping[str, str]) -> Any:
    """DefaultAzureCredential if azure-identity is installed and not switched off, else None."""
    if env.get(NO_IDENTITY_ENV):
        log.debug("%s is set: not trying DefaultAzureCredential", NO_IDENTITY_ENV)
        return None
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        log.debug("azure-identity is not installed: no managed identity or az CLI login")
        return None
    return DefaultAzureCredential()


# -- SDK configuration -------------------------------------------------------------------------


def _backoff_s(retry: int) -> float:
    """Sleep before retry ``retry`` (from 0): full jitter, as in _JitteredRetry."""
    return random.uniform(0.0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retry))


def _content_length(resp: urllib3.BaseHTTPResponse) -> int:
    try:
        return int(resp.headers.get("Content-Length", "-1"))
    except ValueError:
        return -1


class _Signer:
    """Authorizes the data path's raw GETs with the mount's credential: a SAS token in the
    query, a Shared Key signature, a bearer token (refreshed before it expires) or nothing.

    The SDK's pipeline costs about a millisecond of CPU per request, which showed as a
    fifth of single-stream throughput against a local server; a GET signed here and sent on
    the same pooled session costs a fraction of that. Listings and HEADs still go through
    the SDK."""

    _STANDARD = (
        "content-encoding",
        "content-language",
        "content-length",
        "content-md5",
        "content-type",
        "date",
        "if-modified-since",
        "if-match",
        "if-none-match",
        "if-unmodified-since",
        "range",
    )

    def __init__(self, creds: Credentials) -> None:
        self._credential = creds.credential
        self._account = creds.account_name or ""
        self._lock = threading.Lock()
        self._token: Any = None
        # --cache-proxy (engine_query): (container, blob) -> (SAS, when to sign it again, on
        # the monotonic clock); a new signer (rotated credentials) starts with none.
        self._sas: dict[tuple[str, str], tuple[str, float]] = {}
        # The token credential's user delegation key and its expiry (wall clock, UTC).
        self._delegation: tuple[UserDelegationKey, _dt.datetime] | None = None
        self._delegation_lock = threading.Lock()
        self._delegation_refused_until = 0.0  # monotonic
        self._delegation_refusal_logged = False

    def sign(
        self, method: str, origin: str, path: str, headers: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        """The URL to send and the headers with x-ms-version, x-ms-date and authorization."""
        headers = {
            **headers,
            "x-ms-version": _API_VERSION,
            "x-ms-date": email.utils.formatdate(usegmt=True),
        }
        cred = self._credential
        url = origin + path
        if isinstance(cred, AzureSasCredential):
            return f"{url}?{cred.signature.lstrip('?')}", headers
        if isinstance(cred, AzureNamedKeyCredential):
            name, key = cred.named_key
            headers["Authorization"] = _shared_key(name, key, method, path, headers)
            return url, headers
        if cred is not None and hasattr(cred, "get_token"):
            headers["Authorization"] = f"Bearer {self._bearer()}"
        return url, headers

    def _bearer(self) -> str:
        with self._lock:
            token = self._token
            if token is None or token.expires_on - time.time() < 300:
                try:
                    token = self._token = self._credential.get_token(_TOKEN_SCOPE)
                except Exception:
                    # A hiccup of the identity endpoint: a token that is still valid serves on.
                    if token is None or token.expires_on - time.time() < 30:
                        raise
                    log.warning("refreshing the Azure token failed; using the current one")
            return str(token.token)

    def engine_query(
        self, container: str, blob: str, lifetime_s: int, service: BlobServiceClient
    ) -> tuple[str | None, bool]:
        """(Worker thread) The query a data GET of ``blob`` through the cache engine
        (``--cache-proxy``) carries, and whether a SAS was signed for it now; ``""`` for
        anonymous requests, None when the mount's credential cannot make one (a token
        credential refused a user delegation key): that GET goes to the store directly.

        A SAS token credential is sent as it is (its lifetime and scope are the user's). With
        the account key or a token credential, a read-only SAS for this one blob is signed
        here (by the key, or by a user delegation key the token credential obtained), valid
        ``lifetime_s`` from now (and from a few minutes back, for clock skew), remembered and
        signed again once half of that has passed, so a GET never carries one about to
        expire. A SAS is a bearer credential: it is never logged."""
        cred = self._credential
        if cred is None:
            return "", False
        if isinstance(cred, AzureSasCredential):
            return str(cred.signature).lstrip("?"), False  # read now: it rotates in place
        now = time.monotonic()
        known = self._sas.get((container, blob))
        if known is not None and now < known[1]:
            return known[0], False
        wall = _dt.datetime.now(_dt.UTC)
        start = wall - _dt.timedelta(seconds=_SAS_CLOCK_SKEW_S)
        expiry = wall + _dt.timedelta(seconds=lifetime_s)
        permission = BlobSasPermissions(read=True)
        if isinstance(cred, AzureNamedKeyCredential):
            name, key = cred.named_key
            sas = generate_blob_sas(
                name,
                container,
                blob,
                account_key=key,
                permission=permission,
                start=start,
                expiry=expiry,
            )
        elif hasattr(cred, "get_token"):
            delegation = self._delegation_key(service, lifetime_s)
            if delegation is None:
                return None, False
            key_, key_expiry = delegation
            expiry = min(expiry, key_expiry)
            sas = generate_blob_sas(
                self._account,
                container,
                blob,
                user_delegation_key=key_,
                permission=permission,
                start=start,
                expiry=expiry,
            )
        else:
            return None, False
        if len(self._sas) >= _SAS_CACHE_BLOBS:
            self._sas.clear()
        self._sas[(container, blob)] = (sas, now + (expiry - wall).total_seconds() / 2)
        return sas, True

    def _delegation_key(
        self, service: BlobServiceClient, lifetime_s: int
    ) -> tuple[UserDelegationKey, _dt.datetime] | None:
        """The token credential's user delegation key and its expiry, asked for again once
        less than a SAS's lifetime (at most 12 hours) of it remains; None while the service
        refuses one (one warning, with the error code only; asked again every few minutes)."""
        with self._delegation_lock:
            wall = _dt.datetime.now(_dt.UTC)
            known = self._delegation
            if known is not None:
                remaining = (known[1] - wall).total_seconds()
                if remaining > min(lifetime_s, _DELEGATION_KEY_MIN_S / 2):
                    return known
            if time.monotonic() < self._delegation_refused_until:
                return known if known is not None and known[1] > wall else None
            validity = min(_DELEGATION_KEY_MAX_S, max(_DELEGATION_KEY_MIN_S, 2 * lifetime_s))
            start = wall - _dt.timedelta(seconds=_SAS_CLOCK_SKEW_S)
            expiry = wall + _dt.timedelta(seconds=validity)
            try:
                key = service.get_user_delegation_key(start, expiry)
            except Exception as exc:  # the SDK's text may hold a URL: code and type only
                self._delegation_refused_until = time.monotonic() + _DELEGATION_RETRY_S
                if not self._delegation_refusal_logged:
                    self._delegation_refusal_logged = True
                    code = _error_code(exc) if isinstance(exc, HttpResponseError) else ""
                    log.warning(
                        "no user delegation key for --cache-proxy (%s): data GETs go to the "
                        "store directly; grant the Storage Blob Delegator role (or the "
                        "generateUserDelegationKey action) to use the cache engine",
                        code or type(exc).__name__,
                    )
                return known if known is not None and known[1] > wall else None
            self._delegation = (key, expiry)
            return self._delegation


def _shared_key(account: str, key: str, method: str, path: str, headers: dict[str, str]) -> str:
    """The Shared Key ``Authorization`` value for a request without a body or query."""
    lower = {k.lower(): v.strip() for k, v in headers.items()}
    lines = [method, *(lower.get(name, "") for name in _Signer._STANDARD)]
    canonical_headers = "".join(
        f"{name}:{lower[name]}\n" for name in sorted(lower) if name.startswith("x-ms-")
    )
    to_sign = "\n".join(lines) + "\n" + canonical_headers + f"/{account}{path}"
    digest = hmac.new(base64.b64decode(key), to_sign.encode("utf-8"), hashlib.sha256).digest()
    return f"SharedKey {account}:{base64.b64encode(digest).decode()}"


class _JitteredRetry(ExponentialRetry):
    """The SDK's storage retry policy with full-jitter backoff (see _BACKOFF_BASE_S)."""

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        bound = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** int(settings["count"]))
        return random.uniform(0.0, bound)  # jitter, not cryptography


def _ca_bundle() -> str:
    """The CA certificates file that every request to the store trusts: the SDK's (through
    requests, given it as ``connection_verify``: the SDK passes its own ``verify`` with each
    request, which would win over the session's) and the data GETs' (rawhttp).
    $REQUESTS_CA_BUNDLE, else $CURL_CA_BUNDLE (what requests reads from the environment),
    else requests' own bundle (certifi's)."""
    return (
        os.environ.get("REQUESTS_CA_BUNDLE")
        or os.environ.get("CURL_CA_BUNDLE")
        or requests.utils.DEFAULT_CA_BUNDLE_PATH
    )


def _session(account_url: str, pool_size: int, ca_file: str) -> requests.Session:
    """A requests session for one endpoint: a pool of ``pool_size`` connections, no retries of
    its own (the SDK's policy is the one retry layer), the environment's proxy settings
    resolved once here instead of on every request (requests re-reads os.environ per request
    when ``trust_env`` is on: a measurable share of a request's CPU time) and ``ca_file``
    (see :func:`_ca_bundle`) as its CAs."""
    session = requests.Session()
    session.trust_env = False
    session.proxies = requests.utils.get_environ_proxies(account_url)  # honours NO_PROXY
    session.verify = ca_file  # see _ca_bundle
    adapter = HTTPAdapter(
        pool_connections=1,  # one host
        pool_maxsize=pool_size,
        max_retries=Retry(total=False, redirect=False, raise_on_status=False),
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


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


def _error_code(exc: HttpResponseError) -> str:
    code = getattr(exc, "error_code", None)
    if isinstance(code, enum.Enum):
        code = code.value
    return str(code or "")


def _next_page(pages: Iterator[Iterator[Any]]) -> list[Any] | None:
    """Fetch the next page of a listing (blocking), or None when the listing is complete."""
    try:
        return list(next(pages))
    except StopIteration:
        return None


# -- the backend -------------------------------------------------------------------------------


@dataclass
class _Auth:
    """The signing state of one account's backends: replaced field by field (in place) when
    credentials rotate, so every container's backend made by for_container sees the new
    one."""

    credential: Any
    signer: _Signer
    service: BlobServiceClient


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
        self.account_url = creds.account_url
        self.account_name = creds.account_name
        self.credential_kind = creds.kind
        self._anonymous = creds.credential is None
        self._implicit_anonymous = self._anonymous and not options.no_sign_request
        self._identity = creds.kind == "DefaultAzureCredential"
        self.description = f"container {self.container!r} at {redact_url(self.account_url)}"
        # The SDK logs every request at INFO (headers included); objfs logs its own events.
        logging.getLogger("azure").setLevel(logging.WARNING)
        log.info("Azure credentials: %s", creds.kind)
        # +2: listings and HEADs run beside a full set of ranged GETs.
        self._ca_file = _ca_bundle()  # the session's, the SDK client's and the data path's
        self._session = _session(self.account_url, options.max_connections + 2, self._ca_file)
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
    def _signer(self) -> _Signer:
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
            if not isinstance(cause, HttpResponseError) or self._anonymous:
                raise
            code = _error_code(cause)
            if code in _AUTHENTICATION_CODES or cause.status_code == 401:
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
        service = BlobServiceClient(
            self.account_url,
            credential=creds.credential,
            session=self._session,
            connection_verify=self._ca_file,  # see _ca_bundle
            connection_timeout=self.options.connect_timeout_s,
            read_timeout=self.options.read_timeout_s,
            retry_policy=_JitteredRetry(retry_total=max(self.options.max_attempts - 1, 0)),
            max_single_get_size=_MAX_GET_BYTES,
            max_chunk_get_size=_MAX_GET_BYTES,
            connection_data_block_size=_READ_BLOCK_BYTES,
            user_agent="objfs",
        )
        auth: _Auth | None = getattr(self, "_auth", None)
        if auth is None:
            self._auth = _Auth(creds.credential, _Signer(creds), service)
        else:  # in place: the containers' backends share it
            auth.credential, auth.signer, auth.service = creds.credential, _Signer(creds), service

    # -- rotated credentials -----------------------------------------------------------------

    def _prepare_credentials(self, environ: Mapping[str, str]) -> Callable[[], None]:
        """(CredentialWatch) The credential the files now give, to be put in use by the
        returned function; raises UsageError if they give none or another account's."""
        if self.credential_kind not in _FILE_KINDS:
            return lambda: None  # identity or anonymous: no file to take a credential from
        creds = resolve_credentials(self._source, self.options, environ)
        if creds.kind not in _FILE_KINDS:
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

    @staticmethod
    def _is_refusal(exc: Exception) -> bool:
        """An SDK error that fresher credentials may cure."""
        return (
            isinstance(exc, HttpResponseError) and int(exc.status_code or 0) in _AUTH_RETRY_STATUSES
        )

    # -- error mapping ---------------------------------------------------------------------

    def _map_error(self, exc: Exception, what: str) -> ObjfsError:
        """Turn an SDK exception into an objfs error built from codes only (never its text)."""
        if isinstance(exc, ObjfsError):
            return exc
        where = redact_url(self.account_url)
        if isinstance(exc, ClientAuthenticationError) and exc.response is None:
            # Raised by a token credential (DefaultAzureCredential), not by the service.
            return NoCredentialsError(
                "no Azure credentials found (DefaultAzureCredential: no managed identity, "
                "workload identity or az login): set AZURE_STORAGE_CONNECTION_STRING, "
                "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or use --no-sign-request for a "
                "public container"
            )
        if isinstance(exc, ServiceRequestError):
            return EndpointUnreachableError(
                f"cannot reach {where} ({type(exc).__name__}): check the account name "
                "(--account-name, AZURE_STORAGE_ACCOUNT), --account-url and the network"
            )
        if isinstance(exc, ServiceResponseError):
            return TransientStoreError(f"{what}: connection failed ({type(exc).__name__})")
        if isinstance(exc, HttpResponseError):
            return self._map_status(_error_code(exc), int(exc.status_code or 0), what, where)
        if isinstance(exc, AzureError):
            return TransientStoreError(f"{what}: {type(exc).__name__}")
        return TransientStoreError(f"{what}: unexpected {type(exc).__name__}")

    def _map_status(self, code: str, status: int, what: str, where: str) -> ObjfsError:
        label = code or str(status)
        if code == "ContainerNotFound":
            return BucketNotFoundError(
                f"container {self.container!r} does not exist at {where}: check the container "
                "name, the account (--account-name) and --account-url"
            )
        if code == "ConditionNotMet" or status == 412:
            return StaleObjectError(f"{what}: the blob changed while it was open")
        if code == "BlobNotFound":
            return ObjectNotFoundError(f"{what}: not found")
        if self._anonymous and (code in _ANONYMOUS_REFUSED_CODES or status in (401, 403)):
            if self._implicit_anonymous:
                return NoCredentialsError(
                    f"no Azure credentials found and {where} refused anonymous access ({label})"
                    ": set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or "
                    "AZURE_STORAGE_SAS_TOKEN (or install objfs[azure] for managed identity)"
                )
            return AccessDeniedError(
                f"anonymous access refused: {what} ({label}): the container is not public; "
                "drop --no-sign-request and give credentials"
            )
        if code in _AUTHENTICATION_CODES or status == 401:
            return AccessDeniedError(
                f"{where} rejected the credentials ({label}): check the account key, SAS token "
                "or connection string (and that the SAS has not expired)"
            )
        if code == "AuthorizationFailure":
            return AccessDeniedError(
                f"{where} refused the request ({label}): check the credentials (key, SAS, "
                "connection string) and that they may list and read the container"
            )
        if code.startswith("Authorization") or status == 403:
            return AccessDeniedError(
                f"access denied: {what} ({label}): grant read and list on the container (SAS "
                "permissions r and l, or the Storage Blob Data Reader role)"
            )
        if code == "ResourceNotFound":
            return EndpointUnreachableError(
                f"storage account {self.account_name!r} not found at {where}: check "
                "--account-name and --account-url"
            )
        if status == 404:
            return ObjectNotFoundError(f"{what}: not found")
        return TransientStoreError(f"{what}: store error {label}")

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        def call() -> T:
            return call_with_reload(self._watch, fn, self._is_refusal)

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
        tries = Tries(self.options.max_attempts, self._watch, _backoff_s)
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
                resp = self._send(url, headers, timeout)
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
                        for view in views:
                            piece = resp.read(len(view), decode_content=False)
                            view[: len(piece)] = piece
                            got += len(piece)
                            if len(piece) < len(view):
                                break
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
                    elif not (status in _AUTH_RETRY_STATUSES and tries.refused()):
                        raise self._map_status(code, status, what, redact_url(self.account_url))
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
        or no SAS can be made: see objfs.cache_engine and :meth:`_Signer.engine_query`).

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
            self.container, key, self.options.cache_proxy_url_lifetime_s, self._service
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
            "x-ms-version": _API_VERSION,
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
        if status in _AUTH_RETRY_STATUSES and tries.refused():
            return False
        raise self._map_status(code, status, what, redact_url(self.account_url))

    def _send(
        self, url: str, headers: dict[str, str], timeout: tuple[float, float]
    ) -> urllib3.BaseHTTPResponse:
        """GET ``url`` on the session's connection pool, its body not read yet.

        Straight through urllib3 (the pool requests itself uses): requests' per-request work
        (settings merge, hooks, cookies, response wrapping) costs as much CPU as the signing
        and parsing together. With a proxy from the environment, requests' adapter is used."""
        if self._session.proxies.get("http") or self._session.proxies.get("https"):
            r = self._session.get(url, headers=headers, stream=True, timeout=timeout)
            raw: urllib3.BaseHTTPResponse = r.raw
            return raw
        adapter = self._session.get_adapter(url)
        assert isinstance(adapter, HTTPAdapter)
        pool = adapter.poolmanager.connection_from_url(url)
        if url.startswith("https:"):
            # The CA settings requests would apply (the session's bundle, else certifi's).
            adapter.cert_verify(pool, url, self._session.verify, None)
        return pool.urlopen(
            "GET",
            url[len(self._origin) :],  # origin-form request target: path and query
            headers=headers,
            retries=False,
            redirect=False,
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
            preload_content=False,
            decode_content=False,
            assert_same_host=False,
        )

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
