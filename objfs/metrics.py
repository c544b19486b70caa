"""Live figures of a mount: Prometheus metrics (``--metrics-addr``) and the status file.

:class:`Telemetry` gathers the store's figures (:class:`objfs.store_metrics.StoreStats`, counted
by :class:`~objfs.store_metrics.InstrumentedBackend`) with ``FileSystem.statistics()`` (cache
tiers, memory budget) and the FUSE adapter's bytes served. It serves them to Prometheus from a
thread (``prometheus_client``'s HTTP server, bound only to the address given) and writes them
once a second to the status file (:mod:`objfs.status_files`) that ``objfs status`` reads. All
figures are plain integers updated on the trio thread; the HTTP thread only reads them.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import trio

from objfs import __version__
from objfs.config import MountConfig
from objfs.errors import UsageError
from objfs.status_files import STATUS_INTERVAL_S, StatusFile
from objfs.store_metrics import OPERATIONS, InstrumentedBackend

log = logging.getLogger("objfs.metrics")

#: The window over which ``objfs status`` reports throughput.
RATE_WINDOW_S = 10.0
STATUS_FORMAT = 1


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
        self._status = StatusFile(config.mountpoint)
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
            # READs answered from memory as they were read, with no task: by the reader
            # thread itself (under the core's lock), or on arrival in the trio thread.
            "reads_in_reader": int(getattr(self.ops, "reads_in_reader", 0)),
            "reads_on_arrival": int(getattr(self.ops, "reads_on_arrival", 0)),
            # Why the kernel refused a backing file for good (passthrough then off), or None.
            "passthrough_refused": getattr(self.ops, "passthrough_refused", None),
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
                # Where the default budget may grow while handles share a version.
                "ceiling_bytes": fs.get(
                    "ceiling_bytes",
                    self.config.memory_ceiling_bytes or self.config.memory_limit_bytes,
                ),
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
        if self._status.failed:
            return
        snap = self.snapshot()
        snap["rates"] = self._rates(snap["served"]["bytes"], snap["store"]["bytes_fetched"])
        self._status.write(json.dumps(snap, separators=(",", ":")).encode())

    def remove_status(self) -> None:
        self._status.remove()

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
            "objfs_memory_limit_bytes",
            "The memory budget now (--memory-limit; the default grows while several handles "
            "read one file).",
            memory["limit_bytes"],
        )
        yield gauge(
            "objfs_memory_ceiling_bytes",
            "Where the memory budget may grow (the --memory-limit given: no growth).",
            memory["ceiling_bytes"],
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
