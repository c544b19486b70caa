"""``--credentials-file``: store credentials kept in a file instead of the command line.

fstab lines, mount options and unit files are readable by every user and end up in logs and
process listings, so credentials never go there. A credentials file holds ``NAME=VALUE``
lines (the format of systemd's ``EnvironmentFile`` and ``docker --env-file``) for the same
variables the SDKs read from the environment; the mounting daemon loads them into its own
environment before it builds its client. Values are never printed or logged.
"""

from __future__ import annotations

import logging
import os
import stat

from objfs.errors import UsageError

log = logging.getLogger("objfs")

#: The variables a credentials file may set.
ALLOWED = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_STORAGE_ACCOUNT",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_CLIENT_ID",
        "AZURE_TENANT_ID",
        "AZURE_CLIENT_SECRET",
    }
)


def read_credentials_file(path: str) -> dict[str, str]:
    """Parse ``path``; raises UsageError naming the file and line (never a value)."""
    return _read(path)[0]


def _read(path: str) -> tuple[dict[str, str], int]:
    option = "--credentials-file"
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror}: give a readable file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not a text file of NAME=VALUE lines") from None
    if not stat.S_ISREG(mode):
        raise UsageError(f"{option} {path}: not a regular file")
    values: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"{option} {path}: line {number} is not NAME=VALUE")
        if name not in ALLOWED:
            raise UsageError(
                f"{option} {path}: line {number}: {name[:64]!r} is not a credential variable "
                "objfs reads (" + ", ".join(sorted(ALLOWED)) + ")"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values, mode


def load_credentials_file(path: str) -> None:
    """Put the file's variables into this process's environment (they win over it)."""
    values, mode = _read(path)
    if mode & 0o077:
        log.warning("--credentials-file %s can be read by other users: chmod 600 it", path)
    os.environ.update(values)
