"""``objfs csi``, the CSI node plugin, driven by a fake kubelet (a gRPC client over the same
messages) with real mounts, against the moto S3 server.

The plugin runs as ``python -m objfs csi`` in a child with a kubelet directory in a short
folder under /tmp (readable by uid 65534, and short enough for socket paths). Sidecars run as
``objfs sidecar --fd-dir`` under uid 65534 with every capability dropped and no_new_privs; they
see the pod's ``objfs-fd`` directory through a short symlink, as a container sees its emptyDir
at a short mount path. After every test nothing is left mounted under the test's folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from objfs import fdpass
from objfs.csi import DRIVER_NAME, proto
from objfs.csi.offers import socket_name
from objfs.csi.volume import POD_UID_KEY, VolumeContextError, parse_volume_context
from objfs.demo import LocalServer
from objfs.mountinfo import _unescape_mountinfo
from tests.conftest import run_objfs, sha256
from tests.helpers.known_secrets import remember
from tests.test_sidecar_fd import NOBODY, SETPRIV

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")

REPO = Path(__file__).resolve().parent.parent
HAVE_SIDECAR = (REPO / "objfs" / "sidecar_fd.py").exists()
needs_sidecar = pytest.mark.skipif(
    not HAVE_SIDECAR, reason="objfs sidecar --fd-dir (objfs/sidecar_fd.py) is not there yet"
)
CAPABILITY = {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}
FILES = {
    "models/m/config.json": b'{"hidden_size": 64}\n',
    "models/m/weights.bin": os.urandom(5 * 1024 * 1024 + 123),
    "models/m/sub/tokenizer.txt": b"a b c\n" * 1000,
}
EXPECTED = {key.removeprefix("models/m/"): data for key, data in FILES.items()}


def mounts_under(base: Path) -> list[str]:
    """Every mount point under ``base``, from mountinfo (never stat-ing one)."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            target = _unescape_mountinfo(line.split()[4])
            if target.startswith(str(base) + "/"):
                found.append(target)
    return found


def mount_line(target: Path) -> str | None:
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if _unescape_mountinfo(line.split()[4]) == str(target):
                found = line
    return found


def abort_connections(base: Path) -> None:
    """Ends the FUSE connection of every objfs mount under ``base`` (stacked ones too), so no
    reader a failed test left behind stays blocked in the kernel."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            target = _unescape_mountinfo(fields.split()[4])
            if not target.startswith(str(base) + "/") or rest.split()[0] != "fuse.objfs":
                continue
            major, minor = (int(n) for n in fields.split()[2].split(":"))
            with contextlib.suppress(OSError):
                Path(f"/sys/fs/fuse/connections/{(major << 20) | minor}/abort").write_text("1")


def lazy_umount_all(base: Path) -> None:
    for target in reversed(mounts_under(base)):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


@dataclass
class Plugin:
    base: Path
    kubelet: Path
    endpoint: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    client: proto.Client | None = None
    sidecars: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: More arguments of ``objfs csi`` (e.g. the node cache).
    extra_args: list[str] = field(default_factory=list)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "objfs",
                    "csi",
                    "--endpoint",
                    self.endpoint,
                    "--node-id",
                    "node-1",
                    "--kubelet-dir",
                    str(self.kubelet),
                    "--log-level",
                    "debug",
                    *self.extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        socket_path = Path(self.endpoint.removeprefix("unix://"))
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert self.proc.poll() is None, "objfs csi exited:\n" + self.log.read_text()
            assert time.monotonic() < deadline, "objfs csi did not listen:\n" + self.log.read_text()
            time.sleep(0.05)
        self.client = proto.Client(self.endpoint)
        # The socket file appears when gRPC binds, a moment before it listens.
        while True:
            try:
                self.call("Identity", "Probe")
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> int:
        assert self.proc is not None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def call(self, service: str, method: str, **fields: Any) -> Any:
        assert self.client is not None
        return self.client.call(service, method, 30.0, **fields)

    def pod(self, uid: str | None = None, *, fd_volume: bool = True) -> Pod:
        uid = uid or str(uuid.uuid4())
        pod_dir = self.kubelet / "pods" / uid
        fd_dir = pod_dir / "volumes" / "kubernetes.io~empty-dir" / "objfs-fd"
        if fd_volume:
            fd_dir.mkdir(parents=True)
            # As the kubelet makes an emptyDir: the pod's, writable by its user.
            os.chown(fd_dir, NOBODY, NOBODY)
            fd_dir.chmod(0o770)
            for parent in (fd_dir.parent, fd_dir.parent.parent, pod_dir, pod_dir.parent):
                parent.chmod(0o755)
        else:
            pod_dir.mkdir(parents=True)
        return Pod(self, uid, fd_dir)

    def publish(self, pod: Pod, volume: str, target: Path, **attributes: str) -> Any:
        context = {POD_UID_KEY: pod.uid, "csi.storage.k8s.io/ephemeral": "true", **attributes}
        return self.call(
            "Node",
            "NodePublishVolume",
            volume_id=volume,
            target_path=str(target),
            volume_capability=CAPABILITY,
            volume_context=context,
        )

    def unpublish(self, volume: str, target: Path) -> Any:
        return self.call("Node", "NodeUnpublishVolume", volume_id=volume, target_path=str(target))

    def run_sidecar(self, pod: Pod, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """``objfs sidecar --fd-dir`` as uid 65534, no capabilities, no_new_privs."""
        link = pod.short_fd_dir()
        log = self.log.with_name(f"sidecar-{pod.uid[:8]}-{len(self.sidecars)}.out")
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [
                    *SETPRIV,
                    sys.executable,
                    "-m",
                    "objfs",
                    "sidecar",
                    "--fd-dir",
                    str(link),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                env={**os.environ, "HOME": "/nonexistent", **env},
            )
        self.sidecars.append(proc)
        return proc


@dataclass
class Pod:
    plugin: Plugin
    uid: str
    fd_dir: Path

    def short_fd_dir(self) -> Path:
        """The objfs-fd directory by a short path (socket addresses hold 107 bytes at most)."""
        link = self.plugin.base / f"fd-{self.uid[:8]}"
        if not link.is_symlink():
            link.symlink_to(self.fd_dir)
        return link

    def target(self, name: str) -> Path:
        return (
            self.plugin.kubelet
            / "pods"
            / self.uid
            / "volumes"
            / "kubernetes.io~csi"
            / name
            / "mount"
        )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and its descendants (a container killed), by pid."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.wait(timeout=30)


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Plugin]:
    base = Path(tempfile.mkdtemp(prefix="objfs-csi-", dir="/tmp"))
    base.chmod(0o755)
    kubelet = base / "kubelet"
    kubelet.mkdir()
    kubelet.chmod(0o755)
    p = Plugin(base, kubelet, f"unix://{base}/csi.sock", tmp_path / "csi.out")
    try:
        p.start()
        yield p
        if p.proc is not None and p.proc.poll() is None:
            assert p.stop() == 0, "objfs csi did not exit 0 on SIGTERM:\n" + p.log.read_text()
    finally:
        for sidecar in p.sidecars:
            if sidecar.poll() is None:
                kill_tree(sidecar)
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)
        left = mounts_under(base)
        abort_connections(base)
        lazy_umount_all(base)
        if not mounts_under(base):
            shutil.rmtree(base, ignore_errors=True)
    assert not left, f"left mounted: {left}"


@pytest.fixture
def s3_source(s3: Any, bucket: str) -> str:
    for key, data in FILES.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/models/m"


def run_reader(code: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Runs ``python -c code args`` as another process; a read that hangs fails the test.

    Not ``subprocess.run(timeout=...)``: after its timeout that kills the child and then waits
    for it without a limit, and a reader whose request the FUSE server read but never answered
    cannot die until the connection ends, so the suite would hang instead of failing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"a reader of {args} is stuck in the kernel even after SIGKILL (pid {proc.pid}): "
                "a FUSE request nobody answers on a connection that did not end"
            ) from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_tree_elsewhere(root: Path, timeout_s: float = 60.0) -> dict[str, str]:
    """sha256 of every file under ``root``, read by another process (as a workload would)."""
    code = (
        "import hashlib, os, sys, json\n"
        "root = sys.argv[1]\n"
        "out = {}\n"
        "for d, _, files in os.walk(root):\n"
        "    for n in files:\n"
        "        p = os.path.join(d, n)\n"
        "        out[os.path.relpath(p, root)] = hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
        "print(json.dumps(out))\n"
    )
    proc = run_reader(code, str(root), timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stderr
    import json

    result: dict[str, str] = json.loads(proc.stdout)
    return result


def wait_readable(root: Path, timeout_s: float = 60.0) -> dict[str, str]:
    """Reads the tree once the sidecar serves it (a child process that may block meanwhile)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        code = (
            "import os, sys\n"
            "try:\n"
            "    os.listdir(sys.argv[1])\n"
            "except OSError as e:\n"
            "    print(e.errno); sys.exit(1)\n"
        )
        try:
            proc = run_reader(code, str(root), timeout_s=10)
        except subprocess.TimeoutExpired:
            last = "listing blocked (no sidecar serving yet)"
            continue
        if proc.returncode == 0:
            return read_tree_elsewhere(root)
        last = proc.stdout.strip() + proc.stderr.strip()
        time.sleep(0.2)
    raise AssertionError(f"{root} did not serve in time: {last}")


