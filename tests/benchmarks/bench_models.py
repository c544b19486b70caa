"""``make bench``: how fast a model loads from objfs, against the ceiling, peers and local disk.

Usage (``make bench`` installs what this needs, then runs it)::

    python -m tests.benchmarks.bench_models            # the full run (2.2 GB model, 3 runs)
    python -m tests.benchmarks.bench_models --quick    # smoke mode: 270 MB model, 1 run
    python -m tests.benchmarks.bench_models --report .bench/results.json  # tables again

Prints markdown tables and writes every run's figures to ``.bench/results.json``.

One s3rver (data on /dev/shm) serves one data set: a Llama-shaped model (two safetensors shards,
config and tokenizer files) and 1,000 small objects. Every method reads the same bytes from it:

* ceiling: the shards pulled straight into memory with boto3, the best of one GET stream per
  file (files at once) and 8 MiB ranged GETs from 8 and from 32 threads;
* objfs, s3fs-fuse (``parallel_count``/``multipart_size`` set like objfs's connections and part
  size), rclone mount (``--vfs-cache-mode full`` and ``off``), Run:ai Model Streamer, and the
  copy-first baseline (boto3 ``download_file`` of the shards, then the same load from disk);
* local disk: the same load and ``cat`` of the model's local copy;
* the binding ceiling (``binding_ceiling.py``): the model's local copy read into memory and
  served by a minimal pyfuse3 file system with objfs's mount options and kernel tuning, the
  fastest a load through this FUSE binding can be on this machine (objfs's remount target:
  at least 0.8x its throughput).

"Load" is ``safetensors.torch.load_file`` of every shard followed by touching one byte in every
4 KiB page of every tensor (what a loader's first use does; summing every byte would hide the
I/O behind seconds of CPU). "Cold" means a fresh mount with empty caches and the page cache
dropped; "warm" a load right after (the median of 5, as one takes a few tenths of a second);
"remount" a load after unmount and mount again with the disk cache kept (page cache dropped).
For every FUSE method (the binding ceiling included) the daemon's CPU seconds (user + system:
its threads and children) during each load are divided by the GB the load read (the shards'
bytes): "daemon CPU s per GB", cold / warm / remount. The store's CPU seconds per GB during each
cold load (s3rver's, whose one JavaScript thread is the busiest thread of a cold load on this
machine) are reported too, for the mounts, Run:ai and copy first.

A tensor-parallel pass runs 4 processes at once that each ``load_file`` every shard and touch one
byte per 4 KiB page of their quarter of every tensor's bytes (rank r the r-th quarter), as TP
ranks do: objfs (fresh mount, ``--cache-dir``), s3fs, one Run:ai streamer per rank (each
streams every shard) and copy first (one download, then the 4 ranks load the local copy). It
reports the wall time (from all ranks ready to the last one done) and the bytes s3rver sent
(its own write counter, ``wchar`` in /proc/PID/io) over the model's bytes.

A shaped pass puts the shaping proxy (10 ms to each response's first byte, 50 MB/s per
connection) between every method and the server. An Azure pass runs objfs against Azurite next
to raw ranged GETs and rclone's azureblob mount.

Rounds go over all methods in turn, so drift spreads evenly. objfs, local disk and the binding
ceiling run every measure ``--runs`` times. Peers and ceilings run their cold load (and, in the
tensor-parallel pass, their 4-rank load) up to ``--runs`` times, fewer when one run is slow
(``--method-budget-s``, ``--shaped-budget-s``), and their other measures once
(``--peer-detail-runs``); no new round starts after ``--max-minutes``. The JSON keeps every
run's figure. This is a script, not a test: pytest does not collect it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import http.client
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from tests.benchmarks import bench_env as env
from tests.benchmarks.bench_env import MiB

PAGE = 4096
PART = 8 * MiB
REGION = 16 * MiB  # random reads: one per region, so none hits what another fetched
RESULTS = env.REPO / ".bench" / "results.json"
SHAPED_DELAY_S = 0.010
SHAPED_RATE = 50e6
AZ_CONTAINER = "bench"
TP_RANKS = 4  # the tensor-parallel measure's processes
WARM_REPEATS = 5  # a warm load's time is the median of this many (see load_with_cpu)
TP_START_TIMEOUT_S = 300.0  # for the ranks' imports, on a busy machine

# -- measures -------------------------------------------------------------------------------------


def touch_pages(tensors: dict[str, Any], rank: int = 0, world: int = 1) -> int:
    """Read one byte in every 4 KiB page of every tensor; with ``world`` > 1, only in the
    ``rank``-th of ``world`` equal slices of each tensor's flattened bytes (a TP rank's part)."""
    import torch

    total = 0
    for tensor in tensors.values():
        raw = tensor.reshape(-1).view(torch.uint8)
        n = raw.numel()
        raw = raw[n * rank // world : n * (rank + 1) // world]
        if raw.numel():
            total += int(raw[::PAGE].sum()) + int(raw[-1])
    return total


def t_load(files: list[Path]) -> float:
    """``load_file`` of every shard + one byte touched per 4 KiB page: seconds."""
    from safetensors.torch import load_file

    start = time.perf_counter()
    for name in files:
        tensors = load_file(str(name))
        touch_pages(tensors)
        del tensors
    elapsed = time.perf_counter() - start
    gc.collect()
    return elapsed


def t_torch_io(files: list[Path]) -> float:
    from objfs.torch_io import load_safetensors

    start = time.perf_counter()
    state = load_safetensors([str(f) for f in files], "cpu")
    elapsed = time.perf_counter() - start
    del state
    gc.collect()
    return elapsed


def t_cat(files: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def t_from_pretrained(model_dir: Path) -> float:
    from transformers import LlamaForCausalLM

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def t_read_config(model_dir: Path) -> float:
    start = time.perf_counter()
    json.loads((model_dir / "config.json").read_bytes())
    return time.perf_counter() - start


def t_ls(directory: Path) -> float:
    start = time.perf_counter()
    out = subprocess.run(["ls", "-lR", str(directory)], capture_output=True, check=True)
    elapsed = time.perf_counter() - start
    listed = sum(1 for line in out.stdout.splitlines() if line.startswith(b"-"))
    if listed != env.SMALL_COUNT:
        raise RuntimeError(f"ls -lR {directory} listed {listed} files, not {env.SMALL_COUNT}")
    return elapsed


def random_reads(path: Path, count: int, budget_s: float, seed: int) -> list[float]:
    """Latencies (s) of 4 KiB ``pread``s at random pages, kernel read-ahead off.

    At most one read per 16 MiB region (random regions in random order), so that no read can
    be a hit on what an earlier read fetched (a block, a part, a client's read-ahead): every
    figure is a cold read. ``count`` is capped by the number of regions.
    """
    size = path.stat().st_size
    rng = random.Random(seed)
    regions = rng.sample(range(size // REGION), min(count, size // REGION))
    offsets = [r * REGION + rng.randrange(0, REGION // PAGE) * PAGE for r in regions]
    fd = os.open(path, os.O_RDONLY)
    latencies: list[float] = []
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        deadline = time.monotonic() + budget_s
        for offset in offsets:
            start = time.perf_counter()
            data = os.pread(fd, PAGE, offset)
            latencies.append(time.perf_counter() - start)
            if len(data) != PAGE:
                raise RuntimeError(f"short read at {offset} of {path}")
            if time.monotonic() > deadline:
                break
    finally:
        os.close(fd)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


# -- results --------------------------------------------------------------------------------------


@dataclass
class Results:
    """Per (pass, method): measure -> list of values, plus per-run extras and notes."""

    cells: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    extras: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    notes: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, pass_: str, method: str, values: dict[str, float]) -> None:
        cell = self.cells.setdefault(pass_, {}).setdefault(method, {})
        for key, value in values.items():
            cell.setdefault(key, []).append(value)

    def extra(self, pass_: str, method: str, info: dict[str, Any]) -> None:
        self.extras.setdefault(pass_, {}).setdefault(method, []).append(info)

    def note(self, pass_: str, method: str, text: str) -> None:
        self.notes.setdefault(pass_, {})[method] = text

    def values(self, pass_: str, method: str, measure: str) -> list[float]:
        return self.cells.get(pass_, {}).get(method, {}).get(measure, [])

    def median(self, pass_: str, method: str, measure: str) -> float:
        vals = self.values(pass_, method, measure)
        return statistics.median(vals) if vals else math.nan


# -- the benchmark's context ----------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path  # temporary: mountpoints, caches, logs of this run
    model_dir: Path
    small_dir: Path
    s3: env.S3rver
    page_cache: env.PageCache
    results: Results
    deadline: float
    passwd: Path
    proxy: env.ProxyProc | None = None
    round: int = 0  # the round run_rounds is in
    mount_ids: Iterator[int] = field(default_factory=lambda: iter(range(1_000_000)))

    @property
    def local_shards(self) -> list[Path]:
        return [self.model_dir / name for name in env.SHARDS]

    @cached_property
    def model_bytes(self) -> int:
        """The bytes a load reads: the shards'."""
        return sum(p.stat().st_size for p in self.local_shards)

    def fresh(self, kind: str) -> tuple[Path, Path]:
        """A new mountpoint and an empty cache folder."""
        n = next(self.mount_ids)
        mnt = self.work / "mnt" / f"{kind}-{n}"
        cache = self.work / "cache" / f"{kind}-{n}"
        mnt.mkdir(parents=True)
        return mnt, cache

    def drop(self, files: list[Path] | None = None) -> None:
        self.page_cache.drop(files or [])

    def log(self, name: str) -> Path:
        (self.work / "logs").mkdir(exist_ok=True)
        return self.work / "logs" / f"{name}.log"


@dataclass
class FuseKind:
    """How to mount the model (and the small-object) bucket with one FUSE client."""

    name: str
    mount: Callable[[Bench, str, str, Path, Path], contextlib.AbstractContextManager[env.MountProc]]
    persistent_cache: bool


def _objfs_mounter(
    *options: str,
) -> Callable[..., contextlib.AbstractContextManager[env.MountProc]]:
    """objfs's mount with ``options`` added (a transport)."""

    def mount(
        b: Bench, url: str, bucket: str, mnt: Path, cache: Path
    ) -> contextlib.AbstractContextManager[env.MountProc]:
        cmd = env.objfs_cmd(
            f"s3://{bucket}",
            mnt,
            cache,
            b.log(f"objfs-{mnt.name}"),
            ["--endpoint-url", url, *options],
        )
        return env.mounted("objfs", cmd, mnt, b.log("objfs-stdout"))

    return mount


_objfs_mount = _objfs_mounter()


def _s3fs_mount(
    b: Bench, url: str, bucket: str, mnt: Path, cache: Path
) -> contextlib.AbstractContextManager[env.MountProc]:
    cmd = env.s3fs_cmd(bucket, mnt, url, b.passwd, b.args.s3fs_parallel, b.args.s3fs_part_mib)
    return env.mounted("s3fs", cmd, mnt, b.log("s3fs"))


def _rclone_mount(mode: str) -> Callable[..., contextlib.AbstractContextManager[env.MountProc]]:
    def mount(
        b: Bench, url: str, bucket: str, mnt: Path, cache: Path
    ) -> contextlib.AbstractContextManager[env.MountProc]:
        remote = env.rclone_s3_remote(url, bucket)
        cmd = env.rclone_cmd(remote, mnt, mode, cache, b.log(f"rclone-{mode}-{mnt.name}"))
        return env.mounted(f"rclone-{mode}", cmd, mnt, b.log("rclone-stdout"), env.rclone_env())

    return mount


PYFUSE3 = "objfs pyfuse3"  # the fallback transport (the "objfs" rows are the default's)

FUSE_KINDS = {
    "objfs": FuseKind("objfs", _objfs_mount, True),
    # The pyfuse3 transport, objfs's fallback ("objfs" is the default, the kernel transport).
    PYFUSE3: FuseKind(PYFUSE3, _objfs_mounter("--fuse-transport", "pyfuse3"), True),
    "s3fs": FuseKind("s3fs", _s3fs_mount, False),
    "rclone full": FuseKind("rclone full", _rclone_mount("full"), True),
    "rclone off": FuseKind("rclone off", _rclone_mount("off"), False),
}


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def load_with_cpu(
    b: Bench,
    m: env.MountProc,
    shards: list[Path],
    phase: str,
    out: dict[str, float],
    extra: dict[str, Any],
) -> None:
    """``t_load`` as the measure ``{phase}_load``, and the daemon's CPU seconds meanwhile:
    as they are in ``extra``, per GB loaded (the shards' bytes) in ``out``.

    A warm load (a few tenths of a second, all from the page cache) is the median of
    ``WARM_REPEATS`` loads, its CPU their mean: one load is at the mercy of the machine's
    noise (single warm loads of the same files ranged 0.20-0.37 s in one run). A cold load
    also records the store's (s3rver's) CPU seconds per GB meanwhile."""
    repeats = WARM_REPEATS if phase == "warm" else 1
    cpu0, store0, threads0 = m.cpu_s(), store_cpu_s(b), m.thread_cpu_s()
    out[f"{phase}_load"] = statistics.median(t_load(shards) for _ in range(repeats))
    cpu = (m.cpu_s() - cpu0) / repeats
    # The busiest thread bounds what one mount serves where cores are many (threads that
    # ended meanwhile are not counted).
    busiest = max((t - threads0.get(tid, 0.0) for tid, t in m.thread_cpu_s().items()), default=0.0)
    out[f"busiest_thread_cpu_per_gb_{phase}"] = busiest / repeats / (b.model_bytes / 1e9)
    store = store_cpu_s(b) - store0
    extra["daemon_cpu_s" if phase == "cold" else f"{phase}_daemon_cpu_s"] = cpu
    out[f"daemon_cpu_per_gb_{phase}"] = cpu / (b.model_bytes / 1e9)
    if phase == "cold":
        out["store_cpu_per_gb_cold"] = store / (b.model_bytes / 1e9)


def store_cpu_s(b: Bench) -> float:
    """CPU seconds (user + system, all threads) s3rver, the store of both passes, has used."""
    return env.process_cpu(b.s3.pid)


def fuse_run(b: Bench, kind: FuseKind, url: str, full: bool) -> dict[str, float]:
    """One round of measures for one FUSE client; ``full=False``: cold load only.

    Core measures (cold load, remount load) run every round. The others (warm load, cold
    ``cat``, ``from_pretrained``, config.json, random reads, ``ls -lR``) run every round for
    objfs and in the first ``--peer-detail-runs`` rounds for the peers, to bound the time.
    """
    round_start = time.perf_counter()
    out: dict[str, float] = {}
    extra: dict[str, Any] = {}
    pass_ = "shaped" if b.proxy and url == b.proxy.url else "s3"
    mnt, cache = b.fresh(kind.name.replace(" ", "-"))
    try:
        with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache) as m:
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            if b.proxy and pass_ == "shaped":
                b.proxy.reset()
            load_with_cpu(b, m, shards, "cold", out, extra)
            extra["daemon_peak_rss_mib"] = m.peak_rss_mib()
            extra["kernel"] = env.fuse_tuning(mnt)
            if b.proxy and pass_ == "shaped":
                extra["proxy"] = b.proxy.stats()
            if full and (kind.name == "objfs" or b.round < b.args.peer_detail_runs):
                load_with_cpu(b, m, shards, "warm", out, extra)
        if full and kind.persistent_cache:
            b.drop()
            with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache) as m:
                shards = [mnt / s for s in env.SHARDS]
                b.drop(shards)
                load_with_cpu(b, m, shards, "remount", out, extra)
                if kind.name == "objfs":
                    # Warm after a remount: with passthrough, the backing files' page cache.
                    load_with_cpu(b, m, shards, "remount_warm", out, extra)
    finally:
        _rmtree(cache)
    out["_core_s"] = time.perf_counter() - round_start
    if not full or (kind.name != "objfs" and b.round >= b.args.peer_detail_runs):
        b.results.extra(pass_, kind.name, extra)
        return out

    mnt, cache = b.fresh(kind.name.replace(" ", "-"))
    try:
        with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache):
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            out["cold_cat"] = t_cat(shards)
    finally:
        _rmtree(cache)
    mnt, cache = b.fresh(kind.name.replace(" ", "-"))
    try:
        with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache):
            b.drop([mnt / s for s in env.SHARDS])
            out["cold_from_pretrained"] = t_from_pretrained(mnt)
    finally:
        _rmtree(cache)
    mnt, cache = b.fresh(kind.name.replace(" ", "-"))
    try:
        with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache):
            b.drop()
            out["config_json"] = t_read_config(mnt)
            lat = random_reads(mnt / env.SHARDS[0], b.args.random_reads, 30, seed=len(out))
            out["rand4k_shard_p50"] = percentile(lat, 0.5)
            out["rand4k_shard_p99"] = percentile(lat, 0.99)
            extra["rand4k_shard_n"] = len(lat)
    finally:
        _rmtree(cache)
    mnt, cache = b.fresh(kind.name.replace(" ", "-"))
    try:
        with kind.mount(b, url, env.SMALL_BUCKET, mnt, cache):
            b.drop()
            out["ls_lR"] = t_ls(mnt / env.SMALL_PREFIX)
            lat = random_reads(mnt / env.RANDOM_KEY, b.args.random_reads, 30, seed=7)
            out["rand4k_bin_p50"] = percentile(lat, 0.5)
            out["rand4k_bin_p99"] = percentile(lat, 0.99)
            extra["rand4k_bin_n"] = len(lat)
    finally:
        _rmtree(cache)
    b.results.extra(pass_, kind.name, extra)
    return out


