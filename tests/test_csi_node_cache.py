"""The CSI node cache (``objfs csi --node-cache-dir``): pods of one identity on a node share a
persistent disk cache with one fetch between them and passthrough registered by the plugin;
another identity never reaches it (:mod:`objfs.csi.node_cache`).

Driven as ``tests/test_csi.py`` drives the plugin: a fake kubelet, a real ``objfs csi`` with
a node cache under the test's folder, sidecars as uid 65534 with no capabilities, moto behind a
counting proxy (what the store sends is counted there). Pods are told apart by their
namespace and service account, as the kubelet's pod info gives them.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from objfs import fdpass
from objfs.csi.node_cache import LAYOUT, NodeCache
from objfs.csi.offers import socket_name
from objfs.csi.volume import NAMESPACE_KEY, NODE_CACHE_KEY, SERVICE_ACCOUNT_KEY
from objfs.demo import LocalServer
from objfs.disk_cache.layout import FORMAT
from tests.helpers.proxy import Proxy
from tests.test_csi import (
    Plugin,
    Pod,
    kill_tree,
    moto_env,
    mounts_under,
    run_reader,
    wait_log,
    wait_readable,
)
from tests.test_csi import plugin as plugin
from tests.test_sidecar_fd import NOBODY, SETPRIV

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

MiB = 1 << 20
MODEL = {
    "config.json": b'{"hidden_size": 64}\n',
    "model-00001.safetensors": os.urandom(9 * MiB + 17),
    "model-00002.safetensors": os.urandom(7 * MiB + 5),
}
MODEL_BYTES = sum(len(v) for v in MODEL.values())
SHARDS = [name for name in MODEL if name.endswith(".safetensors")]


def hashes() -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in MODEL.items()}


@pytest.fixture
def node(plugin: Plugin) -> Plugin:
    """The plugin restarted with a node cache of 1 GiB under its folder."""
    assert plugin.stop() == 0
    plugin.extra_args = [
        "--node-cache-dir",
        str(plugin.base / "node-cache"),
        "--node-cache-size",
        "1G",
    ]
    plugin.start()
    return plugin


@pytest.fixture
def origin(s3: Any, bucket: str, s3_server: LocalServer) -> Iterator[tuple[str, Proxy]]:
    for name, data in MODEL.items():
        s3.put_object(Bucket=bucket, Key=f"m/{name}", Body=data)
    with Proxy(int(s3_server.url.rsplit(":", 1)[1])) as proxy:
        yield f"s3://{bucket}/m", proxy


def data_gets(proxy: Proxy) -> int:
    """GETs of the model's objects (not listings or probes) the store answered."""
    return sum(
        1
        for r in proxy.stats.requests
        if r.method == "GET" and any(r.target.split("?")[0].endswith(f"/m/{n}") for n in MODEL)
    )


def publish(plugin: Plugin, pod: Pod, source: str, proxy: Proxy, sa: str, **more: str) -> Path:
    target = pod.target("model")
    plugin.publish(
        pod,
        "vol-m",
        target,
        source=source,
        **{
            "endpoint-url": proxy.url,
            "region": "us-east-1",
            "metadata-ttl": "60",
            NAMESPACE_KEY: "models",
            SERVICE_ACCOUNT_KEY: sa,
            **more,
        },
    )
    return target


def folder(plugin: Plugin, sa: str, uid: int = NOBODY) -> Path:
    return plugin.base / "node-cache" / LAYOUT / "models" / sa / str(uid)


def child_status(pod: Pod) -> dict[str, Any]:
    """The sidecar's ``objfs mount`` child's status file (its ``objfs status``)."""
    files = glob.glob(str(pod.fd_dir / ".objfs-run" / "*" / "*.json"))
    assert len(files) == 1, files
    with open(files[0], encoding="utf-8") as f:
        status: dict[str, Any] = json.load(f)
    return status