def wait_log(plugin: Plugin, text: str, count: int = 1, timeout_s: float = 70.0) -> None:
    """Waits until the plugin's log holds ``text`` ``count`` times (e.g. a sidecar's ``ok``)."""
    deadline = time.monotonic() + timeout_s
    while plugin.log.read_text().count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} x{count} in:\n{plugin.log.read_text()}"
        time.sleep(0.1)


def assert_tuned(target: Path) -> None:
    """The plugin (root) tuned the mount the unprivileged sidecar serves, after its INIT."""
    line = mount_line(target)
    assert line is not None
    major, minor = (int(n) for n in line.split()[2].split(":"))
    read_ahead = Path(f"/sys/class/bdi/{major}:{minor}/read_ahead_kb")
    queue = Path(f"/sys/fs/fuse/connections/{(major << 20) | minor}/max_background")
    deadline = time.monotonic() + 10
    while read_ahead.read_text().strip() != "16384" or (
        queue.exists() and queue.read_text().strip() != "64"
    ):
        assert time.monotonic() < deadline, "the mount was not tuned"
        time.sleep(0.2)


def expected_hashes() -> dict[str, str]:
    return {name: sha256(data) for name, data in EXPECTED.items()}


def s3_attributes(s3_server: LocalServer) -> dict[str, str]:
    return {"endpoint-url": s3_server.url, "region": "us-east-1", "metadata-ttl": "5"}


# -- messages and volume attributes (no mounts) ---------------------------------------------


def test_messages_use_the_csi_field_numbers() -> None:
    """The wire bytes of a publish request, field by field, as csi.proto v1 numbers them."""
    request = proto.message_class("NodePublishVolumeRequest")(
        volume_id="v",
        target_path="/t",
        volume_capability={"mount": {"fs_type": "x"}, "access_mode": {"mode": 3}},
        readonly=True,
        volume_context={"k": "v"},
        secrets={"s": "t"},
    )
    data = request.SerializeToString()
    assert data.startswith(b"\x0a\x01v")  # volume_id = 1
    assert b"\x22\x02/t" in data  # target_path = 4
    # volume_capability = 5 { mount = 2 { fs_type = 1 }, access_mode = 3 { mode = 1 } }
    assert b"\x2a\x09\x12\x03\x0a\x01x\x1a\x02\x08\x03" in data
    assert b"\x30\x01" in data  # readonly = 6
    assert b"\x3a\x06\x0a\x01s\x12\x01t" in data  # secrets = 7 (map entry key 1, value 2)
    assert b"\x42\x06\x0a\x01k\x12\x01v" in data  # volume_context = 8
    block = proto.message_class("VolumeCapability")(block={}).SerializeToString()
    assert block == b"\x0a\x00"  # block = 1
    unpublish = proto.message_class("NodeUnpublishVolumeRequest")(volume_id="v", target_path="/t")
    assert unpublish.SerializeToString() == b"\x0a\x01v\x12\x02/t"
    probe = proto.message_class("ProbeResponse")(ready={"value": True})
    assert probe.SerializeToString() == b"\x0a\x02\x08\x01"  # BoolValue ready = 1
    info = proto.message_class("GetPluginInfoResponse")(name="n", vendor_version="1")
    assert info.SerializeToString() == b"\x0a\x01n\x12\x011"
    node = proto.message_class("NodeGetInfoResponse")(node_id="x", max_volumes_per_node=2)
    assert node.SerializeToString() == b"\x0a\x01x\x10\x02"


