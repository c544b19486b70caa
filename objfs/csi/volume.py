"""What a CSI volume asks for: ``volume_context`` checked and turned into ``objfs mount`` options.

A volume's attributes (``volumeAttributes`` of an inline CSI volume or of a static
PersistentVolume) are:

* ``source``: the SOURCE of ``objfs mount`` (``s3://BUCKET/PREFIX``, ``az://...``, ...);
* any long option of ``objfs mount`` without its dashes (``endpoint-url``, ``region``,
  ``metadata-ttl``, ``cache-size``, ...), the value as a string; a flag takes ``"true"`` or
  ``"false"``. The set is read from the ``mount`` command's parser, so it follows the command;
  options that mean nothing here (:data:`NOT_HERE`) are refused with the reason;
* the kubelet's pod-info keys (``csi.storage.k8s.io/pod.uid``, ...; :data:`POD_INFO_KEYS`);
  the pod's namespace and service account name its node cache folder;
* ``node-cache``: ``"false"`` keeps the volume's disk cache in the pod (its ``cache-dir``)
  where the node plugin has a node cache (:mod:`objfs.csi.node_cache`); default ``"true"``.

Invariants: credentials never travel in volume attributes. A key that looks like one
(:data:`_CREDENTIAL_LIKE`), other than the two file-path options ``credentials-file`` and
``sas-token-file`` (absolute paths inside the sidecar's container), is refused; so are URLs
with a user, password, query string, fragment, ``;`` or ``sig=`` (an Azure SAS smuggled into
``account-url`` or ``endpoint-url``). Error messages name the key, never its value: where the
``mount`` command's own checks echo a value, it is replaced by ``<KEY>`` (short numbers stay,
as in "max-connections: 0 is out of range"). The kubelet's
``serviceAccount.tokens`` is accepted (the kubelet sends it when the CSIDriver asks for tokens)
and dropped here: it reaches neither the sidecar, nor the state files, nor any log. Checking
never contacts the store: it runs the ``mount`` command's own argument parsing and value
checks over the options (all local). No value (``source`` or an option's) may start with
``-``, so none reads as an option, and that parsing never prints (no help, no usage) and never
exits the process: whatever argparse would print or exit with becomes a VolumeContextError.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from objfs.config import MountConfig
from objfs.errors import ObjfsError, UsageError
from objfs.options import (
    flag_arguments,
    is_flag,
    mount_arguments,
    mount_config,
    mount_options,
    mount_parser,
    parse_boolean,
)

#: The kubelet adds these when the CSIDriver sets ``podInfoOnMount`` (and, for the token,
#: ``tokenRequests``); ``ephemeral`` marks inline volumes.
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"
NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
SERVICE_ACCOUNT_KEY = "csi.storage.k8s.io/serviceAccount.name"
#: The volume attribute that keeps a volume off the node cache (``"false"``).
NODE_CACHE_KEY = "node-cache"
POD_INFO_KEYS = frozenset(
    {
        "csi.storage.k8s.io/pod.name",
        "csi.storage.k8s.io/pod.namespace",
        POD_UID_KEY,
        "csi.storage.k8s.io/serviceAccount.name",
        "csi.storage.k8s.io/ephemeral",
        "csi.storage.k8s.io/serviceAccount.tokens",
    }
)

#: ``objfs mount`` options that a volume cannot set, and why.
NOT_HERE = {
    "help": "it is not a mount option",
    "foreground": "the sidecar always serves in the foreground",
    "daemon-ready-fd": "it is internal to objfs",
    "log-file": "the sidecar logs to its stderr (kubectl logs)",
    "allow-other": "the node plugin always mounts with allow_other (the pod's containers run "
    "as other users than the sidecar)",
}

#: Options whose value is a path inside the sidecar's container: it must be absolute.
PATH_OPTIONS = frozenset({"credentials-file", "sas-token-file", "ca-bundle", "cache-dir"})
#: Options whose value is a URL: no user, password or query string (a SAS token) in it.
URL_OPTIONS = frozenset({"endpoint-url", "account-url", "cache-proxy"})

_CREDENTIAL_LIKE = re.compile(
    r"secret|passw|token|\bsas\b|sas[-_.]|credential|connection[-_.]?string|account[-_.]?key"
    r"|access[-_.]?key|private[-_.]?key|api[-_.]?key|auth|session|signature|\bsig\b|\bkey\b",
    re.IGNORECASE,
)
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")


class VolumeContextError(Exception):
    """A volume attribute is wrong; ``str()`` is the one-line message for the kubelet."""


@dataclass(frozen=True)
class VolumeSpec:
    """A checked volume: what the sidecar gets (``source``, ``options``) and the pod it serves.

    ``options`` maps ``objfs mount`` long options without dashes to string values, flags to
    ``"true"`` (a flag given ``"false"`` is left out, or becomes ``no-X`` where the option has
    one); it holds no credential.
    """

    source: str
    options: dict[str, str]
    pod_uid: str
    fsname: str
    #: What ``objfs mount`` would run with (its mountpoint: the target), for kernel tuning.
    config: MountConfig = field(compare=False, repr=False)
    #: The pod's namespace and service account (empty if the kubelet did not send them).
    namespace: str = ""
    service_account: str = ""
    #: Whether the volume may use the node cache (``node-cache``, default true).
    node_cache: bool = True

    def identity(self) -> dict[str, Any]:
        """What must match for a repeated publish to be the same one (no pod-info noise)."""
        return {
            "source": self.source,
            "options": dict(sorted(self.options.items())),
            "node_cache": self.node_cache,
        }

    def context(self) -> dict[str, str]:
        """Volume attributes that give this volume again (for the state files)."""
        return {
            **self.options,
            "source": self.source,
            POD_UID_KEY: self.pod_uid,
            NAMESPACE_KEY: self.namespace,
            SERVICE_ACCOUNT_KEY: self.service_account,
            NODE_CACHE_KEY: "true" if self.node_cache else "false",
        }


#: This module's own copy of ``objfs mount``'s parser: :func:`_check_mount_argv` patches it.
_mount_parser = functools.cache(mount_parser)


def _check_value(key: str, value: str) -> None:
    if "\n" in value or "\0" in value:
        raise VolumeContextError(f"volume attribute {key!r}: the value has a line break or NUL")
    if value.lstrip().startswith("-"):
        # It would read as an option of `objfs mount` (the sidecar's, or argparse's -h here).
        raise VolumeContextError(f"volume attribute {key!r}: a value may not start with '-'")
    if key in PATH_OPTIONS and not os.path.isabs(value):
        raise VolumeContextError(
            f"volume attribute {key!r} must be an absolute path inside the objfs sidecar's "
            "container (e.g. a Secret volume mounted into the sidecar)"
        )
    if key in URL_OPTIONS:
        parts = urlsplit(value)
        if (
            parts.username
            or parts.password
            or parts.query
            or parts.fragment
            or any(mark in value for mark in ";#?")
            or "sig=" in value.lower()
        ):
            raise VolumeContextError(
                f"volume attribute {key!r}: the URL carries a user, password, query string, "
                "fragment, ';' or 'sig='; "
                "credentials never travel in volume attributes: give them to the objfs sidecar "
                "(its service account identity, or a Secret mounted into it and credentials-file "
                "or sas-token-file)"
            )


def _refuse_credential(key: str) -> VolumeContextError:
    return VolumeContextError(
        f"volume attribute {key!r} looks like a credential: credentials never travel in volume "
        "attributes; give them to the objfs sidecar instead (its service account identity, or "
        "a Secret mounted into it and the credentials-file or sas-token-file attribute with "
        "its path)"
    )


def parse_volume_context(context: dict[str, str], target_path: str) -> VolumeSpec:
    """Checks ``context`` and returns the volume it describes; raises VolumeContextError."""
    known = mount_options()
    options: dict[str, str] = {}
    for key in sorted(context):
        value = context[key]
        if key in ("source", NODE_CACHE_KEY) or key in POD_INFO_KEYS:
            continue
        if key in NOT_HERE:
            raise VolumeContextError(
                f"volume attribute {key!r} cannot be set on a CSI volume: {NOT_HERE[key]}"
            )
        if key not in known:
            if _CREDENTIAL_LIKE.search(key):
                raise _refuse_credential(key)
            raise VolumeContextError(
                f"unknown volume attribute {key!r}: give 'source' and `objfs mount` long options "
                "without dashes (e.g. endpoint-url, region, metadata-ttl); see `objfs mount --help`"
            )
        if is_flag(key):
            try:
                flag = parse_boolean(value, f"volume attribute {key!r} is a flag")
            except UsageError as exc:
                raise VolumeContextError(str(exc)) from None
            # --force-path-style / --no-force-path-style: "false" is the other one.
            for argument in flag_arguments(key, flag):
                options[argument.removeprefix("--")] = "true"
            continue
        _check_value(key, value)
        options[key] = value
    for key in list(options):
        other = key[3:] if key.startswith("no-") else f"no-{key}"
        if other in options:
            raise VolumeContextError(f"volume attributes {key!r} and {other!r} contradict")

    source = context.get("source", "").strip()
    if not source:
        raise VolumeContextError(
            "volume attribute 'source' is missing: give the bucket or container to mount, e.g. "
            "s3://BUCKET/PREFIX or az://CONTAINER/PREFIX"
        )
    if source.startswith("-"):
        # argparse would take it for an option: "-h" printed help and exited the plugin.
        raise VolumeContextError(
            "volume attribute 'source' may not start with '-': give the bucket or container "
            "to mount, e.g. s3://BUCKET/PREFIX or az://CONTAINER/PREFIX"
        )
    pod_uid = context.get(POD_UID_KEY, "")
    if not pod_uid:
        raise VolumeContextError(
            f"volume context has no {POD_UID_KEY}: set podInfoOnMount: true in the objfs "
            "CSIDriver object (the node plugin needs the pod to find its objfs-fd volume)"
        )
    if not _POD_UID.fullmatch(pod_uid):
        raise VolumeContextError(f"{POD_UID_KEY} is not a pod UID")

    try:
        node_cache = parse_boolean(
            context.get(NODE_CACHE_KEY, "true"), f"volume attribute {NODE_CACHE_KEY!r} is a flag"
        )
    except UsageError as exc:
        raise VolumeContextError(str(exc)) from None

    redact = functools.partial(_redact, options=options)
    # --key=value: a value that starts with a dash stays a value.
    argv = [source, target_path, *mount_arguments(options)]
    try:
        config = _check_mount_argv(argv)
    except VolumeContextError as exc:
        raise VolumeContextError(redact(str(exc))) from None
    return VolumeSpec(
        source=source,
        options=options,
        pod_uid=pod_uid,
        fsname=config.source.url(),
        config=config,
        namespace=context.get(NAMESPACE_KEY, ""),
        service_account=context.get(SERVICE_ACCOUNT_KEY, ""),
        node_cache=node_cache,
    )


_SHORT_NUMBER = re.compile(r"\d{1,6}")


def _redact(message: str, options: dict[str, str]) -> str:
    """``message`` with every option value replaced by ``<KEY>`` (longest first, whole words
    only); short numbers stay, as they say what is out of range and carry no secret."""
    for key, value in sorted(options.items(), key=lambda item: -len(item[1])):
        if not value.strip() or _SHORT_NUMBER.fullmatch(value):
            continue
        pattern = r"(?<!\w)" + re.escape(value) + r"(?!\w)"
        message = re.sub(pattern, f"<{key}>", message)
    return message


class _ParseError(Exception):
    pass


_PARSER_LOCK = threading.Lock()
#: What the check uses when a volume sets no ``memory-limit``: two of the largest parts.
_UNSET_MEMORY_LIMIT = "2G"


def _check_mount_argv(argv: list[str]) -> MountConfig:
    """Runs ``objfs mount``'s parsing and value checks over ``argv``; returns its MountConfig."""
    parser = _mount_parser()

    def error(message: str) -> Any:
        raise _ParseError(message)

    def print_help(file: Any = None) -> None:
        raise _ParseError("a value reads as the help option -h")

    def exit_(status: int = 0, message: str | None = None) -> Any:
        raise _ParseError(message or "a value reads as an option that ends the command")

    try:
        with _PARSER_LOCK:
            # argparse reports through parser.error and ends -h through print_help and exit,
            # all of which print or exit the process; make them raise instead and print
            # nothing. The parser is this module's own copy, only ever used here.
            parser.error = error  # type: ignore[method-assign]
            parser.print_help = print_help  # type: ignore[method-assign]
            parser.exit = exit_  # type: ignore[method-assign]
            parser._print_message = lambda message, file=None: None  # type: ignore[method-assign]
            args = parser.parse_args(argv)
    except (_ParseError, SystemExit) as exc:
        # SystemExit too, whatever else might raise it: a volume never ends the plugin.
        message = (
            str(exc).replace("--", "")
            if isinstance(exc, _ParseError)
            else "a value reads as an option that ends the command"
        )
        raise VolumeContextError(f"volume attributes: {message}") from None
    # A file inside the sidecar's container: the node plugin cannot read it (and must not).
    args.credentials_file = None
    if args.memory_limit is None:
        # The default is a share of the memory of the process that mounts: the sidecar's
        # container, not the node plugin's. Checked against the largest part size here, so
        # only the sidecar's own run of `objfs mount` judges the default.
        args.memory_limit = _UNSET_MEMORY_LIMIT
    try:
        return mount_config(args)
    except ObjfsError as exc:
        message = str(exc).replace("--", "")
        raise VolumeContextError(f"volume attributes: {message}") from None
