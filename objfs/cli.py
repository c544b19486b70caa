"""The ``objfs`` command: runs the command :mod:`objfs.options` parsed, and maps every
failure to one line and an exit code.

Every failure prints one line, ``objfs: error: ...``, and exits with the code listed in
:data:`objfs.errors.EXIT_CODES`; a traceback is never shown on the terminal (``--log-level
debug`` shows it there). An internal error's traceback always goes to the log of a command
that has one (a mount's ``--log-file`` or syslog, a sidecar's stderr). No other module imports
this one but ``python -m objfs`` (tests/test_structure.py checks).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from objfs.backends.base import Backend
from objfs.errors import ObjfsError, UsageError, internal_error_message, log_internal_error
from objfs.options import build_parser, check_memory_limit, mount_config

log = logging.getLogger("objfs")


def _run_mount(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from objfs.daemon import spawn_daemon
    from objfs.logsetup import setup_logging

    # Here, in the process the user runs: a missing libfuse or pyfuse3 fails with its own
    # message, not as a daemon that exited before serving.
    from objfs.mount import serve
    from objfs.mountpoint import check_fuse, check_mountpoint

    config = mount_config(args)
    check_memory_limit(config, args.memory_limit)
    if not config.foreground:
        # Validate what can be validated here so the common mistakes fail before a fork.
        check_mountpoint(config.mountpoint)
        check_fuse()
        return spawn_daemon(argv, config.mountpoint, config.log_file)

    credentials = args.credentials_file and os.path.abspath(args.credentials_file)
    daemon = args.daemon_ready_fd is not None
    if daemon:
        os.chdir("/")  # paths are absolute now; do not keep the caller's directory busy
    setup_logging(config.log_level, config.log_file, daemon=daemon, log_format=args.log_format)

    def make_backend() -> Backend:
        from objfs.credentials import CredentialWatch, load_credentials_file

        if credentials:
            # Here, inside mount.serve: its warning reaches the terminal of `objfs mount`.
            load_credentials_file(credentials)

        if config.source.account_root:  # s3://, az://: every bucket (container)
            from objfs.backends.account import open_account

            return open_account(
                config, CredentialWatch.open(credentials, config.azure.sas_token_file)
            )
        if config.source.store == "azure":
            from objfs.backends.azure import AzureBackend

            # Re-read on change and on an authentication failure (see CredentialWatch).
            watch = CredentialWatch.open(credentials, config.azure.sas_token_file)
            return AzureBackend(config.source, config.azure, credential_watch=watch)
        from objfs.backends.s3 import S3Backend

        watch = CredentialWatch.open(credentials)
        return S3Backend(config.source.bucket, config.s3, credential_watch=watch)

    return serve(config, make_backend, args.daemon_ready_fd)


def _run_status(args: argparse.Namespace) -> int:
    import json

    from objfs.status import format_status, read_status

    if not args.max_age > 0:
        raise UsageError(f"--max-age: {args.max_age} must be more than 0 seconds")
    figures = read_status(args.mountpoint, max_age_s=args.max_age)
    if args.json:
        print(json.dumps(figures, indent=2))
    elif not args.probe:
        print(format_status(figures))
    return 0


def _log_traceback(exc: Exception, args: argparse.Namespace) -> str:
    """Log ``exc``'s traceback where this command logs (a mount's log file or syslog, a
    sidecar's stderr; a terminal only at debug level); returns what to tell the user."""
    handlers = logging.getLogger().handlers
    if not handlers:  # no log set up: Python's last-resort handler would print a traceback
        return "please report it"
    log_internal_error(log, exc)
    files = [h.baseFilename for h in handlers if isinstance(h, logging.FileHandler)]
    if files:
        return f"the traceback is in {files[0]}; please report it"
    if any(not isinstance(h, logging.StreamHandler) for h in handlers):
        return "the traceback is in the log (syslog); please report it"
    if args.command == "mount" and getattr(args, "log_level", "") != "debug":
        return "rerun with --log-file PATH or --log-level debug to see the traceback, and report it"
    return "please report it"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "mount":
            return _run_mount(args, argv)
        if args.command == "warm":
            from objfs.warm import warm

            if not 1 <= args.jobs <= 256:
                raise UsageError(f"--jobs: {args.jobs} is out of range: give 1 to 256")
            warm(args.paths, jobs=args.jobs, cache_only=args.cache_only)
            return 0
        if args.command == "status":
            return _run_status(args)
        if args.command == "sidecar":
            if args.fd_dir is not None:
                from objfs.sidecar_fd import run_fd_sidecar

                return run_fd_sidecar(args.fd_dir)
            from objfs.sidecar import run_sidecar

            return run_sidecar()
        if args.command == "csi":
            from objfs.csi.node import run_csi

            return run_csi(
                endpoint=args.endpoint,
                node_id=args.node_id,
                kubelet_dir=args.kubelet_dir,
                log_level=args.log_level,
                node_cache_dir=args.node_cache_dir,
                node_cache_size=args.node_cache_size,
            )
        if args.if_dead:
            from objfs.mountpoint import clear_dead_mount

            clear_dead_mount(os.path.abspath(args.mountpoint))
            return 0
        from objfs.mountpoint import unmount

        unmount(args.mountpoint, force=args.force)
        return 0
    except ObjfsError as exc:
        print(f"objfs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("objfs: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(
            f"objfs: {internal_error_message(exc)} ({_log_traceback(exc, args)})", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
