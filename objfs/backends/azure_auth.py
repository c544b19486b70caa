"""Azure credentials and request signing for one storage account.

Resolving (:func:`resolve_credentials`), first match wins: ``AZURE_STORAGE_CONNECTION_STRING``;
``AZURE_STORAGE_KEY`` (the account key); a SAS token (``--sas-token-file``, else
``AZURE_STORAGE_SAS_TOKEN``); ``DefaultAzureCredential`` when azure-identity is installed
(managed identity, workload identity, az CLI; skipped when ``OBJFS_AZURE_NO_IDENTITY`` is set);
anonymous. ``--no-sign-request`` goes straight to anonymous. It never contacts anything, and
its errors (UsageError) never echo a secret.

Signing (:class:`Signer`): the data path's raw GETs are authorized here, not by the SDK's
pipeline (a SAS in the query, Shared Key, a bearer token, or nothing), and so is the SAS a GET
through the cache engine carries (:meth:`Signer.engine_query`). A SAS is a bearer credential:
it is never logged. :class:`AccountAuth` is one account's signing state, shared by its
containers' backends and replaced as a whole (in place) when credentials rotate.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import email.utils
import hashlib
import hmac
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import (
    BlobSasPermissions,
    BlobServiceClient,
    UserDelegationKey,
    generate_blob_sas,
)

from objfs.backends.azure_errors import error_code
from objfs.config import ACCOUNT_NAME_RE, AzureOptions, Source
from objfs.errors import UsageError

log = logging.getLogger("objfs.backends.azure")  # the backend's one name

#: Set (to anything) to skip DefaultAzureCredential: for tests and hosts where its probes of
#: the instance-metadata endpoint must not happen.
NO_IDENTITY_ENV = "OBJFS_AZURE_NO_IDENTITY"

_DEFAULT_SUFFIX = "core.windows.net"
# REST version of the data path's own GETs (Azure and Azurite accept it).
API_VERSION = "2021-08-06"
_TOKEN_SCOPE = "https://storage.azure.com/.default"
# Credential sources a changed file can replace (the kinds resolve_credentials names).
FILE_KINDS = {
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_KEY",
    "--sas-token-file",
    "AZURE_STORAGE_SAS_TOKEN",
}
# --cache-proxy: blob SAS remembered (a model's blobs many times over); emptied when full.
_SAS_CACHE_BLOBS = 4096
# A SAS minted for the engine starts this long before now: a store whose clock is behind ours
# still accepts it.
_SAS_CLOCK_SKEW_S = 300
# A user delegation key lives at most 7 days (the service's limit), at least a day here (one
# key serves every blob's SAS); see Signer._delegation_key for when it is replaced.
_DELEGATION_KEY_MAX_S = 7 * 86400
_DELEGATION_KEY_MIN_S = 86400
# After a refused user delegation key: data GETs go to the store directly, asked again later.
_DELEGATION_RETRY_S = 300


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


class Signer:
    """Authorizes the data path's raw GETs with the mount's credential: a SAS token in the
    query, a Shared Key signature, a bearer token (refreshed before it expires) or nothing.
    A GET signed here costs a fraction of the CPU of the SDK's pipeline; listings and HEADs
    still go through the SDK."""

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
            "x-ms-version": API_VERSION,
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
        self,
        container: str,
        blob: str,
        lifetime_s: int,
        service: BlobServiceClient,
        *,
        send_sas_token: bool = False,
    ) -> tuple[str | None, bool]:
        """(Worker thread) The query a data GET of ``blob`` through the cache engine
        (``--cache-proxy``) carries, and whether a SAS was signed for it now; ``""`` for
        anonymous requests, None when the mount's credential cannot make one (a token
        credential refused a user delegation key, or a SAS token credential without
        ``send_sas_token``): that GET goes to the store directly.

        A SAS token credential cannot sign a narrower SAS: it is sent as it is (its lifetime
        and scope are the user's) only if ``send_sas_token`` (``--cache-proxy-send-sas-token``):
        the mount's credential never leaves objfs unasked. With the account key or a token
        credential, a read-only SAS for this one blob is signed here (by the key, or by a user
        delegation key the token credential obtained), valid ``lifetime_s`` from now (and from
        a few minutes back, for clock skew), remembered and signed again once half of that has
        passed, so a GET never carries one about to expire. A SAS is a bearer credential: it
        is never logged."""
        cred = self._credential
        if cred is None:
            return "", False
        if isinstance(cred, AzureSasCredential):
            if not send_sas_token:
                return None, False
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
                    code = error_code(exc) if isinstance(exc, HttpResponseError) else ""
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
    lines = [method, *(lower.get(name, "") for name in Signer._STANDARD)]
    canonical_headers = "".join(
        f"{name}:{lower[name]}\n" for name in sorted(lower) if name.startswith("x-ms-")
    )
    to_sign = "\n".join(lines) + "\n" + canonical_headers + f"/{account}{path}"
    digest = hmac.new(base64.b64decode(key), to_sign.encode("utf-8"), hashlib.sha256).digest()
    return f"SharedKey {account}:{base64.b64encode(digest).decode()}"


class AccountAuth:
    """The signing state of one account's backends: the credential, the data path's signer
    and the SDK client. The backends for_container made share one; :meth:`use` replaces all
    three together, in place, when credentials rotate, so every container's backend sees the
    new ones."""

    credential: Any
    signer: Signer
    service: BlobServiceClient

    def __init__(self, creds: Credentials, service: BlobServiceClient) -> None:
        self.use(creds, service)

    def use(self, creds: Credentials, service: BlobServiceClient) -> None:
        """Sign with ``creds`` (a new signer) and list with ``service`` from now on."""
        self.credential, self.signer, self.service = creds.credential, Signer(creds), service
