"""READs enter objfs's core in the order the kernel sent them (trio thread only).

trio may start tasks spawned together in any order (it reverses batches at random), and the
core tells a sequential reader from a random one by the order its reads come in: the kernel's
read-ahead READ (offset 1 MiB) entering before the READ at 0 made a cold read fetch blocks
twice. Contract: each READ is numbered as it arrives (:meth:`ReadTurns.number`), waits in
:meth:`ReadTurns.take` until every READ numbered before it has entered the core or given up,
and then passes its turn on (:meth:`ReadTurns.done`); a READ that never takes its turn gives it
up (:meth:`ReadTurns.give_up`), so no READ waits on it.
"""

from __future__ import annotations

import trio


class ReadTurns:
    """The READs' turns to enter the core (see the module's contract)."""

    def __init__(self) -> None:
        self._next = 0  # the number of the next READ to arrive
        self._turn = 0  # the READ whose turn it is
        self._skipped: set[int] = set()  # READs past their turn, before ``_turn`` reaches them
        self._changed = trio.Event()

    def number(self) -> int:
        """The number of a READ that just arrived."""
        seq, self._next = self._next, self._next + 1
        return seq

    def idle(self) -> bool:
        """Whether every READ numbered so far has entered the core (or given up): a READ
        answered now, without a number, enters in its arrival order."""
        return self._turn == self._next

    async def take(self, seq: int) -> None:
        """Wait until every READ that arrived before READ ``seq`` has entered the core."""
        while self._turn != seq:
            await self._changed.wait()

    def done(self, seq: int) -> None:
        """READ ``seq`` has entered the core (or never will): the next one may."""
        assert seq >= self._turn, f"READ {seq}: its turn is past (turn {self._turn})"
        self._skipped.add(seq)
        while self._turn in self._skipped:
            self._skipped.discard(self._turn)
            self._turn += 1
        self._changed.set()
        self._changed = trio.Event()

    def give_up(self, seq: int) -> None:
        """READ ``seq`` ends: its turn passes on unless it passed already."""
        if seq >= self._turn:
            self.done(seq)