def objfs_nocache_run(b: Bench, url: str) -> dict[str, float]:
    """objfs's cold load without a disk cache (memory tier only)."""
    mnt, _ = b.fresh("objfs-nocache")
    cmd = env.objfs_cmd(
        f"s3://{env.MODEL_BUCKET}", mnt, None, b.log(f"objfs-{mnt.name}"), ["--endpoint-url", url]
    )
    out: dict[str, float] = {}
    extra: dict[str, Any] = {}
    with env.mounted("objfs", cmd, mnt, b.log("objfs-stdout")) as m:
        shards = [mnt / s for s in env.SHARDS]
        b.drop(shards)
        load_with_cpu(b, m, shards, "cold", out, extra)
        extra["daemon_peak_rss_mib"] = m.peak_rss_mib()
    pass_ = "shaped" if b.proxy and url == b.proxy.url else "s3"
    b.results.extra(pass_, NOCACHE, extra)
    return out


# -- a long-lived mount, and the objfs warm command ------------------------------------------

# The long-lived mount's other shards: opened for their headers and closed before the load,
# as a loader that scans several models does. 16 of 32 MiB: twice the default memory budget,
# so their whole-file read-ahead fills it.
DECOYS = 16
DECOY_BYTES = 32 * MiB
DECOY_PREFIX = "decoys"  # their folder in the model's bucket (one level deep, as s3rver wants)
LONG_LIVED = "objfs, long-lived mount"
WARM_CMD = "objfs warm"
WARM_CACHE_ONLY = "objfs warm --cache-only"
# The store counts as idle once it sent nothing for this long: longer than objfs's backfill
# waits for an idle mount (1 s), so the decoys' read-ahead and backfill are done by then.
IDLE_QUIET_S = 2.5
IDLE_LIMIT_S = 120.0


