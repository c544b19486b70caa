"""The URLs of the S3 backend's data GETs, resolved and signed outside botocore's requests.

Contract: :meth:`ObjectUrls.signed_get` gives a data GET the object's URL as botocore resolves
it (endpoint, addressing style; resolved once per key and client) and SigV4 headers signed
now, with the session's current credentials (rotated ones included): no credential ever sits
in that URL. :meth:`ObjectUrls.presigned` gives a GET through the cache engine a presigned URL
(query authentication: the engine may re-range the request), signed again once half of its
lifetime has passed. One ObjectUrls serves a session's backends (for_bucket's too), from any
thread (single dict operations). A presigned URL is a bearer credential: it is never logged.

The headers are signed here rather than by botocore's ``S3SigV4Auth``, which cost some 110 us
per GET (a fifth of a cold load's per-GET Python): the signature is the one botocore computes
for the same request and second (``tests/test_s3_signing.py`` compares the two), for a GET with
no body, whose payload hash is that of the empty string. The signing key, four HMACs of the
secret, is derived once per day, region and secret, and kept in memory beside the credentials
it comes from, memoized under a hash of the secret (never logged).
"""

from __future__ import annotations

import hashlib
import hmac
import time
import urllib.parse
from typing import TYPE_CHECKING, NamedTuple

import botocore.exceptions
import botocore.session
from botocore.auth import SIGNED_HEADERS_BLACKLIST

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

# Data GETs take their URL from a presigned one (then signed in headers, see signed_get).
_URL_EXPIRY_S = 900
# Object URLs remembered (a model's files many times over); the table is emptied when full.
_URL_CACHE_KEYS = 4096
# Signing keys remembered ((SHA-256 of the secret, day, region) -> key); emptied when full.
_SIGNING_KEYS = 16
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNSIGNED_HEADERS = frozenset(SIGNED_HEADERS_BLACKLIST)


class ObjectUrl(NamedTuple):
    """An object's URL (no query) and what its signature needs of it: the Host header's
    value as botocore derives it, and the path as sent (S3 signs it unnormalized)."""

    url: str
    host: str
    path: str

    @classmethod
    def of(cls, url: str) -> ObjectUrl:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"  # an IPv6 address
        if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
            host = f"{host}:{parts.port}"
        return cls(url, host, parts.path or "/")


def sign_get(
    target: ObjectUrl,
    headers: dict[str, str],
    access_key: str,
    secret_key: str,
    token: str | None,
    region: str,
    amz_date: str,
    keys: dict[tuple[str, str, str], bytes] | None = None,
) -> dict[str, str]:
    """``headers`` plus SigV4 headers (``X-Amz-Date``, ``X-Amz-Security-Token`` with a session
    token, ``X-Amz-Content-SHA256``, ``Authorization``) for a GET of ``target`` at
    ``amz_date`` (``YYYYMMDDTHHMMSSZ``), as botocore's S3SigV4Auth signs it; ``keys``
    memoizes the signing keys. ``headers`` are a data GET's own (Range, If-Match,
    User-Agent): none of the names this adds, no ``Date`` or ``Authorization``, and no name
    twice in different cases (botocore would rewrite those; this signs them as given)."""
    out = dict(headers)
    out["X-Amz-Date"] = amz_date
    if token:
        out["X-Amz-Security-Token"] = token
    out["X-Amz-Content-SHA256"] = _EMPTY_SHA256
    signed = {"host": target.host}
    for name, value in out.items():
        lname = name.lower()
        if lname not in _UNSIGNED_HEADERS:
            signed[lname] = " ".join(value.split())
    names = sorted(signed)
    signed_names = ";".join(names)
    canonical = "\n".join(
        (
            "GET",
            target.path,
            "",
            "".join(f"{n}:{signed[n]}\n" for n in names),
            signed_names,
            _EMPTY_SHA256,
        )
    )
    day = amz_date[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ("AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest())
    )
    cached = (hashlib.sha256(secret_key.encode()).hexdigest(), day, region)
    key = keys.get(cached) if keys is not None else None
    if key is None:
        key = f"AWS4{secret_key}".encode()
        for part in (day, region, "s3", "aws4_request"):
            key = hmac.digest(key, part.encode(), "sha256")
        if keys is not None:
            if len(keys) >= _SIGNING_KEYS:
                keys.clear()
            keys[cached] = key
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
        f"SignedHeaders={signed_names}, Signature={signature}"
    )
    return out


class ObjectUrls:
    """The object URLs of one botocore session's data GETs; ``no_sign_request``: anonymous
    requests, sent unsigned."""

    def __init__(self, session: botocore.session.Session, no_sign_request: bool) -> None:
        self._session = session
        self._no_sign_request = no_sign_request
        # (bucket, key) -> (the client that resolved it, the object's URL without query).
        self._urls: dict[tuple[str, str], tuple[S3Client, ObjectUrl]] = {}
        self._signing_keys: dict[tuple[str, str, str], bytes] = {}
        # --cache-proxy: (bucket, key) -> (client, presigned URL, when to renew).
        self._presigned: dict[tuple[str, str], tuple[S3Client, str, float]] = {}

    def signed_get(
        self, client: S3Client, bucket: str, key: str, headers: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        """The object's URL as ``client`` resolves it (endpoint, addressing style) and
        ``headers`` plus a SigV4 Authorization header for the client's region, signed now:
        refreshed credentials apply, and no credential ever sits in a URL (servers and
        proxies log URLs)."""
        known = self._urls.get((bucket, key))
        if known is not None and known[0] is client:
            target = known[1]
        else:
            # botocore's resolution costs a quarter of a millisecond: once per key and client.
            presigned = client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=_URL_EXPIRY_S
            )
            # The query holds only the presigning parameters.
            target = ObjectUrl.of(presigned.split("?", 1)[0])
            if len(self._urls) >= _URL_CACHE_KEYS:
                self._urls.clear()
            self._urls[(bucket, key)] = (client, target)
        if self._no_sign_request:
            return target.url, headers
        credentials = self._session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        frozen = credentials.get_frozen_credentials()
        if frozen.access_key is None or frozen.secret_key is None:
            raise botocore.exceptions.NoCredentialsError()
        signed = sign_get(
            target,
            headers,
            frozen.access_key,
            frozen.secret_key,
            frozen.token,
            client.meta.region_name,
            time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
            self._signing_keys,
        )
        return target.url, signed

    def presigned(
        self, client: S3Client, bucket: str, key: str, lifetime_s: int
    ) -> tuple[str, bool]:
        """A presigned GET URL for ``key`` (query authentication: the engine may re-range
        the request), valid ``lifetime_s``; signed again once half of that has passed, so a
        GET never carries a URL about to expire. With --no-sign-request, the plain URL. Also
        whether it was signed now."""
        now = time.monotonic()
        known = self._presigned.get((bucket, key))
        if known is not None and known[0] is client and now < known[2]:
            return known[1], False
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=lifetime_s
        )
        if self._no_sign_request:
            url = url.split("?", 1)[0]
        if len(self._presigned) >= _URL_CACHE_KEYS:
            self._presigned.clear()
        self._presigned[(bucket, key)] = (client, url, now + lifetime_s / 2)
        return url, True
