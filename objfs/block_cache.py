"""Memory tier of fixed-size blocks keyed by object version, with single-flight fetches.

Concurrency invariants (trio, one thread):

* The LRU and the in-flight table are touched only from the trio thread; backends run their
  blocking work in worker threads and hand back bytes, so cachetools needs no locking.
* Concurrent misses on the same :class:`BlockKey` share one fetch. The fetching task sets the
  event in ``finally``, so waiters wake on failure too; a waiter whose leader failed with an
  ``Exception`` sees that exception, a waiter whose leader was cancelled retries the fetch.

Blocks are keyed by (key, ETag, index): a new object version never meets an old block, so the
cache never needs invalidation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import cachetools
import trio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BlockKey(NamedTuple):
    key: str
    etag: str
    block: int  # block number: the block starts at block * block_size


@dataclass
class _Call(Generic[V]):
    event: trio.Event = field(default_factory=trio.Event)
    value: V | None = None
    error: Exception | None = None
    done: bool = False


class SingleFlight(Generic[K, V]):
    """Run at most one ``fetch`` per key at a time; concurrent callers share its result."""

    def __init__(self) -> None:
        self._calls: dict[K, _Call[V]] = {}

    def in_flight(self, key: K) -> bool:
        return key in self._calls

    async def run(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        while True:
            call = self._calls.get(key)
            if call is None:
                break
            await call.event.wait()
            if call.error is not None:
                raise call.error
            if call.done:
                return call.value  # type: ignore[return-value]
            # The leader was cancelled: try again, possibly as the new leader.
        call = _Call[V]()
        self._calls[key] = call
        try:
            call.value = await fetch()
            call.done = True
            return call.value
        except Exception as exc:
            call.error = exc
            raise
        finally:
            del self._calls[key]
            call.event.set()


class BlockCache:
    """An LRU of blocks bounded in bytes, plus single-flight loading."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lru: cachetools.LRUCache[BlockKey, bytes] = cachetools.LRUCache(
            maxsize=max(capacity_bytes, 1), getsizeof=len
        )
        self._flight: SingleFlight[BlockKey, bytes] = SingleFlight()
        self.hits = 0
        self.misses = 0

    def get_nowait(self, key: BlockKey) -> bytes | None:
        data = self._lru.get(key)
        if data is not None:
            self.hits += 1
        return data

    def is_cached_or_loading(self, key: BlockKey) -> bool:
        return key in self._lru or self._flight.in_flight(key)

    async def get(self, key: BlockKey, fetch: Callable[[], Awaitable[bytes]]) -> bytes:
        """Return the block, fetching it once however many tasks ask at the same time."""
        data = self.get_nowait(key)
        if data is not None:
            return data

        async def load() -> bytes:
            self.misses += 1
            block = await fetch()
            if len(block) <= self.capacity_bytes:
                self._lru[key] = block
            return block

        return await self._flight.run(key, load)

    def statistics(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "cached_bytes": int(self._lru.currsize),
            "capacity_bytes": self.capacity_bytes,
        }