def build_decoys(root: Path) -> Path:
    """``DECOYS`` safetensors files of ``DECOY_BYTES`` random bytes (one uint8 tensor each) in
    ``root/decoys/decoys/``, unless a complete set is there; returns ``root/decoys``, whose
    upload puts them under the ``decoys/`` prefix."""
    out = root / DECOY_PREFIX
    spec = {"count": DECOYS, "bytes": DECOY_BYTES}
    marker = out / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    (out / DECOY_PREFIX).mkdir(parents=True)
    gen = torch.Generator().manual_seed(1)
    for i in range(DECOYS):
        tensor = torch.randint(0, 256, (DECOY_BYTES,), dtype=torch.uint8, generator=gen)
        path = out / DECOY_PREFIX / f"decoy-{i:02}.safetensors"
        save_file({"weight": tensor}, str(path), metadata={"format": "pt"})
    marker.write_text(json.dumps(spec))
    return out


def read_headers(paths: list[Path]) -> None:
    """Open each safetensors file, read its header (8-byte length, then JSON) and close it."""
    for path in paths:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        if "weight" not in header:
            raise RuntimeError(f"{path}: unexpected header {sorted(header)}")


def wait_store_idle(b: Bench) -> float:
    """Wait until s3rver has sent nothing for ``IDLE_QUIET_S`` (at most ``IDLE_LIMIT_S``);
    return the seconds waited."""
    start = quiet_since = time.monotonic()
    last = b.s3.bytes_sent()
    while time.monotonic() - start < IDLE_LIMIT_S:
        time.sleep(0.1)
        now = b.s3.bytes_sent()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= IDLE_QUIET_S:
            break
    return time.monotonic() - start


def long_lived_run(b: Bench, url: str) -> dict[str, float]:
    """The cold load on a mount that has seen other shards: a fresh mount (empty cache
    folder, page cache dropped) opens the ``DECOYS`` shards, reads their headers and closes
    them, waits until the store is idle (their read-ahead is done), then loads the model.
    Compared with objfs's cold load on a fresh mount of the same pass; ``fetched_x``: the
    bytes s3rver sent during the load over the model's bytes."""
    out: dict[str, float] = {}
    extra: dict[str, Any] = {}
    mnt, cache = b.fresh("objfs-long-lived")
    try:
        with _objfs_mount(b, url, env.MODEL_BUCKET, mnt, cache) as m:
            decoys = sorted((mnt / DECOY_PREFIX).glob("*.safetensors"))
            if len(decoys) != DECOYS:
                raise RuntimeError(f"{len(decoys)} decoy shards on the mount, not {DECOYS}")
            b.drop(decoys)
            sent = b.s3.bytes_sent()
            read_headers(decoys)
            extra["idle_wait_s"] = wait_store_idle(b)
            extra["decoys_fetched_x"] = (b.s3.bytes_sent() - sent) / (DECOYS * DECOY_BYTES)
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            sent = b.s3.bytes_sent()
            load_with_cpu(b, m, shards, "cold", out, extra)
            out["fetched_x"] = (b.s3.bytes_sent() - sent) / b.model_bytes
            extra["daemon_peak_rss_mib"] = m.peak_rss_mib()
    finally:
        _rmtree(cache)
    b.results.extra("s3", LONG_LIVED, extra)
    return out


def warm_cmd_run(b: Bench, url: str, *, cache_only: bool = False) -> dict[str, float]:
    """``objfs warm`` of the shards on a fresh mount (empty cache folder, page cache
    dropped): the command's wall time, its start included, as a user runs it. Its
    throughput is compared with the ceiling's (the same bytes). ``cache_only``: with
    ``--cache-only`` (objfs's caches, not the page cache)."""
    out: dict[str, float] = {}
    mnt, cache = b.fresh("objfs-warm")
    flags = ["--cache-only"] if cache_only else []
    try:
        with _objfs_mount(b, url, env.MODEL_BUCKET, mnt, cache) as m:
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            cpu = m.cpu_s()
            start = time.perf_counter()
            proc = subprocess.run(
                [str(env.VENV_BIN / "objfs"), "warm", *flags, *map(str, shards)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            out["warm_cmd"] = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"objfs warm exited {proc.returncode}: {proc.stderr[-600:]}")
            out["daemon_cpu_per_gb_warm_cmd"] = (m.cpu_s() - cpu) / (b.model_bytes / 1e9)
    finally:
        _rmtree(cache)
    return out


def binding_run(b: Bench, transport: str = "pyfuse3") -> dict[str, float]:
    """The binding ceiling (binding_ceiling.py: the model served from memory by a minimal
    file system through ``transport``, objfs's mount options and kernel tuning): cold and
    warm load on a fresh mount, then a load after unmount and mount again, the page cache
    dropped."""
    out: dict[str, float] = {}
    extra: dict[str, Any] = {}
    mnt, _ = b.fresh(f"binding-{transport}")
    cmd = env.binding_ceiling_cmd(b.model_dir, mnt, transport)
    child_env = env.binding_ceiling_env()
    name = BINDING if transport == "pyfuse3" else BINDING_KERNEL
    for phases in (("cold", "warm"), ("remount",)):
        with env.mounted(name, cmd, mnt, b.log(f"binding-{transport}"), child_env) as m:
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            for phase in phases:
                load_with_cpu(b, m, shards, phase, out, extra)
            extra.setdefault("daemon_peak_rss_mib", m.peak_rss_mib())
            extra.setdefault("kernel", env.fuse_tuning(mnt))
    b.results.extra("s3", name, extra)
    return out


def torch_io_run(b: Bench) -> dict[str, float]:
    """objfs.torch_io.load_safetensors on a fresh objfs mount: cold, then warm; then on a
    new mount over the same disk cache, the page cache dropped (passthrough on the kernel
    transport)."""
    out: dict[str, float] = {}
    mnt, cache = b.fresh("objfs-torchio")
    try:
        with _objfs_mount(b, b.s3.url, env.MODEL_BUCKET, mnt, cache):
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            out["cold_load"] = t_torch_io(shards)
            out["warm_load"] = t_torch_io(shards)
        b.drop()
        with _objfs_mount(b, b.s3.url, env.MODEL_BUCKET, mnt, cache):
            shards = [mnt / s for s in env.SHARDS]
            b.drop(shards)
            out["remount_load"] = t_torch_io(shards)
    finally:
        _rmtree(cache)
    return out


def local_run(b: Bench) -> dict[str, float]:
    shards = b.local_shards
    out: dict[str, float] = {}
    b.drop(shards)
    out["cold_load"] = t_load(shards)
    out["warm_load"] = statistics.median(t_load(shards) for _ in range(WARM_REPEATS))
    b.drop(shards)
    out["cold_cat"] = t_cat(shards)
    b.drop(shards)
    out["cold_from_pretrained"] = t_from_pretrained(b.model_dir)
    b.drop(shards)
    out["torch_io_cold_load"] = t_torch_io(shards)
    out["torch_io_warm_load"] = t_torch_io(shards)
    return out


# -- the ceiling: the bytes straight from the server into memory ----------------------------------


def _read_body(body: Any, view: memoryview) -> None:
    raw = body._raw_stream  # urllib3's response: readinto() fills our buffer without copies
    got = 0
    while got < len(view):
        n = raw.readinto(view[got:])
        if not n:
            raise RuntimeError("short body")
        got += n
    body.close()


_BUFFERS: dict[str, bytearray] = {}


def _buffers(sizes: dict[str, int]) -> dict[str, bytearray]:
    """One buffer per shard, its pages faulted in once (the ceiling times the network, not
    the allocator), reused by every ceiling run."""
    for key, size in sizes.items():
        if len(_BUFFERS.get(key, b"")) != size:
            buf = _BUFFERS[key] = bytearray(size)
            buf[::PAGE] = b"\1" * len(range(0, size, PAGE))
    return {key: _BUFFERS[key] for key in sizes}


def ceiling_run(
    url: str, sizes: dict[str, int], threads: int | None, part_bytes: int = PART
) -> float:
    """Seconds to GET every shard into memory: ``threads=None`` is one stream per file, else
    ranged GETs of ``part_bytes`` from ``threads`` threads."""
    client = env.s3_client(url, pool=max(threads or 1, len(sizes)))
    buffers = _buffers(sizes)

    def whole(key: str) -> None:
        resp = client.get_object(Bucket=env.MODEL_BUCKET, Key=key)
        _read_body(resp["Body"], memoryview(buffers[key]))

    def part(item: tuple[str, int]) -> None:
        key, offset = item
        end = min(offset + part_bytes, sizes[key])
        resp = client.get_object(
            Bucket=env.MODEL_BUCKET, Key=key, Range=f"bytes={offset}-{end - 1}"
        )
        _read_body(resp["Body"], memoryview(buffers[key])[offset:end])

    start = time.perf_counter()
    if threads is None:
        with ThreadPoolExecutor(len(sizes)) as pool:
            list(pool.map(whole, sizes))
    else:
        items = [(k, off) for k, size in sizes.items() for off in range(0, size, part_bytes)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, items))
    elapsed = time.perf_counter() - start
    client.close()
    return elapsed


def server_rtt(url: str, key: str, bucket: str, count: int) -> list[float]:
    """Latencies of 4 KiB ranged GETs on one warm connection."""
    client = env.s3_client(url, pool=1)
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    rng = random.Random(1)
    client.get_object(Bucket=bucket, Key=key, Range="bytes=0-4095")["Body"].read()
    out = []
    for _ in range(count):
        offset = rng.randrange(0, size // PAGE) * PAGE
        start = time.perf_counter()
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + 4095}")
        resp["Body"].read()
        out.append(time.perf_counter() - start)
    client.close()
    return out


# -- peers that are not mounts --------------------------------------------------------------------


