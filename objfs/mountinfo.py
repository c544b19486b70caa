"""Which mount sits at a path, from the kernel's table (``/proc/self/mountinfo``).

Kept apart from :mod:`objfs.mount` so that light commands (``objfs warm``, ``objfs status``)
do not import the FUSE binding, trio and the store SDKs just to find a mount: that import
took 0.25-0.35 s of every ``objfs warm``. Nothing here stats a mount, so a mount whose daemon
hangs or died cannot block or fail these lookups.
"""

from __future__ import annotations

import os


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and i + 4 <= len(field):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mountinfo_record(target: str) -> tuple[list[str], list[str]] | None:
    """The topmost /proc/self/mountinfo line mounted at ``target`` (a real path), split into
    its fields before and after the `` - `` separator.

    Mounts may be stacked at one path (the CSI node plugin mounts a fresh FUSE connection on
    top of a dead one): the topmost is the one no other mount at ``target`` sits on (its mount
    id is no other's parent id there), and the last such line when that does not decide."""
    found: list[tuple[list[str], list[str]]] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and _unescape_mountinfo(fields[4]) == target:
                found.append((fields, right.split()))
    parents = {fields[1] for fields, _ in found}
    on_top = [record for record in found if record[0][0] not in parents]
    if on_top:
        return on_top[-1]
    return found[-1] if found else None


def mount_entry(path: str) -> tuple[str, str] | None:
    """Return (fstype, source) if ``path`` is a mount point, from /proc/self/mountinfo.

    Reads the kernel's table instead of stat-ing the path, which would hang on a mount whose
    daemon is stuck and fail on one whose daemon died.
    """
    # Resolve the parent only: stat-ing a mount root blocks while its daemon is stuck.
    absolute = os.path.abspath(path)
    target = os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))
    record = _mountinfo_record(target)
    if record is None:
        return None
    rest = record[1]
    return (rest[0], rest[1] if len(rest) > 1 else "")
