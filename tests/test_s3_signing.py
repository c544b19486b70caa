"""objfs.backends.s3_signing signs a data GET exactly as botocore's S3SigV4Auth does for the
same request and second (header for header), over the URL shapes a bucket's objects take;
the signing key is derived once per day, region and secret."""

from __future__ import annotations

import datetime
import hashlib
import hmac
from unittest import mock

import botocore.auth
import botocore.credentials
import pytest
from botocore.awsrequest import AWSRequest

from objfs.backends import s3_signing
from objfs.backends.s3_signing import ObjectUrl, sign_get

WHEN = datetime.datetime(2026, 12, 5, 23, 59, 58)

URLS = [
    "http://127.0.0.1:9000/bucket/m/model-00001-of-00002.safetensors",
    "http://127.0.0.1:80/bucket/m/config.json",  # the default port: no port in Host
    "https://bucket.s3.eu-west-1.amazonaws.com/m/a%20b%2Bc/%C3%A9t%C3%A9.bin",
    "https://s3.example.com:8443/bucket/deep/ish/path/with~tilde_and-dash.bin",
    "http://[::1]:9000/bucket/v6.bin",
    "http://MinIO.Local:9000/bucket/Upper/Case.bin",  # the host is signed in lower case
]


def botocore_headers(url: str, headers: dict[str, str], creds: tuple, region: str) -> dict:
    request = AWSRequest(method="GET", url=url, headers=dict(headers))
    frozen = botocore.credentials.ReadOnlyCredentials(*creds)
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=WHEN):
        botocore.auth.S3SigV4Auth(frozen, "s3", region).add_auth(request)
    return dict(request.headers.items())


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEBYaDH+session/token=="])
@pytest.mark.parametrize("if_match", [None, '"9b2cf535f27731c974343645a3985328-3"'])
def test_headers_are_signed_as_botocore_signs_them(
    url: str, token: str | None, if_match: str | None
) -> None:
    headers = {"Range": "bytes=8388608-16777215", "User-Agent": "objfs"}
    if if_match:
        headers["If-Match"] = if_match
    creds = ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", token)
    for region in ("us-east-1", "eu-west-1"):
        ours = sign_get(
            ObjectUrl.of(url), headers, *creds, region, WHEN.strftime("%Y%m%dT%H%M%SZ"), {}
        )
        assert ours == botocore_headers(url, headers, creds, region)
    assert "Authorization" not in headers  # the caller's dict is left as it was


def test_the_signing_key_is_derived_once_per_day_region_and_secret() -> None:
    keys: dict[tuple[str, str, str], bytes] = {}
    target = ObjectUrl.of(URLS[0])
    calls = 0
    real = hmac.digest

    def counting(key: bytes, msg: bytes, digest: str) -> bytes:
        nonlocal calls
        calls += 1
        return real(key, msg, digest)

    with mock.patch.object(s3_signing.hmac, "digest", counting):
        a = sign_get(target, {}, "AK", "secret-1", None, "us-east-1", "20261205T000000Z", keys)
        b = sign_get(target, {}, "AK", "secret-1", None, "us-east-1", "20261205T235959Z", keys)
        assert calls == 4  # one derivation (four HMACs) for both
        sign_get(target, {}, "AK", "secret-1", None, "us-east-1", "20261206T000000Z", keys)
        sign_get(target, {}, "AK", "secret-2", None, "us-east-1", "20261206T000000Z", keys)
        sign_get(target, {}, "AK", "secret-2", None, "eu-west-1", "20261206T000000Z", keys)
        assert calls == 16
    assert a["Authorization"] != b["Authorization"]  # the time is signed
    expected = hashlib.sha256(b"").hexdigest()
    assert a["X-Amz-Content-SHA256"] == expected
    for n in range(s3_signing._SIGNING_KEYS + 3):  # the table stays bounded
        sign_get(target, {}, "AK", f"s{n}", None, "us-east-1", "20261205T000000Z", keys)
    assert len(keys) <= s3_signing._SIGNING_KEYS
