"""The wake-up rules of the fetcher and the write-behind, checked.

A waiter left on an event that nobody will set sleeps forever: in ``objfs.scheduler`` and
``objfs.write_behind`` an event kept in an attribute is replaced only by
:meth:`objfs.wakeup.Signal.fire`, right after it is set.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trio
import trio.testing

from objfs.wakeup import Signal

PACKAGE = Path(__file__).resolve().parents[1] / "objfs"
MODULES = ("scheduler.py", "write_behind.py")


async def test_a_signal_wakes_the_waiters_present_and_no_later_one() -> None:
    signal = Signal()
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await signal.wait()
        woken.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "a")
        nursery.start_soon(waiter, "b")
        await trio.testing.wait_all_tasks_blocked()
        signal.fire()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == ["a", "b"]
        nursery.start_soon(waiter, "c")  # arrives after the fire: waits for the next one
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == ["a", "b"]
        signal.fire()
    assert woken[-1] == "c"


def replaced_events(path: Path) -> list[str]:
    """``self.x = trio.Event()`` outside ``__init__`` and outside class Signal."""
    found: list[str] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, [*scope, child.name])
                continue
            if (
                isinstance(child, ast.Assign)
                and isinstance(child.value, ast.Call)
                and ast.unparse(child.value.func) == "trio.Event"
                and any(isinstance(t, ast.Attribute) for t in child.targets)
                and "Signal" not in scope
                and scope[-1:] != ["__init__"]
            ):
                found.append(f"{path.name}:{child.lineno} in {'.'.join(scope)}")
            visit(child, scope)

    visit(ast.parse(path.read_text()), [])
    return found


def test_events_in_attributes_are_replaced_only_by_a_signal() -> None:
    found = [hit for name in MODULES for hit in replaced_events(PACKAGE / name)]
    assert not found, f"an event replaced outside Signal.fire: {found}"
