"""Counting the store's requests: :class:`InstrumentedBackend` wraps any backend.

It counts each request (by operation: get, head, list), its latency, the bytes fetched, errors
by kind and the requests in flight into a :class:`StoreStats`; with ``--log-level debug`` it
logs every request (logger ``objfs.store``). A cancelled request (read-ahead no longer needed)
is neither a request nor an error. :mod:`objfs.fs` never knows the wrapper is there. The
figures are plain integers written on the trio thread only; :mod:`objfs.metrics` reads them.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import trio

from objfs.backends.base import Backend, ListPage, ObjectInfo
from objfs.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    NoCredentialsError,
    ObjectNotFoundError,
    StaleObjectError,
    TransientStoreError,
)

request_log = logging.getLogger("objfs.store")

#: Store operations, as the ``operation`` label names them.
OPERATIONS = ("get", "head", "list")
#: Error kinds, as the ``kind`` label names them (``other``: anything unexpected).
ERROR_KINDS: dict[type[BaseException], str] = {
    BucketNotFoundError: "bucket_not_found",
    AccessDeniedError: "access_denied",
    NoCredentialsError: "no_credentials",
    EndpointUnreachableError: "unreachable",
    ObjectNotFoundError: "not_found",
    StaleObjectError: "stale",
    TransientStoreError: "transient",
}
_KIND_NAMES = (*ERROR_KINDS.values(), "other")
#: Upper bounds (seconds) of the request latency histogram's buckets (+Inf is implied).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def error_kind(exc: BaseException) -> str:
    for cls, kind in ERROR_KINDS.items():
        if isinstance(exc, cls):
            return kind
    return "other"


class Histogram:
    """Counts per latency bucket plus the sum: what a Prometheus histogram exports."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), list(self.counts), strict=True):
            total += n
            out.append((bound, total))
        return out


class StoreStats:
    """What an :class:`InstrumentedBackend` counted. Written on the trio thread only."""

    def __init__(self) -> None:
        self.requests = dict.fromkeys(OPERATIONS, 0)
        self.latency = {op: Histogram() for op in OPERATIONS}
        self.errors = dict.fromkeys(_KIND_NAMES, 0)
        self.bytes_fetched = 0
        self.in_flight = 0


class InstrumentedBackend(Backend):
    """A backend that counts and times every request of the backend it wraps."""

    def __init__(self, inner: Backend, stats: StoreStats | None = None) -> None:
        self.inner = inner
        self.stats = StoreStats() if stats is None else stats
        self.description = inner.description

    @contextlib.contextmanager
    def _request(self, op: str, what: str) -> Iterator[list[int]]:
        """Count one request; the caller appends the bytes it received to the list."""
        stats = self.stats
        stats.in_flight += 1
        start = time.perf_counter()
        received: list[int] = []
        try:
            yield received
        except trio.Cancelled:
            raise  # read-ahead that is no longer needed: not a request, not an error
        except BaseException as exc:
            elapsed = time.perf_counter() - start
            kind = error_kind(exc)
            stats.requests[op] += 1
            stats.latency[op].observe(elapsed)
            stats.errors[kind] += 1
            request_log.debug("%s %s: %s after %.1f ms", op.upper(), what, kind, elapsed * 1e3)
            raise
        else:
            elapsed = time.perf_counter() - start
            nbytes = sum(received)
            stats.requests[op] += 1
            stats.latency[op].observe(elapsed)
            stats.bytes_fetched += nbytes
            if request_log.isEnabledFor(logging.DEBUG):
                size = f"{nbytes} bytes in " if op == "get" else ""
                request_log.debug("%s %s: %s%.1f ms", op.upper(), what, size, elapsed * 1e3)
        finally:
            stats.in_flight -= 1

    async def check(self, prefix: str) -> bool:
        with self._request("list", f"{prefix!r} (check)"):
            return await self.inner.check(prefix)

    def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        return _ListPages(self, prefix)

    async def head(self, key: str) -> ObjectInfo:
        with self._request("head", repr(key)):
            return await self.inner.head(key)

    async def has_keys_under(self, prefix: str) -> bool:
        with self._request("list", f"{prefix!r} (one key)"):
            return await self.inner.has_keys_under(prefix)

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        with self._request("get", f"{key!r} bytes {start}-{start + length - 1}") as received:
            data = await self.inner.read_range(key, etag, start, length)
            received.append(len(data))
            return data

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        length = sum(len(v) for v in views)
        with self._request("get", f"{key!r} bytes {start}-{start + length - 1}") as received:
            await self.inner.read_into(key, etag, start, views)
            received.append(length)

    def cache_engine_statistics(self) -> dict[str, int] | None:
        return self.inner.cache_engine_statistics()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ListPages:
    """Async iterator over a listing that times each page's request (one per page)."""

    def __init__(self, backend: InstrumentedBackend, prefix: str) -> None:
        self._backend = backend
        self._prefix = prefix
        self._pages = backend.inner.list_prefix(prefix)

    def __aiter__(self) -> _ListPages:
        return self

    async def __anext__(self) -> ListPage:
        stats = self._backend.stats
        stats.in_flight += 1
        start = time.perf_counter()
        try:
            page = await self._pages.__anext__()
        except StopAsyncIteration:
            raise
        except trio.Cancelled:
            raise
        except BaseException as exc:
            kind = error_kind(exc)
            stats.requests["list"] += 1
            stats.latency["list"].observe(time.perf_counter() - start)
            stats.errors[kind] += 1
            request_log.debug("LIST %r: %s", self._prefix, kind)
            raise
        else:
            elapsed = time.perf_counter() - start
            stats.requests["list"] += 1
            stats.latency["list"].observe(elapsed)
            if request_log.isEnabledFor(logging.DEBUG):
                request_log.debug(
                    "LIST %r: %d keys, %d prefixes in %.1f ms",
                    self._prefix,
                    len(page.objects),
                    len(page.prefixes),
                    elapsed * 1e3,
                )
            return page
        finally:
            stats.in_flight -= 1

    async def aclose(self) -> None:
        aclose = getattr(self._pages, "aclose", None)
        if aclose is not None:
            await aclose()
