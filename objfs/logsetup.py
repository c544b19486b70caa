"""Where objfs logs: stderr in the foreground, ``--log-file``, or syslog as a daemon.

:func:`setup_logging` is called once per process, before anything logs; it replaces the root
logger's handlers. :func:`traceback_whereabouts` tells a daemon's ``objfs mount`` where that
set-up keeps an internal error's traceback.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from objfs.errors import INTERNAL_ERROR_RECORD
from objfs.jsonlog import JsonFormatter


def setup_logging(
    level: str, log_file: str | None, *, daemon: bool, log_format: str = "text"
) -> None:
    """Log to stderr in the foreground, to --log-file if given, else to syslog as a daemon.

    An internal error's traceback (:func:`objfs.errors.log_internal_error`) goes to the file
    and syslog at every level, to stderr only at debug level."""
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_format == "json":
        fmt = JsonFormatter()
    handlers: list[logging.Handler] = []
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    if not daemon:
        terminal = logging.StreamHandler(sys.stderr)
        if level.lower() != "debug":
            # An internal error's traceback: the command prints its one line here itself.
            terminal.addFilter(lambda record: not getattr(record, INTERNAL_ERROR_RECORD, False))
        handlers.append(terminal)
    elif not log_file and os.path.exists("/dev/log"):
        syslog = logging.handlers.SysLogHandler(address="/dev/log")
        syslog.setFormatter(logging.Formatter("objfs[%(process)d]: %(levelname)s %(message)s"))
        root.addHandler(syslog)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    # botocore logs request details (never secrets at INFO, but much noise); keep it quiet
    # unless the user asks for debug output of objfs itself.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("pyfuse3").setLevel(logging.INFO if level.lower() != "debug" else "DEBUG")


def traceback_whereabouts(log_file: str | None) -> str:
    """Where a daemon's log keeps a traceback, for the error line of ``objfs mount``."""
    if log_file:
        return f"the traceback is in {log_file}; please report it"
    if any(isinstance(h, logging.handlers.SysLogHandler) for h in logging.getLogger().handlers):
        return "the traceback is in syslog; please report it"
    return "no syslog here keeps the traceback: mount with --log-file PATH to see it"