def wait_status(pod: Pod, check: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = child_status(pod)
            if check(status):
                return status
        except (AssertionError, OSError, ValueError):
            status = {}
        assert time.monotonic() < deadline, f"status never matched: {status}"
        time.sleep(0.3)


def written_behind(status: dict[str, Any]) -> bool:
    disk = status.get("disk") or {}
    return (
        bool(disk)
        and disk.get("write_queue_bytes", 1) == 0
        and disk.get("writes", 0) > 0
        and disk.get("blocks_backfilled", 0) >= disk.get("blocks_not_cached", 0)
    )


def wait_listed(target: Path, timeout_s: float = 60.0) -> None:
    """Waits until the mount serves a listing (nothing of the model read yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            proc = run_reader("import os, sys; os.listdir(sys.argv[1])", str(target), timeout_s=10)
            if proc.returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        assert time.monotonic() < deadline, f"{target} did not serve in time"
        time.sleep(0.2)


def stop_sidecar(sidecar: subprocess.Popen[bytes]) -> None:
    """The pod is deleted: the kubelet stops the sidecar's container (SIGTERM)."""
    sidecar.send_signal(signal.SIGTERM)
    sidecar.wait(timeout=60)


def fuse_fds(pid: int) -> int:
    """How many descriptors of /dev/fuse process ``pid`` holds."""
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{name}") == "/dev/fuse"
    return count


def sidecar_child(sidecar: subprocess.Popen[bytes]) -> int:
    """The pid of the sidecar's ``objfs mount`` child."""
    import psutil

    deadline = time.monotonic() + 30
    while True:
        children = psutil.Process(sidecar.pid).children()
        if children:
            return int(children[0].pid)
        assert time.monotonic() < deadline
        time.sleep(0.1)


# -- the cap across identities (no mounts) ---------------------------------------------------


def _version(root: Path, digest: str, size: int, mtime: float, uid: int) -> None:
    sub = root / FORMAT / digest[:2]
    sub.mkdir(parents=True, exist_ok=True)
    for path, n in ((sub / digest, size), (sub / f"{digest}.idx", 4096)):
        path.write_bytes(os.urandom(n))
        os.chown(path, uid, uid)
        os.utime(path, (mtime, mtime))


def _ledger(root: Path, counted: int, uid: int) -> Path:
    lock = root / FORMAT / ".lock"
    lock.write_bytes(counted.to_bytes(8, "little") + bytes(8))
    os.chown(lock, uid, uid)
    (root / FORMAT / ".writers").touch()
    return lock


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_the_cap_holds_across_identities_least_recently_used_first(tmp_path: Path) -> None:
    """Two identities' folders together over the cap: the oldest versions go, whoever wrote
    them, down to 90% of the cap, and each folder's ledger is recounted."""
    cache = NodeCache(str(tmp_path / "nc"), 10 * MiB)
    cache.prepare()
    now = time.time()
    a = tmp_path / "nc" / LAYOUT / "ns" / "sa1" / "1000"
    b = tmp_path / "nc" / LAYOUT / "ns" / "sa2" / "1001"
    for root, uid in ((a, 1000), (b, 1001)):
        root.mkdir(parents=True)
        os.chown(root, uid, uid)
    # a: the oldest and the newest; b: the middle two. 4 x (3 MiB + a page) = 12 MiB+.
    _version(a, "a" * 64, 3 * MiB, now - 400, 1000)
    _version(b, "b" * 64, 3 * MiB, now - 300, 1001)
    _version(b, "c" * 64, 3 * MiB, now - 200, 1001)
    _version(a, "d" * 64, 3 * MiB, now - 100, 1000)
    lock_a = _ledger(a, 6 * MiB, 1000)
    lock_b = _ledger(b, 6 * MiB, 1001)
    assert cache.usage() == 12 * MiB
    assert cache.sweep() == 2  # to 9 MiB: the two oldest
    left = sorted(p.name for p in (tmp_path / "nc").rglob("*") if len(p.name) == 64)
    assert left == ["c" * 64, "d" * 64]
    ledger_a = int.from_bytes(lock_a.read_bytes()[:8], "little")
    ledger_b = int.from_bytes(lock_b.read_bytes()[:8], "little")
    d = a / FORMAT / "dd"
    c = b / FORMAT / "cc"
    assert ledger_a == _allocated(d / ("d" * 64)) + _allocated(d / f"{'d' * 64}.idx")
    assert ledger_b == _allocated(c / ("c" * 64)) + _allocated(c / f"{'c' * 64}.idx")
    assert cache.sweep() == 0  # under the cap now


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 24)),  # (folder, size in pages)
        min_size=1,
        max_size=12,
    ),
    st.integers(4, 160),  # the cap, in pages
)
def test_the_sweep_removes_exactly_the_oldest_versions_across_folders(
    versions: list[tuple[int, int]], cap_pages: int
) -> None:
    """Any versions in any folders: over the cap, the sweep removes the least recently used
    ones, whatever folder holds them, and no more than it must to reach 90% of the cap; each
    folder's ledger then counts what its folder allocates. Under the cap it removes nothing."""
    page = 4096
    with tempfile.TemporaryDirectory() as tmp:
        cache = NodeCache(os.path.join(tmp, "nc"), cap_pages * page)
        cache.prepare()
        roots = [Path(tmp) / "nc" / LAYOUT / "ns" / f"sa{i}" / str(os.geteuid()) for i in range(3)]
        now = time.time()
        made: list[tuple[float, int, str, int]] = []  # mtime, folder, digest, allocated
        for n, (where, pages) in enumerate(versions):
            digest = f"{n:02x}" + "0" * 62
            mtime = now - 1000 + n * 7 % 997  # distinct ages, not in creation order
            _version(roots[where], digest, pages * page, mtime, os.geteuid())
            sub = roots[where] / FORMAT / digest[:2]
            allocated = _allocated(sub / digest) + _allocated(sub / f"{digest}.idx")
            made.append((mtime, where, digest, allocated))
        locks = {}
        for i in {where for where, _ in versions}:
            counted = sum(a for _, w, _, a in made if w == i)
            locks[i] = _ledger(roots[i], counted, os.geteuid())
        total = sum(a for *_, a in made)
        removed = cache.sweep()
        cap = cap_pages * page
        if total <= cap:
            assert removed == 0
            return
        goal = cap - int(cap * 0.1)
        ordered = sorted(made)
        # The fewest oldest versions whose removal reaches the goal.
        expected, left = 0, total
        while left > goal:
            left -= ordered[expected][3]
            expected += 1
        assert removed == expected
        for k, (_mtime, where, digest, _a) in enumerate(ordered):
            present = (roots[where] / FORMAT / digest[:2] / digest).exists()
            assert present == (k >= expected), (k, expected)
        for i, lock in locks.items():
            kept = sum(a for _, w, d, a in ordered[expected:] if w == i)
            assert int.from_bytes(lock.read_bytes()[:8], "little") == kept


