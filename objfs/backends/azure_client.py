"""The Azure SDK's set-up for one account: HTTP session, CAs, retry policy and client.

Contract: :func:`session` makes the requests session that every request to one endpoint
shares (one pool of the caller's size, no retries of its own, the environment's proxies
resolved once, :func:`ca_bundle`'s CAs); :func:`service_client` makes a BlobServiceClient on
it whose retry policy (bounded attempts, :func:`backoff_s`'s full-jitter backoff) is the one
retry layer of listings and HEADs, and which fetches any range in one GET; :func:`send_get`
sends a data GET on that session's pool (the data path behind a proxy from the environment).
The SDK's clients are immutable and safe to share across threads; so is urllib3's pool.
"""

from __future__ import annotations

import os
import random
from typing import Any

import requests
import urllib3
from azure.storage.blob import BlobServiceClient, ExponentialRetry
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from objfs.config import AzureOptions

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


def backoff_s(retry: int) -> float:
    """Sleep before retry ``retry`` (from 0): full jitter, capped (the SDK's retries too)."""
    return random.uniform(0.0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retry))


class _JitteredRetry(ExponentialRetry):
    """The SDK's storage retry policy with full-jitter backoff (:func:`backoff_s`)."""

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        return backoff_s(int(settings["count"]))  # the data path's backoff, one formula


def ca_bundle() -> str:
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


def session(account_url: str, pool_size: int, ca_file: str) -> requests.Session:
    """A requests session for one endpoint: a pool of ``pool_size`` connections, no retries of
    its own (the SDK's policy is the one retry layer), the environment's proxy settings
    resolved once here instead of on every request (requests re-reads os.environ per request
    when ``trust_env`` is on: a measurable share of a request's CPU time) and ``ca_file``
    (see :func:`ca_bundle`) as its CAs."""
    session = requests.Session()
    session.trust_env = False
    session.proxies = requests.utils.get_environ_proxies(account_url)  # honours NO_PROXY
    session.verify = ca_file  # see ca_bundle
    adapter = HTTPAdapter(
        pool_connections=1,  # one host
        pool_maxsize=pool_size,
        max_retries=Retry(total=False, redirect=False, raise_on_status=False),
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def service_client(
    account_url: str,
    credential: Any,
    session: requests.Session,
    ca_file: str,
    options: AzureOptions,
) -> BlobServiceClient:
    """The SDK's client of one account, signing with ``credential`` (None: anonymous) and
    sending on ``session`` with ``ca_file``'s CAs."""
    return BlobServiceClient(
        account_url,
        credential=credential,
        session=session,
        connection_verify=ca_file,  # see ca_bundle
        connection_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        retry_policy=_JitteredRetry(retry_total=max(options.max_attempts - 1, 0)),
        max_single_get_size=_MAX_GET_BYTES,
        max_chunk_get_size=_MAX_GET_BYTES,
        connection_data_block_size=_READ_BLOCK_BYTES,
        user_agent="objfs",
    )


def send_get(
    session: requests.Session,
    origin: str,
    url: str,
    headers: dict[str, str],
    timeout: tuple[float, float],
) -> urllib3.BaseHTTPResponse:
    """GET ``url`` (on ``origin``) on ``session``'s connection pool, its body not read yet.

    Straight through urllib3 (the pool requests itself uses): requests' per-request work
    (settings merge, hooks, cookies, response wrapping) costs as much CPU as the signing
    and parsing together. With a proxy from the environment, requests' adapter is used."""
    if session.proxies.get("http") or session.proxies.get("https"):
        r = session.get(url, headers=headers, stream=True, timeout=timeout)
        raw: urllib3.BaseHTTPResponse = r.raw
        return raw
    adapter = session.get_adapter(url)
    assert isinstance(adapter, HTTPAdapter)
    pool = adapter.poolmanager.connection_from_url(url)
    if url.startswith("https:"):
        # The CA settings requests would apply (the session's bundle, else certifi's).
        adapter.cert_verify(pool, url, session.verify, None)
    return pool.urlopen(
        "GET",
        url[len(origin) :],  # origin-form request target: path and query
        headers=headers,
        retries=False,
        redirect=False,
        timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
        preload_content=False,
        decode_content=False,
        assert_same_host=False,
    )
