"""make bench's fleet rows: many nodes through a cache engine, and the choice of store.

Two passes, each alternating its methods run by run (medians of ``--runs``), on the network
of tests/test_fleet.py (network namespaces: SeaweedFS as the origin, two nginx instances of
the shipped configuration as the engine, four objfs nodes with disk caches of their own):

- ``fleet``: the four nodes load the model at once, with and without the engine: wall time
  until the last node has read every byte, and the bytes the origin's link sent, as a ratio
  of the model's. Then one node alone: through the engine, cold (new engine instances with
  empty caches: issue 32's "no slower than 1.1x") and warm (the slices cached), and without
  it. Each pass runs with the origin's link unlimited (this machine's 2 cores bound it) and
  shaped to 1 Gbit/s (an origin whose link the fleet shares: where the engine pays off).
- ``store``: one objfs mount on loopback loads the model from s3rver and from SeaweedFS
  (``weed mini``): wall time, and the CPU of objfs and of the store per GB. make bench's main
  pass keeps the store that costs the client (objfs) less per GB: see the README.

Every load reads every file whole; byte-exactness is the tests' job (tests/test_fleet.py).
Results go to ``.bench/fleet.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.benchmarks import bench_env as env
from tests.conftest import mount_command, run_mount
from tests.helpers import seaweedfs
from tests.helpers.netns import Fabric
from tests.test_fleet import BUCKET, NODES, Fleet, _s3tool

MiB = 1 << 20
OUT = Path(".bench/fleet.json")


def model(root: Path, size_mib: int) -> dict[str, Path]:
    """Shards of 256 MiB and a config.json under ``root`` (random bytes, built once)."""
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    left, i = size_mib, 0
    while left > 0:
        part = min(256, left)
        path = root / f"model-{i:05d}.safetensors"
        if not path.exists() or path.stat().st_size != part * MiB:
            with open(path, "wb") as f:
                for _ in range(part):
                    f.write(os.urandom(MiB))
        files[path.name] = path
        left -= part
        i += 1
    (root / "config.json").write_text(json.dumps({"model_type": "bench"}))
    files["config.json"] = root / "config.json"
    return files


def read_all(mountpoint: Path, names: list[str]) -> None:
    for name in names:
        with open(mountpoint / name, "rb", buffering=0) as f:
            while f.read(8 * MiB):
                pass


def timed_loads(mountpoints: list[Path], names: list[str]) -> float:
    """Seconds until every mount has read every file, all at once."""
    errors: list[BaseException] = []

    def one(m: Path) -> None:
        try:
            read_all(m, names)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(m,)) for m in mountpoints]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def fleet_pass(
    work: Path, files: dict[str, Path], runs: int, rates: list[str]
) -> dict[str, list[float]]:
    names = list(files)
    total = sum(p.stat().st_size for p in files.values())
    out: dict[str, list[float]] = {}
    with Fabric() as fabric, contextlib.ExitStack() as stack:
        fleet = Fleet(work / "fleet", fabric, stack)
        stack.callback(fleet.close)
        folder = next(iter(files.values())).parent.resolve()
        _s3tool(fleet.origin, fleet.store.url, "upload", BUCKET, str(folder), "model")
        # (label, through the engine, nodes, new engine instances first)
        methods = [
            ("engine-4", True, NODES, True),
            ("engine-1-cold", True, 1, True),
            ("engine-1-warm", True, 1, False),  # right after the cold one: its slices cached
            ("direct-4", False, NODES, False),
            ("direct-1", False, 1, False),
        ]
        for rate, run in ((r, n) for r in rates for n in range(runs)):
            if rate == "none":
                fleet.origin.unlimit_rate()
            else:
                fleet.origin.limit_rate(rate)
            engine_first = run % 2 == 0
            order = sorted(methods, key=lambda m: m[1] != engine_first)
            for key, via, nodes, fresh in order:
                if fresh:
                    fleet.new_engines(f"{rate}-{run}-{key}")
                with contextlib.ExitStack() as mounts:
                    ms = [fleet.mount(i, engine=via, stack=mounts) for i in range(nodes)]
                    before = fleet.origin.tx_bytes()
                    wall = timed_loads([m.path for m in ms], names)
                    sent = fleet.origin.tx_bytes() - before
                out.setdefault(f"{rate}-{key}-wall_s", []).append(wall)
                out.setdefault(f"{rate}-{key}-origin_x", []).append(sent / total)
                print(f"  fleet, origin {rate}, run {run}: {key}: {wall:.2f} s, "
                      f"origin {sent / total:.3f}x", flush=True)  # fmt: skip
    return out


def store_pass(work: Path, files: dict[str, Path], runs: int) -> dict[str, list[float]]:
    names = list(files)
    total = sum(p.stat().st_size for p in files.values())
    out: dict[str, list[float]] = {}
    s3rver = env.start_s3rver(work / "s3rver.log")
    weed = seaweedfs.SeaweedFS(
        work / "weed", os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    )
    try:
        weed.wait_ready(env.s3_client(weed.url))
        stores: dict[str, tuple[str, Callable[[], float]]] = {
            "s3rver": (s3rver.url, lambda: env.process_cpu(s3rver.pid)),
            "seaweedfs": (weed.url, lambda: env.process_cpu(weed.proc.pid)),
        }
        for url, _ in stores.values():
            client = env.s3_client(url)
            client.create_bucket(Bucket="models")
            for name, path in files.items():
                client.upload_file(str(path), "models", f"model/{name}")
        for run in range(runs):
            order = list(stores)
            if run % 2:
                order.reverse()
            for name in order:
                url, store_cpu = stores[name]
                mountpoint = work / f"mnt-{name}-{run}"
                mountpoint.mkdir()
                log = work / f"objfs-{name}-{run}.log"
                cmd = mount_command(
                    "s3://models/model", mountpoint, log, "--endpoint-url", url,
                    "--cache-dir", str(work / f"cache-{name}-{run}"),
                )  # fmt: skip
                with run_mount(cmd, mountpoint, log.with_suffix(".out")) as m:
                    cpu0, store0 = env.process_cpu(m.proc.pid), store_cpu()
                    wall = timed_loads([m.path], names)
                    cpu = env.process_cpu(m.proc.pid) - cpu0
                    store = store_cpu() - store0
                gb = total / 1e9
                out.setdefault(f"{name}-wall_s", []).append(wall)
                out.setdefault(f"{name}-objfs_cpu_s_per_gb", []).append(cpu / gb)
                out.setdefault(f"{name}-store_cpu_s_per_gb", []).append(store / gb)
                print(f"  store run {run}: {name}: {wall:.2f} s, objfs {cpu / gb:.2f} CPU s/GB, "
                      f"store {store / gb:.2f} CPU s/GB", flush=True)  # fmt: skip
    finally:
        weed.stop()
        s3rver.stop()
    return out


def table(medians: dict[str, float], total: int, rates: list[str]) -> str:
    def m(key: str) -> float:
        return medians[key]

    rows = [
        f"model: {total / 1e9:.2f} GB; medians",
        "| fleet | origin link | wall s | origin bytes / model |",
        "|---|---|---|---|",
    ]
    for rate in rates:
        link = "unlimited" if rate == "none" else rate
        direct1 = m(f"{rate}-direct-1-wall_s")
        for key, what in (
            ("engine-4", f"{NODES} nodes at once, through the engine"),
            ("direct-4", f"{NODES} nodes at once, each from the store"),
            ("engine-1-cold", "1 node, through a cold engine"),
            ("engine-1-warm", "1 node, through a warm engine"),
            ("direct-1", "1 node, from the store"),
        ):
            wall = m(f"{rate}-{key}-wall_s")
            ratio = f" ({wall / direct1:.2f}x 1 node direct)" if key.startswith("engine-1") else ""
            rows.append(
                f"| {what} | {link} | {wall:.2f}{ratio} | {m(f'{rate}-{key}-origin_x'):.3f}x |"
            )
    if "s3rver-wall_s" in medians:
        rows += [
            "",
            "| store (1 node, loopback) | wall s | objfs CPU s/GB | store CPU s/GB |",
            "|---|---|---|---|",
        ]
        for name in ("s3rver", "seaweedfs"):
            rows.append(
                f"| {name} | {m(name + '-wall_s'):.2f} | {m(name + '-objfs_cpu_s_per_gb'):.2f} | "
                f"{m(name + '-store_cpu_s_per_gb'):.2f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mib", type=int, default=768, help="model size (default 768 MiB)")
    p.add_argument("--runs", type=int, default=2, help="runs per method (default 2)")
    p.add_argument("--skip-store", action="store_true", help="the fleet pass only")
    p.add_argument(
        "--origin-rates",
        default="none,1gbit",
        help="the origin link's rate per fleet pass, tc units or none (default none,1gbit)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_fleet: network namespaces need root", file=sys.stderr)
        return 2
    env.setup_process_env()
    with tempfile.TemporaryDirectory(prefix="objfs-bench-fleet-") as tmp:
        work = Path(tmp)
        files = model(Path(".bench/data/fleet-model"), args.model_mib)
        total = sum(p.stat().st_size for p in files.values())
        rates = [r.strip() for r in args.origin_rates.split(",") if r.strip()]
        results = fleet_pass(work, files, args.runs, rates)
        if not args.skip_store:
            results |= store_pass(work, files, args.runs)
    medians = {k: statistics.median(v) for k, v in results.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model_bytes": total, "runs": results, "medians": medians},
                                   indent=1))  # fmt: skip
    print(table(medians, total, rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
