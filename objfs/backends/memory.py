"""An in-memory object store: for unit tests, fault injection and offline demos.

It follows S3's listing rules (lexicographic keys, ``/`` delimiter, common prefixes, pages of
``page_size`` entries) and S3's conditional reads (a read pinned to an ETag fails with
StaleObjectError once the key holds another version). ``statistics()`` counts requests so
that tests can assert how many round trips the layers above made. ``etags=False`` plays a
store that sends no ETags: versions are then pinned by size and last-modified second
(:func:`~objfs.backends.base.version_pin`), and each new version gets a later second.

Objects can be real bytes or :class:`SyntheticData`, which derives every byte from its offset,
so tests can serve multi-GiB objects (e.g. reads past 4 GiB) without holding them.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio

from objfs.backends.base import Backend, ListPage, ObjectInfo, version_pin
from objfs.errors import ObjectNotFoundError, ObjfsError, StaleObjectError

_CHUNK = 4096  # SyntheticData repeats one sha256 digest 128 times per 4 KiB chunk


class SyntheticData:
    """Deterministic content of any size: chunk ``c`` (4 KiB) is ``sha256(seed, c)`` x 128."""

    def __init__(self, size: int, seed: bytes = b"objfs") -> None:
        self.size = size
        self.seed = seed

    def _chunk(self, index: int) -> bytes:
        return hashlib.sha256(self.seed + index.to_bytes(8, "little")).digest() * (_CHUNK // 32)

    def read(self, start: int, length: int) -> bytes:
        end = min(start + length, self.size)
        if start >= end:
            return b""
        first, last = start // _CHUNK, (end - 1) // _CHUNK
        data = b"".join(self._chunk(c) for c in range(first, last + 1))
        off = start - first * _CHUNK
        return data[off : off + (end - start)]


@dataclass
class _Stored:
    data: bytes | SyntheticData
    etag: str
    mtime_ns: int

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.size

    def read(self, start: int, length: int) -> bytes:
        if isinstance(self.data, bytes):
            return self.data[start : start + length]
        return self.data.read(start, length)


class MemoryBackend(Backend):
    """A bucket in a dict. ``latency_s`` delays every request (use trio's autojump clock);
    ``fault`` is called with (operation, key) before each request and may raise."""

    def __init__(
        self,
        *,
        page_size: int = 1000,
        latency_s: float = 0.0,
        fault: Callable[[str, str], None] | None = None,
        etags: bool = True,
    ) -> None:
        self.description = "memory://"
        self.etags = etags
        self._last_mtime_ns = 0
        self.page_size = page_size
        self.latency_s = latency_s
        self.fault = fault
        self._objects: dict[str, _Stored] = {}
        self._sorted: list[str] = []
        self._version = 0
        self.requests: Counter[str] = Counter()
        self._active = 0  # requests in flight
        self.peak_concurrent = 0

    # -- test helpers (synchronous) --------------------------------------------------------

    def put(self, key: str, data: bytes | SyntheticData, *, mtime_ns: int | None = None) -> str:
        """Store ``data`` under ``key`` as a new version; returns its ETag."""
        self._version += 1
        etag = hashlib.md5(f"{key}:{self._version}".encode(), usedforsecurity=False).hexdigest()
        if mtime_ns is None:
            mtime_ns = time.time_ns()
            if not self.etags:  # a later second than any earlier version
                mtime_ns = max(mtime_ns, self._last_mtime_ns + 1_000_000_000)
        self._last_mtime_ns = max(self._last_mtime_ns, mtime_ns)
        if key not in self._objects:
            bisect.insort(self._sorted, key)
        stored = _Stored(data, etag, mtime_ns)
        self._objects[key] = stored
        return self._info(key, stored).etag

    def delete(self, key: str) -> None:
        del self._objects[key]
        self._sorted.remove(key)

    def statistics(self) -> dict[str, int]:
        return dict(self.requests)

    # -- Backend ---------------------------------------------------------------------------

    async def _request(self, op: str, key: str) -> None:
        self.requests[op] += 1
        self._active += 1
        self.peak_concurrent = max(self.peak_concurrent, self._active)
        try:
            if self.latency_s:
                await trio.sleep(self.latency_s)
            else:
                await trio.lowlevel.checkpoint()
        finally:
            self._active -= 1
        if self.fault is not None:
            self.fault(op, key)

    def _info(self, key: str, obj: _Stored) -> ObjectInfo:
        etag = obj.etag if self.etags else version_pin("", obj.size, obj.mtime_ns, key)
        return ObjectInfo(key=key, size=obj.size, etag=etag, mtime_ns=obj.mtime_ns)

    async def check(self, prefix: str) -> bool:
        await self._request("list", prefix)
        i = bisect.bisect_left(self._sorted, prefix)
        return i < len(self._sorted) and self._sorted[i].startswith(prefix)

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        # Collect the whole level first (entries in key order, prefixes rolled up), then cut it
        # into pages the way S3 does: a page holds up to page_size keys *and* prefixes.
        entries: list[ObjectInfo | str] = []
        i = bisect.bisect_left(self._sorted, prefix)
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            key = self._sorted[i]
            slash = key.find("/", len(prefix))
            if slash < 0:
                entries.append(self._info(key, self._objects[key]))
                i += 1
            else:
                common = key[: slash + 1]
                entries.append(common)
                # Skip every key under this common prefix: the next candidate sorts after it.
                i = bisect.bisect_left(self._sorted, common[:-1] + chr(ord("/") + 1))
        for start in range(0, max(len(entries), 1), self.page_size):
            await self._request("list", prefix)
            chunk = entries[start : start + self.page_size]
            yield ListPage(
                objects=[e for e in chunk if isinstance(e, ObjectInfo)],
                prefixes=[e for e in chunk if isinstance(e, str)],
                more=start + self.page_size < len(entries),
            )

    async def head(self, key: str) -> ObjectInfo:
        await self._request("head", key)
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"{key!r} not found")
        return self._info(key, obj)

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        await self._request("get", key)
        obj = self._objects.get(key)
        if obj is None:
            raise ObjectNotFoundError(f"{key!r} not found")
        if self._info(key, obj).etag != etag:
            raise StaleObjectError(f"{key!r} changed while open (ETag {etag} is gone)")
        data = obj.read(start, length)
        if len(data) != length:
            raise ObjfsError(f"range {start}+{length} is past the end of {key!r}")
        self.requests["get_bytes"] += length
        return data