def runai_run(b: Bench, url: str) -> dict[str, float]:
    child_env = {
        **os.environ,
        "AWS_ENDPOINT_URL": url,
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "PYTHONPATH": os.pathsep.join([str(env.RUNAI_SITE), str(env.REPO)]),
    }
    uris = [f"s3://{env.MODEL_BUCKET}/{s}" for s in env.SHARDS]
    store0 = store_cpu_s(b)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_runai", *uris],
        capture_output=True,
        text=True,
        env=child_env,
        cwd=env.REPO,
        timeout=600,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"Run:ai worker exited {proc.returncode}: {proc.stderr[-1500:]}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(result["error"])
    return {
        "cold_load": float(result["seconds"]),
        "store_cpu_per_gb_cold": (store_cpu_s(b) - store0) / (b.model_bytes / 1e9),
    }


def copy_first_run(b: Bench, url: str) -> dict[str, float]:
    client = env.s3_client(url)
    dest = b.work / "copy-first"
    _rmtree(dest)
    dest.mkdir(parents=True)
    try:
        store0 = store_cpu_s(b)
        start = time.perf_counter()
        for shard in env.SHARDS:
            client.download_file(env.MODEL_BUCKET, shard, str(dest / shard))
        download = time.perf_counter() - start
        store = store_cpu_s(b) - store0
        load = t_load([dest / s for s in env.SHARDS])
    finally:
        client.close()
        _rmtree(dest)
    return {
        "cold_load": download + load,
        "download": download,
        "store_cpu_per_gb_cold": store / (b.model_bytes / 1e9),
    }


# -- tensor parallel: 4 ranks load the same model at once ------------------------------------------


def _tp_rank(
    rank: int,
    world: int,
    sources: list[str],
    runai_env: dict[str, str] | None,
    barrier: Any,
    results: Any,
) -> None:
    """One tensor-parallel rank, in a spawned process: ``load_file`` of every shard, then one
    byte read per 4 KiB page of the rank-th quarter of every tensor's bytes. With
    ``runai_env`` (added to the environment) the rank streams every shard (``sources`` are
    s3:// URIs) with its own Run:ai Model Streamer instead. Imports happen before the barrier,
    so the parent's clock starts when every rank is ready."""
    try:
        if runai_env is None:
            from safetensors.torch import load_file
        else:
            os.environ.update(runai_env)
            sys.path.insert(0, str(env.RUNAI_SITE))  # this process only, as bench_runai.py
            from runai_model_streamer import SafetensorsStreamer
        barrier.wait(timeout=TP_START_TIMEOUT_S)
        if runai_env is None:
            for source in sources:
                tensors = load_file(source)
                touch_pages(tensors, rank, world)
                del tensors
        else:
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(sources)
                for name, tensor in streamer.get_tensors():
                    touch_pages({name: tensor}, rank, world)
        results.put({"rank": rank})
    except BaseException as exc:  # reported by the parent
        barrier.abort()
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def tp_load(sources: list[str], runai_env: dict[str, str] | None = None) -> float:
    """Seconds from the moment ``TP_RANKS`` ranks are all ready (imports done) until the last
    of them has loaded ``sources`` (see ``_tp_rank``)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(TP_RANKS + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_tp_rank,
            args=(rank, TP_RANKS, sources, runai_env, barrier, results),
            daemon=True,
        )
        for rank in range(TP_RANKS)
    ]
    for proc in procs:
        proc.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):  # a rank failed: it says why
            barrier.wait(timeout=TP_START_TIMEOUT_S)
        start = time.perf_counter()
        deadline = time.monotonic() + 600
        finished = 0
        while finished < TP_RANKS:
            try:
                msg = results.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel ranks died (exit codes {dead}) or ran past 600 s"
                    ) from None
                continue
            if "error" in msg:
                raise RuntimeError(f"rank {msg['rank']}: {msg['error']}")
            finished += 1
        return time.perf_counter() - start
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _tp_measure(b: Bench, load: Callable[[], float]) -> dict[str, float]:
    """``load``'s seconds, and the bytes s3rver sent meanwhile (its own counter)."""
    before = b.s3.bytes_sent()
    wall = load()
    fetched = b.s3.bytes_sent() - before
    return {"wall": wall, "fetched_bytes": fetched, "fetched_x": fetched / b.model_bytes}


def _tp_jobs(b: Bench) -> dict[str, Callable[[], dict[str, float]]]:
    """Methods of the tensor-parallel pass: objfs (with --cache-dir) and s3fs on a fresh mount,
    the page cache dropped; one Run:ai streamer per rank; copy first (one download, then the
    ranks load the local copy)."""
    url = b.s3.url

    def fuse(kind: FuseKind) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            mnt, cache = b.fresh(f"tp-{kind.name.replace(' ', '-')}")
            try:
                with kind.mount(b, url, env.MODEL_BUCKET, mnt, cache):
                    shards = [mnt / s for s in env.SHARDS]
                    b.drop(shards)
                    return _tp_measure(b, lambda: tp_load([str(p) for p in shards]))
            finally:
                _rmtree(cache)

        return run

    def runai() -> dict[str, float]:
        runai_env = {"AWS_ENDPOINT_URL": url, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        uris = [f"s3://{env.MODEL_BUCKET}/{s}" for s in env.SHARDS]
        return _tp_measure(b, lambda: tp_load(uris, runai_env))

    def copy_first() -> dict[str, float]:
        client = env.s3_client(url)
        dest = b.work / "tp-copy-first"
        _rmtree(dest)
        dest.mkdir(parents=True)
        timing: dict[str, float] = {}

        def load() -> float:
            start = time.perf_counter()
            for shard in env.SHARDS:
                client.download_file(env.MODEL_BUCKET, shard, str(dest / shard))
            timing["download"] = time.perf_counter() - start
            return timing["download"] + tp_load([str(dest / s) for s in env.SHARDS])

        try:
            return {**_tp_measure(b, load), **timing}
        finally:
            client.close()
            _rmtree(dest)

    return {
        "objfs": fuse(FUSE_KINDS["objfs"]),
        "s3fs": fuse(FUSE_KINDS["s3fs"]),
        "Run:ai streamer": runai,
        "copy first": copy_first,
    }


# -- The page cache's new memory: taken back by the host, or still backed -------------------------

MEMORY_STATES = {
    "taken back": "page cache dropped, 4 s idle: the host has the freed memory back",
    "backed": "then 2x the model's bytes written and freed just before: still backed",
}


def memory_pass(b: Bench, url: str, only: list[str]) -> None:
    """A cold ``cat`` of the shards through the binding ceiling and through an objfs remount
    (disk cache filled beforehand, no store involved), in the two states of the memory the
    page cache's new pages come from (``MEMORY_STATES``). On a VM with free page reporting
    (virtio-balloon), memory the guest freed goes back to the host about 2 s later, and the
    first write to it faults in the host; in a FUSE mount that first write is the daemon's
    reply copy. The pass measures that cost in this run, for a file system that does nothing
    else (the binding ceiling) and for objfs; and objfs's cold load from the store (a fresh
    mount, an empty ``--cache-dir``: the main pass's cold load) in both states, so that the
    daemon's own CPU per GB is seen apart from the host's faults."""
    mnt, cache = b.fresh("objfs-memory")
    bmnt, _ = b.fresh("binding-memory")
    child_env = env.binding_ceiling_env()
    try:
        with _objfs_mount(b, url, env.MODEL_BUCKET, mnt, cache):
            shards = [str(mnt / s) for s in env.SHARDS]
            subprocess.run(
                [str(env.VENV_BIN / "objfs"), "warm", "--cache-only", *shards],
                capture_output=True,
                timeout=600,
                check=True,
            )
        gb = b.model_bytes / 1e9

        def cat(m: env.MountProc, root: Path, state: str) -> dict[str, float]:
            env.settle_page_cache(b.page_cache, 2 * b.model_bytes if state == "backed" else 0)
            cpu = m.cpu_s()
            elapsed = t_cat([root / s for s in env.SHARDS])
            return {"cold_cat": elapsed, "daemon_cpu_per_gb_cat": (m.cpu_s() - cpu) / gb}

        def cold_job(state: str) -> Callable[[], dict[str, float]]:
            def run() -> dict[str, float]:
                cmnt, ccache = b.fresh("objfs-memory-cold")
                try:
                    with _objfs_mount(b, url, env.MODEL_BUCKET, cmnt, ccache) as m:
                        shards = [cmnt / s for s in env.SHARDS]
                        env.settle_page_cache(
                            b.page_cache, 2 * b.model_bytes if state == "backed" else 0
                        )
                        out: dict[str, float] = {}
                        load_with_cpu(b, m, shards, "cold", out, {})
                        return out
                finally:
                    _rmtree(ccache)

            return run

        def objfs_job(state: str) -> Callable[[], dict[str, float]]:
            def run() -> dict[str, float]:
                with _objfs_mount(b, url, env.MODEL_BUCKET, mnt, cache) as m:
                    return cat(m, mnt, state)

            return run

        cmd = env.binding_ceiling_cmd(b.model_dir, bmnt)
        with env.mounted("binding ceiling", cmd, bmnt, b.log("binding-memory"), child_env) as bm:
            jobs: dict[str, Callable[[], dict[str, float]]] = {}
            for state in MEMORY_STATES:
                jobs[f"{BINDING} | {state}"] = functools.partial(cat, bm, bmnt, state)
                jobs[f"objfs remount | {state}"] = objfs_job(state)
                jobs[f"objfs cold load | {state}"] = cold_job(state)
            run_rounds(b, "memory", {k: v for k, v in jobs.items() if _wanted(k, only)})
    finally:
        _rmtree(cache)


# -- Azure: objfs over Azurite against raw ranged GETs and rclone's azureblob mount ---------------


def azure_pass(b: Bench, sizes: dict[str, int], methods: list[str]) -> None:
    import datetime

    from azure.storage.blob import (
        BlobServiceClient,
        ContainerSasPermissions,
        generate_container_sas,
    )

    from tests.azurite import DEV_ACCOUNT, DEV_KEY, start_azurite

    server = start_azurite(str(b.log("azurite")))
    try:
        service = BlobServiceClient(
            server.account_url, credential={"account_name": DEV_ACCOUNT, "account_key": DEV_KEY}
        )
        container = service.get_container_client(AZ_CONTAINER)
        container.create_container()
        start = time.perf_counter()
        for path in env.local_files(b.model_dir):
            with open(path, "rb") as f:
                container.upload_blob(path.name, f, overwrite=True, max_concurrency=4)
        print(f"    uploaded the model to Azurite in {time.perf_counter() - start:.1f} s")
        service.close()
        sas = generate_container_sas(
            DEV_ACCOUNT,
            AZ_CONTAINER,
            account_key=DEV_KEY,
            permission=ContainerSasPermissions(read=True),
            expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=3),
        )

        def raw(threads: int | None) -> dict[str, float]:
            return {"cold_load": azure_raw_run(server.port, sizes, sas, threads)}

        def objfs_az() -> dict[str, float]:
            mnt, cache = b.fresh("objfs-az")
            cmd = env.objfs_cmd(
                f"az://{AZ_CONTAINER}",
                mnt,
                cache,
                b.log(f"objfs-{mnt.name}"),
                ["--account-name", DEV_ACCOUNT, "--account-url", server.account_url],
            )
            az_env: dict[str, str | None] = {
                "AZURE_STORAGE_KEY": DEV_KEY,
                "OBJFS_AZURE_NO_IDENTITY": "1",
            }
            try:
                with env.mounted("objfs", cmd, mnt, b.log("objfs-stdout"), az_env) as m:
                    shards = [mnt / s for s in env.SHARDS]
                    b.drop(shards)
                    cpu0 = m.cpu_s()
                    t = t_load(shards)
                    b.results.extra(
                        "azure",
                        "objfs",
                        {"daemon_cpu_s": m.cpu_s() - cpu0, "daemon_peak_rss_mib": m.peak_rss_mib()},
                    )
                    return {"cold_load": t}
            finally:
                _rmtree(cache)

        def rclone_az(mode: str) -> Callable[[], dict[str, float]]:
            # rclone 1.60 takes `endpoint` as a DNS suffix (it would look up
            # ACCOUNT.<endpoint>); a container SAS URL points it at Azurite exactly.
            list_sas = generate_container_sas(
                DEV_ACCOUNT,
                AZ_CONTAINER,
                account_key=DEV_KEY,
                permission=ContainerSasPermissions(read=True, list=True),
                expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=3),
            )
            remote = f":azureblob,sas_url='{server.account_url}/{AZ_CONTAINER}?{list_sas}':"
            remote += AZ_CONTAINER

            def run() -> dict[str, float]:
                mnt, cache = b.fresh(f"rclone-az-{mode}")
                cmd = env.rclone_cmd(remote, mnt, mode, cache, b.log(f"rclone-{mnt.name}"))
                try:
                    with env.mounted("rclone", cmd, mnt, b.log("rclone-stdout"), env.rclone_env()):
                        shards = [mnt / s for s in env.SHARDS]
                        b.drop(shards)
                        return {"cold_load": t_load(shards)}
                finally:
                    _rmtree(cache)

            return run

        jobs: dict[str, Callable[[], dict[str, float]]] = {
            "ceiling: 1 GET/file": lambda: raw(None),
            "ceiling: 8 MiB x 8": lambda: raw(8),
            "ceiling: 8 MiB x 32": lambda: raw(32),
            "objfs": objfs_az,
        }
        for mode in b.args.azure_rclone_modes.split(","):
            jobs[f"rclone {mode}"] = rclone_az(mode)
        run_rounds(b, "azure", {k: v for k, v in jobs.items() if _wanted(k, methods)})
    finally:
        server.stop()