def test_the_sweep_follows_no_link_a_folder_owner_plants(tmp_path: Path) -> None:
    """A folder's owner controls what is in it: a ledger that is a link to a host file is
    not written, a subdirectory that is a link is not entered, nothing outside is removed."""
    cache = NodeCache(str(tmp_path / "nc"), 1 * MiB)
    cache.prepare()
    root = tmp_path / "nc" / LAYOUT / "ns" / "sa" / "1000"
    (root / FORMAT).mkdir(parents=True)
    outside = tmp_path / "host"
    outside.mkdir()
    victim = outside / ("e" * 64)
    victim.write_bytes(b"x" * (2 * MiB))
    host_file = outside / "passwd"
    host_file.write_bytes(b"root:x:0:0\n" + bytes(16))
    os.symlink(outside, root / FORMAT / "ee")
    os.symlink(host_file, root / FORMAT / ".lock")
    _version(root, "f" * 64, 2 * MiB, time.time() - 50, 1000)
    # Another folder whose v4 itself is a link to a folder with a ledger of the same uid.
    other = tmp_path / "nc" / LAYOUT / "ns" / "sb" / "1000"
    other.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / FORMAT).mkdir(parents=True)
    foreign = _ledger(elsewhere, 12345, 1000)
    os.symlink(elsewhere / FORMAT, other / FORMAT)
    cache.evict()
    assert victim.exists()
    assert host_file.read_bytes() == b"root:x:0:0\n" + bytes(16)
    assert int.from_bytes(foreign.read_bytes()[:8], "little") == 12345  # not written
    assert cache.usage() == 0  # nothing counted through links
    assert not (root / FORMAT / "ff" / ("f" * 64)).exists()  # its own version went


