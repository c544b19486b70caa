"""Configuration: the parsed SOURCE and the mount options, as frozen dataclasses.

Units are part of field names (``metadata_ttl_s``, ``block_size_bytes``). Every default has a
one-line reason next to it. Parsing helpers raise :class:`~objfs.errors.UsageError` or
:class:`~objfs.errors.SourceFormatError` with a message that says what to do.
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field

from objfs.errors import SourceFormatError, UnknownSchemeError, UsageError

#: A TTL that means "never expires" (``--metadata-ttl indefinite``).
INDEFINITE = math.inf

# S3 bucket names: 3-63 chars of lowercase letters, digits, dots and hyphens. Legacy
# us-east-1 buckets may contain uppercase and underscores; accept those too and let the store
# answer, so objfs never refuses a bucket that exists.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{2,254}$")

SUPPORTED_SCHEMES = ("s3", "az", "azure", "https")
#: The schemes served by the Azure Blob Storage backend (``https`` only for Azure blob URLs).
AZURE_SCHEMES = ("az", "azure", "https")

# Azure container names: 3-63 lowercase letters, digits and single hyphens, starting and ending
# with a letter or digit; "$root" and "$web" are the service's two special containers.
_CONTAINER_RE = re.compile(r"^(?=[a-z0-9-]{3,63}$)[a-z0-9]+(?:-[a-z0-9]+)*$|^\$(?:root|web)$")
#: Azure storage account names: 3-24 lowercase letters and digits.
ACCOUNT_NAME_RE = re.compile(r"^[a-z0-9]{3,24}$")
_AZURE_FORMS = {
    "az": "az://CONTAINER/PREFIX",
    "azure": "azure://ACCOUNT/CONTAINER/PREFIX",
    "https": "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX",
}


@dataclass(frozen=True)
class Source:
    """Where the data lives: ``scheme://bucket/prefix``.

    ``prefix`` is empty (the whole bucket) or ends with exactly one ``/``, whether or not the
    user typed the trailing slash: ``s3://b/models`` and ``s3://b/models/`` are the same
    directory. For Azure, ``bucket`` is the container; ``account`` is the storage account when
    SOURCE names one (``azure://``, ``https://``) and ``account_url`` the endpoint an
    ``https://`` SOURCE names (``https://ACCOUNT.blob.core.windows.net``).

    An empty ``bucket`` is the *account root* (``s3://``, ``az://``, ``azure://ACCOUNT``,
    ``https://ACCOUNT.blob.core.windows.net``): every bucket (container) the credentials can
    list is a top-level directory; its ``prefix`` is always empty.
    """

    scheme: str
    bucket: str
    prefix: str
    account: str | None = None
    account_url: str | None = None

    @property
    def store(self) -> str:
        """``"s3"`` or ``"azure"``: which backend serves this source."""
        return "azure" if self.scheme in AZURE_SCHEMES else "s3"

    @property
    def account_root(self) -> bool:
        """The whole account: one top-level directory per bucket (container)."""
        return not self.bucket

    def url(self) -> str:
        if self.account_root:
            if self.scheme == "https":
                return f"{self.account_url}/"
            if self.scheme == "azure":
                return f"azure://{self.account}/"
            return f"{self.scheme}://"
        if self.scheme == "https":
            return f"{self.account_url}/{self.bucket}/{self.prefix}"
        if self.scheme == "azure":
            return f"azure://{self.account}/{self.bucket}/{self.prefix}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse_source(text: str) -> Source:
    """Parse SOURCE; raises SourceFormatError / UnknownSchemeError with a one-line fix."""
    if "://" not in text:
        raise SourceFormatError(
            f"SOURCE {text!r} is not a URL: write it as s3://BUCKET or s3://BUCKET/PREFIX"
        )
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise UnknownSchemeError(
            f"unknown scheme {scheme!r} in SOURCE: objfs serves "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            + " (for MinIO and other S3-compatible stores use s3:// with --endpoint-url)"
        )
    if scheme in AZURE_SCHEMES:
        return _parse_azure_source(scheme, rest)
    authority, _, path = rest.partition("/")
    if "@" in authority or ":" in authority:
        # Never echo the text back: it may hold a secret.
        raise SourceFormatError(
            "SOURCE must not contain credentials or a port: give the bucket only "
            "(s3://BUCKET/PREFIX), the endpoint with --endpoint-url and credentials through "
            "the environment or a profile"
        )
    if "?" in text or "#" in authority:
        raise SourceFormatError(
            "SOURCE must not contain a query string: write it as s3://BUCKET/PREFIX"
        )
    if not authority:
        if not path.strip("/"):
            # s3:// alone: every bucket the credentials can list (the account root).
            return Source(scheme=scheme, bucket="", prefix="")
        raise SourceFormatError(
            f"SOURCE {text!r} has no bucket name: write it as s3://BUCKET/PREFIX (or s3:// "
            "alone for every bucket)"
        )
    if not _BUCKET_RE.match(authority):
        raise SourceFormatError(
            f"{authority!r} is not a valid bucket name: use 3-63 letters, digits, '.', '-'"
        )
    prefix = path.strip("/")
    if "//" in prefix or any(seg in (".", "..") for seg in prefix.split("/")):
        raise SourceFormatError(
            f"prefix {prefix!r} contains an empty, '.' or '..' segment: give the prefix as it "
            "appears in the keys, e.g. s3://BUCKET/models/llama"
        )
    return Source(scheme=scheme, bucket=authority, prefix=f"{prefix}/" if prefix else "")


def _parse_azure_source(scheme: str, rest: str) -> Source:
    """Parse the part after ``az://``, ``azure://`` or ``https://`` (an Azure blob URL, whose
    path is percent-decoded); same rules as s3:// for the prefix. Never echoes what could be
    a secret."""
    form = _AZURE_FORMS[scheme]
    authority, _, path = rest.partition("/")
    if "?" in rest or "#" in authority:
        raise SourceFormatError(
            f"SOURCE must not contain a query string: write it as {form} and give a SAS token "
            "with AZURE_STORAGE_SAS_TOKEN or --sas-token-file"
        )
    if "@" in authority or ":" in authority:
        raise SourceFormatError(
            f"SOURCE must not contain credentials or a port: write it as {form}, a custom "
            "endpoint with --account-url and credentials through the environment"
        )
    account: str | None = None
    account_url: str | None = None
    if scheme == "az":
        container = authority
    elif scheme == "azure":
        account = authority
        container, _, path = path.partition("/")
    else:
        labels = authority.lower().split(".")
        if len(labels) < 3 or "blob" not in labels[1:]:
            raise SourceFormatError(
                f"an https:// SOURCE must be an Azure blob URL, {form} (for S3 use s3://BUCKET "
                "with --endpoint-url)"
            )
        account, account_url = labels[0], "https://" + ".".join(labels)
        container, _, path = path.partition("/")
        path = urllib.parse.unquote(path)
    if account is not None and not ACCOUNT_NAME_RE.match(account):
        raise SourceFormatError(
            f"{account!r} is not a valid storage account name: use 3-24 lowercase letters and "
            f"digits ({form})"
        )
    if not container:
        if not path.strip("/"):
            # az://, azure://ACCOUNT, https://ACCOUNT.blob.core.windows.net: every container
            # of the account (the account root).
            return Source(
                scheme=scheme, bucket="", prefix="", account=account, account_url=account_url
            )
        raise SourceFormatError(f"SOURCE has no container name: write it as {form}")
    if not _CONTAINER_RE.match(container):
        raise SourceFormatError(
            f"{container!r} is not a valid container name: use 3-63 lowercase letters, digits "
            "and single hyphens, starting and ending with a letter or digit"
        )
    prefix = path.strip("/")
    if "//" in prefix or any(seg in (".", "..") for seg in prefix.split("/")):
        raise SourceFormatError(
            f"prefix {prefix!r} contains an empty, '.' or '..' segment: give the prefix as it "
            f"appears in the blob names, e.g. {form.replace('PREFIX', 'models/llama')}"
        )
    return Source(
        scheme=scheme,
        bucket=container,
        prefix=f"{prefix}/" if prefix else "",
        account=account,
        account_url=account_url,
    )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, *, option: str) -> int:
    """Parse ``512``, ``64M``, ``64MiB``, ``1.5G`` into bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(
            f"{option}: {text!r} is not a size: use a number with an optional K, M, G or T "
            "suffix (binary units), e.g. 8M or 20GiB"
        )
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]
    if not value < 1 << 62:  # also inf, from more digits than a float holds
        shown = text if len(text) <= 24 else f"{text[:20]}..."
        raise UsageError(f"{option}: {shown!r} is too large: give a size below 4000000T")
    return int(value)


