"""``objfs status MOUNTPOINT``: the live figures of a mount, for a person or a probe.

Given the fd dir of ``objfs sidecar --fd-dir`` instead, it reads the sidecar's own status file
(see :mod:`objfs.sidecar_fd`): ``--probe`` then passes while the sidecar runs and serves every
volume offered to it.

It reads the status file the daemon rewrites every second (see :mod:`objfs.status_files`) and the
kernel's mount table; it never touches the mount itself, so it answers while the mount hangs.
It trusts only status files written by the user that mounted (or root) in a folder no other
user may write; another one is skipped with a warning.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any

from objfs.errors import DaemonNotAnsweringError, NotMountedError
from objfs.mountinfo import _mountinfo_record, mount_entry
from objfs.status_files import STATUS_INTERVAL_S, find_status_files, pid_gone

#: A status file older than this means the daemon no longer runs its loop.
DEFAULT_MAX_AGE_S = 10.0
#: ``objfs sidecar --fd-dir``'s status file, in its state dir, and the kind it declares.
STATUS_FILE = ".objfs-sidecar.json"
STATUS_KIND = "fd-sidecar"


def _resolve(path: str) -> str:
    # Resolve the parent only, as the daemon did before mounting: stat-ing the mount root
    # would hang on a stuck mount.
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


class _Untrusted(Exception):
    """A status file that someone other than the mount's owner could have written."""


def _trusted_owners(mountpoint: str) -> set[int]:
    """Who may have written the status file of the mount at ``mountpoint``: the user that
    mounted it (the FUSE mount's ``user_id``, the daemon's uid) and root; this user and root
    when the mount table does not say."""
    record = _mountinfo_record(mountpoint)
    options = record[1][2].split(",") if record is not None and len(record[1]) > 2 else []
    for option in options:
        name, _, value = option.partition("=")
        if name == "user_id" and value.isdigit():
            return {int(value), 0}
    return {os.geteuid(), 0}


def _owner_text(owners: set[int]) -> str:
    return " or ".join(f"uid {uid}" for uid in sorted(owners, reverse=True))


