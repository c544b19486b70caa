"""Run at most one instance of an async computation per key; concurrent callers share it.

Used for directory listings and random reads. The leader sets the event in ``finally``, so
waiters wake on failure too: a waiter whose leader failed with an ``Exception`` raises that
exception, a waiter whose leader was cancelled runs the computation itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Call(Generic[V]):
    event: trio.Event = field(default_factory=trio.Event)
    value: V | None = None
    error: Exception | None = None
    done: bool = False


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._calls: dict[K, _Call[V]] = {}

    async def run(self, key: K, compute: Callable[[], Awaitable[V]]) -> V:
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
            call.value = await compute()
            call.done = True
            return call.value
        except Exception as exc:
            call.error = exc
            raise
        finally:
            del self._calls[key]
            call.event.set()