def azure_raw_run(port: int, sizes: dict[str, int], sas: str, threads: int | None) -> float:
    """Raw http.client GETs (the Azure ceiling), as in azure_sdk_vs_raw.py."""
    buffers = _buffers(sizes)
    local = threading.local()

    def get(key: str, offset: int, length: int) -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request(
            "GET",
            f"/devstoreaccount1/{AZ_CONTAINER}/{key}?{sas}",
            headers={
                "Range": f"bytes={offset}-{offset + length - 1}",
                "x-ms-version": "2021-08-06",
            },
        )
        resp = conn.getresponse()
        if resp.status not in (200, 206):
            raise RuntimeError(f"raw GET {key}: HTTP {resp.status}")
        view = memoryview(buffers[key])[offset : offset + length]
        got = 0
        while got < length:
            n = resp.readinto(view[got:])
            if not n:
                raise RuntimeError("raw GET: short body")
            got += n

    start = time.perf_counter()
    if threads is None:
        with ThreadPoolExecutor(len(sizes)) as pool:
            list(pool.map(lambda k: get(k, 0, sizes[k]), sizes))
    else:
        items = [
            (k, off, min(PART, size - off))
            for k, size in sizes.items()
            for off in range(0, size, PART)
        ]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda it: get(*it), items))
    return time.perf_counter() - start


# -- rounds ---------------------------------------------------------------------------------------


# objfs without --cache-dir: the cold load alone, to show what the persistent cache costs.
NOCACHE = "objfs, no --cache-dir"
# The model served from memory by a minimal pyfuse3 file system (binding_ceiling.py).
BINDING = "binding ceiling (pyfuse3, memory)"
# The same through objfs's own transport (binding_ceiling.py --transport kernel).
BINDING_KERNEL = "binding ceiling (kernel, memory)"
# Every run of these is kept: the targets are about them.
UNBUDGETED = frozenset(
    {"objfs", "objfs torch_io", "local disk", BINDING, BINDING_KERNEL, LONG_LIVED, WARM_CMD}
)


def _wanted(name: str, only: list[str]) -> bool:
    return not only or any(o in name for o in only)


def round_order(names: list[str], rnd: int) -> list[str]:
    """The order of round ``rnd``: every name once, the round's first ``names[rnd % n]``, then
    every ``stride``-th name after it, the stride the round's number coprime to ``n`` (1, then
    3, 5, 7 for eight jobs; the last, n - 1, is the reverse order). A job's place and the job
    run just before it change from round to round: a plain rotation kept every job's
    predecessor, and a job pays for the memory its predecessor left behind (the page cache
    it dropped, freed memory the host took back), so one neighbour weighed on all of its runs.
    """
    n = len(names)
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    stride = strides[rnd % len(strides)]
    return [names[(rnd + i * stride) % n] for i in range(n)]


