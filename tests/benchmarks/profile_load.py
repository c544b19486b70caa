"""Profile one objfs load: wall time, daemon CPU per GB (per thread), bytes fetched.

A development tool, not part of ``make bench``::

    python -m tests.benchmarks.profile_load [--quick] [--no-cache-dir] [--py-spy OUT]

Starts s3rver (data on /dev/shm), uploads the bench model, then runs: a cold load (fresh
mount, empty caches, page cache dropped), a warm reload, and a remount load (disk cache kept,
page cache dropped). For each it prints the wall time, the daemon's CPU seconds per GB (the
process's, as ``make bench`` counts them), split by thread (from /proc/PID/task/*/stat: the
threads alive at the end: those that ended meanwhile count in the total only), and its peak
RSS; then the machine's CPU
seconds meanwhile, split into s3rver, the loader (this process), the daemon and the rest
(the kernel's own threads: softirqs, writeback, ...). ``--py-spy`` records the
daemon during the cold load (raw collapsed stacks, for flame graphs or grep).

``--binding`` runs the same loads (``--tp``, ``--cat`` and ``--first-touch`` included) through
the binding ceiling instead (``binding_ceiling.py``: the model served from memory by a minimal
pyfuse3 file system with objfs's mount options): what the kernel and the binding allow for
that access pattern, so that a gap between the two is objfs's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tests.benchmarks import bench_env as env
from tests.benchmarks.bench_models import SHAPED_DELAY_S, SHAPED_RATE, t_cat, t_load, tp_load

CLK = os.sysconf("SC_CLK_TCK")


def t_torch_io(files: list[Path], threads: int | None) -> float:
    """Seconds to load ``files`` with objfs.torch_io onto the CPU with ``threads`` readers."""
    from objfs.torch_io import load_safetensors

    start = time.perf_counter()
    state = load_safetensors([str(f) for f in files], "cpu", threads=threads)
    elapsed = time.perf_counter() - start
    del state
    return elapsed


def thread_cpu(pid: int) -> Counter[str]:
    """CPU seconds of process ``pid``: user and system time of its main thread (the trio
    thread) and of all other threads (threads that exited are lost), and each thread's own
    total under ``tid N`` (see :func:`busiest`)."""
    out: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        who = "main" if task.name == str(pid) else "workers"
        out[f"{who} user"] += int(fields[11]) / CLK
        out[f"{who} sys"] += int(fields[12]) / CLK
        out[f"tid {task.name}"] += (int(fields[11]) + int(fields[12])) / CLK
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvolun")):
                    out[f"{who} ctxsw"] += int(line.split()[1])
    return out


class Timeline:
    """Samples s3rver's CPU and bytes sent, the daemon's CPU and the loader's (this process's)
    every ``step`` seconds while running; ``table()`` sums them per ``bucket`` seconds: busy
    fractions of one core, and MB sent. Shows whether the server was idle (the client asked
    too little) or busy. Not the machine's busy CPU: /proc/stat's counts over half a second
    disagreed with the processes' own (a bucket read 14% busy while s3rver alone used 66%)."""

    def __init__(self, server: env.S3rver, daemon: int, step: float = 0.05) -> None:
        self.server = server
        self.daemon = daemon
        self.step = step
        self.samples: list[tuple[float, float, int, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append(
            (
                time.perf_counter(),
                env.process_cpu(self.server.pid),
                self.server.bytes_sent(),
                sum(v for k, v in thread_cpu(self.daemon).items() if k.endswith(("user", "sys"))),
                env.process_cpu(os.getpid()),
            )
        )

    def _run(self) -> None:
        while not self._stop.wait(self.step):
            self._sample()

    def __enter__(self) -> Timeline:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def table(self, bucket: float = 0.5) -> str:
        t0 = self.samples[0][0]
        rows = []
        start = self.samples[0]
        for sample in self.samples[1:]:
            if sample[0] - start[0] >= bucket or sample is self.samples[-1]:
                dt = sample[0] - start[0]
                rows.append(
                    f"{start[0] - t0:5.1f}s s3rver {(sample[1] - start[1]) / dt:4.0%} "
                    f"{(sample[2] - start[2]) / 1e6 / dt:6.0f} MB/s daemon "
                    f"{(sample[3] - start[3]) / dt:4.0%} loader "
                    f"{(sample[4] - start[4]) / dt:4.0%}"
                )
                start = sample
        return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-cache-dir", action="store_true")
    p.add_argument(
        "--cache-root",
        default="",
        help="put each run's --cache-dir under this directory (default: the run's work "
        "directory), e.g. a RAM-backed file system, to tell the disk device's cost from the "
        "daemon's",
    )
    p.add_argument(
        "--py-spy", default="", help="py-spy record the daemon's first load into this file"
    )
    p.add_argument("--py-spy-rate", type=int, default=100, help="py-spy's samples per second")
    p.add_argument(
        "--py-spy-gil", action="store_true", help="py-spy: only the thread holding the GIL"
    )
    p.add_argument("--perf", default="", help="perf record the daemon's cold load into this file")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--cold-only", action="store_true", help="skip the remount load")
    p.add_argument("--keep-log", default="", help="copy the daemon's log to this path at the end")
    p.add_argument("--extra", default="", help="more objfs mount options, space-separated")
    p.add_argument(
        "--tp", action="store_true", help="load with the tensor-parallel pass's 4 ranks instead"
    )
    p.add_argument(
        "--first-touch",
        choices=("any", "idle", "backed"),
        default="any",
        help="the page cache's new pages before a cold or remount load: 'idle' drops the page "
        "cache and waits 4 s, so the hypervisor has taken back the freed memory (on a VM with "
        "free page reporting, first writes to it then fault in the host); 'backed' then also "
        "writes and frees 2x the model's bytes of memory just before the load, so its first "
        "pages are still backed; 'any' (default) does neither",
    )
    p.add_argument("--cat", action="store_true", help="cat the shards instead of loading them")
    p.add_argument(
        "--shaped",
        action="store_true",
        help="mount through make bench's shaping proxy (10 ms to first byte, 50 MB/s per "
        "connection), as in its shaped pass",
    )
    p.add_argument(
        "--torch-io",
        type=int,
        default=None,
        metavar="THREADS",
        help="load with objfs.torch_io.load_safetensors and THREADS reader threads (0: its "
        "default) instead of safetensors' load_file",
    )
    p.add_argument(
        "--binding",
        action="store_true",
        help="serve the loads from the binding ceiling (the model in memory, a minimal pyfuse3 "
        "file system) instead of objfs; implies --cold-only",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print s3rver's and the daemon's CPU and the bytes sent per half second of loads",
    )
    args = p.parse_args()
    env.setup_process_env()
    work = Path(tempfile.mkdtemp(prefix="objfs-prof-"))
    spec = env.QUICK_MODEL if args.quick else env.FULL_MODEL
    model = env.build_model(spec, env.REPO / ".bench" / "data")
    server = env.start_s3rver(work / "s3rver.log")
    cache = env.PageCache()
    proxy: env.ProxyProc | None = None
    cache_root = Path(args.cache_root) if args.cache_root else work
    cache_dirs: list[Path] = []  # removed at the end (those under --cache-root are not in work)
    try:
        client = env.s3_client(server.url)
        env.upload_tree(client, model, env.MODEL_BUCKET)
        nbytes = sum(f.stat().st_size for f in model.iterdir() if f.suffix == ".safetensors")
        # Untimed warm-up, as make bench does: the first load imports torch and safetensors
        # (about 2 CPU s in this process, which the cold load would otherwise include).
        t_load(sorted(model.glob("*.safetensors")))
        endpoint = server.url
        if args.shaped:
            proxy = env.start_proxy(server.port, SHAPED_DELAY_S, SHAPED_RATE)
            endpoint = proxy.url
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        reported_prev = env.host_reported_mib()  # at the end of the previous load
        for run in range(args.runs):
            cache_dir = None if args.no_cache_dir else cache_root / f"objfs-prof-cache{run}"
            if cache_dir is not None:
                cache_dirs.append(cache_dir)
            mnt = work / "mnt"
            if args.binding:
                name, cmd = "binding ceiling", env.binding_ceiling_cmd(model, mnt)
                child_env = env.binding_ceiling_env()
            else:
                name, child_env = "objfs", None
                cmd = env.objfs_cmd(
                    f"s3://{env.MODEL_BUCKET}",
                    mnt,
                    cache_dir,
                    work / "objfs.log",
                    ["--endpoint-url", endpoint, *args.extra.split()],
                )
            for phase in ("cold", "remount"):
                if phase == "remount" and (cache_dir is None or args.cold_only or args.binding):
                    continue
                cache.drop()
                with env.mounted(name, cmd, mnt, work / "objfs.log", child_env) as m:
                    files = sorted(mnt.glob("*.safetensors"))
                    reads_before = 0
                    fetched_before = 0
                    for measure in (phase, "warm"):
                        spy = None
                        if args.py_spy and measure == phase and run == 0:
                            out = f"{args.py_spy}.{phase}"
                            spy = subprocess.Popen(
                                [
                                    str(env.VENV_BIN / "py-spy"),
                                    "record",
                                    "-p",
                                    str(m.pid),
                                    "--threads",
                                    "-r",
                                    str(args.py_spy_rate),
                                    "-f",
                                    "raw",
                                    "-o",
                                    out,
                                    "--nonblocking",
                                    *(["--gil"] if args.py_spy_gil else []),
                                ],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                            )
                            time.sleep(1.5)
                        if args.perf and measure == phase and run == 0:
                            spy = subprocess.Popen(
                                [
                                    "perf",
                                    "record",
                                    "-e",
                                    "cpu-clock",
                                    "-g",
                                    "-p",
                                    str(m.pid),
                                    "-o",
                                    f"{args.perf}.{phase}",
                                ],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                            )
                            time.sleep(1.0)
                        before, proc0 = thread_cpu(m.pid), env.process_cpu(m.pid)
                        who0 = (
                            env.process_cpu(server.pid),
                            env.process_cpu(os.getpid()),
                            env.machine_cpu(),
                        )
                        reported0 = env.host_reported_mib()
                        sent0 = server.bytes_sent()
                        timeline = Timeline(server, m.pid)
                        if measure == phase and args.first_touch != "any":
                            env.settle_page_cache(
                                cache, 2 * nbytes if args.first_touch == "backed" else 0
                            )
                            before, proc0 = thread_cpu(m.pid), env.process_cpu(m.pid)
                            who0 = (
                                env.process_cpu(server.pid),
                                env.process_cpu(os.getpid()),
                                env.machine_cpu(),
                            )
                            reported0 = env.host_reported_mib()
                        with timeline if args.timeline else contextlib.nullcontext():
                            if args.tp:
                                elapsed = tp_load([str(f) for f in files])
                            elif args.cat:
                                elapsed = t_cat(files)
                            elif args.torch_io is not None:
                                elapsed = t_torch_io(files, args.torch_io or None)
                            else:
                                elapsed = t_load(files)
                        if args.timeline and measure != "warm":
                            print(timeline.table(), flush=True)
                        after, proc1 = thread_cpu(m.pid), env.process_cpu(m.pid)
                        who1 = (
                            env.process_cpu(server.pid),
                            env.process_cpu(os.getpid()),
                            env.machine_cpu(),
                        )
                        reported1 = env.host_reported_mib()
                        sent = server.bytes_sent() - sent0
                        if spy is not None:
                            spy.send_signal(2)
                            spy.wait()
                        used = after - before
                        per_thread = {k: v for k, v in used.items() if k.startswith("tid ")}
                        used = Counter({k: v for k, v in used.items() if k not in per_thread})
                        # The daemon's CPU: the process's (every thread's, those that ended
                        # meanwhile too); the live threads' share is in the brackets.
                        live = sum(v for k, v in used.items() if not k.endswith("ctxsw"))
                        total = proc1 - proc0
                        gb = nbytes / 1e9
                        top = ", ".join(
                            f"{k} {v / gb:.0f}" if k.endswith("ctxsw") else f"{k} {v / gb:.2f}"
                            for k, v in sorted(used.items())
                        )
                        # The busiest thread bounds one mount's throughput where cores are many.
                        top += f", busiest thread {max(per_thread.values(), default=0) / gb:.2f}"
                        top += f", threads alive at the end {live / gb:.2f}"
                        s3rver, loader = (b - a for a, b in zip(who0[:2], who1[:2], strict=True))
                        machine, steal = (b - a for a, b in zip(who0[2], who1[2], strict=True))
                        usage = (
                            f"{'':8s} machine CPU {machine:.2f} s in {elapsed:.2f} s: s3rver "
                            f"{s3rver:.2f}, loader {loader:.2f}, daemon {total:.2f}, other "
                            f"{machine - s3rver - loader - total:.2f}; stolen {steal:.2f}"
                        )
                        if (
                            reported_prev is not None
                            and reported0 is not None
                            and reported1 is not None
                        ):
                            # Free memory the guest gave back to the host (a VM's free page
                            # reporting): the load's new page-cache pages may be such pages,
                            # each faulting in the host at its first write.
                            usage += (
                                f"; reported to the host: {reported0 - reported_prev:.0f} MiB "
                                f"since the previous load, {reported1 - reported0:.0f} during "
                                "this one"
                            )
                        reported_prev = reported1
                        if args.binding:  # no store, no status file
                            print(
                                f"{measure:8s} {elapsed:6.2f} s  binding ceiling "
                                f"{total / gb:.2f} CPU s/GB rss {m.peak_rss_mib():.0f} MiB "
                                f"[{top}]\n{usage}",
                                flush=True,
                            )
                            continue
                        time.sleep(1.2)  # the status file is rewritten every second
                        status = json.loads(
                            subprocess.run(
                                [str(env.VENV_BIN / "objfs"), "status", "--json", str(mnt)],
                                capture_output=True,
                                check=True,
                            ).stdout
                        )
                        served = status["served"]
                        delta = served["reads"] - reads_before
                        reads_before = served["reads"]
                        fetched = status["store"]["bytes_fetched"] - fetched_before
                        fetched_before = status["store"]["bytes_fetched"]
                        print(
                            f"{measure:8s} {elapsed:6.2f} s  daemon {total / gb:.2f} CPU s/GB "
                            f"rss {m.peak_rss_mib():.0f} MiB (now {m.rss_mib():.0f}) "
                            f"{delta} reads, "
                            f"fetched {sent / nbytes:.3f}x during the load, "
                            f"{fetched / nbytes:.3f}x by the status 1.2 s later (the backfill) "
                            f"[{top}] disk {status['disk']} "
                            f"served {served} memory {status['memory']} "
                            f"store {status['store']['requests']}",
                            flush=True,
                        )
                        print(usage, flush=True)
    finally:
        if args.keep_log and (work / "objfs.log").exists():
            shutil.copy(work / "objfs.log", args.keep_log)
        if proxy is not None:
            proxy.stop()
        server.stop()
        for path in [work, *cache_dirs]:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
