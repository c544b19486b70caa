"""Live figures of a mount: Prometheus metrics (``--metrics-addr``) and the status file.

* :class:`InstrumentedBackend` wraps any backend and counts its requests (by operation), their
  latency, the bytes fetched, errors by kind and the requests in flight; with
  ``--log-level debug`` it logs every request. :mod:`objfs.fs` never knows it is there.
* :class:`Telemetry` gathers those figures with ``FileSystem.statistics()`` (cache tiers,
  memory budget) and the FUSE adapter's bytes served. It serves them to Prometheus from a
  thread (``prometheus_client``'s HTTP server, bound only to the address given) and writes
  them once a second to a small JSON *status file* that ``objfs status`` reads.

The status file lives under :func:`runtime_dir` and is named after the mountpoint, so
``objfs status`` answers without touching the mount: it works while the mount hangs, and the
serving process never stats its own mountpoint (that would deadlock it). All figures are
plain integers updated on the trio thread; the HTTP thread only reads them.

A daemon that is killed (SIGKILL, the OOM killer, a node that loses power with a persistent
runtime folder) cannot remove its status file. When a daemon first writes its own, it
removes those of daemons that are gone: a status file (or a temporary one) not rewritten for
:data:`STALE_STATUS_S` whose pid no longer runs. Both conditions, because a pid can be
reused, and a daemon in another pid namespace that shares the folder looks gone by its pid
but rewrites its file every second.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import trio

from objfs import __version__
from objfs.backends.base import Backend, ListPage, ObjectInfo
from objfs.config import MountConfig
from objfs.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    NoCredentialsError,
    ObjectNotFoundError,
    StaleObjectError,
    TransientStoreError,
    UsageError,
)

log = logging.getLogger("objfs.metrics")
request_log = logging.getLogger("objfs.store")

#: Store operations, as the ``operation`` label names them.
OPERATIONS = ("get", "head", "list")
#: Error kinds, as the ``kind`` label names them (``other``: anything unexpected).
ERROR_KINDS: dict[type[BaseException], str] = {
    BucketNotFoundError: "bucket_not_found",
    AccessDeniedError: "access_denied",
    NoCredentialsError: "no_credentials",
    EndpointUnreachableError: "unreachable",
    ObjectNotFoundError: "not_found",
    StaleObjectError: "stale",
    TransientStoreError: "transient",
}
_KIND_NAMES = (*ERROR_KINDS.values(), "other")
#: Upper bounds (seconds) of the request latency histogram's buckets (+Inf is implied).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How often the daemon rewrites its status file.
STATUS_INTERVAL_S = 1.0
#: The window over which ``objfs status`` reports throughput.
RATE_WINDOW_S = 10.0
STATUS_FORMAT = 1


def error_kind(exc: BaseException) -> str:
    for cls, kind in ERROR_KINDS.items():
        if isinstance(exc, cls):
            return kind
    return "other"


class Histogram:
    """Counts per latency bucket plus the sum: what a Prometheus histogram exports."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), list(self.counts), strict=True):
            total += n
            out.append((bound, total))
        return out


class StoreStats:
    """What an :class:`InstrumentedBackend` counted. Written on the trio thread only."""

    def __init__(self) -> None:
        self.requests = dict.fromkeys(OPERATIONS, 0)
        self.latency = {op: Histogram() for op in OPERATIONS}
        self.errors = dict.fromkeys(_KIND_NAMES, 0)
        self.bytes_fetched = 0
        self.in_flight = 0


