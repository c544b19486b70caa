"""The backend interface every object store implements.

A backend is a thin async adapter: it lists one "directory" level (keys grouped by ``/``),
heads one key, and reads a byte range of one object *version*. It never caches; caching and
read-ahead live above it so that every backend gets them.

Contracts:

* All methods are ``async`` and safe to call concurrently from the trio thread.
* Failures are :mod:`objfs.errors` exceptions, never SDK exceptions.
* :meth:`Backend.read_range` returns exactly ``length`` bytes, or raises: a store that sends
  fewer is a transient error, never passed on.
* Versions: ``ObjectInfo.etag`` is the version's *pin*, made by :func:`version_pin`: the
  store's ETag, or, for a store that sends none, a pin made of the size and the last-modified
  second (``objfs-size-mtime:SIZE:SECONDS``; logged once). A read of a pinned version sends
  ``If-Match`` with a real ETag (:func:`if_match`) and checks every reply against the pin
  (:func:`reply_version_error`): a reply of another version is StaleObjectError even from a
  store or gateway that ignores ``If-Match``, so its bytes are never passed on.
"""

from __future__ import annotations

import abc
import email.utils
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from objfs.rawhttp import report_filled

log = logging.getLogger(__name__)

# The pin of a version whose store sent no ETag (see version_pin). Not a valid ETag (no
# quotes), so it can never equal one a store sends.
_NO_ETAG_PIN = "objfs-size-mtime:"
_warned_no_etag = False


def version_pin(etag: str, size: int, mtime_ns: int, key: str) -> str:
    """The pin of one object version: its ETag, or, when the store sent none, its size and
    last-modified second (the precision of the HTTP ``Last-Modified`` header). Logs once per
    process that versions of such a store are told apart that way."""
    if etag:
        return etag
    global _warned_no_etag
    if not _warned_no_etag:
        _warned_no_etag = True
        log.warning(
            "the store sent no ETag for %r: objfs tells versions apart by size and "
            "last-modified second for such objects (a replacement of the same size within the "
            "same second goes unnoticed)",
            key,
        )
    return f"{_NO_ETAG_PIN}{size}:{mtime_ns // 1_000_000_000}"


def if_match(pin: str) -> str | None:
    """The ``If-Match`` value for a read of the pinned version (None for a pin without an
    ETag: the reply's size and date are checked instead)."""
    return None if not pin or pin.startswith(_NO_ETAG_PIN) else pin


def _bare_etag(etag: str) -> str:
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    return etag.strip('"')


def reply_version_error(
    pin: str, etag: str | None, last_modified: str | None, total_size: int | None
) -> str | None:
    """Why a data reply is not of the pinned version (None: it is, as far as the reply
    tells). ``etag``, ``last_modified`` (an HTTP date) and ``total_size`` (the object's size,
    from ``Content-Range`` or a whole reply's length) are the reply's, None where it sent
    none. A reply without an ETag cannot be checked against an ETag pin, and passes."""
    if not pin:
        return None
    if not pin.startswith(_NO_ETAG_PIN):
        if etag and _bare_etag(etag) != _bare_etag(pin):
            return f"the reply is of version {etag}, not the pinned {pin}"
        return None
    size_s, _, seconds_s = pin[len(_NO_ETAG_PIN) :].partition(":")
    if total_size is not None and total_size != int(size_s):
        return f"the object now has {total_size} bytes, not the pinned {size_s}"
    if last_modified:
        try:
            when = int(email.utils.parsedate_to_datetime(last_modified).timestamp())
        except (TypeError, ValueError):
            return None
        if when != int(seconds_s):
            return f"the object was modified at {last_modified}, after the pinned version"
    return None


def content_range_total(content_range: str | None) -> int | None:
    """The total size in a ``Content-Range: bytes A-B/TOTAL`` header (None if unknown)."""
    if not content_range:
        return None
    _, _, total = content_range.rpartition("/")
    return int(total) if total.strip().isdigit() else None


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
        the views (the memory tier's pooled buffers) without an intermediate copy. Views
        that are ``rawhttp.FilledViews`` are reported as each is filled.
        """
        length = sum(len(v) for v in views)
        data = memoryview(await self.read_range(key, etag, start, length))
        offset = 0
        for n, view in enumerate(views):
            view[:] = data[offset : offset + len(view)]
            offset += len(view)
            report_filled(views, n)

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

    def cache_engine_statistics(self) -> dict[str, int] | None:
        """What data GETs did through ``--cache-proxy`` (see objfs.cache_engine); None
        without one."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections and threads."""
