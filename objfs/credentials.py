"""``--credentials-file``: store credentials kept in a file instead of the command line.

fstab lines, mount options and unit files are readable by every user and end up in logs and
process listings, so credentials never go there. A credentials file holds ``NAME=VALUE``
lines (the format of systemd's ``EnvironmentFile`` and ``docker --env-file``) for the same
variables the SDKs read from the environment; the mounting daemon loads them into its own
environment before it builds its client. Values are never printed or logged.

While mounted, :class:`CredentialWatch` re-reads the credential files when they change (a
rotated key, SAS or session token, a Kubernetes Secret volume swapping its ``..data``
symlink) and when a request fails authentication, and hands the new values to the backend.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from objfs.errors import ObjfsError, UsageError

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
    """Parse ``path``; raises UsageError naming the file, the line number and what the line
    should be (never any of the line's text: a name may be a secret mistyped)."""
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
            # Never echo the line: a bare secret with base64 padding ("...==") parses as a
            # NAME=VALUE line whose name is the secret.
            raise UsageError(
                f"{option} {path}: line {number} does not set a credential variable objfs "
                "reads: give NAME=VALUE lines, NAME one of " + ", ".join(sorted(ALLOWED))
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


# -- re-reading credential files while mounted -----------------------------------------------

#: How often at most a request stats the credential files (a stat per file).
CHECK_INTERVAL_S = 1.0

#: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of the file a path resolves to
#: (symlinks followed), or None when it cannot be stat'ed.
Signature = tuple[int, int, int, int, int] | None

#: Given the environment with the credentials file's current values, a backend validates the
#: credentials it would build from it (raising an ObjfsError naming the problem, never a
#: value) and returns the function that puts them in use.
Prepare = Callable[[Mapping[str, str]], Callable[[], None]]


def _signature(path: str) -> Signature:
    try:
        st = os.stat(path)  # the file, not the link: Kubernetes swaps a `..data` symlink
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class CredentialWatch:
    """The credential files of a mount (``--credentials-file``, ``--sas-token-file``),
    re-read when they change.

    :meth:`poll` stats the files, at most once per ``interval_s`` unless ``force`` (after a
    request failed authentication). When a file's signature (inode, size, times) changed, the
    credentials file is parsed again, the backend's ``prepare`` (see :meth:`bind`) builds and
    validates the new credentials from it, and only if that succeeds and no file changed
    while it was read are they put in use: :attr:`generation` grows by one and
    "credentials reloaded from FILE" is logged. A missing, unreadable or invalid file (a
    half-written one that does not parse) keeps the current credentials and logs one warning
    (until the files change again); a file that changes while it is read is read again at
    the next poll. Nothing here raises, and no value is ever logged.

    Thread-safe: requests poll from worker threads; one of them re-reads at a time while
    the others go on with the current credentials.
    """

    def __init__(
        self,
        files: Sequence[tuple[str, str]],
        *,
        credentials_file: str | None = None,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``files``: (option, absolute path) pairs to watch; ``credentials_file``, one of
        them, is the ``NAME=VALUE`` file whose values :attr:`environ` holds. Raises
        UsageError if the credentials file cannot be read now."""
        self._files = list(files)
        self._credentials_file = credentials_file
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._prepare: Prepare | None = None
        self._generation = 0
        # Signatures first: a change while the files are read now is seen at the next poll.
        self._signatures = self._stat()
        self._rejected: dict[str, Signature] | None = None
        self._base = dict(os.environ)
        values = {} if credentials_file is None else read_credentials_file(credentials_file)
        # The file's names belong to it: a name it no longer sets is unset, not the old value.
        for name in values:
            self._base.pop(name, None)
        self.environ: Mapping[str, str] = {**self._base, **values}
        self._next_check_s = clock() + interval_s

    @classmethod
    def open(
        cls, credentials_file: str | None, sas_token_file: str | None = None
    ) -> CredentialWatch | None:
        """A watch of the files given, or None when there is none to watch."""
        files = [
            (option, path)
            for option, path in (
                ("--credentials-file", credentials_file),
                ("--sas-token-file", sas_token_file),
            )
            if path is not None
        ]
        return cls(files, credentials_file=credentials_file) if files else None

    @property
    def generation(self) -> int:
        """How many times the credentials were replaced since the mount."""
        return self._generation

    def bind(self, prepare: Prepare) -> None:
        """Let ``prepare`` rebuild the backend's credentials at each change (see Prepare)."""
        self._prepare = prepare

    def poll(self, *, force: bool = False) -> int:
        """Re-read the files if they changed (checked at most once per interval unless
        ``force``); returns :attr:`generation` after it."""
        if not force and self._clock() < self._next_check_s:
            return self._generation
        with self._lock:
            now = self._clock()
            if not force and now < self._next_check_s:
                return self._generation
            self._next_check_s = now + self._interval_s
            self._check()
            return self._generation

    def newer_than(self, generation: int) -> int | None:
        """After a request signed at ``generation`` failed authentication: re-read the files
        now; the generation to retry with, or None when nothing newer is there."""
        current = self.poll(force=True)
        return current if current != generation else None

    def _stat(self) -> dict[str, Signature]:
        return {path: _signature(path) for _, path in self._files}

    def _check(self) -> None:
        seen = self._stat()
        if seen == self._signatures:
            self._rejected = None
            return
        if seen == self._rejected:
            return  # warned about exactly these files already
        missing = [f"{option} {path}" for option, path in self._files if seen[path] is None]
        if missing:
            self._reject(seen, f"{', '.join(missing)}: missing or unreadable")
            return
        try:
            values = (
                {}
                if self._credentials_file is None
                else read_credentials_file(self._credentials_file)
            )
            environ = {**self._base, **values}
            commit = self._prepare(environ) if self._prepare is not None else _nothing
        except ObjfsError as exc:  # messages name files and lines, never values
            self._reject(seen, str(exc))
            return
        except Exception as exc:  # never crash a mount over a credential file
            self._reject(seen, f"unexpected {type(exc).__name__} while reading them")
            return
        if self._stat() != seen:
            return  # written while read: read again at the next poll
        try:
            commit()
        except Exception as exc:
            self._reject(seen, f"unexpected {type(exc).__name__} while applying them")
            return
        changed = [path for _, path in self._files if seen[path] != self._signatures[path]]
        self.environ = environ
        self._signatures = seen
        self._rejected = None
        self._generation += 1
        for path in changed:
            log.info("credentials reloaded from %s", path)

    def _reject(self, seen: dict[str, Signature], reason: str) -> None:
        self._rejected = seen
        log.warning(
            "credential files changed but cannot be used (%s): keeping the current credentials",
            reason,
        )


def _nothing() -> None:
    pass