POD = {POD_UID_KEY: "0b7c3c5e-1f2a-4d8e-9a6b-2c4d6e8f0a1b"}
# A stand-in for a token or key put in volume attributes: never echoed, never logged (the last
# test of the suite looks for it in every log).
SECRET = remember("a token in volume attributes", "csi-attribute-token-0f9e8d7c6b5a4f3e")


def test_volume_context_becomes_mount_options() -> None:
    spec = parse_volume_context(
        {
            "source": "s3://bucket-a/models",
            "endpoint-url": "http://minio:9000",
            "metadata-ttl": "indefinite",
            "force-path-style": "false",
            "no-sign-request": "true",
            "credentials-file": "/secrets/objfs/credentials",
            "csi.storage.k8s.io/serviceAccount.tokens": '{"sts.amazonaws.com":{"token":"x"}}',
            "csi.storage.k8s.io/pod.name": "vllm-0",
            **POD,
        },
        "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/m/mount",
    )
    assert spec.source == "s3://bucket-a/models"
    assert spec.options == {
        "credentials-file": "/secrets/objfs/credentials",
        "endpoint-url": "http://minio:9000",
        "metadata-ttl": "indefinite",
        "no-force-path-style": "true",
        "no-sign-request": "true",
    }
    assert spec.pod_uid == POD[POD_UID_KEY]
    assert "token" not in repr(spec)


def test_a_volume_can_send_its_data_gets_through_a_cache_engine() -> None:
    spec = parse_volume_context(
        {
            "source": "s3://bucket-a/models",
            "cache-proxy": "http://objfs-cache.objfs.svc:8080",
            "cache-proxy-url-lifetime": "1800",
            **POD,
        },
        "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/m/mount",
    )
    assert spec.options == {
        "cache-proxy": "http://objfs-cache.objfs.svc:8080",
        "cache-proxy-url-lifetime": "1800",
    }
    assert spec.config.s3.cache_proxy == "http://objfs-cache.objfs.svc:8080"
    assert spec.config.s3.cache_proxy_url_lifetime_s == 1800
    # A signed URL given as the engine's address is refused, and not echoed.
    with pytest.raises(VolumeContextError) as info:
        parse_volume_context(
            {"source": "s3://bucket-a", "cache-proxy": f"http://c:8080/?sig={SECRET}", **POD},
            "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/m/mount",
        )
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"source": "s3://bucket-a", "aws-secret-access-key": SECRET}, "looks like a credential"),
        ({"source": "s3://bucket-a", "sas-token": SECRET}, "looks like a credential"),
        ({"source": "s3://bucket-a", "AccountKey": SECRET}, "looks like a credential"),
        ({"source": "s3://bucket-a", "password": SECRET}, "looks like a credential"),
        ({"source": "s3://bucket-a", "connection-string": SECRET}, "looks like a credential"),
        ({"source": "s3://bucket-a", "colour": "blue"}, "unknown volume attribute 'colour'"),
        ({"source": "s3://bucket-a", "foreground": "true"}, "'foreground' cannot be set"),
        ({"source": "s3://bucket-a", "log-file": "/x"}, "'log-file' cannot be set"),
        ({"source": "s3://bucket-a", "credentials-file": "creds"}, "absolute path"),
        ({"source": "s3://bucket-a", "sas-token-file": "t"}, "absolute path"),
        ({"source": "s3://bucket-a", "endpoint-url": "http://u:p@h:9000"}, "user, password"),
        ({"source": "s3://bucket-a", "max-connections": "0"}, "max-connections: 0"),
        ({"source": "s3://bucket-a", "log-format": f"x{SECRET}"}, "invalid choice: '<log-format>'"),
        ({"source": "s3://bucket-a", "max-connections": SECRET}, "'<max-connections>'"),
        ({"source": "s3://bucket-a", "part-size": f"{SECRET}M"}, "part-size"),
        (
            {"source": "az://c", "account-url": f"https://a.blob.core.windows.net/;sig={SECRET}"},
            "fragment, ';' or 'sig='",
        ),
        ({"source": "s3://bucket-a", "endpoint-url": f"http://h:9000/sig={SECRET}"}, "'sig='"),
        ({"source": "s3://bucket-a", "endpoint-url": f"http://h:9000/#{SECRET}"}, "fragment"),
        ({"source": "s3://bucket-a", "metadata-ttl": "soon"}, "metadata-ttl"),
        ({"source": "s3://bucket-a", "no-sign-request": "maybe"}, "is a flag"),
        ({"source": "gs://bucket-a"}, "unknown scheme"),
        ({"region": "x"}, "'source' is missing"),
    ],
)
def test_bad_volume_context_is_refused(context: dict[str, str], message: str) -> None:
    with pytest.raises(VolumeContextError, match=message) as info:
        parse_volume_context({**POD, **context}, "/k/pods/x/volumes/kubernetes.io~csi/m/mount")
    text = str(info.value)
    assert "\n" not in text
    assert SECRET not in text