# -- through the plugin and real sidecars ----------------------------------------------------


def test_a_pod_of_the_same_identity_loads_from_the_node_cache_by_passthrough(
    node: Plugin, origin: tuple[str, Proxy]
) -> None:
    """Pod A loads the model cold and is deleted; pod B of the same identity on the node
    loads it with no data GET and every shard opened by passthrough, byte-exact."""
    source, proxy = origin
    pod_a = node.pod()
    target_a = publish(node, pod_a, source, proxy, "sa1")
    sidecar_a = node.run_sidecar(pod_a, moto_env())
    assert wait_readable(target_a) == hashes()
    wait_log(node, "with the node cache of models/sa1 uid 65534")
    wait_status(pod_a, written_behind)
    cold = data_gets(proxy)
    assert cold > 0
    # The identity's folder: 0700, the sidecar's uid; the levels above are root's.
    info = folder(node, "sa1").stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (NOBODY, 0o700)
    assert stat.S_IMODE(folder(node, "sa1").parent.stat().st_mode) == 0o700
    assert folder(node, "sa1").parent.stat().st_uid == 0
    stop_sidecar(sidecar_a)
    node.unpublish("vol-m", target_a)

    pod_b = node.pod()
    target_b = publish(node, pod_b, source, proxy, "sa1")
    node.run_sidecar(pod_b, moto_env())
    assert wait_readable(target_b) == hashes()
    assert data_gets(proxy) == cold  # not one data GET more
    status = wait_status(pod_b, lambda s: s["fuse"]["passthrough_opens"] >= len(SHARDS))
    assert status["fuse"]["passthrough"] is True
    assert status["fuse"]["passthrough_refused"] is None
    # The shards' bytes came from the kernel's reads of the cache files, not the daemon.
    assert status["served"]["bytes"] < MODEL_BYTES // 4, status["served"]
    node.unpublish("vol-m", target_b)
    assert mounts_under(node.base) == []


