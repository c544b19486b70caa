"""``mount.fuse.objfs``: the helper mount(8) runs for ``mount -t fuse.objfs`` and fstab lines.

mount(8) calls ``mount.fuse.objfs SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]``, looking for it only
in ``/sbin``, ``/sbin/fs.d`` and ``/sbin/fs`` (util-linux ignores $PATH here and drops it from
the helper's environment), so link the console script there::

    ln -s /usr/local/bin/mount.fuse.objfs /sbin/mount.fuse.objfs

The comma-separated OPTIONS become ``objfs mount`` options: ``key=value`` is ``--key value``
(``endpoint_url=...`` is ``--endpoint-url ...``), a bare ``allow_other`` is ``--allow-other``;
mount(8)'s own options (``ro``, ``_netdev``, ``nofail``, ``noauto``, ``x-systemd.*``, ...) are
accepted and left to mount(8) and systemd. Credentials never go in OPTIONS (fstab is readable
by every user): ``credentials=PATH`` names a file of ``NAME=VALUE`` lines instead (see
:mod:`objfs.credentials`). The helper returns once the mount serves, like ``objfs mount``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from objfs.options import is_flag, mount_options

#: Options that take a value, and the ``objfs mount`` option each becomes: every option of
#: ``objfs mount`` (:func:`objfs.options.mount_options`), ``_`` for ``-``.
VALUE_OPTIONS = {
    name.replace("-", "_"): f"--{name}" for name in mount_options() if not is_flag(name)
}
VALUE_OPTIONS["credentials"] = "--credentials-file"
#: Options without a value that switch on an ``objfs mount`` flag.
FLAG_OPTIONS = {name.replace("-", "_"): f"--{name}" for name in mount_options() if is_flag(name)}
#: mount(8)'s and systemd's own options, and FUSE defaults objfs always applies.
IGNORED = frozenset(
    {
        "ro",
        "_netdev",
        "nofail",
        "auto",
        "noauto",
        "defaults",
        "user",
        "nouser",
        "users",
        "owner",
        "group",
        "nodev",
        "nosuid",
        "noexec",
        "dev",
        "suid",
        "exec",
        "noatime",
        "nodiratime",
        "relatime",
        "atime",
        "async",
        "default_permissions",
    }
)
IGNORED_PREFIXES = ("x-", "comment=", "fsname=", "subtype=")
#: Option names that would put a secret in fstab: refused with a pointer to credentials=.
SECRET_NAMES = frozenset(
    {
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "access_key",
        "access_key_id",
        "secret_key",
        "secret_access_key",
        "session_token",
        "account_key",
        "azure_storage_key",
        "storage_key",
        "sas",
        "sas_token",
        "connection_string",
        "azure_storage_connection_string",
        "password",
        "passwd",
        "token",
        "key",
        "secret",
    }
)

_USAGE = "usage: mount.fuse.objfs SOURCE MOUNTPOINT [-sfnv] [-o OPTION[,OPTION...]]"


class HelperError(Exception):
    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _split_options(text: str) -> list[str]:
    return [o.strip() for o in text.split(",") if o.strip()]


def translate_options(options: Sequence[str], *, sloppy: bool = False) -> list[str]:
    """mount(8)-style options into ``objfs mount`` arguments; raises HelperError.

    Error messages name an option, never its value.
    """
    args: list[str] = []
    for option in options:
        key, sep, value = option.partition("=")
        key = key.strip()
        if option in IGNORED or option.startswith(IGNORED_PREFIXES):
            continue
        if key in SECRET_NAMES or key.lower() in SECRET_NAMES:
            raise HelperError(
                f"option {key!r} would put a credential in the mount options (fstab is readable "
                "by every user): put it in a file of NAME=VALUE lines (chmod 600) and pass "
                "credentials=PATH"
            )
        if key == "rw":
            raise HelperError("objfs mounts are read-only: use ro (or leave it out)")
        if key in VALUE_OPTIONS:
            if not sep or not value:
                raise HelperError(f"option {key!r} needs a value: {key}=...")
            args += [VALUE_OPTIONS[key], value]
        elif key in FLAG_OPTIONS and not sep:
            args.append(FLAG_OPTIONS[key])
        elif sloppy:
            print(f"mount.fuse.objfs: ignoring unknown option {key!r} (-s)", file=sys.stderr)
        else:
            raise HelperError(
                f"unknown option {key!r}: objfs takes "
                + ", ".join(sorted([*VALUE_OPTIONS, *FLAG_OPTIONS]))
                + " and mount(8)'s own (ro, _netdev, nofail, noauto, x-systemd.*, ...)"
            )
    return args


def parse_helper_args(argv: Sequence[str]) -> tuple[str, str, list[str], bool, bool]:
    """(source, mountpoint, objfs options, fake, verbose) from mount(8)'s helper arguments."""
    positional: list[str] = []
    options: list[str] = []
    sloppy = fake = verbose = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-o":
            if i + 1 >= len(argv):
                raise HelperError("-o needs a value")
            options += _split_options(argv[i + 1])
            i += 2
            continue
        if arg.startswith("-o") and len(arg) > 2:
            options += _split_options(arg[2:])
        elif arg == "-t":
            i += 1  # the type (fuse.objfs): nothing to do
        elif arg in ("-N", "--namespace"):
            raise HelperError("mounting in another namespace (-N) is not supported")
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvi"):
            sloppy |= "s" in arg
            fake |= "f" in arg
            verbose |= "v" in arg
        elif arg.startswith("-"):
            raise HelperError(f"unknown argument {arg!r}; {_USAGE}")
        else:
            positional.append(arg)
        i += 1
    if len(positional) != 2:
        raise HelperError(_USAGE)
    source, mountpoint = positional
    return source, mountpoint, translate_options(options, sloppy=sloppy), fake, verbose


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        source, mountpoint, options, fake, verbose = parse_helper_args(args)
    except HelperError as exc:
        print(f"mount.fuse.objfs: error: {exc}", file=sys.stderr)
        return exc.code
    # mount(8) runs helpers without PATH; objfs runs umount and the like by name.
    os.environ.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    command = ["mount", source, mountpoint, *options]
    if verbose or fake:
        print("objfs " + " ".join(command), file=sys.stderr)
    if fake:
        return 0
    # The command itself, in this process (exec: same pid, so mount(8) waits for it).
    os.execv(sys.executable, [sys.executable, "-m", "objfs", *command])


if __name__ == "__main__":
    sys.exit(main())