def test_an_unset_memory_limit_is_left_to_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default memory limit is a share of the sidecar's memory, not the node plugin's: a
    node plugin in a small container must not refuse a part size the sidecar would accept."""
    import objfs.options

    monkeypatch.setattr(objfs.options, "default_memory_limit", lambda: 64 << 20)
    target = "/k/pods/x/volumes/kubernetes.io~csi/m/mount"
    spec = parse_volume_context({**POD, "source": "s3://bucket-a", "part-size": "64M"}, target)
    assert spec.options == {"part-size": "64M"}  # no memory-limit passed on to the sidecar
    with pytest.raises(VolumeContextError, match="below two parts"):
        parse_volume_context(
            {**POD, "source": "s3://bucket-a", "part-size": "64M", "memory-limit": "64M"}, target
        )


def test_missing_pod_uid_is_refused() -> None:
    with pytest.raises(VolumeContextError, match="podInfoOnMount"):
        parse_volume_context({"source": "s3://bucket-a"}, "/t")


def test_socket_names_are_short_and_distinct() -> None:
    a = socket_name("vol/../x" * 20, "/k/a/mount")
    b = socket_name("vol/../x" * 20, "/k/b/mount")
    assert a != b
    assert "/" not in a
    assert len(a) <= 40 + 1 + 8 + 5


# -- the plugin, no sidecar -------------------------------------------------------------------


def test_usage_errors_are_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CSI_ENDPOINT", "KUBE_NODE_NAME")}
    for args, text in [
        ((), "--endpoint is missing"),
        (("--endpoint", "unix:///tmp/x.sock"), "--node-id is missing"),
        (("--endpoint", "tcp://127.0.0.1:1", "--node-id", "n"), "unix:///"),
        (("--endpoint", "unix://relative.sock", "--node-id", "n"), "absolute"),
    ]:
        result = run_objfs("csi", *args, env=env)
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert text in lines[0], result.stderr


def test_identity_and_node_info(plugin: Plugin) -> None:
    info = plugin.call("Identity", "GetPluginInfo")
    assert info.name == DRIVER_NAME
    from objfs import __version__

    assert info.vendor_version == __version__
    assert list(plugin.call("Identity", "GetPluginCapabilities").capabilities) == []
    probe = plugin.call("Identity", "Probe")
    assert probe.HasField("ready")
    assert probe.ready.value is True
    assert plugin.call("Node", "NodeGetInfo").node_id == "node-1"
    assert list(plugin.call("Node", "NodeGetCapabilities").capabilities) == []
    assert plugin.client is not None
    for service, method in [("Node", "NodeStageVolume"), ("Controller", "CreateVolume")]:
        with pytest.raises(grpc.RpcError) as info_:
            plugin.client.call_raw(service, method)
        assert info_.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_publish_is_idempotent_and_unpublish_needs_no_sidecar(plugin: Plugin) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    attributes = {"source": "s3://bucket-a/models", "region": "eu-west-1"}
    started = time.monotonic()
    plugin.publish(pod, "vol-a", target, **attributes)
    assert time.monotonic() - started < 5, "publish waited for something"
    line = mount_line(target)
    assert line is not None
    options, _, rest = line.partition(" - ")
    assert rest.split()[0] == "fuse.objfs"
    assert rest.split()[1] == "s3://bucket-a/models/"
    assert {"ro", "nosuid", "nodev"} <= set(options.split()[5].split(","))
    assert {"allow_other", "default_permissions"} <= set(rest.split()[2].split(","))
    sockets = list(pod.fd_dir.iterdir())
    assert [s.name for s in sockets] == [socket_name("vol-a", str(target))]
    assert sockets[0].stat().st_mode & 0o777 == 0o666
    state = list((plugin.kubelet / "plugins" / DRIVER_NAME / "state").iterdir())
    assert len(state) == 1
    assert "eu-west-1" in state[0].read_text()

    # A kubelet retry: OK, the same mount (no second one stacked).
    plugin.publish(pod, "vol-a", target, **attributes)
    assert mounts_under(plugin.base) == [str(target)]
    # The same target with other attributes, or another volume: ALREADY_EXISTS.
    for volume, changed in [
        ("vol-a", {**attributes, "region": "us-east-2"}),
        ("vol-b", attributes),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish(pod, volume, target, **changed)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already published" in info.value.details()

    started = time.monotonic()
    plugin.unpublish("vol-a", target)
    assert time.monotonic() - started < 5, "unpublish waited for a sidecar"
    assert mounts_under(plugin.base) == []
    assert not target.exists()
    assert list(pod.fd_dir.iterdir()) == []
    assert state[0].exists() is False
    # Unpublish again, or a target never published: OK.
    plugin.unpublish("vol-a", target)
    plugin.unpublish("vol-x", pod.target("never"))


def test_a_reader_waits_until_a_sidecar_serves_then_unpublish_frees_it(plugin: Plugin) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    reader = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(target)],
        stderr=subprocess.DEVNULL,
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(timeout=2)  # waits: no sidecar has the fd yet
        plugin.unpublish("vol-a", target)
        assert reader.wait(timeout=30) != 0  # ended with an error, not hung
        assert mounts_under(plugin.base) == []
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()


def test_two_volumes_and_two_targets_of_one_volume(plugin: Plugin) -> None:
    pod = plugin.pod()
    other = plugin.pod()
    targets = [
        (pod, "vol-a", pod.target("a")),
        (pod, "vol-b", pod.target("b")),
        (other, "vol-a", other.target("a")),
    ]
    for owner, volume, target in targets:
        plugin.publish(owner, volume, target, source=f"s3://bucket-{volume[-1]}/p")
    assert sorted(mounts_under(plugin.base)) == sorted(str(t) for _, _, t in targets)
    assert len(list(pod.fd_dir.iterdir())) == 2
    assert len(list(other.fd_dir.iterdir())) == 1
    for _owner, volume, target in targets:
        plugin.unpublish(volume, target)
    assert mounts_under(plugin.base) == []


def test_bad_requests_are_refused_with_messages(plugin: Plugin) -> None:
    pod = plugin.pod()
    no_fd = plugin.pod(fd_volume=False)
    target = pod.target("bad")

    def refused(code: grpc.StatusCode, text: str, **fields: Any) -> None:
        request = {
            "volume_id": "vol-bad",
            "target_path": str(target),
            "volume_capability": CAPABILITY,
            "volume_context": {POD_UID_KEY: pod.uid, "source": "s3://bucket-a/p"},
            **fields,
        }
        with pytest.raises(grpc.RpcError) as info:
            plugin.call("Node", "NodePublishVolume", **request)
        assert info.value.code() == code, info.value.details()
        assert text in info.value.details()
        assert "\n" not in info.value.details()
        assert mounts_under(plugin.base) == []

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    refused(
        invalid,
        "unknown volume attribute 'colour'",
        volume_context={POD_UID_KEY: pod.uid, "source": "s3://bucket-a/p", "colour": "blue"},
    )
    refused(
        invalid,
        "'aws-access-key-id' looks like a credential",
        volume_context={
            POD_UID_KEY: pod.uid,
            "source": "s3://bucket-a/p",
            "aws-access-key-id": "AKIAX",
        },
    )
    refused(invalid, "'source' is missing", volume_context={POD_UID_KEY: pod.uid})
    refused(invalid, "podInfoOnMount", volume_context={"source": "s3://bucket-a/p"})
    refused(invalid, "block devices", volume_capability={"block": {}})
    refused(invalid, "no CSI secrets", secrets={"key": "value"})
    refused(invalid, "outside the kubelet directory", target_path="/tmp/elsewhere/mount")
    # Under the kubelet directory but not in the volumes of the pod the offer goes to.
    other = plugin.pod()
    refused(invalid, "not under the volumes of pod", target_path=str(other.target("bad")))
    refused(
        invalid,
        "not under the volumes of pod",
        target_path=str(plugin.kubelet / "plugins" / "x" / "mount"),
    )
    refused(
        invalid,
        "not under the volumes of pod",
        target_path=str(plugin.kubelet / "pods" / pod.uid / "mount"),
    )
    assert not other.target("bad").exists()
    refused(invalid, "volume_id is missing", volume_id="")
    refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        "no emptyDir volume named objfs-fd",
        target_path=str(no_fd.target("bad")),
        volume_context={POD_UID_KEY: no_fd.uid, "source": "s3://bucket-a/p"},
    )
    assert not no_fd.target("bad").exists()

    # Unpublish touches nothing outside the kubelet directory either.
    elsewhere = plugin.base / "elsewhere"
    elsewhere.mkdir()
    for path in (str(elsewhere), "/tmp/../tmp/x", "relative/mount"):
        with pytest.raises(grpc.RpcError) as info:
            plugin.call("Node", "NodeUnpublishVolume", volume_id="vol-bad", target_path=path)
        assert info.value.code() == invalid, info.value.details()
    assert elsewhere.is_dir()


def test_sigterm_leaves_mounts_and_a_restart_unpublishes_them(plugin: Plugin) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    assert plugin.stop() == 0
    assert mounts_under(plugin.base) == [str(target)], "SIGTERM must leave mounts to the pods"
    plugin.start()
    assert "found vol-a published" in plugin.log.read_text()
    # Listening again for the pod's sidecar.
    assert [s.name for s in pod.fd_dir.iterdir()] == [socket_name("vol-a", str(target))]
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")  # a retry: OK
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []
    assert list(pod.fd_dir.iterdir()) == []


# -- with the unprivileged sidecar ------------------------------------------------------------


def moto_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


@needs_sidecar
def test_sidecar_serves_byte_exact_and_takes_over_after_a_kill(
    plugin: Plugin, s3_source: str, s3_server: LocalServer
) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source=s3_source, **s3_attributes(s3_server))
    sidecar = plugin.run_sidecar(pod, moto_env())
    assert wait_readable(target) == expected_hashes()
    wait_log(plugin, "the sidecar serves")  # it answered ok: the plugin closed its fd
    assert_tuned(target)
    family = [psutil.Process(sidecar.pid), *psutil.Process(sidecar.pid).children(recursive=True)]
    assert all(member.uids().real == NOBODY for member in family[1:])

    # A retry of the publish while served: OK, and it still serves.
    plugin.publish(pod, "vol-a", target, source=s3_source, **s3_attributes(s3_server))
    assert read_tree_elsewhere(target) == expected_hashes()

    # The sidecar's container is killed: readers fail (never hang, never wrong bytes).
    kill_tree(sidecar)
    deadline = time.monotonic() + 30
    code = (
        "import errno, sys\n"
        "try:\n"
        "    open(sys.argv[1], 'rb').read()\n"
        "except OSError as e:\n"
        "    print(errno.errorcode.get(e.errno, e.errno)); sys.exit(3)\n"
    )
    while True:
        proc = run_reader(code, str(target / "config.json"), timeout_s=30)
        if proc.returncode == 3:
            assert proc.stdout.strip() in ("ENOTCONN", "EIO", "ECONNABORTED"), proc.stdout
            break
        assert time.monotonic() < deadline, "reads still succeed after the sidecar died"
        time.sleep(0.2)
    assert "is gone" in plugin.log.read_text()

    # A new sidecar on the same socket: served again without a new publish.
    plugin.run_sidecar(pod, moto_env())
    assert wait_readable(target) == expected_hashes()
    assert "replaced the mount" in plugin.log.read_text()
    wait_log(plugin, "the sidecar serves", 2)
    # The fresh mount sits on the dead one (so containers' copies receive it), and the
    # plugin tuned the topmost one.
    assert mounts_under(plugin.base) == [str(target), str(target)]
    assert_tuned(target)

    plugin.unpublish("vol-a", target)  # removes the whole stack
    assert mounts_under(plugin.base) == []


def umount_all_at(path: Path) -> None:
    """Lazily unmounts every mount stacked at ``path`` (from mountinfo, never stat-ing it)."""
    for _ in range(16):
        if mount_line(path) is None:
            return
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
    assert mount_line(path) is None, f"{path} stays mounted"


def device_of(path: Path) -> str:
    """``major:minor`` of the topmost mount at ``path`` (its FUSE connection), from mountinfo."""
    line = mount_line(path)
    assert line is not None
    return line.split()[2]


@needs_sidecar
def test_takeover_reaches_the_containers_view_of_the_target(
    plugin: Plugin, s3_source: str, s3_server: LocalServer
) -> None:
    """The model server's container sees the volume through its own copy of the target: the
    runtime bind-mounts the target into the container as a slave (``mountPropagation:
    HostToContainer``), under a kubelet directory that is a shared mount. Here the kubelet
    directory is made shared and VIEW is that slave copy, in this namespace (propagation works
    across namespaces the same way). After a sidecar restart the fresh mount must reach VIEW:
    mounted on top of the dead mount it propagates to the slave; detached first and mounted
    anew on the bare directory it would not, and VIEW would answer ENOTCONN for good."""
    kubelet = plugin.kubelet
    view = plugin.base / "view"  # where the container sees the volume
    view.mkdir()

    def run(*argv: str) -> None:
        subprocess.run(list(argv), check=True, capture_output=True, timeout=30)

    try:
        run("mount", "--bind", str(kubelet), str(kubelet))
        run("mount", "--make-shared", str(kubelet))
        pod = plugin.pod()
        target = pod.target("models")
        plugin.publish(pod, "vol-a", target, source=s3_source, **s3_attributes(s3_server))
        sidecar = plugin.run_sidecar(pod, moto_env())
        assert wait_readable(target) == expected_hashes()
        wait_log(plugin, "the sidecar serves")

        # The runtime starts the container: its view is a slave of the target's mount.
        run("mount", "--bind", str(target), str(view))
        run("mount", "--make-slave", str(view))
        line = mount_line(view)
        assert line is not None
        assert "master:" in line, line
        assert device_of(view) == device_of(target)
        assert read_tree_elsewhere(view) == expected_hashes()

        # The sidecar's container is killed and restarted; the plugin takes over.
        kill_tree(sidecar)
        wait_log(plugin, "is gone")
        plugin.run_sidecar(pod, moto_env())
        wait_log(plugin, "replaced the mount")
        assert wait_readable(target) == expected_hashes()
        wait_log(plugin, "the sidecar serves", 2)

        # The container reads the fresh mount, byte-exact, from another process.
        assert wait_readable(view, timeout_s=20) == expected_hashes()
        assert device_of(view) == device_of(target)

        plugin.unpublish("vol-a", target)
        assert str(target) not in mounts_under(plugin.base)
    finally:
        umount_all_at(view)
        umount_all_at(kubelet)
        view.rmdir()
    assert mounts_under(plugin.base) == []


@needs_sidecar
def test_sidecar_serves_two_volumes_and_two_targets(
    plugin: Plugin, s3: Any, s3_source: str, s3_server: LocalServer
) -> None:
    bucket = s3_source.split("/")[2]
    s3.put_object(Bucket=bucket, Key="other/x.txt", Body=b"other volume\n")
    pod = plugin.pod()
    attributes = s3_attributes(s3_server)
    first, second, again = pod.target("a"), pod.target("b"), pod.target("c")
    plugin.publish(pod, "vol-a", first, source=s3_source, **attributes)
    plugin.publish(pod, "vol-b", second, source=f"s3://{bucket}/other", **attributes)
    plugin.publish(pod, "vol-a", again, source=s3_source, **attributes)
    plugin.run_sidecar(pod, moto_env())
    assert wait_readable(first) == expected_hashes()
    assert wait_readable(again) == expected_hashes()
    assert wait_readable(second) == {"x.txt": sha256(b"other volume\n")}
    for volume, target in [("vol-a", first), ("vol-b", second), ("vol-a", again)]:
        plugin.unpublish(volume, target)
    assert mounts_under(plugin.base) == []


@needs_sidecar
def test_plugin_restart_keeps_the_sidecar_serving_and_takeover_still_works(
    plugin: Plugin, s3_source: str, s3_server: LocalServer
) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source=s3_source, **s3_attributes(s3_server))
    sidecar = plugin.run_sidecar(pod, moto_env())
    assert wait_readable(target) == expected_hashes()
    wait_log(plugin, "the sidecar serves")

    # The node plugin restarts (a DaemonSet update): the volume keeps serving throughout.
    assert plugin.stop() == 0
    assert read_tree_elsewhere(target) == expected_hashes()
    plugin.start()
    wait_log(plugin, "found vol-a published")
    assert read_tree_elsewhere(target) == expected_hashes()
    assert sidecar.poll() is None

    # The restarted plugin still replaces the mount for a restarted sidecar.
    kill_tree(sidecar)
    plugin.run_sidecar(pod, moto_env())
    wait_log(plugin, "replaced the mount")
    assert wait_readable(target) == expected_hashes()
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_a_refused_or_abandoned_offer_is_offered_again(plugin: Plugin) -> None:
    """A sidecar that answers an error leaves the fd with the plugin for the next one; one
    that goes away without answering may have read requests from it, so the plugin drops it
    and mounts afresh for the next one. The offer carries the options and never a token."""
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(
        pod,
        "vol-a",
        target,
        source="s3://bucket-a/models",
        region="eu-west-1",
        **{"no-sign-request": "true", "csi.storage.k8s.io/serviceAccount.tokens": SECRET},
    )
    path = str(pod.short_fd_dir() / socket_name("vol-a", str(target)))
    offer = fdpass.take(path)
    try:
        assert offer.payload == {
            "version": fdpass.PROTOCOL_VERSION,
            "source": "s3://bucket-a/models",
            "options": {"region": "eu-west-1", "no-sign-request": "true"},
            "volume_id": "vol-a",
            "target_path": str(target),
            "fds": ["fuse"],  # no node cache: the FUSE fd alone
        }
        assert offer.extra == {}
        offer.fail("refused by the test")
    finally:
        offer.close()
    wait_log(plugin, "refused by the test")
    offer = fdpass.take(path)  # offered again, the same mount
    assert mounts_under(plugin.base) == [str(target)]
    assert "replaced the mount" not in plugin.log.read_text()

    # A sidecar that dies with the fd in hand, after its server read the kernel's INIT (and
    # maybe a reader's request): the plugin drops its copy, so the connection ends and the
    # reader fails instead of waiting in the kernel for good.
    reader = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; os.listdir(sys.argv[1])", str(target)],
        stderr=subprocess.DEVNULL,
    )
    try:
        assert len(os.read(offer.fd, 1 << 20)) > 0  # INIT, never answered
        offer.close()  # gone without answering
        assert reader.wait(timeout=30) != 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)
    wait_log(plugin, "the next one gets a fresh mount")
    offer = fdpass.take(path)  # a fresh connection, mounted on top of the dead one
    offer.close()
    wait_log(plugin, "the next one gets a fresh mount", 2)
    assert "replaced the mount" in plugin.log.read_text()
    assert mounts_under(plugin.base) == [str(target), str(target)]
    assert SECRET not in plugin.log.read_text()
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_a_target_unmounted_behind_the_plugin_is_published_again(plugin: Plugin) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    subprocess.run(["umount", "-l", str(target)], check=True)
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")  # a retry
    assert mounts_under(plugin.base) == [str(target)]
    assert "no longer mounted: publishing it again" in plugin.log.read_text()
    plugin.unpublish("vol-a", target)


def test_a_mount_no_sidecar_serves_in_time_ends_instead_of_hanging_host_tools(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar that keeps answering an error (bad credentials) never serves the mount: after
    the wait limit the plugin ends the connection, so a stat of the target on the host fails
    with ENOTCONN instead of blocking, and the next sidecar gets a fresh mount."""
    assert plugin.stop() == 0
    monkeypatch.setenv("OBJFS_CSI_SIDECAR_WAIT_S", "2")
    plugin.start()
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    path = str(pod.short_fd_dir() / socket_name("vol-a", str(target)))
    offer = fdpass.take(path)
    try:
        offer.fail("access denied by the test")
    finally:
        offer.close()
    wait_log(plugin, "access denied by the test")
    wait_log(plugin, "no sidecar served", timeout_s=30)
    code = (
        "import errno, os, sys\n"
        "try:\n"
        "    os.stat(sys.argv[1])\n"
        "except OSError as e:\n"
        "    print(errno.errorcode.get(e.errno, e.errno)); sys.exit(3)\n"
    )
    started = time.monotonic()
    proc = run_reader(code, str(target), timeout_s=20)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout.strip() == "ENOTCONN"
    assert time.monotonic() - started < 10
    proc = run_reader("import os, sys; os.statvfs(sys.argv[1])", str(target), timeout_s=20)
    assert proc.returncode != 0

    # The next sidecar gets a fresh connection, stacked on the dead mount.
    offer = fdpass.take(path)
    try:
        assert len(os.read(offer.fd, 1 << 20)) > 0  # the fresh connection's INIT
    finally:
        offer.close()
    wait_log(plugin, "replaced the mount")
    assert mounts_under(plugin.base) == [str(target), str(target)]
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_an_offer_that_cannot_be_sent_keeps_the_mount(plugin: Plugin) -> None:
    """A sidecar gone before the offer was sent never had the fd: the plugin keeps it (no
    fresh mount) and offers it to the next one."""
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    path = str(pod.short_fd_dir() / socket_name("vol-a", str(target)))
    first = fdpass.take(path)  # the plugin now waits for its answer
    try:
        # A second sidecar connects and goes away while the first one holds the offer: the
        # plugin accepts it only after, and its send fails (EPIPE).
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        gone.connect(path)
        gone.close()
        first.fail("refused by the test")
    finally:
        first.close()
    wait_log(plugin, "could not offer")
    offer = fdpass.take(path)  # the same mount, offered again
    try:
        assert len(os.read(offer.fd, 1 << 20)) > 0  # its INIT, still unread
    finally:
        offer.close()
    log = plugin.log.read_text()
    assert "replaced the mount" not in log
    assert log.count("the next one gets a fresh mount") <= 1
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_an_orphan_objfs_mount_at_the_target_is_replaced_on_publish(plugin: Plugin) -> None:
    """An objfs mount the plugin has no record of (a crash between mount and state file, a
    wiped state directory) is removed and the target published; another file system there is
    still refused."""
    from objfs.csi.fusemount import mount_fd, open_fuse_device

    pod = plugin.pod()
    target = pod.target("models")
    target.mkdir(parents=True)
    fd = open_fuse_device()
    try:
        mount_fd(fd, str(target), "orphan")
    finally:
        os.close(fd)  # nobody serves it: its connection is dead
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    assert mounts_under(plugin.base) == [str(target)]
    assert "did not record" in plugin.log.read_text()
    line = mount_line(target)
    assert line is not None
    assert "orphan" not in line  # the plugin's own mount, not the orphan
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []

    other = pod.target("other")
    other.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(other)], check=True, timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish(pod, "vol-b", other, source="s3://bucket-a/models")
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        umount_all_at(other)
    assert mounts_under(plugin.base) == []


