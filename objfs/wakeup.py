"""One wake-up primitive for tasks on the trio thread.

:class:`Signal` wakes every task waiting when it fires. The rule it makes structural: an event
that tasks wait on is replaced only once it is set, so no waiter is ever left on an event that
nobody will set (``tests/test_wakeups.py`` checks that the scheduler and the write-behind
replace none of theirs another way).
"""

from __future__ import annotations

import trio


class Signal:
    """Wakes every task waiting at the time of :meth:`fire`. Its event is replaced only in
    ``fire``, right after it is set, so no waiter is ever left on an event nobody sets. A
    waiter checks its condition before waiting, with no await in between."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()
