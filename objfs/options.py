"""``objfs``'s options, declared once: the command's parser and the one translation of mount
options, for every front end.

Contract: :func:`build_parser` is the only declaration of an option. The command
(:mod:`objfs.cli`), the fstab helper (:mod:`objfs.mount_helper`), the environment sidecar
(:mod:`objfs.sidecar`), the fd sidecar (:mod:`objfs.sidecar_fd`) and the CSI plugin
(:mod:`objfs.csi.volume`) all take their option names from :func:`mount_options`, and values
become a :class:`~objfs.config.MountConfig` only through :func:`mount_config` (the CSI plugin
calls it; the others run ``objfs mount``, which does), so a front end cannot know an option
the command does not, nor check a value differently. Where a flag arrives
as text (a volume attribute, an fd offer, an ``OBJFS_*`` variable), it is spelled ``true`` or
``false`` (:func:`parse_boolean`), and nothing else. Nothing here contacts a store or starts a
mount.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Mapping
from typing import NoReturn

from objfs import __version__
from objfs.cache_engine import parse_engine_url
from objfs.config import (
    ACCOUNT_NAME_RE,
    FUSE_TRANSPORTS,
    TRANSPORT_ENV,
    AzureOptions,
    CacheProxyOptions,
    MountConfig,
    S3Options,
    available_memory_bytes,
    default_memory_ceiling,
    default_memory_limit,
    parse_id,
    parse_size,
    parse_source,
    parse_ttl,
)
from objfs.errors import EXIT_CODES, UsageError

_LOG_LEVELS = ("debug", "info", "warning", "error")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line instead of argparse's usage block.
        self.exit(2, f"objfs: error: {message} (see `{self.prog} --help`)\n")


def _exit_code_epilog() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="objfs",
        description="Mount an object-store bucket/prefix as a read-only POSIX directory.",
        epilog=_exit_code_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"objfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    m = sub.add_parser(
        "mount",
        help="mount SOURCE on MOUNTPOINT",
        description="Mount SOURCE (s3://BUCKET[/PREFIX], az://CONTAINER[/PREFIX]; s3:// or az:// "
        "alone for every bucket or container of the account) read-only on MOUNTPOINT. Without "
        "--foreground, returns once the mount serves and leaves a daemon running.",
        epilog=_exit_code_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "source",
        metavar="SOURCE",
        help="s3://BUCKET[/PREFIX], az://CONTAINER[/PREFIX], azure://ACCOUNT/CONTAINER[/PREFIX] "
        "or https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX]; without the bucket "
        "(s3://, az://, azure://ACCOUNT): every bucket or container as a directory",
    )
    m.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")

    store = m.add_argument_group("object store")
    store.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint, e.g. http://minio:9000 (default: $AWS_ENDPOINT_URL)",
    )
    store.add_argument(
        "--cache-proxy",
        metavar="URL",
        help="send data GETs through this cache engine (nginx proxy_cache, Dragonfly) as "
        "signed URLs (S3: presigned; Azure: with a SAS), reading from the store directly "
        "while it fails",
    )
    store.add_argument(
        "--cache-proxy-url-lifetime",
        metavar="SECONDS",
        type=int,
        help="how long each URL signed for --cache-proxy is valid, 2 to 604800; signed again "
        "at half of it (default 3600)",
    )
    store.add_argument("--region", help="region (default: $AWS_REGION / profile, else us-east-1)")
    store.add_argument("--profile", help="AWS profile from ~/.aws/config")
    store.add_argument(
        "--no-sign-request",
        action="store_true",
        help="send anonymous requests (public buckets); no credentials are looked up",
    )
    store.add_argument(
        "--force-path-style",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="path-style URLs (http://host/bucket/key); default: on with --endpoint-url "
        "(MinIO needs it), off for AWS",
    )
    store.add_argument(
        "--ca-bundle",
        metavar="PEM",
        help="CA certificates for a TLS endpoint with a private CA (default: $AWS_CA_BUNDLE)",
    )

    store.add_argument(
        "--connect-timeout",
        type=float,
        default=S3Options.connect_timeout_s,
        metavar="SECONDS",
        help="give up connecting to the store after this long (default: %(default)s)",
    )
    store.add_argument(
        "--read-timeout",
        type=float,
        default=S3Options.read_timeout_s,
        metavar="SECONDS",
        help="give up on a response that sends nothing for this long (default: %(default)s)",
    )
    store.add_argument(
        "--max-attempts",
        type=int,
        default=S3Options.max_attempts,
        metavar="N",
        help="attempts per request, the first included, with exponential backoff and jitter "
        "(default: %(default)s)",
    )

    azure = m.add_argument_group(
        "Azure", "for az://, azure:// and https://ACCOUNT.blob.core.windows.net SOURCEs"
    )
    azure.add_argument(
        "--account-name",
        metavar="NAME",
        help="storage account of an az:// SOURCE (default: $AZURE_STORAGE_ACCOUNT, or the "
        "connection string's)",
    )
    azure.add_argument(
        "--account-url",
        metavar="URL",
        help="blob endpoint, e.g. http://127.0.0.1:10000/devstoreaccount1 for Azurite, a "
        "sovereign cloud or a private endpoint (default: https://ACCOUNT.blob.core.windows.net)",
    )
    azure.add_argument(
        "--sas-token-file",
        metavar="PATH",
        help="file holding a SAS token (default: $AZURE_STORAGE_SAS_TOKEN); the connection "
        "string and account key take precedence",
    )
    azure.add_argument(
        "--cache-proxy-send-sas-token",
        action="store_true",
        default=None,
        help="with --cache-proxy and a SAS token as the credential: send that SAS to the "
        "engine as it is (it cannot sign a narrower one; refused without this option)",
    )
    m.add_argument_group("credentials").add_argument(
        "--credentials-file",
        metavar="PATH",
        help="NAME=VALUE lines (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_KEY, "
        "...) loaded into objfs's environment; for fstab and services (chmod 600 it)",
    )

    perf = m.add_argument_group("performance and caching")
    perf.add_argument(
        "--max-connections",
        type=int,
        default=S3Options.max_connections,
        metavar="N",
        help="parallel requests to the store (default: %(default)s)",
    )
    perf.add_argument(
        "--part-size",
        metavar="SIZE",
        default="8M",
        help="bytes per ranged GET of read-ahead (default: %(default)s)",
    )
    perf.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="budget for in-flight and buffered data (default: 240M, or a quarter of the "
        "machine's or cgroup's memory if that is less, at least 64M; the default grows up to "
        "4x while several handles read one file, e.g. tensor-parallel ranks; a value given "
        "here never grows)",
    )
    perf.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="persistent block cache, kept across unmount and restart (default: none)",
    )
    perf.add_argument(
        "--cache-size",
        metavar="SIZE",
        default="64G",
        help="cap of the disk cache (default: %(default)s)",
    )
    perf.add_argument(
        "--cache-min-free",
        metavar="SIZE",
        help="free space to leave on the cache's disk (default: 10%% of it, at most 5G)",
    )
    perf.add_argument(
        "--fuse-transport",
        choices=FUSE_TRANSPORTS,
        default=None,
        help="how objfs speaks FUSE: kernel (objfs's own protocol implementation: replies "
        "outside the GIL, passthrough) or pyfuse3 (libfuse, the fallback) (default: "
        f"${TRANSPORT_ENV} if set, else {MountConfig.fuse_transport})",
    )
    perf.add_argument(
        "--read-ahead-kb",
        type=int,
        default=MountConfig.read_ahead_kb,
        metavar="KB",
        help="kernel read-ahead of the mount; 0 keeps the kernel's (default: %(default)s)",
    )

    fs = m.add_argument_group("file system")
    fs.add_argument(
        "-f", "--foreground", action="store_true", help="stay in the foreground (logs to stderr)"
    )
    fs.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users (e.g. a serving container's user) read the mount",
    )
    fs.add_argument("--uid", metavar="UID", help="owner of every file (default: your uid)")
    fs.add_argument("--gid", metavar="GID", help="group of every file (default: your gid)")
    fs.add_argument(
        "--metadata-ttl",
        metavar="SECONDS|indefinite",
        default="60",
        help="how long listings and file sizes are trusted (default: %(default)s); "
        "'indefinite' for buckets that never change, 0 to re-check on every access",
    )
    fs.add_argument(
        "--max-stale",
        metavar="SECONDS",
        default="86400",
        help="while the store is unreachable, keep serving known listings and file versions "
        "for up to this long past their TTL (default: %(default)s, a day); 0 fails at once",
    )

    logs = m.add_argument_group("logging")
    logs.add_argument("--log-level", choices=_LOG_LEVELS, default="info")
    logs.add_argument(
        "--log-file",
        metavar="PATH",
        help="append logs here (default: stderr in the foreground, syslog as a daemon)",
    )
    logs.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="json: one object per line (time, level, logger, message) for log collectors",
    )
    logs.add_argument(
        "--metrics-addr",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics, e.g. 127.0.0.1:9101 "
        "(default: off)",
    )
    m.add_argument("--daemon-ready-fd", type=int, help=argparse.SUPPRESS)

    w = sub.add_parser(
        "warm",
        help="read files on a mount ahead of time",
        description="Read files (or whole directories) on an objfs mount so they sit in the "
        "caches before a model server starts; shows bytes, rate and ETA.",
    )
    w.add_argument("paths", nargs="+", metavar="PATH", help="files or directories on a mount")
    w.add_argument(
        "-j", "--jobs", type=int, default=8, metavar="N", help="files read at once (default: 8)"
    )
    w.add_argument(
        "--cache-only",
        action="store_true",
        help="fill objfs's memory and disk caches only, not the kernel's page cache: the "
        "daemon reads the files itself (faster, no copy); needs a mount with --cache-dir",
    )

    u = sub.add_parser(
        "unmount",
        help="unmount a mountpoint",
        description="Unmount an objfs mount; its daemon then exits.",
    )
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u_mode = u.add_mutually_exclusive_group()
    u_mode.add_argument(
        "--force", action="store_true", help="detach lazily even if files are still open"
    )
    u_mode.add_argument(
        "--if-dead",
        action="store_true",
        help="detach the mount only if its daemon is gone (Transport endpoint is not "
        "connected); a live mount, or none, is left alone and the exit status is 0",
    )

    st = sub.add_parser(
        "status",
        help="show a mount's live figures",
        description="Show the source, uptime, throughput, requests and cache use of an objfs "
        "mount, from the status file its daemon rewrites every second (never touching the "
        "mount, so it answers while the mount hangs).",
        epilog=_exit_code_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument("mountpoint", metavar="MOUNTPOINT")
    st_mode = st.add_mutually_exclusive_group()
    st_mode.add_argument("--json", action="store_true", help="print the figures as JSON")
    st_mode.add_argument(
        "--probe",
        action="store_true",
        help="print nothing; exit 0 only if the mount is served by a live daemon (for "
        "startup and liveness probes)",
    )
    st.add_argument(
        "--max-age",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a daemon silent for longer counts as hung (default: %(default)s)",
    )

    sc = sub.add_parser(
        "sidecar",
        help="container entrypoint: mount from environment variables, supervise, unmount; "
        "or, with --fd-dir, serve the mounts a CSI node plugin hands over (unprivileged)",
        description="Mount $OBJFS_SOURCE on $OBJFS_MOUNTPOINT (more options in $OBJFS_OPTIONS "
        "and OBJFS_* variables) and stay in the foreground; write $OBJFS_READY_FILE once the "
        "mount serves; SIGTERM unmounts and exits 0; exits 19 if the mount dies while "
        "serving. With --fd-dir: take every FUSE fd that `objfs csi` offers on a socket in "
        "DIR and serve it with the options that came with it; needs no capabilities. See "
        "the README's Kubernetes section.",
        epilog=_exit_code_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sc.add_argument(
        "--fd-dir",
        metavar="DIR",
        help="serve the FUSE fds offered by `objfs csi` on sockets in DIR (the pod's objfs-fd "
        "emptyDir) instead of mounting from environment variables",
    )

    csi = sub.add_parser(
        "csi",
        help="CSI node plugin: mounts volumes (privileged) for unprivileged objfs sidecars",
        description="Serve the Container Storage Interface (Identity and Node services) on a "
        "Unix socket. NodePublishVolume opens /dev/fuse, mounts the target path read-only and "
        "offers the fd to the `objfs sidecar --fd-dir` in the pod. Needs root (CAP_SYS_ADMIN) "
        "and /dev/fuse; the sidecar needs neither. See the README's Kubernetes section.",
        epilog=_exit_code_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csi.add_argument(
        "--endpoint",
        default=os.environ.get("CSI_ENDPOINT"),
        metavar="unix:///PATH",
        help="where to serve gRPC (default: $CSI_ENDPOINT)",
    )
    csi.add_argument(
        "--node-id",
        default=os.environ.get("KUBE_NODE_NAME"),
        metavar="ID",
        help="this node's name, answered by NodeGetInfo (default: $KUBE_NODE_NAME)",
    )
    csi.add_argument(
        "--kubelet-dir",
        default="/var/lib/kubelet",
        metavar="DIR",
        help="the kubelet's root directory, where pods' emptyDir volumes lie "
        "(default: %(default)s)",
    )
    csi.add_argument(
        "--node-cache-dir",
        default=os.environ.get("OBJFS_NODE_CACHE_DIR"),
        metavar="DIR",
        help="keep a disk cache on the node that outlives pods: one folder per identity "
        "(namespace, service account, sidecar uid) under DIR, handed to the sidecars with "
        "their mounts, with passthrough registered by this plugin (default: "
        "$OBJFS_NODE_CACHE_DIR; none: each pod's sidecar keeps its cache-dir)",
    )
    csi.add_argument(
        "--node-cache-size",
        default=os.environ.get("OBJFS_NODE_CACHE_SIZE"),
        metavar="SIZE",
        help="the cap of the whole node cache, across identities (least recently used "
        "versions go first); default 100G ($OBJFS_NODE_CACHE_SIZE)",
    )
    csi.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="(default: %(default)s)",
    )
    return parser


# Options that only one kind of store understands: refused for the other, never ignored.
_S3_OPTIONS = {
    "endpoint_url": "--endpoint-url",
    "region": "--region",
    "profile": "--profile",
    "force_path_style": "--force-path-style",
    "ca_bundle": "--ca-bundle",
}
_AZURE_OPTIONS = {
    "account_name": "--account-name",
    "account_url": "--account-url",
    "sas_token_file": "--sas-token-file",
    "cache_proxy_send_sas_token": "--cache-proxy-send-sas-token",
}


def _url_lifetime(value: int | None) -> int:
    """--cache-proxy-url-lifetime, checked: SigV4 allows at most 7 days (and so does an
    Azure user delegation key)."""
    if value is None:
        return CacheProxyOptions.cache_proxy_url_lifetime_s
    if not 2 <= value <= 604800:
        raise UsageError(
            f"--cache-proxy-url-lifetime: {value} is out of range: 2 to 604800 seconds"
        )
    return value


def _check_store_options(args: argparse.Namespace, store: str) -> None:
    foreign = _S3_OPTIONS if store == "azure" else _AZURE_OPTIONS
    for dest, flag in foreign.items():
        if getattr(args, dest) is None:
            continue
        if store == "azure":
            raise UsageError(
                f"{flag} is an S3 option: an Azure SOURCE takes --account-name, --account-url "
                "and --sas-token-file"
            )
        raise UsageError(f"{flag} is an Azure option: an s3:// SOURCE takes --endpoint-url")


def mount_config(args: argparse.Namespace) -> MountConfig:
    source = parse_source(args.source)
    if args.max_connections < 1 or args.max_connections > 1024:
        raise UsageError(
            f"--max-connections: {args.max_connections} is out of range: give 1 to 1024"
        )
    for flag, value in (
        ("--connect-timeout", args.connect_timeout),
        ("--read-timeout", args.read_timeout),
    ):
        if not 0.1 <= value <= 3600:  # also refuses nan
            raise UsageError(f"{flag}: {value:g} is out of range: give 0.1 to 3600 seconds")
    if not 1 <= args.max_attempts <= 100:
        raise UsageError(f"--max-attempts: {args.max_attempts} is out of range: give 1 to 100")
    timeouts = {
        "connect_timeout_s": args.connect_timeout,
        "read_timeout_s": args.read_timeout,
        "max_attempts": args.max_attempts,
    }
    # Both stores' (CacheProxyOptions): parsed once, given to both.
    cache_proxy = parse_engine_url(args.cache_proxy) if args.cache_proxy else None
    url_lifetime = _url_lifetime(args.cache_proxy_url_lifetime)
    s3 = S3Options(
        endpoint_url=args.endpoint_url,
        region=args.region or os.environ.get("AWS_REGION") or None,
        profile=args.profile,
        no_sign_request=args.no_sign_request,
        force_path_style=args.force_path_style,
        ca_bundle=args.ca_bundle,
        max_connections=args.max_connections,
        cache_proxy=cache_proxy,
        cache_proxy_url_lifetime_s=url_lifetime,
        **timeouts,
    )
    if not 0 <= args.read_ahead_kb <= 1 << 20:
        raise UsageError(f"--read-ahead-kb: {args.read_ahead_kb} is out of range: 0 to 1048576")
    part_size = parse_size(args.part_size, option="--part-size")
    if not 1 << 20 <= part_size <= 1 << 30:
        raise UsageError(f"--part-size: {args.part_size!r} is out of range: give 1M to 1G")
    memory_limit = (
        default_memory_limit()
        if args.memory_limit is None
        else parse_size(args.memory_limit, option="--memory-limit")
    )
    if memory_limit < 2 * part_size:
        raise UsageError(
            f"--memory-limit: {args.memory_limit!r} is below two parts ({2 * part_size >> 20}M):"
            " raise it or lower --part-size"
        )
    _check_store_options(args, source.store)
    if args.account_name is not None and not ACCOUNT_NAME_RE.match(args.account_name):
        raise UsageError(
            f"--account-name: {args.account_name!r} is not a storage account name: use 3-24 "
            "lowercase letters and digits"
        )
    sas_file = args.sas_token_file  # absolute below: a daemon changes to / before reading it
    if args.metrics_addr is not None:
        from objfs.metrics import parse_listen_address

        parse_listen_address(args.metrics_addr)
    if args.credentials_file is not None:
        from objfs.credentials import read_credentials_file

        read_credentials_file(args.credentials_file)  # fails here, before a daemon starts
    azure = AzureOptions(
        account_name=args.account_name,
        account_url=args.account_url,
        sas_token_file=None if sas_file is None else os.path.abspath(sas_file),
        no_sign_request=args.no_sign_request,
        max_connections=args.max_connections,
        cache_proxy=cache_proxy,
        cache_proxy_url_lifetime_s=url_lifetime,
        cache_proxy_send_sas_token=bool(args.cache_proxy_send_sas_token),
        **timeouts,
    )
    return MountConfig(
        source=source,
        azure=azure,
        part_size_bytes=part_size,
        memory_limit_bytes=memory_limit,
        memory_ceiling_bytes=default_memory_ceiling() if args.memory_limit is None else None,
        cache_dir=None if args.cache_dir is None else os.path.abspath(args.cache_dir),
        cache_size_bytes=parse_size(args.cache_size, option="--cache-size"),
        cache_min_free_bytes=None
        if args.cache_min_free is None
        else parse_size(args.cache_min_free, option="--cache-min-free"),
        read_ahead_kb=args.read_ahead_kb,
        fuse_transport=fuse_transport(args.fuse_transport),
        mountpoint=os.path.abspath(args.mountpoint),
        foreground=args.foreground,
        allow_other=args.allow_other,
        metadata_ttl_s=parse_ttl(args.metadata_ttl),
        max_stale_s=parse_ttl(args.max_stale, option="--max-stale"),
        uid=None if args.uid is None else parse_id(args.uid, option="--uid"),
        gid=None if args.gid is None else parse_id(args.gid, option="--gid"),
        log_level=args.log_level,
        log_file=None if args.log_file is None else os.path.abspath(args.log_file),
        log_format=args.log_format,
        metrics_addr=args.metrics_addr,
        s3=s3,
    )


def fuse_transport(option: str | None) -> str:
    """--fuse-transport, else $OBJFS_FUSE_TRANSPORT (one switch for every mount of a node or
    an image), else the default."""
    if option is not None:
        return option
    value = os.environ.get(TRANSPORT_ENV, "")
    if not value:
        return MountConfig.fuse_transport
    if value not in FUSE_TRANSPORTS:
        raise UsageError(
            f"${TRANSPORT_ENV}: {value!r} is not a FUSE transport: use one of "
            + ", ".join(FUSE_TRANSPORTS)
        )
    return value


def check_memory_limit(config: MountConfig, text: str | None) -> None:
    """Refuse a --memory-limit beyond the memory of this machine (or of its cgroup).

    Checked where the mount runs, not in :func:`mount_config`, which the CSI node plugin
    also runs for a sidecar's mount in another container."""
    available = available_memory_bytes()
    if config.memory_limit_bytes > available:
        shown = (
            repr(text) if text is not None else f"the default {config.memory_limit_bytes >> 20}M"
        )
        raise UsageError(
            f"--memory-limit: {shown} is more than the {available / (1 << 30):.1f}G of memory "
            "this machine (or its cgroup) has: give less"
        )


