"""objfs.backends.s3_signing signs a data GET exactly as botocore's S3SigV4Auth does for the
same request and second (header for header), over the URL shapes a bucket's objects take
(hand-written, and made by real clients: path and virtual addressing, keys with the
characters S3 allows); ``signed_get`` follows rotated credentials and refuses missing ones;
the signing key is derived once per day, region and secret."""

from __future__ import annotations

import datetime
import hashlib
import hmac
from typing import Any
from unittest import mock

import botocore.auth
import botocore.config
import botocore.credentials
import botocore.exceptions
import botocore.session
import pytest
from botocore.awsrequest import AWSRequest

from objfs.backends import s3_signing
from objfs.backends.s3_signing import ObjectUrl, ObjectUrls, sign_get

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


KEYS = [
    "m/model-00001-of-00002.safetensors",
    "m/a b+c=d~e!f'g(h)i*j.bin",
    "m//double//slash/",
    "m/\u00e9t\u00e9/\u30e2\u30c7\u30eb.bin",
    "m/%41%2F?#&;.bin",
    "m/./../dots",
]


def session(access: str = "AKIAIOSFODNN7EXAMPLE", secret: str | None = "s3cr3t") -> Any:
    s = botocore.session.get_session()
    s.set_credentials(access, secret, None)
    return s


@pytest.mark.parametrize(
    ("endpoint", "style"),
    [
        ("http://127.0.0.1:9000", "path"),
        ("http://[::1]:9000", "path"),
        ("https://s3.example.com:8443/prefix", "path"),
        (None, "virtual"),
        (None, "path"),
    ],
)
def test_urls_real_clients_make_are_signed_as_botocore_signs_them(
    endpoint: str | None, style: str
) -> None:
    sess = session()
    client = sess.create_client(
        "s3",
        region_name="eu-west-1",
        endpoint_url=endpoint,
        config=botocore.config.Config(s3={"addressing_style": style}),
    )
    urls = ObjectUrls(sess, no_sign_request=False)
    headers = {"Range": "bytes=0-1048575", "User-Agent": "objfs", "If-Match": '"e1"'}
    creds = ("AKIAIOSFODNN7EXAMPLE", "s3cr3t", None)
    fixed = WHEN.timetuple()
    for key in KEYS:
        with mock.patch.object(s3_signing.time, "gmtime", return_value=fixed):
            url, ours = urls.signed_get(client, "my-bucket.v2", key, headers)
        assert "?" not in url
        assert ours == botocore_headers(url, headers, creds, "eu-west-1"), key


def test_signed_get_follows_rotated_credentials_and_refuses_missing_ones() -> None:
    sess = session("AKIAOLD", "old-secret")
    client = sess.create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
    urls = ObjectUrls(sess, no_sign_request=False)
    fixed = WHEN.timetuple()
    with mock.patch.object(s3_signing.time, "gmtime", return_value=fixed):
        _, before = urls.signed_get(client, "b", "k", {})
        sess.set_credentials("AKIANEW", "new-secret", "tok")
        url, after = urls.signed_get(client, "b", "k", {})
    assert before["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIAOLD/")
    assert after["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIANEW/")
    assert after == botocore_headers(url, {}, ("AKIANEW", "new-secret", "tok"), "us-east-1")
    assert "new-secret" not in repr(urls.__dict__)  # keys are derived from a hash of it
    sess.set_credentials("AKIANEW", None, None)
    with pytest.raises(botocore.exceptions.NoCredentialsError):
        urls.signed_get(client, "b", "k", {})
    anonymous = ObjectUrls(sess, no_sign_request=True)
    url, plain = anonymous.signed_get(client, "b", "k", {"Range": "bytes=0-0"})
    assert plain == {"Range": "bytes=0-0"}
    assert url.endswith("/b/k")