class InstrumentedBackend(Backend):
    """A backend that counts and times every request of the backend it wraps."""

    def __init__(self, inner: Backend, stats: StoreStats | None = None) -> None:
        self.inner = inner
        self.stats = StoreStats() if stats is None else stats
        self.description = inner.description

    @contextlib.contextmanager
    def _request(self, op: str, what: str) -> Iterator[list[int]]:
        """Count one request; the caller appends the bytes it received to the list."""
        stats = self.stats
        stats.in_flight += 1
        start = time.perf_counter()
        received: list[int] = []
        try:
            yield received
        except trio.Cancelled:
            raise  # read-ahead that is no longer needed: not a request, not an error
        except BaseException as exc:
            elapsed = time.perf_counter() - start
            kind = error_kind(exc)
            stats.requests[op] += 1
            stats.latency[op].observe(elapsed)
            stats.errors[kind] += 1
            request_log.debug("%s %s: %s after %.1f ms", op.upper(), what, kind, elapsed * 1e3)
            raise
        else:
            elapsed = time.perf_counter() - start
            nbytes = sum(received)
            stats.requests[op] += 1
            stats.latency[op].observe(elapsed)
            stats.bytes_fetched += nbytes
            if request_log.isEnabledFor(logging.DEBUG):
                size = f"{nbytes} bytes in " if op == "get" else ""
                request_log.debug("%s %s: %s%.1f ms", op.upper(), what, size, elapsed * 1e3)
        finally:
            stats.in_flight -= 1

    async def check(self, prefix: str) -> bool:
        with self._request("list", f"{prefix!r} (check)"):
            return await self.inner.check(prefix)

    def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        return _ListPages(self, prefix)

    async def head(self, key: str) -> ObjectInfo:
        with self._request("head", repr(key)):
            return await self.inner.head(key)

    async def has_keys_under(self, prefix: str) -> bool:
        with self._request("list", f"{prefix!r} (one key)"):
            return await self.inner.has_keys_under(prefix)

    async def read_range(self, key: str, etag: str, start: int, length: int) -> bytes:
        with self._request("get", f"{key!r} bytes {start}-{start + length - 1}") as received:
            data = await self.inner.read_range(key, etag, start, length)
            received.append(len(data))
            return data

    async def read_into(self, key: str, etag: str, start: int, views: Sequence[memoryview]) -> None:
        length = sum(len(v) for v in views)
        with self._request("get", f"{key!r} bytes {start}-{start + length - 1}") as received:
            await self.inner.read_into(key, etag, start, views)
            received.append(length)

    def cache_engine_statistics(self) -> dict[str, int] | None:
        return self.inner.cache_engine_statistics()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ListPages:
    """Async iterator over a listing that times each page's request (one per page)."""

    def __init__(self, backend: InstrumentedBackend, prefix: str) -> None:
        self._backend = backend
        self._prefix = prefix
        self._pages = backend.inner.list_prefix(prefix)

    def __aiter__(self) -> _ListPages:
        return self

    async def __anext__(self) -> ListPage:
        stats = self._backend.stats
        stats.in_flight += 1
        start = time.perf_counter()
        try:
            page = await self._pages.__anext__()
        except StopAsyncIteration:
            raise
        except trio.Cancelled:
            raise
        except BaseException as exc:
            kind = error_kind(exc)
            stats.requests["list"] += 1
            stats.latency["list"].observe(time.perf_counter() - start)
            stats.errors[kind] += 1
            request_log.debug("LIST %r: %s", self._prefix, kind)
            raise
        else:
            elapsed = time.perf_counter() - start
            stats.requests["list"] += 1
            stats.latency["list"].observe(elapsed)
            if request_log.isEnabledFor(logging.DEBUG):
                request_log.debug(
                    "LIST %r: %d keys, %d prefixes in %.1f ms",
                    self._prefix,
                    len(page.objects),
                    len(page.prefixes),
                    elapsed * 1e3,
                )
            return page
        finally:
            stats.in_flight -= 1

    async def aclose(self) -> None:
        aclose = getattr(self._pages, "aclose", None)
        if aclose is not None:
            await aclose()


# -- the listen address ----------------------------------------------------------------------


