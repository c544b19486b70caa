"""One rule for the errors of a nursery: callers see one exception, never a group.

trio (>= 0.25) wraps whatever a nursery's tasks raise in a ``BaseExceptionGroup``, even a single
exception. objfs's error handling (the stale-but-available rule in :mod:`objfs.availability`,
the errno boundary in :mod:`objfs.fuse_ops`, the exit codes of the CLI) catches domain
exceptions by class, so a group would slip past every ``except`` and become EIO or "internal
error". Every nursery in objfs is therefore opened with :func:`open_nursery`, which applies
:func:`collapse`:

* a group whose leaves are all ``trio.Cancelled`` is re-raised as it is (trio's cancel scopes
  catch such groups);
* otherwise the leaf that says most is raised by itself, with its own traceback: a
  ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt, SystemExit) first, then
  an exception that is not an :class:`~objfs.errors.ObjfsError` (a bug: it must surface as
  one), then a domain error that is not transient (a 403 is EACCES even when the other task
  timed out), then the first domain error.

Invariant (tested): nothing that leaves :func:`open_nursery` is a ``BaseExceptionGroup`` unless
all of its leaves are ``trio.Cancelled``; and the exception raised is one of the leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

from objfs.errors import EndpointUnreachableError, ObjfsError, TransientStoreError


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions of ``group`` and of the groups nested in it, in order."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found.extend(leaves(exc))
        else:
            found.append(exc)
    return found


def _rank(exc: BaseException) -> int:
    if not isinstance(exc, Exception):
        return 0
    if not isinstance(exc, ObjfsError):
        return 1
    if not isinstance(exc, EndpointUnreachableError | TransientStoreError):
        return 2
    return 3


def collapse(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception to raise for ``group`` (``group`` itself if every leaf is
    ``trio.Cancelled``); see the module docstring for the order."""
    candidates = [exc for exc in leaves(group) if not isinstance(exc, trio.Cancelled)]
    if not candidates:
        return group
    return min(candidates, key=_rank)  # min keeps the first of equal rank


@contextlib.asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """``trio.open_nursery()`` whose failure is one exception (see :func:`collapse`)."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        chosen = collapse(group)
        if chosen is group:
            raise
        raise chosen from None
