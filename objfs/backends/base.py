"""The backend interface every object store implements.

A backend is a thin async adapter: it lists one "directory" level (keys grouped by ``/``),
heads one key, and reads a byte range of one object *version*. It never caches; caching and
read-ahead live above it so that every backend gets them.

Contracts:

* All methods are ``async`` and safe to call concurrently from the trio thread.
* Failures are :mod:`objfs.errors` exceptions, never SDK exceptions.
* :meth:`Backend.read_range` returns exactly ``length`` bytes, or raises: a store that sends
  fewer is a transient error, never passed on.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectInfo:
    """One object version as the store reports it."""

    key: str
    size: int
    etag: str
    mtime_ns: int


@dataclass
class ListPage:
    """One page of a delimiter listing under a prefix.

    ``objects`` are the keys directly under the prefix (the prefix itself included when a
    directory marker exists); ``prefixes`` are the common prefixes, each ending in ``/``.
    """

    objects: list[ObjectInfo]
    prefixes: list[str]
    more: bool = False  # another page follows


class Backend(abc.ABC):
    """An object store holding one bucket (container)."""

    #: Human-readable description for logs (no secrets): ``s3://bucket at http://host:port``.
    description: str = ""

    @abc.abstractmethod
    async def check(self, prefix: str) -> bool:
        """Verify that the bucket exists and can be listed at ``prefix``; returns whether
        any key lies under ``prefix`` (the same one-key listing tells).

        Raises BucketNotFoundError, AccessDeniedError, NoCredentialsError or
        EndpointUnreachableError with a message that says what to do. Used before mounting so
        that a bad configuration fails the command instead of every later request.
        """

    @abc.abstractmethod
    def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        """Yield the pages of a ``/``-delimited listing of ``prefix`` (``""`` or ending in
        ``/``), following continuation tokens until the listing is complete."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Return the current version of ``key``; raises ObjectNotFoundError."""

    @abc.abstractmethod
    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        """Return exactly ``length`` bytes of ``key`` from ``start`` (``length > 0``).

        The read is conditional on ``etag``: if the object now has another version, raises
        StaleObjectError (never bytes of the other version).
        """

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        """Read ``sum(len(v) for v in views)`` bytes from ``start`` with one request, filling
        ``views`` in order. Same contract as :meth:`read_range` (all bytes or an exception;
        on an exception the views hold garbage). Backends override it to receive straight into
        the views (the memory tier's pooled buffers) without an intermediate copy.
        """
        length = sum(len(v) for v in views)
        data = memoryview(await self.read_range(key, etag, start, length))
        offset = 0
        for view in views:
            view[:] = data[offset : offset + len(view)]
            offset += len(view)

    async def has_keys_under(self, prefix: str) -> bool:
        """Whether any key starts with ``prefix`` (ending in ``/``): one listing request,
        whatever the number of keys. Backends may override it with a one-key listing."""
        pages = self.list_prefix(prefix)
        try:
            async for page in pages:
                return bool(page.objects or page.prefixes)
            return False
        finally:
            await pages.aclose()  # type: ignore[attr-defined]

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections and threads."""