# -- bounds on stacked mounts (issue 30, item 3) ----------------------------------------------


def loop_on_offer_socket(path: str, loops: int) -> int:
    """What a container may do to its pod's 0666 offer socket: connect, read what comes and
    close, ``loops`` times (the fd that comes with an offer is dropped unread, as a plain
    ``recv`` drops it). Returns how many connections got an offer. The plugin takes one
    connection at a time, so when the last ``recv`` returns the plugin has handled every
    earlier connection, and mounts only when it accepts one: the mount count is final."""
    offers = 0
    for _ in range(loops):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(30)
            conn.connect(path)
            offers += bool(conn.recv(4096))
        finally:
            conn.close()
    return offers


def start_with_replace_interval(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch, seconds: str
) -> None:
    assert plugin.stop() == 0
    monkeypatch.setenv("OBJFS_CSI_REPLACE_INTERVAL_S", seconds)
    plugin.start()


def test_a_pod_looping_on_its_offer_socket_gets_a_burst_of_replacements_then_none(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection that leaves with the fd unanswered kills the mount, and the next one
    would get a fresh mount stacked on it: 40 loops stacked 40 mounts before the bound. Now
    the first connection takes the published mount, the next REPLACE_BURST get replacements
    and the rest are closed without an offer (no token comes back within the test: one per
    hour), with one warning."""
    from objfs.csi.publication import REPLACE_BURST

    start_with_replace_interval(plugin, monkeypatch, "3600")
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    path = str(pod.short_fd_dir() / socket_name("vol-a", str(target)))
    assert loop_on_offer_socket(path, 40) == 1 + REPLACE_BURST
    assert mounts_under(plugin.base) == [str(target)] * (1 + REPLACE_BURST)
    assert plugin.log.read_text().count("not replacing the dead mount") == 1
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_replacements_stop_at_the_cap_however_slowly_they_come(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar that keeps dying (OOM-killed at every start) gets replacements at the rate
    the bucket allows, but never more than MAX_REPLACEMENTS stacked on the target: here the
    bucket refills between any two connections (a token per microsecond)."""
    from objfs.csi.publication import MAX_REPLACEMENTS

    start_with_replace_interval(plugin, monkeypatch, "0.000001")
    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    path = str(pod.short_fd_dir() / socket_name("vol-a", str(target)))
    assert loop_on_offer_socket(path, MAX_REPLACEMENTS + 10) == 1 + MAX_REPLACEMENTS
    assert mounts_under(plugin.base) == [str(target)] * (1 + MAX_REPLACEMENTS)
    log = plugin.log.read_text()
    assert log.count("not replacing the dead mount") == 1
    assert "replacements are stacked there already" in log
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []


def test_unpublish_fails_while_a_mount_it_cannot_remove_is_on_top(plugin: Plugin) -> None:
    """A mount objfs did not make, on top of its own: unpublish never answers OK with mounts
    left at the target; once that mount is gone, the kubelet's retry finishes the job."""
    from objfs.csi import fusemount

    pod = plugin.pod()
    target = pod.target("models")
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    # mount(2) itself, not mount(8): nothing may stat the unserved FUSE mount beneath.
    assert fusemount._libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", 0, None) == 0
    try:
        with pytest.raises(grpc.RpcError) as info:
            plugin.unpublish("vol-a", target)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a tmpfs mount that objfs did not make remains at" in info.value.details()
        assert "\n" not in info.value.details()
        assert len(mounts_under(plugin.base)) == 2
    finally:
        fusemount.detach(str(target))
    plugin.unpublish("vol-a", target)
    assert mounts_under(plugin.base) == []
    assert not target.exists()


def test_unpublish_fails_while_objfs_mounts_remain_past_max_stacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More objfs mounts stacked than one unpublish detaches (MAX_STACKED, lowered here to 2):
    FAILED_PRECONDITION with the mounts left, not OK; the next call removes the rest."""
    from objfs.csi import fusemount
    from objfs.csi.node import Node
    from objfs.csi.publication import CsiError

    base = Path(tempfile.mkdtemp(prefix="objfs-csi-", dir="/tmp"))
    target = base / "kubelet" / "pods" / "p" / "volumes" / "kubernetes.io~csi" / "v" / "mount"
    target.mkdir(parents=True)
    try:
        for _ in range(3):
            fd = fusemount.open_fuse_device()
            try:
                fusemount.mount_fd(fd, str(target), "stacked-by-the-test")
            finally:
                os.close(fd)  # nobody serves it: a dead mount
        monkeypatch.setattr(fusemount, "MAX_STACKED", 2)
        node = Node("node-1", str(base / "kubelet"))
        request = proto.message_class("NodeUnpublishVolumeRequest")(
            volume_id="vol-a", target_path=str(target)
        )
        with pytest.raises(CsiError) as info:
            node.unpublish(request)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "objfs mounts remain at" in str(info.value)
        assert mounts_under(base) == [str(target)]
        node.unpublish(request)
        assert mounts_under(base) == []
        assert not target.exists()
    finally:
        lazy_umount_all(base)
        if not mounts_under(base):
            shutil.rmtree(base, ignore_errors=True)


# -- values that read as options (issue 30, item 11) ------------------------------------------

DASHED = [
    ({"source": "-h"}, "'source' may not start with '-'"),
    ({"source": "--help"}, "'source' may not start with '-'"),
    ({"source": " -h "}, "'source' may not start with '-'"),
    ({"source": "s3://bucket-a", "region": "-x"}, "'region': a value may not start with '-'"),
    ({"source": "s3://bucket-a", "region": "-h"}, "'region': a value may not start with '-'"),
    ({"source": "s3://bucket-a", "log-level": "--help"}, "'log-level': a value may not start"),
]


@pytest.mark.parametrize(("context", "message"), DASHED)
def test_a_value_that_starts_with_a_dash_is_refused(
    context: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``source: -h`` reached argparse's help action: 7 KB of help on stdout and
    SystemExit(0) instead of an error."""
    with pytest.raises(VolumeContextError, match=message) as info:
        parse_volume_context({**POD, **context}, "/k/pods/x/volumes/kubernetes.io~csi/m/mount")
    assert "\n" not in str(info.value)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("argv", [["-h", "/t"], ["s3://bucket-a", "/t", "--help"]])
def test_parsing_the_mount_options_never_prints_or_exits(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever reaches the option parser (past the checks above), its help action raises a
    VolumeContextError: no help printed, no SystemExit."""
    from objfs.csi.volume import _check_mount_argv

    with pytest.raises(VolumeContextError, match="the help option -h"):
        _check_mount_argv(argv)
    assert capsys.readouterr() == ("", "")


def test_a_dashed_value_gets_invalid_argument_and_the_plugin_carries_on(plugin: Plugin) -> None:
    pod = plugin.pod()
    target = pod.target("models")
    before = plugin.log.read_text()
    for context, message in DASHED:
        with pytest.raises(grpc.RpcError) as info:
            plugin.publish(pod, "vol-a", target, **context)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert message in info.value.details()
        assert plugin.proc is not None
        assert plugin.proc.poll() is None
    assert mounts_under(plugin.base) == []
    # The plugin's stdout and stderr both go to its log: no help or usage text came out.
    added = plugin.log.read_text().removeprefix(before)
    assert "usage:" not in added
    assert "show this help message" not in added
    # Still serving: a good publish goes through.
    plugin.publish(pod, "vol-a", target, source="s3://bucket-a/models")
    assert mounts_under(plugin.base) == [str(target)]
    plugin.unpublish("vol-a", target)