# -- mount options as text: fstab lines, OBJFS_* variables, volume attributes, fd offers ------

#: ``objfs mount`` options only the command line takes: none is a mount option elsewhere.
COMMAND_LINE_ONLY = frozenset({"help", "foreground", "daemon-ready-fd"})
#: The one spelling of a boolean where a flag arrives as text (any case, spaces ignored).
BOOLEANS = {"true": True, "false": False}


def mount_parser() -> argparse.ArgumentParser:
    """A new parser of ``objfs mount`` alone: the caller's own copy, which it may patch."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["mount"]
            return parser
    raise AssertionError("objfs's parser has no mount command")


@functools.cache
def mount_options() -> dict[str, argparse.Action]:
    """Every long option of ``objfs mount`` by its name without dashes, in the parser's order
    (both forms of a ``--X``/``--no-X`` flag), except :data:`COMMAND_LINE_ONLY`."""
    found: dict[str, argparse.Action] = {}
    for action in mount_parser()._actions:
        for option in action.option_strings:
            name = option.removeprefix("--")
            if option.startswith("--") and name not in COMMAND_LINE_ONLY:
                found[name] = action
    return found


def is_flag(name: str) -> bool:
    """Whether mount option ``name`` (a key of :func:`mount_options`) takes no value."""
    return mount_options()[name].nargs == 0


def parse_boolean(value: str, what: str) -> bool:
    """``true`` or ``false`` (:data:`BOOLEANS`); anything else is a UsageError that says
    ``"{what}: give true or false"``."""
    truth = BOOLEANS.get(value.strip().lower())
    if truth is None:
        raise UsageError(f"{what}: give true or false")
    return truth


def flag_arguments(name: str, value: bool) -> list[str]:
    """The arguments that set flag ``name`` to ``value``: ``--name`` for true; for false, the
    other form of a ``--X``/``--no-X`` flag, or nothing (the default) for a plain one."""
    if value:
        return [f"--{name}"]
    if isinstance(mount_options()[name], argparse.BooleanOptionalAction):
        return ["--" + (name[3:] if name.startswith("no-") else f"no-{name}")]
    return []


def mount_arguments(options: Mapping[str, str]) -> list[str]:
    """``objfs mount`` arguments for ``options`` (names of :func:`mount_options`, flags
    ``true``/``false``), sorted by name; raises UsageError (one line) for any other name or a
    flag's other value. A value goes as ``--name=value``, so one that starts with a dash stays
    a value; it is checked by the parser, not here."""
    known = mount_options()
    argv: list[str] = []
    for name, value in sorted(options.items()):
        if name not in known:
            raise UsageError(
                f"unknown option {name!r}: give `objfs mount` long options without dashes "
                "(e.g. region, metadata-ttl, cache-size)"
            )
        if is_flag(name):
            argv += flag_arguments(name, parse_boolean(value, f"option {name!r} is a flag"))
        else:
            argv.append(f"--{name}={value}")
    return argv