def parse_ttl(text: str, *, option: str = "--metadata-ttl") -> float:
    """Parse seconds (``0``, ``1.5``, ``300``) or ``indefinite`` into seconds (inf)."""
    if text.strip().lower() in ("indefinite", "inf", "infinite", "forever"):
        return INDEFINITE
    try:
        value = float(text)
    except ValueError:
        raise UsageError(
            f"{option}: {text!r} is not a duration: give seconds (e.g. 60) or 'indefinite'"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{option}: {text!r} must be zero or more seconds, or 'indefinite'")
    return value


def parse_id(text: str, *, option: str) -> int:
    """Parse a numeric uid/gid."""
    try:
        value = int(text, 10)
    except ValueError:
        raise UsageError(f"{option}: {text!r} is not a number: give a numeric id") from None
    if not 0 <= value < 2**32 - 1:
        raise UsageError(f"{option}: {text!r} is out of range (0 to 4294967294)")
    return value


@dataclass(frozen=True)
class CacheProxyOptions:
    """``--cache-proxy`` and ``--cache-proxy-url-lifetime``, declared once for both stores:
    :class:`S3Options` and :class:`AzureOptions` inherit them, so each backend reads
    ``options.cache_proxy`` and the command line parses the values once for both."""

    # --cache-proxy: data GETs go through this cache engine as signed URLs (S3: presigned,
    # Azure: with a SAS; see objfs.cache_engine); None: straight to the store.
    cache_proxy: str | None = None
    # --cache-proxy-url-lifetime: the lifetime of each URL (SAS) objfs signs for the engine,
    # signed again at half of it. An hour: a GET never carries one about to expire, and a
    # leaked one is useless soon after.
    cache_proxy_url_lifetime_s: int = 3600


@dataclass(frozen=True)
class S3Options(CacheProxyOptions):
    """How to reach an S3-compatible endpoint. Secrets are never stored here."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    no_sign_request: bool = False
    # None: path style for a custom endpoint (MinIO and most S3-compatible stores need it),
    # the SDK's choice (virtual hosted) for AWS itself.
    force_path_style: bool | None = None
    ca_bundle: str | None = None
    # A short connect timeout so an unreachable endpoint fails in seconds, not minutes.
    connect_timeout_s: float = 5.0
    # Long enough for one ranged GET on a slow link; short enough to notice a stall.
    read_timeout_s: float = 60.0
    # Attempts per request, the first included (botocore's "standard" retry mode).
    max_attempts: int = 5
    # Parallel connections to the store; the HTTP pool and the thread limiter are sized to it.
    # Enough parallel parts to keep a fast link busy (AWS: one connection per 85-90 MB/s);
    # the memory budget bounds how many parts are in flight at once.
    max_connections: int = 32

    def path_style(self) -> bool:
        if self.force_path_style is not None:
            return self.force_path_style
        return self.endpoint_url is not None


@dataclass(frozen=True)
class AzureOptions(CacheProxyOptions):
    """How to reach Azure Blob Storage. Secrets are never stored here: the backend reads them
    from the environment or from ``sas_token_file`` when it builds its client."""

    # The storage account for az:// (else $AZURE_STORAGE_ACCOUNT or the connection string's).
    account_name: str | None = None
    # None: https://ACCOUNT.blob.core.windows.net; set it for Azurite, sovereign clouds and
    # private endpoints.
    account_url: str | None = None
    sas_token_file: str | None = None
    # Anonymous requests (public containers): no credential is looked up.
    no_sign_request: bool = False
    # Same reasons as for S3: fail an unreachable endpoint in seconds, notice a stalled read.
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    # Attempts per request, the first included (the SDK's retry policy, exponential backoff).
    max_attempts: int = 5
    # Parallel connections; the SDK's HTTP pool and the thread limiter are sized to it.
    max_connections: int = 16
    # --cache-proxy-send-sas-token: with --cache-proxy, a SAS token credential (which cannot
    # sign a narrower SAS) is sent to the engine as it is. Off: such a mount is refused, as
    # the mount's SAS (often long-lived, listing, maybe broader) is not the engine's to see.
    cache_proxy_send_sas_token: bool = False


#: The FUSE transports ``--fuse-transport`` chooses from (see MountConfig.fuse_transport).
FUSE_TRANSPORTS = ("pyfuse3", "kernel")
#: The environment variable that sets the transport of mounts without --fuse-transport.
TRANSPORT_ENV = "OBJFS_FUSE_TRANSPORT"


@dataclass(frozen=True)
class MountConfig:
    """Everything ``mount`` needs besides the backend."""

    source: Source
    mountpoint: str
    foreground: bool = False
    allow_other: bool = False
    # One minute: a model bucket changes rarely, and the cache answers the hundreds of stats a
    # model loader issues; use 'indefinite' for immutable buckets, 0 for read-after-write.
    metadata_ttl_s: float = 60.0
    # How long past its TTL known metadata may be served while the store is unreachable
    # (connection refused, timeouts, 5xx): a day, so an outage does not fail reads of cached
    # models; 0 fails at once (strict).
    max_stale_s: float = 86400.0
    uid: int | None = None
    gid: int | None = None
    # 1 MiB: the unit of caching and of a random read (rounded to a block); the kernel sends
    # reads of up to 1 MiB once the FUSE connection allows it.
    block_size_bytes: int = 1 << 20
    # 8 MiB ranged GETs for read-ahead (AWS guidance: 8-16 MiB per request and connection).
    # The read-ahead window (half the default budget, 128 MiB) holds 16 of them in flight
    # against 8 of 16 MiB: where each connection is slow (S3: 85-90 MB/s per connection; the
    # benchmark's shaped pass: 50 MB/s), throughput is parts in flight times that rate.
    # Measured in the shaped pass: cold load 5.5-7.5 s against 8.4-8.7 s with 16 MiB parts;
    # unshaped (CPU-bound here, where 16 MiB halves the GETs) no slower: 4.8-5.8 s against
    # 4.7-6.0 s, and tensor parallel 7.2-7.4 s against 6.8-10.2 s.
    part_size_bytes: int = 8 << 20
    # In-flight plus buffered blocks; see default_memory_limit().
    memory_limit_bytes: int = 1 << 30
    # How far the budget may grow while several handles read one large file version
    # (tensor-parallel ranks); None: it stays memory_limit_bytes (an explicit --memory-limit).
    # See default_memory_ceiling() and objfs.fs.FileSystem._fit_budget.
    memory_ceiling_bytes: int | None = None
    # First read-ahead window of a stream, doubled per sequential read (Mountpoint starts at
    # about 1 MiB too).
    readahead_initial_bytes: int = 1 << 20
    # Largest window; None: readahead_max()'s share of the memory budget, about half (whole
    # files once that covers them).
    readahead_max_bytes: int | None = None
    # Files every loader reads whole: fetch them ahead from the moment they are opened.
    prefetch_on_open_suffixes: tuple[str, ...] = (".safetensors",)
    # Persistent block cache; None: no disk tier.
    cache_dir: str | None = None
    # Cap of the disk cache.
    cache_size_bytes: int = 64 << 30
    # Free space to leave on the cache's file system; None: 10% of it, at most 5 GiB.
    cache_min_free_bytes: int | None = None
    # Kernel read-ahead for the mount (bdi read_ahead_kb); 0 leaves the kernel default.
    read_ahead_kb: int = 16384
    # FUSE connection queue (max_background); the kernel default of 12 starves parallel reads.
    max_background: int = 64
    # How objfs speaks to the kernel: "kernel" (objfs's own implementation of the protocol,
    # objfs.kernel: replies written outside the GIL, passthrough; the whole suite and the vLLM
    # end-to-end test run on it) or "pyfuse3" (libfuse 3.14 through pyfuse3, the original
    # binding, kept as the fallback and tested on the mount, fault and CSI suites).
    fuse_transport: str = "kernel"
    log_level: str = "info"
    log_file: str | None = None
    # "text" for people, "json" (one object per line) for log collectors.
    log_format: str = "text"
    # HOST:PORT of the Prometheus endpoint; None: no endpoint (nothing listens by default).
    metrics_addr: str | None = None
    s3: S3Options = field(default_factory=S3Options)
    azure: AzureOptions = field(default_factory=AzureOptions)

    def readahead_max(self, budget: int | None = None) -> int:
        """The read-ahead share of ``budget`` (default: ``memory_limit_bytes``)."""
        if self.readahead_max_bytes is not None:
            return self.readahead_max_bytes
        # Half the budget; and from the budget above 112 MiB (what the shares of read blocks,
        # replies and demand fetches need at the default) up to 128 MiB: the default 240 MiB
        # budget keeps the 16 parts in flight of the earlier 256 MiB default.
        if budget is None:
            budget = self.memory_limit_bytes
        return max(self.part_size_bytes, budget // 2, min(128 << 20, budget - (112 << 20)))

    def kernel_timeout_s(self) -> float:
        """Entry/attr timeout handed to the kernel (the metadata TTL, capped at one day)."""
        return min(self.metadata_ttl_s, 86400.0)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory_bytes() -> int:
    """The smaller of the machine's memory and this process's cgroup limit (v2 or v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [
        _read_int("/sys/fs/cgroup/memory.max"),
        _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ]
    return min([total, *(x for x in limits if x)])


DEFAULT_MEMORY_LIMIT = 240 << 20


def default_memory_limit() -> int:
    """240 MiB, or a quarter of the available memory if that is less (at least 64 MiB).

    240 and not 256: the daemon's peak RSS is the budget (its block arena is touched whole
    during a load) plus about 52 MiB of interpreter and libraries, and a default under 300 MiB
    in all was a target. The read-ahead share stays 128 MiB (:meth:`MountConfig.readahead_max`),
    so a load keeps as many GETs in flight as with 256 MiB; what is smaller is the share of
    blocks already read, which the kernel's page cache holds anyway.

    Read-ahead needs only what covers the store's latency at the link's speed (128 MiB is a
    third of a second at 400 MB/s, four times what a 2.5 GB/s link moves in a 50 ms first
    byte): the kernel's page cache holds what was served. A bigger budget only made the
    daemon fault in fresh memory for blocks prefetched far ahead of the reader: the same
    load took as long with 512 MiB as with 256 MiB (tests/benchmarks/profile_load.py), and
    several GiB made a fifth of the daemon's CPU page zeroing."""
    return max(64 << 20, min(DEFAULT_MEMORY_LIMIT, available_memory_bytes() // 4))


#: At most this many times the default budget while several handles read one file version.
MEMORY_GROWTH = 4


def default_memory_ceiling() -> int:
    """Where the default budget may grow while several handles read one large file version:
    four times the default (960 MiB), or a quarter of the available memory if that is less.

    Tensor-parallel ranks each read their part of every tensor, so a version read by N
    handles keeps blocks fetched for the slower ranks until they reach them: with four
    ranks on 2 cores the ranks drifted further apart than 240 MiB holds, and the blocks
    fetched for the slowest were evicted unread (read back from the disk cache, or fetched
    again) while the leader's own reads fetched single blocks (372-523 GETs for the 264
    parts of one loader). 720 MiB and 1 GiB held them (264 GETs, none evicted unread;
    tests/benchmarks/README.md). An explicit ``--memory-limit`` never grows."""
    return max(
        default_memory_limit(),
        min(MEMORY_GROWTH * DEFAULT_MEMORY_LIMIT, available_memory_bytes() // 4),
    )


def redact_url(url: str) -> str:
    """Return ``url`` without user info or query string, for logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))
