"""Stale but available: what metadata to serve when the store fails.

Known metadata is *fresh* for ``metadata_ttl_s``. Past that the store is asked again
(:meth:`StoreAvailability.from_store`, the one place the rule is applied); if the store is
unreachable (connection refused, timeout, 5xx after retries), what is known is served for up
to ``max_stale_s`` past its TTL (0: strict, fail instead). One warning per outage; during an
outage the store is tried again at most every ``OUTAGE_RETRY_S`` and other requests get the
known answer at once instead of waiting. Trio thread only; no I/O of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from objfs.config import MountConfig
from objfs.errors import EndpointUnreachableError, TransientStoreError

log = logging.getLogger("objfs.fs")  # the core's one name

T = TypeVar("T")

# During an outage, the store is tried again at most this often; meanwhile known metadata is
# served at once (within --max-stale).
OUTAGE_RETRY_S = 5.0


class StoreAvailability:
    """The store's reachability as metadata requests saw it, and the serving rule."""

    def __init__(self, config: MountConfig) -> None:
        self.config = config
        self.outage_since: float | None = None  # monotonic time the current outage began
        self._outage_tried_at = 0.0
        self.outages = 0
        self.stale_answers = 0
        self.metadata_requests = 0

    def fresh(self, checked_at: float) -> bool:
        """Metadata confirmed at ``checked_at`` is within its TTL: served without asking."""
        return time.monotonic() - checked_at < self.config.metadata_ttl_s

    def servable(self, checked_at: float) -> bool:
        """Known metadata this old may still be served while the store is unreachable."""
        age = time.monotonic() - checked_at
        return self.config.max_stale_s > 0 and age < (
            self.config.metadata_ttl_s + self.config.max_stale_s
        )

    def _skip_store(self, checked_at: float) -> bool:
        """During an outage, answer from what is known without waiting on the store (it is
        tried again every OUTAGE_RETRY_S)."""
        return (
            self.outage_since is not None
            and time.monotonic() - self._outage_tried_at < OUTAGE_RETRY_S
            and self.servable(checked_at)
        )

    def call(self) -> None:
        """A metadata request to the store starts."""
        self.metadata_requests += 1
        self._outage_tried_at = time.monotonic()

    def answered(self) -> None:
        """The store answered a metadata request: an outage, if any, is over."""
        if self.outage_since is not None:
            log.warning(
                "the store answers again after %.0f s; %d answers were served from cached "
                "metadata meanwhile",
                time.monotonic() - self.outage_since,
                self.stale_answers,
            )
            self.outage_since = None

    def _failed(self, exc: Exception) -> None:
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            self.outages += 1
            if self.config.max_stale_s > 0:
                log.warning(
                    "the store is unreachable (%s): serving cached metadata for up to %.0f s "
                    "past its TTL (--max-stale) until it answers again",
                    exc,
                    self.config.max_stale_s,
                )
            else:
                log.warning("the store is unreachable (%s); --max-stale 0: failing", exc)

    async def from_store(
        self, ask: Callable[[], Awaitable[T]], known_at: Callable[[], float | None]
    ) -> tuple[T] | None:
        """The store's answer to ``ask()`` (in a 1-tuple), or None when the caller should
        serve what it knows instead: the store is unreachable (or was a moment ago, see
        _skip_store) and what is known, confirmed at ``known_at()`` (None: nothing), may
        still be served. The one place the stale-but-available rule is applied."""
        at = known_at()
        if at is not None and self._skip_store(at):
            self.stale_answers += 1
            return None
        try:
            return (await ask(),)
        except (EndpointUnreachableError, TransientStoreError) as exc:
            self._failed(exc)
            at = known_at()
            if at is not None and self.servable(at):
                self.stale_answers += 1
                return None
            raise

    def state(self) -> dict[str, float | int | None]:
        return {
            "outages": self.outages,
            "stale_answers": self.stale_answers,
            "unreachable_for_s": None
            if self.outage_since is None
            else time.monotonic() - self.outage_since,
        }