def _read_trusted(file: str, owners: set[int]) -> Any:
    """The JSON of the status file ``file``; raises _Untrusted (its reason) unless the file is
    a regular file that one of ``owners`` owns and only its owner may write, in a folder
    of one of ``owners`` that only its owner may write. OSError, ValueError: unreadable."""
    folder = os.stat(os.path.dirname(file))
    if folder.st_uid not in owners:
        raise _Untrusted(
            f"its folder belongs to uid {folder.st_uid}, not to the mount's owner "
            f"({_owner_text(owners)}): set OBJFS_RUNTIME_DIR to a private folder"
        )
    if folder.st_mode & 0o022:
        raise _Untrusted(
            "its folder is writable by other users: make it private (chmod go-w) or set "
            "OBJFS_RUNTIME_DIR to a private folder"
        )
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # ELOOP for a symlink
    with open(fd, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted("not a regular file")
        if st.st_uid not in owners:
            raise _Untrusted(
                f"owned by uid {st.st_uid}, not by the mount's owner ({_owner_text(owners)})"
            )
        if st.st_mode & 0o022:
            raise _Untrusted("writable by other users (a daemon writes it with mode 0644)")
        return json.load(f)


def read_status(path: str, *, max_age_s: float = DEFAULT_MAX_AGE_S) -> dict[str, Any]:
    """The live figures of the mount at ``path``; raises NotMountedError (15) if nothing is
    mounted there, DaemonNotAnsweringError (18) if no live objfs daemon reports on it.

    Only status files the mount's owner (or root) wrote, in a folder no other user may
    write, are trusted (see :func:`_read_trusted`); any other one is skipped with a warning
    on stderr: another user's file could report a hung or dead daemon as live."""
    mountpoint = _resolve(path)
    entry = mount_entry(mountpoint)
    if entry is None or not entry[0].startswith("fuse"):
        # The fd dir of `objfs sidecar --fd-dir` (an emptyDir, maybe tmpfs): its own file.
        sidecar_file = state_status_file(mountpoint)
        if sidecar_file is not None:
            return read_fd_sidecar_status(path, sidecar_file, max_age_s)
    if entry is None:
        raise NotMountedError(f"{path} is not mounted")
    if entry[0] != "fuse.objfs":
        raise NotMountedError(f"{path} is not an objfs mount (it is {entry[0]})")
    owners = _trusted_owners(mountpoint)
    newest: dict[str, Any] | None = None
    for file in find_status_files(mountpoint):
        try:
            data = _read_trusted(file, owners)
        except _Untrusted as exc:
            print(f"objfs: warning: ignoring status file {file}: {exc}", file=sys.stderr)
            continue
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("mountpoint") != mountpoint:
            continue
        if newest is None or data.get("updated_at", 0) > newest.get("updated_at", 0):
            newest = data
    if newest is None:
        raise DaemonNotAnsweringError(
            f"{path} is an objfs mount but no daemon reports on it: it died (then `objfs "
            f"unmount --force {path}` and mount again) or runs as another user or in another "
            "container (set OBJFS_RUNTIME_DIR alike for both)"
        )
    pid = int(newest.get("pid", 0))
    if pid <= 0 or pid_gone(pid):
        raise DaemonNotAnsweringError(
            f"the objfs daemon of {path} (pid {pid}) is gone: run `objfs unmount --force "
            f"{path}` and mount again"
        )
    age = time.time() - float(newest.get("updated_at", 0))
    if age > max_age_s:
        raise DaemonNotAnsweringError(
            f"the objfs daemon of {path} (pid {pid}) has not reported for {age:.0f} s "
            f"(it reports every {STATUS_INTERVAL_S:.0f} s): it hangs or is stopped"
        )
    return newest


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _grows_to(memory: dict[str, Any]) -> str:
    """' (grows to X)' where the budget may grow (the default --memory-limit), else ''."""
    ceiling = memory.get("ceiling_bytes", 0)
    return f" (grows to {_size(ceiling)})" if ceiling > memory["limit_bytes"] else ""


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s"


def _rate(hits: int, misses: int) -> str:
    total = hits + misses
    return "no lookups yet" if total == 0 else f"{100 * hits / total:.1f}% hits"


def format_status(s: dict[str, Any]) -> str:
    """A few aligned lines for a person."""
    if s.get("kind") == STATUS_KIND:
        return format_fd_sidecar_status(s)
    store, memory, disk = s["store"], s["memory"], s.get("disk")
    rates = s.get("rates") or {}
    window = float(rates.get("window_s", 0.0))
    requests = store["requests"]
    errors = sum(store["errors"].values())
    error_kinds = ", ".join(f"{k} {n}" for k, n in store["errors"].items() if n)
    served = s["served"]["bytes"]
    from_caches = max(0.0, min(1.0, 1 - store["bytes_fetched"] / served)) if served else None
    lines = [
        f"{s['mountpoint']}: {s['source']} ({s['backend']})",
        f"  daemon        pid {s['pid']}, objfs {s['version']}, up "
        f"{_duration(time.time() - s['started_at'])}",
        f"  served        {_size(served)} in {s['served']['reads']} reads; "
        + (
            f"{_size(rates.get('served_bytes_per_s', 0.0))}/s over the last {window:.0f} s"
            if window > 0
            else "rate: measuring"
        ),
        f"  fetched       {_size(store['bytes_fetched'])}; "
        + (
            f"{_size(rates.get('fetched_bytes_per_s', 0.0))}/s" if window > 0 else "rate: measuring"
        ),
        f"  requests      {requests['get']} GET, {requests['list']} LIST, {requests['head']} HEAD;"
        f" {store['in_flight']} in flight, {errors} failed"
        + (f" ({error_kinds})" if error_kinds else ""),
        f"  memory cache  {_size(memory['used_bytes'])} of {_size(memory['limit_bytes'])}"
        f"{_grows_to(memory)} used "
        f"(peak {_size(memory['peak_bytes'])}); {memory['hits']} block hits, "
        f"{memory['misses']} blocks loaded",
    ]
    if disk is None:
        lines.append("  disk cache    off (no --cache-dir)")
    else:
        state = "" if disk["enabled"] else " (turned off after an error: see the log)"
        looked_up = disk["hits"] + disk["misses"]
        lines.append(
            f"  disk cache    {_size(disk['bytes'])} of {_size(disk['limit_bytes'])}; "
            f"{_rate(disk['hits'], disk['misses'])} ({disk['hits']} of {looked_up} blocks)"
            f"{state}"
        )
    if from_caches is not None:
        lines.append(
            f"  hit rate      {100 * from_caches:.1f}% of the bytes served came from the caches"
        )
    lines.append(f"  open files    {s['open_files']} ({s['inodes']} inodes known)")
    fuse = s.get("fuse") or {}
    if fuse.get("transport") == "kernel":
        lines.append(
            f"  fuse          kernel transport, protocol {fuse.get('protocol')}, requests up to "
            f"{_size(fuse.get('max_request_bytes', 0))}; {' '.join(fuse.get('flags', []))}"
            + (
                f"; {fuse.get('passthrough_opens', 0)} opens served by the kernel from the disk "
                "cache (passthrough)"
                if fuse.get("passthrough")
                else ""
            )
        )
    elif fuse:
        lines.append(f"  fuse          {fuse.get('transport')} transport")
    meta = s.get("metadata") or {}
    if meta.get("empty_source"):
        if meta.get("account_root"):
            lines.append("  source        no bucket or container visible at mount: which account?")
        else:
            lines.append("  source        held no objects at mount: is SOURCE mistyped?")
    if meta.get("unreachable_for_s") is not None:
        lines.append(
            f"  store         UNREACHABLE for {_duration(meta['unreachable_for_s'])}: serving "
            f"cached metadata (--max-stale); {meta.get('stale_answers', 0)} stale answers"
        )
    elif meta.get("outages"):
        lines.append(
            f"  store         {meta['outages']} outages so far, "
            f"{meta.get('stale_answers', 0)} answers served from stale metadata"
        )
    if s.get("metrics_addr"):
        lines.append(f"  metrics       http://{s['metrics_addr']}/metrics")
    return "\n".join(lines)


# -- `objfs sidecar --fd-dir`'s status file (objfs.sidecar_fd writes it) -------------------


def state_status_file(path: str) -> str | None:
    """The sidecar's status file if ``path`` is its fd dir (or state dir), else None.

    Only for a path that is not a FUSE mount: looking inside one could hang.
    """
    file = os.path.join(path, STATUS_FILE)
    return file if os.path.isfile(file) else None


def read_fd_sidecar_status(path: str, status_file: str, max_age_s: float) -> dict[str, Any]:
    """``objfs status DIR`` for an fd dir: the sidecar's figures.

    Raises DaemonNotAnsweringError (18) if the sidecar is gone or silent for ``max_age_s``,
    or if a volume offered to it is not served (``--probe`` fails until every one serves).
    """
    try:
        with open(status_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise DaemonNotAnsweringError(f"cannot read {status_file}: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != STATUS_KIND:
        raise DaemonNotAnsweringError(f"{status_file} is not an objfs sidecar's status file")
    pid = int(data.get("pid", 0))
    if pid <= 0 or pid_gone(pid):
        raise DaemonNotAnsweringError(f"the objfs sidecar serving {path} (pid {pid}) is gone")
    age = time.time() - float(data.get("updated_at", 0))
    if age > max_age_s:
        raise DaemonNotAnsweringError(
            f"the objfs sidecar serving {path} (pid {pid}) has not reported for {age:.0f} s: "
            "it hangs or is stopped"
        )
    if not data.get("ready"):
        pending = [
            f"{name} ({v.get('state')}" + (f": {v['error']}" if v.get("error") else "") + ")"
            for name, v in sorted(dict(data.get("volumes", {})).items())
            if v.get("state") not in ("serving", "idle")
        ]
        raise DaemonNotAnsweringError(
            f"the objfs sidecar in {path} does not serve every volume yet: "
            + (", ".join(pending) or "starting")
        )
    return data


def format_fd_sidecar_status(s: dict[str, Any]) -> str:
    lines = [f"{s['fd_dir']}: objfs sidecar, pid {s['pid']}, {len(s['volumes'])} volumes"]
    for name, v in sorted(s["volumes"].items()):
        line = f"  {name:<20} {v.get('state')}"
        if v.get("source"):
            line += f"  {v['source']}"
        if v.get("pid"):
            line += f"  (pid {v['pid']})"
        if v.get("error"):
            line += f"  {v['error']}"
        lines.append(line)
    return "\n".join(lines)