def run_rounds(b: Bench, pass_: str, jobs: dict[str, Callable[[], dict[str, float]]]) -> None:
    """``--runs`` rounds over ``jobs``, each in its own order (``round_order``); slow jobs get
    fewer rounds."""
    if not jobs:
        return
    allowed = dict.fromkeys(jobs, b.args.runs)
    ran = dict.fromkeys(jobs, 0)
    for rnd in range(b.args.runs):
        if rnd and time.monotonic() > b.deadline:
            for name in jobs:
                if ran[name] < allowed[name]:
                    b.results.note(pass_, name, "fewer runs: --max-minutes reached")
            print(f"  [{pass_}] --max-minutes reached: no more rounds", flush=True)
            break
        order = round_order(list(jobs), rnd)
        for name in order:
            if rnd >= allowed[name]:
                continue
            start = time.perf_counter()
            b.round = rnd
            try:
                values = jobs[name]()
            except Exception as exc:
                text = f"{type(exc).__name__}: {str(exc).strip()[:600]}"
                print(f"  [{pass_}] {name}: FAILED: {text}", flush=True)
                if b.args.verbose:
                    traceback.print_exc()
                b.results.note(pass_, name, f"failed: {text}")
                allowed[name] = 0
                continue
            took = time.perf_counter() - start
            # What a later round will cost: the core measures only, where the job says so.
            core = values.pop("_core_s", took)
            b.results.add(pass_, name, values)
            ran[name] += 1
            shown = ", ".join(f"{k} {_fmt_value(k, v)}" for k, v in values.items())
            print(f"  [{pass_}] run {rnd + 1} {name} ({took:.0f} s): {shown}", flush=True)
            budget = b.args.shaped_budget_s if pass_ == "shaped" else b.args.method_budget_s
            if rnd == 0 and b.args.runs > 1 and name not in UNBUDGETED:
                fit = max(1, min(b.args.runs, int(budget // max(core, 1e-3))))
                if fit < b.args.runs:
                    allowed[name] = fit
                    b.results.note(
                        pass_,
                        name,
                        f"{fit} run(s): one run took {core:.0f} s "
                        f"(budget {budget:.0f} s per method in this pass)",
                    )


def _fmt_value(key: str, value: float) -> str:
    if key.startswith(("rand4k", "config", "rtt")):
        return f"{value * 1e3:.1f} ms"
    if key.startswith(("daemon_cpu_per_gb", "busiest_thread_cpu_per_gb")):
        return f"{value:.2f} CPU s/GB"
    if key == "fetched_bytes":
        return f"{value / 1e9:.2f} GB"
    if key == "fetched_x":
        return f"{value:.2f}x the model"
    return f"{value:.2f} s"


# -- report ---------------------------------------------------------------------------------------

PEERS = ("s3fs", "rclone full", "rclone off", "Run:ai streamer")
CEILINGS = (
    "ceiling: 1 GET/file",
    "ceiling: 8 MiB x 8",
    "ceiling: 8 MiB x 32",
    "ceiling: 16 MiB x 16",
)


def _cell(r: Results, pass_: str, method: str, measure: str, scale: float = 1.0) -> str:
    vals = r.values(pass_, method, measure)
    if not vals:
        return ""
    med = statistics.median(vals) * scale
    digits = 1 if scale != 1.0 else 2
    if len(vals) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(vals) * scale:.{digits}f}-{max(vals) * scale:.{digits}f})"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b > 0 else ""


def best(
    r: Results, pass_: str, methods: tuple[str, ...], measure: str = "cold_load"
) -> tuple[str, float]:
    found = [(r.median(pass_, m, measure), m) for m in methods if r.values(pass_, m, measure)]
    if not found:
        return "", math.nan
    value, name = min(found)
    return name, value


# The peers the targets compare objfs with (in every pass that has them).
TARGET_PEERS = ("s3fs", "Run:ai streamer", "copy first")


@dataclass(frozen=True)
class Target:
    """One target row: objfs's median against its limit, both in the measure's own units
    (seconds, CPU s per GB, MiB, times); shown times ``scale`` in ``unit``."""

    name: str
    value: float
    limit: float
    unit: str
    scale: float = 1.0
    strict: bool = False  # met only when value < limit (else value <= limit)

    def as_dict(self) -> dict[str, Any]:
        """The JSON's ``targets`` entry: value and limit ``None`` (``met`` too) where a pass or
        a method it needs did not run (``--only``, ``--skip``, a failure)."""
        known = _known(self.value) and _known(self.limit)
        met = None
        if known:
            met = self.value < self.limit if self.strict else self.value <= self.limit
        return {
            "target": self.name,
            "value": self.value if _known(self.value) else None,
            "limit": self.limit if _known(self.limit) else None,
            "met": met,
            "unit": self.unit,
            "scale": self.scale,
        }


def _known(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def _median_extra(r: Results, pass_: str, method: str, key: str) -> float:
    values = [e[key] for e in r.extras.get(pass_, {}).get(method, []) if key in e]
    return float(statistics.median(values)) if values else math.nan


def summarize(r: Results, meta: dict[str, Any]) -> dict[str, Any]:
    """Medians, ceilings, best peers, ratios and the issue's targets."""
    s: dict[str, Any] = {}
    for pass_ in ("s3", "shaped", "azure"):
        ceil_name, ceil = best(r, pass_, CEILINGS)
        peer_name, peer = best(
            r, pass_, PEERS if pass_ != "azure" else ("rclone full", "rclone off")
        )
        s[pass_] = {
            "ceiling": ceil,
            "ceiling_method": ceil_name,
            "best_peer": peer,
            "best_peer_method": peer_name,
        }
    for pass_, measure in (("s3", "cold_load"), ("shaped", "cold_load"), ("tp", "wall")):
        name, value = best(r, pass_, TARGET_PEERS, measure)
        s.setdefault(pass_, {}).update({"target_peer": value, "target_peer_method": name})
    peers = ", ".join(TARGET_PEERS)
    objfs_cold = r.median("s3", "objfs", "cold_load")
    shaped_objfs = r.median("shaped", "objfs", "cold_load")
    remount = r.median("s3", "objfs", "remount_load")
    rtt = r.median("s3", "server", "rtt4k_p50")
    long_lived = r.median("s3", LONG_LIVED, "cold_load")
    targets = [
        Target(
            f"cold load <= the best peer's ({peers})",
            objfs_cold,
            s["s3"]["target_peer"],
            "s",
        ),
        Target("cold load <= 1.15x ceiling", objfs_cold, 1.15 * s["s3"]["ceiling"], "s"),
        Target(
            "shaped cold load <= the shaped best peer's",
            shaped_objfs,
            s["shaped"]["target_peer"],
            "s",
        ),
        Target(
            "shaped cold load <= 1.15x shaped ceiling",
            shaped_objfs,
            1.15 * s["shaped"]["ceiling"],
            "s",
        ),
        Target(
            "daemon CPU during the cold load <= 0.9 CPU s per GB",
            r.median("s3", "objfs", "daemon_cpu_per_gb_cold"),
            0.9,
            "CPU s/GB",
        ),
        Target(
            "the same, the page cache's new memory still backed (memory pass) <= 0.9",
            r.median("memory", "objfs cold load | backed", "daemon_cpu_per_gb_cold"),
            0.9,
            "CPU s/GB",
        ),
        Target(
            "daemon CPU during the remount load <= 0.05 CPU s per GB",
            r.median("s3", "objfs", "daemon_cpu_per_gb_remount"),
            0.05,
            "CPU s/GB",
        ),
        Target(
            "remount load <= 1.05x local disk cold load",
            remount,
            1.05 * r.median("s3", "local disk", "cold_load"),
            "s",
        ),
        Target(
            "busiest daemon thread during the cold load <= 0.35 CPU s per GB",
            r.median("s3", "objfs", "busiest_thread_cpu_per_gb_cold"),
            0.35,
            "CPU s/GB",
        ),
        Target(
            "binding ceiling: the kernel transport's >= 1.3x pyfuse3's throughput (cold load)",
            r.median("s3", BINDING_KERNEL, "cold_load"),
            r.median("s3", BINDING, "cold_load") / 1.3,
            "s",
        ),
        Target(
            "tensor parallel: <= 1.15x the single loader's cold load",
            r.median("tp", "objfs", "wall"),
            1.15 * objfs_cold,
            "s",
        ),
        Target(
            "torch_io from passthrough files >= 0.95x its throughput from local disk",
            r.median("s3", "objfs torch_io", "remount_load"),
            r.median("s3", "local disk", "torch_io_cold_load") / 0.95,
            "s",
        ),
        Target(
            "torch_io cold <= 1.1x load_file's cold load on a fresh mount",
            r.median("s3", "objfs torch_io", "cold_load"),
            1.1 * objfs_cold,
            "s",
        ),
        Target(
            "remount load >= 0.8x the binding ceiling's throughput",
            remount,
            r.median("s3", BINDING, "remount_load") / 0.8,
            "s",
        ),
        Target(
            "warm reload <= 1.05x local warm load",
            r.median("s3", "objfs", "warm_load"),
            1.05 * r.median("s3", "local disk", "warm_load"),
            "s",
        ),
        Target(
            "warm reload after a remount <= 1.05x local warm load",
            r.median("s3", "objfs", "remount_warm_load"),
            1.05 * r.median("s3", "local disk", "warm_load"),
            "s",
        ),
        Target(
            "daemon peak RSS during the cold load <= 300 MiB",
            _median_extra(r, "s3", "objfs", "daemon_peak_rss_mib"),
            300.0,
            "MiB",
        ),
        Target(
            "`objfs warm` >= 0.9x the ceiling's throughput",
            r.median("s3", WARM_CMD, "warm_cmd"),
            s["s3"]["ceiling"] / 0.9,
            "s",
        ),
        Target(
            "`objfs warm --cache-only` >= 0.9x the ceiling's throughput",
            r.median("s3", WARM_CACHE_ONLY, "warm_cmd"),
            s["s3"]["ceiling"] / 0.9,
            "s",
        ),
        Target(
            f"long-lived mount ({DECOYS} other shards' headers read first): "
            "cold load <= 1.1x a fresh mount's",
            long_lived,
            1.1 * objfs_cold,
            "s",
        ),
        Target(
            "long-lived mount: fetched <= 1.05x the model's bytes",
            r.median("s3", LONG_LIVED, "fetched_x"),
            1.05,
            "x",
        ),
        Target(
            "tensor parallel: fetched <= 1.02x the model's bytes",
            r.median("tp", "objfs", "fetched_x"),
            1.02,
            "x",
        ),
        Target(
            f"tensor parallel: done before every peer ({peers})",
            r.median("tp", "objfs", "wall"),
            s["tp"]["target_peer"],
            "s",
            strict=True,
        ),
        Target(
            "random 4 KiB p50 < 2x server ranged-GET RTT (shard)",
            r.median("s3", "objfs", "rand4k_shard_p50"),
            2 * rtt,
            "ms",
            1e3,
            strict=True,
        ),
        Target(
            "random 4 KiB p50 < 2x server ranged-GET RTT (non-safetensors)",
            r.median("s3", "objfs", "rand4k_bin_p50"),
            2 * rtt,
            "ms",
            1e3,
            strict=True,
        ),
    ]
    s["targets"] = [t.as_dict() for t in targets]
    return s


def _target_cell(value: float | None, unit: str, scale: float) -> str:
    if value is None or not _known(value):
        return "n/a"
    if unit == "x":
        return f"{value * scale:.2f}x"
    digits = 0 if unit == "MiB" else 2
    return f"{value * scale:.{digits}f} {unit}"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _proxy_cell(r: Results, name: str) -> str:
    proxy = [e["proxy"] for e in r.extras.get("shaped", {}).get(name, []) if "proxy" in e]
    if not proxy:
        return ""
    gets = statistics.median(x.get("GET", 0) for x in proxy)
    conns = statistics.median(x["connections"] for x in proxy)
    peak = statistics.median(x["peak_open_connections"] for x in proxy)
    return f"{gets:.0f} / {conns:.0f} / {peak:.0f}"


def render(r: Results, s: dict[str, Any], meta: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m = meta["machine"]
    model = meta["model"]
    add(
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux {m['kernel']}, "
        f"{m['date']}, objfs {m['objfs_commit']}. Model: {model['name']}, "
        f"{model['bytes'] / 1e9:.2f} GB in {len(env.SHARDS)} shards; page cache dropped with "
        f"{meta['page_cache']}. Seconds: median (min-max) of the runs; ratios from medians."
    )
    add("")
    ceil, peer, sceil = s["s3"]["ceiling"], s["s3"]["best_peer"], s["shaped"]["ceiling"]
    add(
        _row(
            "method",
            "cold load s",
            "x ceiling",
            "x best peer",
            "shaped cold load s",
            "x shaped ceiling",
            "cold cat s",
            "warm load s",
            "remount load s",
            "cold from_pretrained s",
        )
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in (
        *CEILINGS,
        "objfs",
        PYFUSE3,
        NOCACHE,
        *PEERS,
        "copy first",
        "local disk",
        BINDING_KERNEL,
        BINDING,
    ):
        cold = r.median("s3", name, "cold_load")
        shaped = r.median("shaped", name, "cold_load")
        add(
            _row(
                name,
                _cell(r, "s3", name, "cold_load"),
                _ratio(cold, ceil),
                _ratio(cold, peer) if name not in CEILINGS else "",
                _cell(r, "shaped", name, "cold_load"),
                _ratio(shaped, sceil),
                _cell(r, "s3", name, "cold_cat"),
                _cell(r, "s3", name, "warm_load"),
                _cell(r, "s3", name, "remount_load"),
                _cell(r, "s3", name, "cold_from_pretrained"),
            )
        )
    add("")
    rewarm = _cell(r, "s3", "objfs", "remount_warm_load")
    if rewarm:
        add("")
        add(
            f"objfs, warm load after the remount load (passthrough on the kernel transport: "
            f"the disk cache files' page cache): {rewarm} s; daemon CPU "
            f"{_cell(r, 's3', 'objfs', 'daemon_cpu_per_gb_remount_warm')} CPU s/GB."
        )
    add(
        f"Ceiling: {s['s3']['ceiling_method']}; best peer: {s['s3']['best_peer_method']}. "
        f"Shaped: ceiling {s['shaped']['ceiling_method']}, best peer "
        f"{s['shaped']['best_peer_method']}. One connection per file (measured in the shaped "
        f"pass): {', '.join(meta.get('one_connection_per_file', [])) or 'none'}."
    )
    add("")
    add(
        _row(
            "method",
            "config.json ms (fresh mount)",
            "ls -lR 1,000 objects s",
            "4 KiB random p50 / p99 ms (shard)",
            "4 KiB random p50 / p99 ms (other file)",
            "daemon CPU s per GB: cold / warm / remount load",
            "daemon peak RSS MiB",
            "store (s3rver) CPU s per GB, cold load",
            "shaped: GETs / connections / peak open",
        )
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in (
        "objfs",
        PYFUSE3,
        NOCACHE,
        "s3fs",
        "rclone full",
        "rclone off",
        BINDING_KERNEL,
        BINDING,
        "Run:ai streamer",
        "copy first",
    ):
        ex = r.extras.get("s3", {}).get(name, [])
        rss = [e["daemon_peak_rss_mib"] for e in ex if "daemon_peak_rss_mib" in e]
        add(
            _row(
                name,
                _cell(r, "s3", name, "config_json", 1e3),
                _cell(r, "s3", name, "ls_lR"),
                _pair(r, "s3", name, "rand4k_shard"),
                _pair(r, "s3", name, "rand4k_bin"),
                _cpu_cell(r, name),
                f"{max(rss):.0f}" if rss else "",
                _cell(r, "s3", name, "store_cpu_per_gb_cold"),
                _proxy_cell(r, name),
            )
        )
    for pass_, label in (("s3", "unshaped"), ("shaped", "shaped")):
        if r.values(pass_, "server", "rtt4k_p50"):
            pair = _pair(r, pass_, "server", "rtt4k")
            add(_row(f"server: one 4 KiB ranged GET ({label})", "", "", pair, pair, "", "", "", ""))
    if r.values("s3", LONG_LIVED, "cold_load") or r.values("s3", WARM_CMD, "warm_cmd"):
        add("")
        add(
            "| objfs, fresh mount | cold load s | x fresh mount | fetched / model bytes "
            "| `objfs warm` s | x ceiling |"
        )
        add("|---|---:|---:|---:|---:|---:|")
        add(_row("fresh mount", _cell(r, "s3", "objfs", "cold_load"), "", "", "", ""))
        add(
            _row(
                f"after {DECOYS} other shards' headers were read",
                _cell(r, "s3", LONG_LIVED, "cold_load"),
                _ratio(
                    r.median("s3", LONG_LIVED, "cold_load"),
                    r.median("s3", "objfs", "cold_load"),
                ),
                _cell(r, "s3", LONG_LIVED, "fetched_x"),
                "",
                "",
            )
        )
        for method in (WARM_CMD, WARM_CACHE_ONLY):
            if method == WARM_CMD or r.values("s3", method, "warm_cmd"):
                add(
                    _row(
                        f"`{method}` of the shards",
                        "",
                        "",
                        "",
                        _cell(r, "s3", method, "warm_cmd"),
                        _ratio(r.median("s3", method, "warm_cmd"), ceil),
                    )
                )
    if r.cells.get("tp"):
        add("")
        add(f"| tensor parallel: {TP_RANKS} ranks at once, cold | wall s | fetched / model bytes |")
        add("|---|---:|---:|")
        for name in ("objfs", "s3fs", "Run:ai streamer", "copy first"):
            add(_row(name, _cell(r, "tp", name, "wall"), _cell(r, "tp", name, "fetched_x")))
    if r.cells.get("s3", {}).get("objfs torch_io") or r.cells.get("s3", {}).get("local disk"):
        add("")
        add("| torch_io (CPU) | cold s | warm s | remount s (passthrough) |")
        add("|---|---:|---:|---:|")
        for label, method, prefix in (
            ("objfs mount: objfs.torch_io.load_safetensors", "objfs torch_io", ""),
            ("objfs mount: load_file + touch pages", "objfs", ""),
            ("local disk: objfs.torch_io.load_safetensors", "local disk", "torch_io_"),
            ("local disk: load_file + touch pages", "local disk", ""),
        ):
            add(
                _row(
                    label,
                    _cell(r, "s3", method, f"{prefix}cold_load"),
                    _cell(r, "s3", method, f"{prefix}warm_load"),
                    _cell(r, "s3", method, "remount_load") if method != "local disk" else "",
                )
            )
    if r.cells.get("memory"):
        add("")
        add(
            "| the page cache's new memory | cold `cat`: binding ceiling s | daemon CPU s/GB "
            "| cold `cat`: objfs remount s | daemon CPU s/GB "
            "| objfs cold load (store, --cache-dir) s | daemon CPU s/GB |"
        )
        add("|---|---:|---:|---:|---:|---:|---:|")
        for state, text in MEMORY_STATES.items():
            cells = []
            for who in (BINDING, "objfs remount"):
                name = f"{who} | {state}"
                cells += [
                    _cell(r, "memory", name, "cold_cat"),
                    _cell(r, "memory", name, "daemon_cpu_per_gb_cat"),
                ]
            name = f"objfs cold load | {state}"
            cells += [
                _cell(r, "memory", name, "cold_load"),
                _cell(r, "memory", name, "daemon_cpu_per_gb_cold"),
            ]
            add(_row(f"{state}: {text}", *cells))
    if r.cells.get("azure"):
        add("")
        aceil, apeer = s["azure"]["ceiling"], s["azure"]["best_peer"]
        add("| Azure (Azurite) | cold load s | x ceiling | x best peer |")
        add("|---|---:|---:|---:|")
        for name in (*CEILINGS, "objfs", "rclone full", "rclone off"):
            v = r.median("azure", name, "cold_load")
            add(
                _row(
                    name,
                    _cell(r, "azure", name, "cold_load"),
                    _ratio(v, aceil),
                    _ratio(v, apeer) if name not in CEILINGS else "",
                )
            )
    add("")
    add("| target | objfs | limit | met |")
    add("|---|---:|---:|---|")
    for t in s["targets"]:
        unit, scale = t["unit"], t.get("scale", 1.0)
        add(
            _row(
                t["target"],
                _target_cell(t["value"], unit, scale),
                _target_cell(t["limit"], unit, scale),
                "-" if t["met"] is None else "yes" if t["met"] else "NO",
            )
        )
    notes = [(p, k, v) for p, d in r.notes.items() for k, v in d.items()]
    if notes:
        add("")
        add("Notes:")
        for pass_, name, text in notes:
            add(f"- {pass_} / {name}: {text}")
    return "\n".join(lines)


def _cpu_cell(r: Results, method: str) -> str:
    """Medians of the daemon's CPU seconds per GB loaded: cold / warm / remount."""
    values = [r.median("s3", method, f"daemon_cpu_per_gb_{p}") for p in ("cold", "warm", "remount")]
    if all(v != v for v in values):
        return ""
    busiest = r.median("s3", method, "busiest_thread_cpu_per_gb_cold")
    cell = " / ".join(f"{v:.2f}" if v == v else "-" for v in values)
    return cell + (f" (busiest thread, cold: {busiest:.2f})" if busiest == busiest else "")


def _pair(r: Results, pass_: str, method: str, prefix: str) -> str:
    p50 = _cell(r, pass_, method, f"{prefix}_p50", 1e3)
    return f"{p50} / {_cell(r, pass_, method, f'{prefix}_p99', 1e3)}" if p50 else ""


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="270 MB model, 1 run: a smoke test")
    p.add_argument("--runs", type=int, help="runs per measure (default 3; --quick 1)")
    p.add_argument("--only", default="", help="comma list: run only methods whose name has one")
    p.add_argument(
        "--skip", default="", help="comma list of passes to skip: s3,tp,shaped,memory,azure"
    )
    p.add_argument(
        "--random-reads", type=int, help="4 KiB reads per file (default 200; --quick 50)"
    )
    p.add_argument(
        "--method-budget-s",
        type=float,
        default=60.0,
        help="seconds a peer's or a ceiling's runs may take in one pass: one whose first run "
        "is slower gets fewer runs (objfs and local disk always get --runs)",
    )
    p.add_argument(
        "--shaped-budget-s",
        type=float,
        default=30.0,
        help="the same for the shaped pass, where one-connection peers take minutes",
    )
    p.add_argument(
        "--azure-rclone-modes",
        default="full",
        help="rclone --vfs-cache-mode values for the Azure pass (comma list; default full, "
        "the faster mode on S3)",
    )
    p.add_argument(
        "--peer-detail-runs",
        type=int,
        default=1,
        help="rounds in which peers also run cat, from_pretrained, config, random reads, ls",
    )
    p.add_argument("--max-minutes", type=float, default=20.0, help="start no new round after this")
    p.add_argument("--s3fs-parallel", type=int, default=32)
    p.add_argument("--s3fs-part-mib", type=int, default=8)  # objfs's part size
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep-work", action="store_true", help="keep the temporary folder (logs)")
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="run nothing: print the tables of a results file an earlier run wrote, the "
        "summary and targets computed again from its figures",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.random_reads is None:
        args.random_reads = 50 if args.quick else 200
    return args


def report(path: Path) -> int:
    """``--report``: the tables of a saved results file, with today's summary and targets."""
    saved = json.loads(path.read_text())
    results = Results(saved.get("cells", {}), saved.get("extras", {}), saved.get("notes", {}))
    meta = saved["meta"]
    print(render(results, summarize(results, meta), meta))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    started = time.monotonic()
    env.setup_process_env()
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    spec = env.QUICK_MODEL if args.quick else env.FULL_MODEL
    data_root = env.REPO / ".bench" / "data"
    print(f"==> data under {data_root}", flush=True)
    model_dir = env.build_model(spec, data_root)
    small_dir = env.build_small(data_root, (256 if args.quick else 1024) * MiB)
    decoy_dir = build_decoys(data_root)
    sizes = {s: (model_dir / s).stat().st_size for s in env.SHARDS}
    print(
        f"    model {model_dir.name}: {sum(sizes.values()) / 1e9:.2f} GB; "
        f"small objects: {env.SMALL_COUNT}",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="objfs-bench-"))
    passwd = work / "s3fs-passwd"
    passwd.write_text(f"{env.S3_KEY}:{env.S3_SECRET}\n")
    passwd.chmod(0o600)
    results = Results()
    s3 = env.start_s3rver(work / "s3rver.log")
    b = Bench(
        args,
        work,
        model_dir,
        small_dir,
        s3,
        env.PageCache(),
        results,
        started + args.max_minutes * 60,
        passwd,
    )
    meta: dict[str, Any] = {
        "machine": env.machine_info(),
        "model": {
            "name": spec.name,
            "spec": spec.__dict__,
            "bytes": sum(sizes.values()),
            "files": sorted(p.name for p in env.local_files(model_dir)),
        },
        "page_cache": b.page_cache.method,
        "args": {k: str(v) for k, v in vars(args).items()},
        "objfs_options": "defaults (--max-connections 32, --part-size 8M) with --cache-dir",
        "s3fs_options": f"parallel_count={args.s3fs_parallel},multipart_size={args.s3fs_part_mib}",
        "daemon_cpu": "user+system seconds of the FUSE process, its threads and children, "
        "during the load; per GB: divided by the shards' bytes / 1e9",
        "tensor_parallel": {
            "ranks": TP_RANKS,
            "fetched_bytes": "s3rver's wchar (/proc/PID/io) over the measure",
        },
        "shaping": {
            "first_byte_delay_s": SHAPED_DELAY_S,
            "bytes_per_s_per_connection": SHAPED_RATE,
        },
    }
    print(
        f"==> s3rver {s3.url} (data in {s3.data_dir}); page cache: {b.page_cache.method}",
        flush=True,
    )
    try:
        client = env.s3_client(s3.url)
        start = time.perf_counter()
        env.upload_tree(client, model_dir, env.MODEL_BUCKET)
        env.upload_tree(client, small_dir, env.SMALL_BUCKET)
        env.upload_tree(client, decoy_dir, env.MODEL_BUCKET)
        client.close()
        print(f"    uploaded in {time.perf_counter() - start:.1f} s", flush=True)
        # Untimed warm-up: imports, transformers' model code, the allocator.
        t_load(b.local_shards)
        t_from_pretrained(model_dir)

        if "s3" not in skip:
            print("==> pass 1: straight from s3rver", flush=True)
            jobs = _s3_jobs(b, s3.url, sizes, full=True)
            results.add("s3", "server", _rtt_values(s3.url))
            run_rounds(b, "s3", {k: v for k, v in jobs.items() if _wanted(k, only)})
        if "tp" not in skip:
            print(
                f"==> tensor parallel: {TP_RANKS} ranks load the model at once, from s3rver",
                flush=True,
            )
            jobs = _tp_jobs(b)
            run_rounds(b, "tp", {k: v for k, v in jobs.items() if _wanted(k, only)})
        if "shaped" not in skip:
            proxy = env.start_proxy(s3.port, SHAPED_DELAY_S, SHAPED_RATE)
            b.proxy = proxy
            try:
                print(
                    f"==> pass 2: through the shaping proxy {proxy.url} "
                    "(10 ms, 50 MB/s per connection)",
                    flush=True,
                )
                results.add("shaped", "server", _rtt_values(proxy.url))
                jobs = _s3_jobs(b, proxy.url, sizes, full=False)
                run_rounds(b, "shaped", {k: v for k, v in jobs.items() if _wanted(k, only)})
            finally:
                proxy.stop()
                b.proxy = None
        if "memory" not in skip:
            print(
                "==> the page cache's new memory: taken back by the host, or still backed",
                flush=True,
            )
            memory_pass(b, s3.url, only)
        if "azure" not in skip:
            print("==> pass 3: Azure (Azurite)", flush=True)
            try:
                azure_pass(b, sizes, only)
            except Exception as exc:
                results.note("azure", "all", f"failed: {type(exc).__name__}: {exc}")
                print(f"  Azure pass failed: {exc}", flush=True)
    finally:
        s3.stop()
        if not args.keep_work:
            _rmtree(work)

    # One connection per file: the peers whose peak of open connections in the shaped pass
    # stayed at or below the number of shards plus one (a listing or an idle pooled
    # connection): measured, not assumed.
    single = []
    for name in PEERS:
        proxy_stats = [
            e["proxy"] for e in results.extras.get("shaped", {}).get(name, []) if "proxy" in e
        ]
        if (
            proxy_stats
            and max(x["peak_open_connections"] for x in proxy_stats) <= len(env.SHARDS) + 1
        ):
            single.append(name)
    meta["one_connection_per_file"] = single
    # objfs runs from the working tree (an editable install): say so if it changed meanwhile.
    now = env.machine_info()["objfs_commit"]
    if now != meta["machine"]["objfs_commit"]:
        results.note("all", "objfs", f"objfs changed during the run: {now} at the end")
    summary = summarize(results, meta)
    meta["total_s"] = time.monotonic() - started
    table = render(results, summary, meta)
    print("\n" + table + "\n")
    print(f"total time {meta['total_s'] / 60:.1f} min (objfs {meta['machine']['objfs_commit']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "meta": meta,
                "summary": summary,
                "cells": results.cells,
                "extras": results.extras,
                "notes": results.notes,
                "table": table,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {args.out}")
    return 0


def _rtt_values(url: str) -> dict[str, float]:
    lat = server_rtt(url, env.RANDOM_KEY, env.SMALL_BUCKET, 100)
    return {"rtt4k_p50": percentile(lat, 0.5), "rtt4k_p99": percentile(lat, 0.99)}


def _s3_jobs(
    b: Bench, url: str, sizes: dict[str, int], full: bool
) -> dict[str, Callable[[], dict[str, float]]]:
    jobs: dict[str, Callable[[], dict[str, float]]] = {
        "ceiling: 1 GET/file": lambda: {"cold_load": ceiling_run(url, sizes, None)},
        "ceiling: 8 MiB x 8": lambda: {"cold_load": ceiling_run(url, sizes, 8)},
        "ceiling: 8 MiB x 32": lambda: {"cold_load": ceiling_run(url, sizes, 32)},
        # Fewer, larger GETs: on these 2 cores each GET costs s3rver CPU, so this is usually
        # the fastest way to pull the bytes unshaped.
        "ceiling: 16 MiB x 16": lambda: {"cold_load": ceiling_run(url, sizes, 16, 2 * PART)},
    }
    for name, kind in FUSE_KINDS.items():
        jobs[name] = partial(fuse_run, b, kind, url, full)
    jobs[NOCACHE] = lambda: objfs_nocache_run(b, url)
    jobs["Run:ai streamer"] = lambda: _with_proxy_stats(
        b, "Run:ai streamer", lambda: runai_run(b, url)
    )
    jobs["copy first"] = lambda: _with_proxy_stats(b, "copy first", lambda: copy_first_run(b, url))
    if full:
        jobs[LONG_LIVED] = lambda: long_lived_run(b, url)
        jobs[WARM_CMD] = lambda: warm_cmd_run(b, url)
        jobs[WARM_CACHE_ONLY] = lambda: warm_cmd_run(b, url, cache_only=True)
        jobs["objfs torch_io"] = lambda: torch_io_run(b)
        jobs["local disk"] = lambda: local_run(b)
        jobs[BINDING] = lambda: binding_run(b)
        jobs[BINDING_KERNEL] = lambda: binding_run(b, "kernel")
    return jobs


def _with_proxy_stats(b: Bench, name: str, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    if b.proxy is None:
        return fn()
    b.proxy.reset()
    out = fn()
    b.results.extra("shaped", name, {"proxy": b.proxy.stats()})
    return out


if __name__ == "__main__":
    sys.exit(main())