def test_two_pods_of_one_identity_starting_together_fetch_once(
    node: Plugin, origin: tuple[str, Proxy]
) -> None:
    """Pods B and C of one identity start together on a cold node cache: the store sends
    the model's bytes about once between them, every byte right."""
    source, proxy = origin
    pods = [node.pod() for _ in range(2)]
    targets = [publish(node, pod, source, proxy, "sa1") for pod in pods]
    for pod in pods:
        node.run_sidecar(pod, moto_env())
    for target in targets:
        wait_listed(target)
    before = proxy.stats.response_bytes
    results: list[dict[str, str]] = []

    def load(target: Path) -> None:
        results.append(wait_readable(target))

    threads = [threading.Thread(target=load, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [hashes(), hashes()]
    sent = proxy.stats.response_bytes - before
    assert sent <= 1.05 * MODEL_BYTES, sent / MODEL_BYTES
    for target in targets:
        node.unpublish("vol-m", target)


def test_another_identity_fetches_itself_and_never_reaches_the_folder(
    node: Plugin, origin: tuple[str, Proxy]
) -> None:
    """Pod D (service account sa2) on the same node fetches the model itself: it gets its
    own folder, holds no descriptor of sa1's, and its uid has no path to sa1's folder."""
    source, proxy = origin
    pod_a = node.pod()
    target_a = publish(node, pod_a, source, proxy, "sa1")
    node.run_sidecar(pod_a, moto_env())
    assert wait_readable(target_a) == hashes()
    wait_status(pod_a, written_behind)
    after_a = proxy.stats.response_bytes

    pod_d = node.pod()
    target_d = publish(node, pod_d, source, proxy, "sa2")
    sidecar_d = node.run_sidecar(pod_d, moto_env())
    assert wait_readable(target_d) == hashes()
    assert proxy.stats.response_bytes - after_a >= MODEL_BYTES  # fetched it all itself
    assert folder(node, "sa2").is_dir()
    own = str(folder(node, "sa1"))
    child = sidecar_child(sidecar_d)
    for name in os.listdir(f"/proc/{child}/fd"):
        with contextlib.suppress(OSError):
            assert not os.readlink(f"/proc/{child}/fd/{name}").startswith(own)
    probe = subprocess.run(
        [*SETPRIV, sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", own],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0
    assert "PermissionError" in probe.stderr
    for target in (target_a, target_d):
        node.unpublish("vol-m", target)


def test_a_sidecar_killed_mid_load_ends_the_mount_and_the_plugins_copy(
    node: Plugin, origin: tuple[str, Proxy]
) -> None:
    """The sidecar killed while a reader loads: the reader fails with ENOTCONN (never a
    hang), the plugin holds no copy of that FUSE fd any more, a new sidecar serves on."""
    source, proxy = origin
    proxy.bytes_per_s = 2 * MiB  # a slow store: the load lasts seconds
    pod = node.pod()
    target = publish(node, pod, source, proxy, "sa1")
    sidecar = node.run_sidecar(pod, moto_env())
    wait_listed(target)
    wait_log(node, "with the node cache of")
    assert node.proc is not None
    assert fuse_fds(node.proc.pid) == 1  # the broker's copy, while the sidecar serves
    code = (
        "import errno, sys\n"
        "try:\n"
        "    open(sys.argv[1], 'rb').read()\n"
        "    print('read')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode.get(e.errno, e.errno)); sys.exit(3)\n"
    )
    result: list[subprocess.CompletedProcess[str]] = []
    reader = threading.Thread(
        target=lambda: result.append(run_reader(code, str(target / SHARDS[0]), timeout_s=60))
    )
    reader.start()
    time.sleep(1.5)
    kill_tree(sidecar)
    reader.join(60)
    assert result, "the reader never returned"
    assert result[0].returncode == 3, result[0].stdout
    assert result[0].stdout.strip() in ("ENOTCONN", "ECONNABORTED", "EIO"), result[0].stdout
    wait_log(node, "is gone")
    assert fuse_fds(node.proc.pid) == 0
    proxy.bytes_per_s = None
    node.run_sidecar(pod, moto_env())
    assert wait_readable(target) == hashes()
    node.unpublish("vol-m", target)


def publish_unserved(node: Plugin, pod: Pod, sa: str, **more: str) -> Path:
    """A volume of a bucket nobody serves, published for ``pod`` (namespace models, service
    account ``sa``): for tests that take the offer themselves."""
    target = pod.target("model")
    node.publish(
        pod,
        "vol-m",
        target,
        source="s3://bucket-a/m",
        region="us-east-1",
        **{NAMESPACE_KEY: "models", SERVICE_ACCOUNT_KEY: sa, **more},
    )
    return target


_FAKE_SIDECAR = r"""
import errno, json, os, socket, sys
from objfs import fdpass
from objfs.kernel.passthrough import BROKER_ANSWER, BROKER_CLOSE, BROKER_ID, BROKER_OPEN

path, elsewhere, go = sys.argv[1], sys.argv[2], int(sys.argv[3])
offer = fdpass.take(path)
out = {"extra": sorted(offer.extra), "node_cache": offer.payload.get("node_cache"),
       "options": offer.options}
broker = socket.socket(fileno=offer.extra.pop("backing"))
folder = offer.extra["cache-dir"]
offer.ready()

def ask(message, fds):
    socket.send_fds(broker, [message], fds)
    return list(BROKER_ANSWER.unpack(broker.recv(64)))

os.makedirs(f"/proc/self/fd/{folder}/v4/ab", exist_ok=True)
inside = f"/proc/self/fd/{folder}/v4/ab/" + "a" * 64
with open(inside, "wb") as f:
    f.write(b"x" * 4096)
os.chmod(inside, 0o600)
with open(elsewhere, "wb") as f:
    f.write(b"y" * 4096)
os.chmod(elsewhere, 0o600)
a, b = socket.socketpair()
bad = {
    "outside": os.open(elsewhere, os.O_RDONLY),
    "writable": os.open(inside, os.O_RDWR),
    "directory": os.open(f"/proc/self/fd/{folder}", os.O_RDONLY | os.O_DIRECTORY),
    "socket": a.fileno(),
    "another uid": os.open(f"/proc/self/fd/{folder}/v4/ab/" + "b" * 64, os.O_RDONLY),
}
out["answers"] = {what: ask(BROKER_OPEN, [fd]) for what, fd in bad.items()}
out["garbage"] = ask(b"garbage", [])
out["open without fd"] = ask(BROKER_OPEN, [])
out["unknown id"] = ask(BROKER_CLOSE + BROKER_ID.pack(7), [])
print(json.dumps(out), flush=True)
os.read(go, 1)  # the test looks at the plugin meanwhile
broker.close()
offer.close()
"""


def test_the_broker_refuses_what_is_not_the_sidecars_cache_file(
    node: Plugin, tmp_path: Path
) -> None:
    """A sidecar (here a fake one, uid 65534) that sends the plugin a file outside its folder,
    a writable descriptor, a directory, a socket, a file of another uid, garbage or an id it
    never got: each one refused with an errno and a log line, no backing id; the plugin
    carries on, and drops its copy of the FUSE fd when the sidecar goes. A sidecar running as
    root gets no node cache at all: a descriptor of a folder lets root climb out by ``..``."""
    pod = node.pod()
    target = publish_unserved(node, pod, "sa9")
    path = str(pod.short_fd_dir() / socket_name("vol-m", str(target)))
    as_root = fdpass.take(path)
    assert as_root.extra == {}  # no folder, no broker for uid 0
    as_root.fail("not serving in this test")
    as_root.close()
    wait_log(node, "the sidecar runs as root")
    # A file of another uid in the folder the sidecar will get (made as the plugin makes it).
    mine = folder(node, "sa9")
    (mine / FORMAT / "ab").mkdir(parents=True)
    for level in (mine.parent, mine.parent.parent, mine.parent.parent.parent):
        level.chmod(0o700)
    os.chown(mine, NOBODY, NOBODY)
    for d in (mine, mine / FORMAT, mine / FORMAT / "ab"):
        os.chown(d, NOBODY, NOBODY)
        d.chmod(0o700)
    (mine / FORMAT / "ab" / ("b" * 64)).write_bytes(b"z" * 4096)  # root's, 0644
    scratch = node.base / "sidecar-scratch"  # a folder uid 65534 reaches
    scratch.mkdir()
    os.chown(scratch, NOBODY, NOBODY)
    go_r, go_w = os.pipe()
    fake = subprocess.Popen(
        [*SETPRIV, sys.executable, "-c", _FAKE_SIDECAR, path, str(scratch / "x"), str(go_r)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(go_r,),
        text=True,
    )
    os.close(go_r)
    try:
        assert fake.stdout is not None
        line = fake.stdout.readline()
        assert line, fake.stderr.read() if fake.stderr else ""
        out = json.loads(line)
        assert out["extra"] == ["backing", "cache-dir"]
        assert out["node_cache"] == f"models/sa9 uid {NOBODY}"
        assert "cache-dir" not in out["options"]
        assert out["options"]["cache-size"] == str(1 << 30)
        for what, answer in out["answers"].items():
            assert answer == [errno.EACCES, 0], what
        assert out["garbage"] == [errno.EBADMSG, 0]
        assert out["open without fd"] == [errno.EBADMSG, 0]
        assert out["unknown id"] == [errno.EINVAL, 0]
        text = node.log.read_text()
        for reason in (
            "not inside the identity's node cache folder",
            "not opened read-only",
            "not a regular file",
            f"owned by uid 0, not by the sidecar's uid {NOBODY}",
            "a request the broker does not know",
            "backing id 7 is not the sidecar's",
        ):
            assert reason in text, reason
        node.call("Identity", "Probe")  # carries on
        assert node.proc is not None
        assert fuse_fds(node.proc.pid) == 1  # the broker's copy, while the sidecar is there
    finally:
        with contextlib.suppress(BrokenPipeError):
            os.write(go_w, b"x")
        os.close(go_w)
        fake.communicate(timeout=30)  # waits, and closes its pipes
    wait_log(node, "is gone")
    assert fuse_fds(node.proc.pid) == 0
    node.unpublish("vol-m", target)
    assert mounts_under(node.base) == []


def test_node_cache_false_keeps_the_pods_own_cache(node: Plugin) -> None:
    """``node-cache: "false"``: the offer carries the FUSE fd alone and the volume's options
    as given; no folder is made."""
    pod = node.pod()
    target = publish_unserved(node, pod, "sa3", **{NODE_CACHE_KEY: "false", "cache-dir": "/cache"})
    offer = fdpass.take(str(pod.short_fd_dir() / socket_name("vol-m", str(target))))
    try:
        assert offer.extra == {}
        assert offer.options["cache-dir"] == "/cache"
        assert "node_cache" not in offer.payload
    finally:
        offer.fail("not serving in this test")
        offer.close()
    assert not (node.base / "node-cache" / LAYOUT / "models" / "sa3").exists()
    node.unpublish("vol-m", target)


def test_after_a_plugin_restart_mounts_serve_and_new_opens_go_through_the_sidecar(
    node: Plugin, origin: tuple[str, Proxy]
) -> None:
    """The node plugin restarts while a sidecar serves from the node cache: the mount keeps
    serving, a file open by passthrough across the restart keeps reading right, new opens are
    served by the sidecar itself (passthrough off for that mount, said once), and the node
    cache outlives it all."""
    source, proxy = origin
    pod_a = node.pod()
    target_a = publish(node, pod_a, source, proxy, "sa1")
    sidecar_a = node.run_sidecar(pod_a, moto_env())
    assert wait_readable(target_a) == hashes()
    wait_status(pod_a, written_behind)
    stop_sidecar(sidecar_a)
    node.unpublish("vol-m", target_a)
    fetched = data_gets(proxy)

    pod = node.pod()
    target = publish(node, pod, source, proxy, "sa1")
    sidecar = node.run_sidecar(pod, moto_env())
    wait_listed(target)
    held = open(target / SHARDS[0], "rb")  # noqa: SIM115  (held across the restart)
    try:
        assert held.read(MiB) == MODEL[SHARDS[0]][:MiB]
        wait_status(pod, lambda s: s["fuse"]["passthrough_opens"] == 1)  # rewritten each second
        assert node.stop() == 0
        assert held.read() == MODEL[SHARDS[0]][MiB:]
        assert wait_readable(target) == hashes()  # the other files: new opens
        status = wait_status(pod, lambda s: s["fuse"]["passthrough_refused"] is not None)
        assert "broker is gone" in status["fuse"]["passthrough_refused"]
        # The held shard's second open shares its backing file; the other shard's open, the
        # one that needed the broker, was served by the sidecar.
        assert status["fuse"]["passthrough_opens"] == 2
        node.start()
        wait_log(node, "found vol-m published")
        assert wait_readable(target) == hashes()
        assert sidecar.poll() is None
    finally:
        held.close()
    assert data_gets(proxy) == fetched  # all of it from the node cache
    node.unpublish("vol-m", target)


def test_a_hard_link_counts_once_and_a_future_mtime_as_now(tmp_path: Path) -> None:
    """A folder's owner can link one version under many names and date it in the future:
    the sweep counts an inode's bytes once and takes a future mtime for now."""
    cache = NodeCache(str(tmp_path / "nc"), 5 * MiB)
    cache.prepare()
    root = tmp_path / "nc" / LAYOUT / "ns" / "sa" / "1000"
    root.mkdir(parents=True)
    _version(root, "a" * 64, 3 * MiB, time.time() + 86400, 1000)
    sub = root / FORMAT / "aa"
    os.link(sub / ("a" * 64), sub / ("a" * 63 + "b"))
    _ledger(root, 6 * MiB, 1000)
    assert cache.evict() == 0  # 3 MiB and a page, under 90% of 5 MiB: nothing to remove
    other = tmp_path / "nc" / LAYOUT / "ns" / "sb" / "1000"
    other.mkdir(parents=True)
    _version(other, "c" * 64, 2 * MiB, time.time() - 100, 1000)
    assert cache.evict() == 1  # over now: the older one goes, not the one dated tomorrow
    assert (sub / ("a" * 64)).exists()
    assert not (other / FORMAT / "cc" / ("c" * 64)).exists()