def parse_listen_address(text: str, *, option: str = "--metrics-addr") -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` into (host, port); the host is required, so nothing is
    ever exposed on an address nobody asked for."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(
            f"{option}: {text!r} is not HOST:PORT: give e.g. 127.0.0.1:9101 (this host only) "
            "or 0.0.0.0:9101 (every interface, e.g. in a Kubernetes pod)"
        )
    return host, int(port_text)


# -- where the status files live -------------------------------------------------------------


def _runtime_dirs() -> list[str]:
    """Candidate folders for status files, the daemon's choice first.

    ``$OBJFS_RUNTIME_DIR`` alone when set; else ``/run/objfs`` for root, ``$XDG_RUNTIME_DIR/
    objfs`` and ``/tmp/objfs-UID`` (mode 0700) for other users.
    """
    explicit = os.environ.get("OBJFS_RUNTIME_DIR")
    if explicit:
        return [explicit]
    dirs = ["/run/objfs"] if os.geteuid() == 0 else []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        dirs.append(os.path.join(xdg, "objfs"))
    dirs.append(os.path.join(tempfile.gettempdir(), f"objfs-{os.geteuid()}"))
    return dirs


#: A status file this old (not rewritten), of a pid that no longer runs, is removed.
STALE_STATUS_S = 60.0


def pid_gone(pid: int) -> bool:
    """True when no process ``pid`` runs (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # another user's process, or not a pid at all (kept: not ours to judge)
    return False


def remove_stale_status_files(folder: str, *, now: float | None = None) -> int:
    """Remove the status files in ``folder`` left by daemons that are gone (see the module's
    docstring); returns how many. Files that are not status files are never touched."""
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        temporary = name.startswith(".status-")
        if not (temporary or _STATUS_NAME.fullmatch(name)):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if now - st.st_mtime < STALE_STATUS_S:
                continue
            if not temporary:
                with open(path, "rb") as f:
                    text = f.read(1 << 20)
                try:
                    data = json.loads(text)
                except ValueError:
                    data = None  # not written by a daemon (each write is whole): nobody's
                pid = data.get("pid") if isinstance(data, dict) else None
                if isinstance(pid, int) and pid > 0 and not pid_gone(pid):
                    continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


_STATUS_NAME = re.compile(r"[0-9a-f]{32}\.json")


def status_file_name(mountpoint: str) -> str:
    return hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:32] + ".json"


def find_status_files(mountpoint: str) -> list[str]:
    """Status files that may describe ``mountpoint`` (a root daemon's too, for any user)."""
    name = status_file_name(mountpoint)
    dirs = _runtime_dirs()
    if "/run/objfs" not in dirs and not os.environ.get("OBJFS_RUNTIME_DIR"):
        dirs.append("/run/objfs")
    return [p for p in (os.path.join(d, name) for d in dirs) if os.path.isfile(p)]


def _usable_dir(path: str) -> bool:
    """Create ``path`` if needed; True if it is a real directory owned by this user."""
    shared = os.geteuid() == 0 and path == "/run/objfs"
    try:
        os.makedirs(path, mode=0o755 if shared else 0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    # Never write into a folder someone else controls (a /tmp name taken by another user).
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


# -- Telemetry -------------------------------------------------------------------------------


class Telemetry:
    """The figures of one mount: the status file, and the Prometheus endpoint if asked for.

    ``fs`` and ``ops`` are the mount's :class:`~objfs.fs.FileSystem` and FUSE operations;
    they are read, never changed.
    """

    def __init__(self, config: MountConfig, backend: InstrumentedBackend, fs: Any, ops: Any):
        self.config = config
        self.backend = backend
        self.fs = fs
        self.ops = ops
        self.started_at = time.time()
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()
        self._status_path: str | None = None
        self._status_failed = False
        self._httpd: Any = None
        if config.metrics_addr:
            self._start_http(config.metrics_addr)

    # -- figures ---------------------------------------------------------------------------

    def fs_statistics(self) -> dict[str, int]:
        # Read from the HTTP thread while the trio thread works: retry the rare race of a
        # table changing size under the reader.
        for _ in range(5):
            try:
                return dict(self.fs.statistics())
            except RuntimeError:
                continue
        return {}

    def _unreachable_for(self) -> float | None:
        state = getattr(self.fs, "store_state", None)
        if state is None:
            return None
        value = state().get("unreachable_for_s")
        return None if value is None else float(value)

    def _fuse(self) -> dict[str, Any]:
        """The FUSE transport and what it negotiated with the kernel (pyfuse3: libfuse's
        choice, not visible here)."""
        negotiated = getattr(self.ops, "negotiated", None)
        if negotiated is None:
            return {"transport": "pyfuse3"}
        return {
            **negotiated.as_dict(),
            "passthrough": bool(getattr(self.ops, "passthrough", False)),
            "passthrough_opens": int(getattr(self.ops, "passthrough_opens", 0)),
        }

    def snapshot(self) -> dict[str, Any]:
        """Every figure, as the status file holds it."""
        stats = self.backend.stats
        fs = self.fs_statistics()
        disk: dict[str, int] | None = None
        if "disk_hits" in fs:
            disk = {
                "hits": fs.get("disk_hits", 0),
                "misses": fs.get("disk_misses", 0),
                "writes": fs.get("disk_writes", 0),
                "corrupt": fs.get("disk_corrupt", 0),
                "bytes": fs.get("disk_bytes", 0),
                "enabled": fs.get("disk_enabled", 0),
                "limit_bytes": self.config.cache_size_bytes,
                "write_queue_bytes": fs.get("disk_write_queue_bytes", 0),
                "writes_deferred": fs.get("disk_writes_deferred", 0),
                "blocks_not_cached": fs.get("disk_blocks_not_cached", 0),
                "blocks_backfilled": fs.get("disk_blocks_backfilled", 0),
                "blocks_skipped_low_space": fs.get("disk_blocks_skipped_low_space", 0),
            }
        served = int(getattr(self.ops, "bytes_served", 0))
        get_latency = stats.latency["get"]
        return {
            "format": STATUS_FORMAT,
            "version": __version__,
            "pid": os.getpid(),
            "source": self.config.source.url(),
            "backend": self.backend.description,
            "mountpoint": self.config.mountpoint,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "metrics_addr": self.config.metrics_addr,
            "fuse": self._fuse(),
            "served": {
                "bytes": served,
                "reads": int(getattr(self.ops, "reads", 0)),
                # Reads across blocks answered with one view of adjacent buffers, and those
                # assembled by a copy (see FileSystem.read).
                "spanned": fs.get("reads_spanned", 0),
                "assembled": fs.get("reads_assembled", 0),
                "scattered": fs.get("reads_scattered", 0),
            },
            "store": {
                "requests": dict(stats.requests),
                "bytes_fetched": stats.bytes_fetched,
                "errors": dict(stats.errors),
                "in_flight": stats.in_flight,
                "get_seconds_sum": get_latency.sum_s,
            },
            "memory": {
                "hits": fs.get("hits", 0),
                "misses": fs.get("misses", fs.get("inserts", 0)),
                "evictions": fs.get("evictions", 0),
                "evicted_unread": fs.get("evicted_unread", 0),
                "orphaned": fs.get("orphaned", 0),
                "used_bytes": fs.get("cached_bytes", 0)
                + fs.get("inflight_bytes", 0)
                + fs.get("held_bytes", 0)
                + fs.get("reply_bytes", 0),
                "cached_bytes": fs.get("cached_bytes", 0),
                "reply_bytes": fs.get("reply_bytes", 0),
                "peak_bytes": fs.get("peak_bytes", 0),
                "limit_bytes": fs.get("budget_bytes", self.config.memory_limit_bytes),
            },
            "disk": disk,
            # --cache-proxy: bytes through the engine and straight from the store meanwhile.
            "cache_engine": self.backend.cache_engine_statistics(),
            "open_files": fs.get("open_files", 0),
            "inodes": fs.get("inodes", 0),
            "metadata": {
                "empty_source": bool(getattr(self.fs, "empty_source", False)),
                "account_root": self.config.source.account_root,
                "listings": fs.get("listings", 0),
                "probes": fs.get("probes", 0),
                "outages": fs.get("store_outages", 0),
                "stale_answers": fs.get("stale_answers", 0),
                "unreachable_for_s": self._unreachable_for(),
            },
        }

    def _rates(self, served: int, fetched: int) -> dict[str, float]:
        """Throughput over the last RATE_WINDOW_S; called once a second by the status writer."""
        now = time.monotonic()
        samples = self._samples
        samples.append((now, served, fetched))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, served0, fetched0 = samples[0]
        span = now - t0
        if span <= 0:
            return {"window_s": 0.0, "served_bytes_per_s": 0.0, "fetched_bytes_per_s": 0.0}
        return {
            "window_s": span,
            "served_bytes_per_s": (served - served0) / span,
            "fetched_bytes_per_s": (fetched - fetched0) / span,
        }

    # -- the status file -------------------------------------------------------------------

    def write_status(self) -> None:
        if self._status_failed:
            return
        snap = self.snapshot()
        snap["rates"] = self._rates(snap["served"]["bytes"], snap["store"]["bytes_fetched"])
        data = json.dumps(snap, separators=(",", ":")).encode()
        if self._status_path is None:
            for folder in _runtime_dirs():
                if _usable_dir(folder):
                    self._status_path = os.path.join(
                        folder, status_file_name(self.config.mountpoint)
                    )
                    removed = remove_stale_status_files(folder)
                    if removed:
                        log.info("removed %d status files of daemons that are gone", removed)
                    break
            else:
                self._status_failed = True
                log.warning(
                    "cannot create a folder for the status file (%s): `objfs status` will not "
                    "see this mount; set OBJFS_RUNTIME_DIR to a writable folder",
                    ", ".join(_runtime_dirs()),
                )
                return
        folder = os.path.dirname(self._status_path)
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".status-")
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self._status_path)
        except OSError as exc:
            self._status_failed = True
            log.warning("cannot write the status file in %s (%s)", folder, exc.strerror)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)

    def remove_status(self) -> None:
        if self._status_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._status_path)

    async def run(self, on_ready: Callable[[], None], ready: trio.Event) -> None:
        """Write the status file, report readiness once ``ready`` is set, then refresh the
        file every second.

        Started in the nursery that serves FUSE: the first write happens once the nursery
        schedules tasks, i.e. when the FUSE loop is reading requests.
        """
        await trio.lowlevel.checkpoint()
        try:
            self.write_status()
            await ready.wait()
            on_ready()
            while True:
                self.write_status()
                await trio.sleep(STATUS_INTERVAL_S)
        finally:
            self.remove_status()

    # -- Prometheus ------------------------------------------------------------------------

    def _start_http(self, address: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, port = parse_listen_address(address)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        try:
            self._httpd, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise UsageError(
                f"--metrics-addr {address}: cannot listen there ({reason}): choose another "
                "port or address"
            ) from None
        log.info("metrics on http://%s/metrics", address)

    def close(self) -> None:
        """Stop the metrics endpoint and remove the status file."""
        if self._httpd is not None:
            httpd, self._httpd = self._httpd, None
            httpd.shutdown()
            httpd.server_close()
        self.remove_status()


class _Collector:
    """prometheus_client collector: builds every family from the live figures on a scrape."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        t = self.t
        stats = t.backend.stats
        snap = t.snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        info = GaugeMetricFamily(
            "objfs_info",
            "The mount this daemon serves.",
            labels=["source", "mountpoint", "version"],
        )
        info.add_metric([snap["source"], snap["mountpoint"], __version__], 1)
        yield info
        yield gauge(
            "objfs_start_time_seconds", "When the daemon started (Unix time).", t.started_at
        )
        yield counter(
            "objfs_served_bytes",
            "Bytes returned to readers by FUSE reads.",
            snap["served"]["bytes"],
        )
        yield counter("objfs_served_reads", "FUSE read requests answered.", snap["served"]["reads"])

        requests = CounterMetricFamily(
            "objfs_store_requests",
            "Requests to the object store (get: ranged GETs of data).",
            labels=["operation"],
        )
        latency = HistogramMetricFamily(
            "objfs_store_request_duration_seconds",
            "Latency of requests to the object store, retries included.",
            labels=["operation"],
        )
        for op in OPERATIONS:
            requests.add_metric([op], stats.requests[op])
            hist = stats.latency[op]
            latency.add_metric([op], buckets=hist.cumulative(), sum_value=hist.sum_s)
        yield requests
        yield latency
        yield counter(
            "objfs_store_fetched_bytes",
            "Bytes received from the object store.",
            snap["store"]["bytes_fetched"],
        )
        errors = CounterMetricFamily(
            "objfs_store_errors", "Failed requests to the object store, by kind.", labels=["kind"]
        )
        for kind, n in snap["store"]["errors"].items():
            errors.add_metric([kind], n)
        yield errors
        yield gauge(
            "objfs_store_requests_in_flight",
            "Requests to the object store waiting for an answer.",
            snap["store"]["in_flight"],
        )

        memory, disk = snap["memory"], snap["disk"]
        hits = CounterMetricFamily(
            "objfs_cache_hits", "Blocks read from a cache tier.", labels=["tier"]
        )
        misses = CounterMetricFamily(
            "objfs_cache_misses",
            "Blocks a cache tier did not hold (memory: blocks loaded from disk or the store, "
            "read-ahead included; disk: blocks looked up and not found).",
            labels=["tier"],
        )
        hits.add_metric(["memory"], memory["hits"])
        misses.add_metric(["memory"], memory["misses"])
        if disk is not None:
            hits.add_metric(["disk"], disk["hits"])
            misses.add_metric(["disk"], disk["misses"])
        yield hits
        yield misses
        evictions = CounterMetricFamily(
            "objfs_cache_evictions", "Blocks dropped to make room.", labels=["tier"]
        )
        evictions.add_metric(["memory"], memory["evictions"])
        yield evictions
        yield counter(
            "objfs_memory_evicted_unread_blocks",
            "Blocks fetched ahead of a reader and evicted unread to make room for a reader's own "
            "fetch (memory pressure: raise --memory-limit if this grows with every load).",
            memory["evicted_unread"],
        )
        yield gauge(
            "objfs_memory_used_bytes",
            "Memory budget in use: cached blocks plus fetches in flight.",
            memory["used_bytes"],
        )
        yield gauge(
            "objfs_memory_limit_bytes", "The memory budget (--memory-limit).", memory["limit_bytes"]
        )
        yield gauge(
            "objfs_memory_peak_bytes", "Highest memory budget use so far.", memory["peak_bytes"]
        )
        if disk is not None:
            yield gauge("objfs_disk_cache_bytes", "Bytes in the disk cache.", disk["bytes"])
            yield gauge(
                "objfs_disk_cache_limit_bytes",
                "The disk cache cap (--cache-size).",
                disk["limit_bytes"],
            )
            yield gauge(
                "objfs_disk_cache_enabled",
                "1 while the disk cache works, 0 once it was turned off (disk full, read-only).",
                disk["enabled"],
            )
            yield counter(
                "objfs_disk_cache_writes", "Blocks written to the disk cache.", disk["writes"]
            )
            yield counter(
                "objfs_disk_cache_blocks_not_cached",
                "Fetched blocks not written to the disk cache because the disk fell behind the "
                "reader and they left memory first (fetched again when idle: see backfilled).",
                disk["blocks_not_cached"],
            )
            yield counter(
                "objfs_disk_cache_blocks_backfilled",
                "Blocks the disk cache lost during a load, fetched again and written once the "
                "mount was idle.",
                disk["blocks_backfilled"],
            )
            yield counter(
                "objfs_disk_cache_blocks_skipped_low_space",
                "Blocks not written to the disk cache because its file system had less free "
                "space than --cache-min-free.",
                disk["blocks_skipped_low_space"],
            )
            yield counter(
                "objfs_disk_cache_corrupt_blocks",
                "Blocks that failed their checksum (dropped and fetched again).",
                disk["corrupt"],
            )
        engine = snap["cache_engine"]
        if engine is not None:
            yield counter(
                "objfs_cache_engine_bytes",
                "Data bytes that came through the --cache-proxy engine.",
                engine["bytes_via_engine"],
            )
            yield counter(
                "objfs_cache_engine_direct_bytes",
                "Data bytes read from the store directly while the engine was failing.",
                engine["bytes_direct"],
            )
            yield counter(
                "objfs_cache_engine_failures",
                "GETs the engine failed (each made objfs read from the store directly).",
                engine["failures"],
            )
            yield gauge(
                "objfs_cache_engine_up",
                "1 while data GETs go through the engine, 0 while it is left alone.",
                1 - engine["down"],
            )
        meta = snap["metadata"]
        yield counter(
            "objfs_store_outages",
            "Times metadata requests found the store unreachable (each outage counts once).",
            meta["outages"],
        )
        yield counter(
            "objfs_stale_metadata_answers",
            "Lookups, stats, opens and listings answered from cached metadata past its TTL "
            "because the store was unreachable (--max-stale).",
            meta["stale_answers"],
        )
        yield gauge(
            "objfs_store_unreachable",
            "1 while metadata requests find the store unreachable, else 0.",
            0 if meta["unreachable_for_s"] is None else 1,
        )
        yield gauge("objfs_open_files", "Files open on the mount.", snap["open_files"])
        yield gauge("objfs_inodes", "Files and directories known to the mount.", snap["inodes"])
