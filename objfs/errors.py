"""Domain exceptions: one class per failure a user or a FUSE caller can see.

Every exception carries two mappings so that no other module has to decide them:

* ``errno``: what a FUSE request that hits this failure returns (``fuse_ops`` is the only
  place that turns it into ``pyfuse3.FUSEError``);
* ``exit_code``: what ``objfs`` exits with when the failure stops a command (the README's
  exit-code table is generated from :data:`EXIT_CODES` by hand; keep them in step).

Messages are one line, name the problem and the fix, and never contain credentials.
"""

from __future__ import annotations

import errno as _errno
import logging
from typing import ClassVar


class ObjfsError(Exception):
    """Base class. ``str(exc)`` is the one-line message shown to the user."""

    errno: ClassVar[int] = _errno.EIO
    exit_code: ClassVar[int] = 1
    log_level: ClassVar[int] = logging.ERROR


# --- command-line / configuration -------------------------------------------------------------


class UsageError(ObjfsError):
    """An option value is malformed (a size, a TTL, a uid...)."""

    exit_code = 2


class SourceFormatError(ObjfsError):
    """SOURCE is not a well-formed URL of a supported scheme (e.g. no bucket name)."""

    exit_code = 3


class UnknownSchemeError(ObjfsError):
    """SOURCE names a scheme objfs does not serve."""

    exit_code = 4


# --- object store ---------------------------------------------------------------------------


class BucketNotFoundError(ObjfsError):
    """The bucket (or container) does not exist at the endpoint."""

    errno = _errno.ENOENT
    exit_code = 5


class AccessDeniedError(ObjfsError):
    """The store refused the credentials or the operation (HTTP 403)."""

    errno = _errno.EACCES
    exit_code = 6
    log_level = logging.WARNING


class NoCredentialsError(ObjfsError):
    """No credentials were found and unsigned requests were not asked for."""

    errno = _errno.EACCES
    exit_code = 7


class EndpointUnreachableError(ObjfsError):
    """The endpoint refused, timed out or did not resolve."""

    errno = _errno.EIO
    exit_code = 8


class ObjectNotFoundError(ObjfsError):
    """A key that was listed no longer exists."""

    errno = _errno.ENOENT
    exit_code = 1
    log_level = logging.INFO


class StaleObjectError(ObjfsError):
    """The object changed (new ETag) while a handle pinned to the old version was open."""

    errno = _errno.ESTALE
    log_level = logging.WARNING


class TransientStoreError(ObjfsError):
    """A request failed after retries (5xx, throttling, connection reset, truncated body)."""

    errno = _errno.EIO


# --- local side -----------------------------------------------------------------------------


class MountpointMissingError(ObjfsError):
    exit_code = 9


class MountpointNotDirectoryError(ObjfsError):
    exit_code = 10


class MountpointNotEmptyError(ObjfsError):
    exit_code = 11


class AlreadyMountedError(ObjfsError):
    exit_code = 12


class FuseUnavailableError(ObjfsError):
    exit_code = 13


class MountFailedError(ObjfsError):
    """The mount could not be established or the daemon died before it served."""

    exit_code = 14


class NotMountedError(ObjfsError):
    """``objfs unmount`` was given a path that is not an objfs/FUSE mount."""

    exit_code = 15


class UnmountFailedError(ObjfsError):
    """``objfs unmount`` could not detach the mount (busy, no permission)."""

    exit_code = 16


class WarmIncompleteError(ObjfsError):
    """``objfs warm`` could not read some of the files."""

    exit_code = 17


class DaemonNotAnsweringError(ObjfsError):
    """``objfs status``: the mount exists but no live objfs daemon reports on it."""

    exit_code = 18


class MountLostError(ObjfsError):
    """``objfs sidecar``: the mount stopped while serving (its daemon died or was unmounted)."""

    exit_code = 19


class InternalError(ObjfsError):
    """An unexpected exception (a bug, or a failure objfs has no message for) that stopped a
    mount's daemon: already logged with its traceback (see :func:`log_internal_error`) and
    reported to ``objfs mount``; raised in its place so that it is not logged twice."""


class ReadOnlyError(ObjfsError):
    """Any attempt to modify the file system."""

    errno = _errno.EROFS
    log_level = logging.DEBUG


class NotADirectoryFsError(ObjfsError):
    errno = _errno.ENOTDIR
    log_level = logging.DEBUG


class IsADirectoryFsError(ObjfsError):
    errno = _errno.EISDIR
    log_level = logging.DEBUG


class BadFileHandleError(ObjfsError):
    errno = _errno.EBADF


class InvalidArgumentError(ObjfsError):
    errno = _errno.EINVAL
    log_level = logging.DEBUG


class NoDiskCacheError(ObjfsError):
    """A warm into the caches only (``objfs warm --cache-only``) on a mount without a disk
    cache: nothing would keep the bytes."""

    errno = _errno.EOPNOTSUPP
    log_level = logging.INFO


#: Exit codes in the order the README lists them.
EXIT_CODES: dict[int, str] = {
    0: "success (for `mount` without --foreground: the mount is live and serving)",
    1: "unexpected internal error (please report it with the log)",
    2: "usage: an unknown option or a malformed value",
    3: "SOURCE is malformed (e.g. no bucket name, credentials embedded in it)",
    4: "SOURCE has an unknown scheme",
    5: "bucket not found",
    6: "access denied by the store (wrong keys, missing permission)",
    7: "no credentials found",
    8: "endpoint unreachable (refused, timed out, name not resolved, TLS failure)",
    9: "mountpoint does not exist",
    10: "mountpoint is not a directory",
    11: "mountpoint is not empty",
    12: "mountpoint is already mounted",
    13: "FUSE is unavailable (/dev/fuse or fusermount3 missing, no permission)",
    14: "the mount failed or the daemon stopped before it served",
    15: "`unmount`, `status`: the path is not mounted",
    16: "`unmount`: the mount is busy or could not be detached",
    17: "`warm`: some files could not be read (each is listed), or, with `--cache-only`, "
    "not stored whole in the disk cache",
    18: "`status`: no live objfs daemon reports on the mount (it died or hangs)",
    19: "`sidecar`: the mount stopped while serving (the daemon died or was unmounted)",
}


#: The attribute that marks the log record of an internal error's traceback: a terminal's
#: handler shows it only at debug level (objfs.logsetup.setup_logging), since the command prints
#: the error's one line there itself.
INTERNAL_ERROR_RECORD = "objfs_internal_error"


def internal_error_message(exc: BaseException) -> str:
    """One line for an unexpected exception: its type and message, newlines folded."""
    text = " ".join(str(exc).split())
    return f"internal error: {type(exc).__name__}" + (f": {text}" if text else "")


def log_internal_error(logger: logging.Logger, exc: BaseException) -> None:
    """Log ``exc`` with its traceback at error level: a log file and syslog always keep it,
    a terminal (stderr) shows it only at debug level."""
    logger.error(
        "%s", internal_error_message(exc), exc_info=exc, extra={INTERNAL_ERROR_RECORD: True}
    )
