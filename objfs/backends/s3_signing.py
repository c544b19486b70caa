"""The URLs of the S3 backend's data GETs, resolved and signed outside botocore's requests.

Contract: :meth:`ObjectUrls.signed_get` gives a data GET the object's URL as botocore resolves
it (endpoint, addressing style; resolved once per key and client) and SigV4 headers signed
now, with the session's current credentials (rotated ones included): no credential ever sits
in that URL. :meth:`ObjectUrls.presigned` gives a GET through the cache engine a presigned URL
(query authentication: the engine may re-range the request), signed again once half of its
lifetime has passed. One ObjectUrls serves a session's backends (for_bucket's too), from any
thread (single dict operations). A presigned URL is a bearer credential: it is never logged.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import botocore.exceptions
import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

# Data GETs take their URL from a presigned one (then signed in headers, see signed_get).
_URL_EXPIRY_S = 900
# Object URLs remembered (a model's files many times over); the table is emptied when full.
_URL_CACHE_KEYS = 4096


class ObjectUrls:
    """The object URLs of one botocore session's data GETs; ``no_sign_request``: anonymous
    requests, sent unsigned."""

    def __init__(self, session: botocore.session.Session, no_sign_request: bool) -> None:
        self._session = session
        self._no_sign_request = no_sign_request
        # (bucket, key) -> (the client that resolved it, the object's URL without query).
        self._urls: dict[tuple[str, str], tuple[S3Client, str]] = {}
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
            url = known[1]
        else:
            # botocore's resolution costs a quarter of a millisecond: once per key and client.
            presigned = client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=_URL_EXPIRY_S
            )
            url = presigned.split("?", 1)[0]  # the query holds only the presigning parameters
            if len(self._urls) >= _URL_CACHE_KEYS:
                self._urls.clear()
            self._urls[(bucket, key)] = (client, url)
        if self._no_sign_request:
            return url, headers
        credentials = self._session.get_credentials()
        if credentials is None:
            raise botocore.exceptions.NoCredentialsError()
        request = AWSRequest(method="GET", url=url, headers=dict(headers))
        S3SigV4Auth(credentials.get_frozen_credentials(), "s3", client.meta.region_name).add_auth(
            request
        )
        return url, dict(request.headers.items())

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
