"""The one retry layer of a backend request, shared by the S3 and Azure backends.

:class:`Tries` runs in the worker thread of one data GET: a retryable failure (connection,
throttling, 5xx, short body, wrong range) is retried until ``max_attempts`` tries have failed,
sleeping the backend's jittered backoff between them; a refusal of the credentials gets one
extra try, at once and not counted as a failure, if the credential files
(:class:`~objfs.credentials.CredentialWatch`) now hold newer credentials than the request was
signed with. :func:`call_with_reload` is the same extra try for one SDK call (listings, HEADs),
whose own retry policy is the retry layer there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from objfs.credentials import CredentialWatch

T = TypeVar("T")


class Tries:
    """The tries of one request (one worker thread; not shared)."""

    def __init__(
        self,
        max_attempts: int,
        watch: CredentialWatch | None,
        backoff_s: Callable[[int], float],
    ) -> None:
        self._attempts = max(1, max_attempts)
        self._backoff_s = backoff_s
        self._watch = watch
        self._failures = 0
        self._reloaded = False  # the one try with reloaded credentials is spent
        # The credentials the next try is signed with (checking the files is cheap).
        self._generation = 0 if watch is None else watch.poll()

    def failed(self, error: Exception) -> None:
        """A retryable failure: raise ``error`` if it was the last try, else sleep the
        backoff before the next one."""
        self._failures += 1
        if self._failures >= self._attempts:
            raise error
        time.sleep(self._backoff_s(self._failures - 1))

    def refused(self) -> bool:
        """The store refused the credentials: True if newer ones are there to try once more
        (at once); False if the refusal is final."""
        if self._watch is None or self._reloaded:
            return False
        newer = self._watch.newer_than(self._generation)
        if newer is None:
            return False
        self._reloaded, self._generation = True, newer
        return True


def call_with_reload(
    watch: CredentialWatch | None, fn: Callable[[], T], is_refusal: Callable[[Exception], bool]
) -> T:
    """``fn()``, once more if it failed with a refusal of the credentials and the credential
    files now hold newer ones."""
    generation = 0 if watch is None else watch.poll()
    try:
        return fn()
    except Exception as exc:
        if watch is None or not is_refusal(exc) or watch.newer_than(generation) is None:
            raise
    return fn()  # signed with the reloaded credentials
