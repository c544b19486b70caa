"""make bench's Kubernetes rows: the CSI node cache, through a fake kubelet and real sidecars.

A real ``objfs csi --node-cache-dir`` driven as tests/test_csi.py drives it (a gRPC client in
place of the kubelet), sidecars as uid 65534 with no capabilities, s3rver as the store (what it
sends is counted at its process: ``wchar``). Each run, on a fresh node cache:

- ``pod A cold``: pod A (namespace models, service account sa1) loads the model, then is
  deleted (its sidecar stopped, the volume unpublished);
- ``pod B, same identity``: a new pod of that identity loads it: wall time, bytes the store
  sent, GETs its sidecar sent, opens by passthrough, its sidecar's CPU per GB;
- ``local disk``: the same load of the model's local copy (the page cache dropped before this
  and before pod B's load): pod B's target is at most 1.1x this;
- ``pod-local cache`` (``node-cache: "false"``, a cache-dir in the pod, as before the node
  cache): pod A2 loads, is deleted, pod B2 of the same identity loads again: what the store
  sends then, and its sidecar's CPU per GB (the baseline this replaces);
- ``pods B+C together``: two pods of one identity load at once on a cold node cache: bytes the
  store sent, as a ratio of the model's;
- ``pod D, other identity``: after pod A's load, a pod of service account sa2 loads: it fetches
  the model itself.

A load reads every file whole (8 MiB reads); byte-exactness is the tests' job
(tests/test_csi_node_cache.py). Medians of ``--runs``. Results go to ``.bench/csi.json`` and a
table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks import bench_env as env
from tests.benchmarks.bench_fleet import model, timed_loads
from tests.test_csi import Plugin, Pod
from tests.test_sidecar_fd import NOBODY

MiB = 1 << 20
OUT = Path(".bench/csi.json")
BUCKET = "csi-bench"
NAMESPACE = "csi.storage.k8s.io/pod.namespace"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"


class Node:
    """A node: the plugin with a node cache, its pods and their sidecars."""

    def __init__(self, base: Path, store_url: str) -> None:
        self.base = base
        self.store_url = store_url
        kubelet = base / "kubelet"
        kubelet.mkdir(parents=True)
        for d in (base, kubelet):
            d.chmod(0o755)
        self.plugin = Plugin(base, kubelet, f"unix://{base}/csi.sock", base / "csi.log")
        self.plugin.extra_args = [
            "--node-cache-dir",
            str(base / "node-cache"),
            "--node-cache-size",
            "100G",
        ]
        self.plugin.start()
        self.pods: list[tuple[Pod, Path, subprocess.Popen[bytes]]] = []

    def start_pod(self, sa: str, **more: str) -> tuple[Pod, Path, subprocess.Popen[bytes]]:
        pod = self.plugin.pod(str(uuid.uuid4()))
        target = pod.target("model")
        self.plugin.publish(
            pod,
            "vol-m",
            target,
            source=f"s3://{BUCKET}/model",
            **{
                "endpoint-url": self.store_url,
                "region": "us-east-1",
                "metadata-ttl": "600",
                NAMESPACE: "models",
                SERVICE_ACCOUNT: sa,
                **more,
            },
        )
        keys = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        sidecar = self.plugin.run_sidecar(pod, keys)
        entry = (pod, target, sidecar)
        self.pods.append(entry)
        return entry

    def delete_pod(self, entry: tuple[Pod, Path, subprocess.Popen[bytes]]) -> None:
        _pod, target, sidecar = entry
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=60)
        self.plugin.unpublish("vol-m", target)
        self.pods.remove(entry)

    def close(self) -> None:
        for entry in list(self.pods):
            with contextlib.suppress(Exception):
                self.delete_pod(entry)
        with contextlib.suppress(Exception):
            self.plugin.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def wait_served(target: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = "import os, sys; os.listdir(sys.argv[1])"
        proc = subprocess.run(
            [sys.executable, "-c", code, str(target)], capture_output=True, timeout=30
        )
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{target} was not served in {timeout_s:g} s")
        time.sleep(0.2)


def child(sidecar: subprocess.Popen[bytes]) -> psutil.Process:
    deadline = time.monotonic() + 30
    while True:
        children = psutil.Process(sidecar.pid).children()
        if children:
            return children[0]
        if time.monotonic() > deadline:
            raise RuntimeError("the sidecar started no objfs mount")
        time.sleep(0.1)


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def status(pod: Pod, settle_s: float = 1.5) -> dict[str, Any]:
    """The sidecar child's status file, once it has been rewritten after the load."""
    time.sleep(settle_s)
    files = list((pod.fd_dir / ".objfs-run").glob("*/*.json"))
    with open(files[0], encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def written_behind(pod: Pod, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        disk = status(pod, 0.5).get("disk") or {}
        if (
            disk.get("write_queue_bytes", 1) == 0
            and disk.get("writes", 0) > 0
            and disk.get("blocks_backfilled", 0) >= disk.get("blocks_not_cached", 0)
        ):
            return  # every block on disk: those the reader outran were backfilled
        if time.monotonic() > deadline:
            raise RuntimeError("the disk cache did not finish writing")


def one_run(
    work: Path, store: env.S3rver, files: dict[str, Path], cache: env.PageCache
) -> dict[str, float]:
    names = list(files)
    total = sum(p.stat().st_size for p in files.values())
    out: dict[str, float] = {}
    node = Node(Path(tempfile.mkdtemp(prefix="objfs-csi-", dir="/tmp")), store.url)
    try:
        # Pod A cold, then deleted.
        entry = node.start_pod("sa1")
        wait_served(entry[1])
        before = store.bytes_sent()
        out["pod_a_cold_s"] = timed_loads([entry[1]], names)
        out["pod_a_store_x"] = (store.bytes_sent() - before) / total
        written_behind(entry[0])
        node.delete_pod(entry)

        # Pod B of the same identity, and the local disk, both with the page cache dropped.
        entry = node.start_pod("sa1")
        wait_served(entry[1])
        mount = child(entry[2])
        cache.drop()
        before, cpu_before = store.bytes_sent(), cpu(mount)
        out["pod_b_s"] = timed_loads([entry[1]], names)
        out["pod_b_store_x"] = (store.bytes_sent() - before) / total
        out["pod_b_sidecar_cpu_s_per_gb"] = (cpu(mount) - cpu_before) / (total / 1e9)
        st = status(entry[0])
        out["pod_b_gets"] = st["store"]["requests"].get("get", 0)
        out["pod_b_passthrough_opens"] = st["fuse"]["passthrough_opens"]
        out["pod_b_files"] = len(names)
        cache.drop()
        out["local_disk_s"] = timed_loads([next(iter(files.values())).parent], names)
        node.delete_pod(entry)

        # Pod D, another identity, after pod A's load: fetches the model itself.
        entry = node.start_pod("sa2")
        wait_served(entry[1])
        before = store.bytes_sent()
        timed_loads([entry[1]], names)
        out["pod_d_store_x"] = (store.bytes_sent() - before) / total
        node.delete_pod(entry)

        # The pod-local cache, as before the node cache: a re-created pod fetches again.
        local_cache = node.base / "pod-cache"
        local_cache.mkdir(mode=0o700)
        os.chown(local_cache, NOBODY, NOBODY)
        extra = {"node-cache": "false", "cache-dir": str(local_cache / "c")}
        entry = node.start_pod("sa3", **extra)
        wait_served(entry[1])
        timed_loads([entry[1]], names)
        written_behind(entry[0])
        node.delete_pod(entry)
        shutil.rmtree(local_cache / "c")  # the pod's emptyDir goes with the pod
        entry = node.start_pod("sa3", **extra)
        wait_served(entry[1])
        mount = child(entry[2])
        before, cpu_before = store.bytes_sent(), cpu(mount)
        out["pod_local_again_s"] = timed_loads([entry[1]], names)
        out["pod_local_again_store_x"] = (store.bytes_sent() - before) / total
        out["pod_local_again_sidecar_cpu_s_per_gb"] = (cpu(mount) - cpu_before) / (total / 1e9)
        node.delete_pod(entry)
    finally:
        node.close()

    # Pods B and C together on a cold node cache.
    node = Node(Path(tempfile.mkdtemp(prefix="objfs-csi-", dir="/tmp")), store.url)
    try:
        pair = [node.start_pod("sa1") for _ in range(2)]
        for entry in pair:
            wait_served(entry[1])
        before = store.bytes_sent()
        out["pods_bc_s"] = timed_loads([entry[1] for entry in pair], names)
        out["pods_bc_store_x"] = (store.bytes_sent() - before) / total
    finally:
        node.close()
    return out


def table(medians: dict[str, float], total: int) -> str:
    def ratio(a: str, b: str) -> str:
        return f"{medians[a] / medians[b]:.2f}x" if medians.get(b) else "-"

    lines = [
        f"CSI node cache, model {total / MiB:.0f} MiB (medians)",
        "| row | wall s | store sent (x model) | sidecar CPU s/GB | note |",
        "|---|---|---|---|---|",
        f"| pod A cold (sa1) | {medians['pod_a_cold_s']:.2f} | {medians['pod_a_store_x']:.3f} "
        "| | |",
        f"| pod B after A, same identity | {medians['pod_b_s']:.2f} | "
        f"{medians['pod_b_store_x']:.4f} | {medians['pod_b_sidecar_cpu_s_per_gb']:.3f} | "
        f"{medians['pod_b_gets']:.0f} GETs, {medians['pod_b_passthrough_opens']:.0f} of "
        f"{medians['pod_b_files']:.0f} opens by passthrough; "
        f"{ratio('pod_b_s', 'local_disk_s')} local disk |",
        f"| local disk, same load | {medians['local_disk_s']:.2f} | | | page cache dropped |",
        f"| pod re-created, pod-local cache (before) | {medians['pod_local_again_s']:.2f} | "
        f"{medians['pod_local_again_store_x']:.3f} | "
        f"{medians['pod_local_again_sidecar_cpu_s_per_gb']:.3f} | node-cache: false |",
        f"| pods B+C together, cold | {medians['pods_bc_s']:.2f} | "
        f"{medians['pods_bc_store_x']:.3f} | | target <= 1.05x |",
        f"| pod D, other identity | | {medians['pod_d_store_x']:.3f} | | fetches itself |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mib", type=int, default=512, help="model size (default 512 MiB)")
    p.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_csi: the node plugin mounts: run as root", file=sys.stderr)
        return 2
    env.setup_process_env()
    cache = env.PageCache()
    with tempfile.TemporaryDirectory(prefix="objfs-bench-csi-") as tmp:
        work = Path(tmp)
        files = model(Path(".bench/data/csi-model"), args.model_mib)
        total = sum(p.stat().st_size for p in files.values())
        store = env.start_s3rver(work / "s3rver.log")
        try:
            client = env.s3_client(store.url)
            client.create_bucket(Bucket=BUCKET)
            for name, path in files.items():
                with open(path, "rb") as f:
                    client.put_object(Bucket=BUCKET, Key=f"model/{name}", Body=f)
            results: dict[str, list[float]] = {}
            for run in range(args.runs):
                got = one_run(work, store, files, cache)
                for key, value in got.items():
                    results.setdefault(key, []).append(value)
                print(
                    f"  csi run {run}: pod B {got['pod_b_s']:.2f} s "
                    f"(local disk {got['local_disk_s']:.2f} s), store {got['pod_b_store_x']:.4f}x, "
                    f"B+C {got['pods_bc_store_x']:.3f}x",
                    flush=True,
                )
        finally:
            store.stop()
    medians = {k: statistics.median(v) for k, v in results.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model_bytes": total, "runs": results, "medians": medians},
                                   indent=1))  # fmt: skip
    print(table(medians, total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
