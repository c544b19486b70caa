"""Data GETs through a shared cache engine (``--cache-proxy URL``), with the store as fallback.

Many nodes that load one model fetch it once from the store when their data GETs go through a
cache engine that collapses them: nginx's ``proxy_cache`` with the slice module
(``k8s/cache-engine/``), or Dragonfly's dfdaemon. The engine is a reverse proxy: a data GET for
``https://STORE/PATH?QUERY`` is sent as ``GET URL/PATH?QUERY``, where ``URL`` is the engine's,
and the engine forwards path and query to the store unchanged. So ``PATH`` names the bucket
(S3 presigns engine URLs path-style, whatever the data path's addressing) and the query is a
signature narrowed to one object and read access: a presigned GET URL (S3,
objfs.backends.s3_signing) or a read-only blob SAS signed by the account key or a user
delegation key (Azure, objfs.backends.azure_auth; the mount's own SAS token only with
``--cache-proxy-send-sas-token``). The engine may re-range the request (its slices) and still
present a valid signature, because the signature covers neither ``Range`` nor ``If-Match``.
Every GET carries ``If-Match`` with the version's ETag, so the engine's cache key (path,
If-Match, slice) names the version and not the signature, and the caller still checks every
reply's ETag against its pin. The shipped engine has the store authorize every GET, hit or
miss, with the caller's signature: a refusal (401/403) reaches the caller.

Fallback: any failure of the engine (a refused connection, a reset, a timeout, a 5xx, a short
or misplaced body, another version's bytes) makes the caller read that range from the store
directly; the engine is then left alone for ``retry_after_s`` (one warning per outage, counted
in ``failures``), after which the next GET tries it again; its first success logs that it is
back. Two answers are the store's, not the engine's: a 412 (the pinned version is gone) and a
401/403 (the store refused the caller's signature; counted in ``refused``, logged once). The
caller then reads that range from the store directly, whose own answer counts (ESTALE,
EACCES), and the engine is not blamed.

Secrets: a signed URL is a bearer credential. Nothing here logs or reports a URL: only the
engine's own base URL (which holds no secret: :func:`parse_engine_url` refuses user info and
queries) appears in logs and ``objfs status``.

Thread safety: :class:`CacheEngine` is used from the backend's worker threads; its state is
guarded by one lock.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence

from objfs import rawhttp
from objfs.errors import StaleObjectError, UsageError

log = logging.getLogger(__name__)

# How long the engine is left alone after a failure before it is tried again.
RETRY_AFTER_S = 30.0


def parse_engine_url(value: str) -> str:
    """The engine's base URL, ``http(s)://host[:port][/prefix]`` without a trailing slash;
    UsageError with what is wrong otherwise."""
    parts = urllib.parse.urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"--cache-proxy {value!r} is not an http:// or https:// URL: give the cache "
            "engine's address, e.g. http://objfs-cache.objfs.svc:8080"
        )
    if parts.username or parts.password or parts.query or parts.fragment:
        raise UsageError(
            "--cache-proxy takes the engine's address only (no user, query or fragment): "
            "objfs signs each data GET itself"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UsageError(f"--cache-proxy {value!r} has an invalid port") from None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


class CacheEngine:
    """Where data GETs go (see the module docstring), and what they did."""

    def __init__(self, base_url: str, *, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.base_url = parse_engine_url(base_url)
        self.retry_after_s = retry_after_s
        self.bytes_via_engine = 0
        self.bytes_direct = 0  # read from the store while the engine was off or failed
        self.failures = 0
        self.refused = 0  # GETs the store refused through the engine (401/403)
        self.urls_signed = 0
        self._down_until = 0.0
        self._down = False
        self._refusal_logged = False
        self._lock = threading.Lock()

    def route(self, store_url: str) -> str | None:
        """The engine's URL for the signed store URL ``store_url`` (its path and query on the
        engine), or None while the engine is left alone after a failure."""
        with self._lock:
            if self._down and time.monotonic() < self._down_until:
                return None
        parts = urllib.parse.urlsplit(store_url)
        target = self.base_url + (parts.path or "/")
        return target + ("?" + parts.query if parts.query else "")

    def fetch(
        self,
        pool: rawhttp.ConnectionPool,
        url: str,
        headers: dict[str, str],
        start: int,
        views: Sequence[memoryview],
        check_version: Callable[[rawhttp.Reply], None],
    ) -> bool:
        """(Worker thread) One GET of ``url`` (a :meth:`route` result) into ``views``, the
        range from ``start``: True when they hold it and ``check_version`` (which raises
        StaleObjectError for another version's reply) passed; else False, counted as read
        from the store directly, and as a failure of the engine unless it answered 412 or
        401/403 (the store's answers: the caller's direct GET gets them again)."""
        length = sum(len(v) for v in views)
        try:
            reply = pool.get_into(url, headers, views)
        except rawhttp.ConnectionFailed as exc:
            self.failed(f"connection failed: {str(exc).split(':', 1)[0]}")
            self.direct(length)
            return False
        problem = None
        if reply.status in (200, 206):
            problem = reply.body_error(start, length)
            if problem is None:
                try:
                    check_version(reply)
                except StaleObjectError:
                    problem = "it answered another version"
                else:
                    self.served(length)
                    return True
        elif reply.status == 412:
            # The store's answer that the pinned version is gone: the direct GET says so.
            self.direct(length)
            return False
        elif reply.status in (401, 403):
            # The store refused the signature (the engine's authorization check): the direct
            # GET gets the store's own refusal (EACCES) or, if the store serves it, the bytes.
            self.was_refused(reply.status)
            self.direct(length)
            return False
        self.failed(problem or f"HTTP {reply.status}")
        self.direct(length)
        return False

    def signed(self) -> None:
        """A URL was signed (or signed again, its lifetime half over) for the engine."""
        with self._lock:
            self.urls_signed += 1

    def served(self, nbytes: int) -> None:
        """A GET through the engine brought ``nbytes`` of the pinned version."""
        with self._lock:
            self.bytes_via_engine += nbytes
            back, self._down = self._down, False
        if back:
            log.warning("cache engine %s answers again; data GETs go through it", self.base_url)

    def was_refused(self, status: int) -> None:
        """The engine answered ``status`` (401/403): the store refused the GET's signature."""
        with self._lock:
            self.refused += 1
            first, self._refusal_logged = not self._refusal_logged, True
        if first:
            log.warning(
                "cache engine %s: the store refused a GET through it (HTTP %d); reading that "
                "range from the store directly (if the store serves it, the engine's "
                "ORIGIN_URL and ORIGIN_HOST are not the store objfs signs for)",
                self.base_url,
                status,
            )

    def direct(self, nbytes: int) -> None:
        """``nbytes`` came from the store directly instead."""
        with self._lock:
            self.bytes_direct += nbytes

    def failed(self, why: str) -> None:
        """The engine failed a GET (``why``: no URL in it); the caller reads from the store."""
        with self._lock:
            self.failures += 1
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.retry_after_s
        if first:
            log.warning(
                "cache engine %s failed (%s); reading from the store directly, trying the "
                "engine again in %.0f s",
                self.base_url,
                why,
                self.retry_after_s,
            )

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_via_engine": self.bytes_via_engine,
                "bytes_direct": self.bytes_direct,
                "failures": self.failures,
                "refused": self.refused,
                "urls_signed": self.urls_signed,
                "down": int(self._down),
            }
