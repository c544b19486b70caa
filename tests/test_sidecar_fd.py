"""``objfs sidecar --fd-dir``: an unprivileged sidecar serves FUSE fds mounted by someone else.

The test plays the node plugin (``objfs csi``): it opens /dev/fuse, mounts a target read-only
with ``fd=N`` and offers the fd on ``DIR/NAME.sock`` (objfs/fdpass.py); when the sidecar's
connection ends, the next connection gets a fresh mount of the same target, as the node plugin
does. The sidecar runs as uid 65534 with no capabilities and ``no_new_privs`` (setpriv).

Nothing here stats a target before the sidecar answers ``ok`` (the kernel would wait for a
server that does not exist yet); mounts are checked in /proc/self/mountinfo, and every file is
read by another process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from objfs import fdpass, sidecar_fd
from objfs.csi import fusemount
from objfs.demo import LocalServer
from objfs.errors import UsageError
from objfs.sidecar_fd import READY_FILE, STATUS_FILE, mount_arguments
from tests.conftest import run_objfs, sha256

NOBODY = 65534
SETPRIV = [
    "setpriv",
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
    "--no-new-privs",
]
WAIT_S = 60.0


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts with fd= need root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]


def mountinfo_targets() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split()[4] for line in f]


def is_mounted(target: str) -> bool:
    return target in mountinfo_targets()


def fuse_mount(target: str) -> int:
    """What the node plugin does: open /dev/fuse and mount ``target`` with ``fd=N``."""
    fd = fusemount.open_fuse_device()
    try:
        fusemount.mount_fd(fd, target, "objfs-test")
    except OSError:
        os.close(fd)
        raise
    return fd


def lazy_umount(target: str) -> None:
    fusemount.detach_all(target)


class FakeNodePlugin:
    """One published volume: a target mounted with fd=N, offered on ``fd_dir/name``."""

    def __init__(self, fd_dir: Path, name: str, target: Path, payload: dict[str, Any]) -> None:
        self.target = str(target)
        self.sock_path = str(fd_dir / name)
        self.payload = {"volume_id": name, "target_path": self.target, **payload}
        self.replies: list[str | None] = []  # None: "ok"; else the error message
        self.eofs = 0
        self.fd: int | None = fuse_mount(self.target)
        self.stale = False
        self.stop = threading.Event()
        self.listener = self._listen()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)
        listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o666)
        listener.listen(4)
        listener.settimeout(0.2)
        return listener

    def rebind(self) -> None:
        """What a restarted node plugin does: bind the same socket name anew."""
        old, self.listener = self.listener, self._listen()
        old.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                continue  # rebound, or closed on the way out
            with conn:
                self._offer(conn)

    def _offer(self, conn: socket.socket) -> None:
        if self.fd is None:  # the last sidecar went away: replace its dead mount
            lazy_umount(self.target)
            self.fd = fuse_mount(self.target)
        fdpass.send_offer(conn, {"fuse": self.fd}, self.payload)
        try:
            reply = fdpass.read_reply(conn, WAIT_S)
        except fdpass.FdPassError as exc:
            self.replies.append(f"protocol error: {exc}")
            return
        self.replies.append(reply)
        if reply is not None:
            return  # not served: offer the same mount again on the next connection
        os.close(self.fd)  # the sidecar's child holds the only fd now
        self.fd = None
        conn.settimeout(0.2)
        while not self.stop.is_set():
            try:
                if not conn.recv(1):
                    self.eofs += 1
                    return
            except TimeoutError:
                continue
            except OSError:
                self.eofs += 1
                return

    def wait_replies(self, count: int) -> list[str | None]:
        deadline = time.monotonic() + WAIT_S
        while len(self.replies) < count:
            assert time.monotonic() < deadline, f"only {self.replies} from the sidecar"
            time.sleep(0.05)
        return self.replies

    def wait_eofs(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.eofs < count:
            assert time.monotonic() < deadline, "the sidecar's connection stayed open"
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        lazy_umount(self.target)


class Env:
    """A world readable folder with the fd dir (owned by nobody) and the targets."""

    def __init__(self, base: Path, server: LocalServer) -> None:
        self.base = base
        self.server = server
        self.fd_dir = base / "objfs-fd"
        self.fd_dir.mkdir(mode=0o755)
        os.chown(self.fd_dir, NOBODY, NOBODY)
        self.nodes: list[FakeNodePlugin] = []
        self.sidecars: list[subprocess.Popen[bytes]] = []
        self.log_path = base / "sidecar.log"

    def publish(self, name: str, source: str, **options: str) -> FakeNodePlugin:
        target = self.base / name.removesuffix(".sock")
        target.mkdir(mode=0o755)
        opts = {"endpoint-url": self.server.url, **options}
        node = FakeNodePlugin(self.fd_dir, name, target, {"source": source, "options": opts})
        self.nodes.append(node)
        return node

    def start_sidecar(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "HOME": "/nonexistent", "OBJFS_LOG_LEVEL": "debug"}
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                [*SETPRIV, sys.executable, "-m", "objfs", "sidecar", "--fd-dir", str(self.fd_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd="/",
            )
        self.sidecars.append(proc)
        return proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        for proc in self.sidecars:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for node in self.nodes:
            node.close()


@pytest.fixture
def env(s3_server: LocalServer) -> Iterator[Env]:
    base = Path(tempfile.mkdtemp(prefix="objfs-fd-test-"))
    base.chmod(0o755)  # nobody must reach the fd dir; pytest's tmp_path is 0700
    world = Env(base, s3_server)
    try:
        yield world
    finally:
        try:
            world.close()
        finally:
            left = [t for t in mountinfo_targets() if t.startswith(str(base))]
            for target in left:
                lazy_umount(target)
            shutil.rmtree(base, ignore_errors=True)
        assert not left, f"left mounted: {left}"


def read_file(path: str) -> tuple[int, bytes, str]:
    """(returncode, bytes, stderr) of ``cat path`` in another process."""
    proc = subprocess.run(["cat", path], capture_output=True, timeout=60, check=False)
    return proc.returncode, proc.stdout, proc.stderr.decode(errors="replace")


def read_errno(path: str) -> int | str:
    """0 and the sha256 if a read in another process succeeds, else the errno it got."""
    code = (
        "import hashlib, sys\n"
        "try:\n"
        "    data = open(sys.argv[1], 'rb').read()\n"
        "except OSError as e:\n"
        "    print(e.errno); sys.exit(0)\n"
        "print('ok', hashlib.sha256(data).hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[1] if out[0] == "ok" else int(out[0])


def privileges(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()[0] if value.split() else ""
    return fields


def put(s3: Any, bucket: str, objects: dict[str, bytes]) -> None:
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)


def assert_unprivileged(pid: int) -> None:
    p = privileges(pid)
    assert p["Uid"] == str(NOBODY), p
    assert p["Gid"] == str(NOBODY), p
    assert int(p["CapEff"], 16) == 0, p
    assert int(p["CapPrm"], 16) == 0, p
    assert int(p["CapBnd"], 16) == 0, p
    assert p["NoNewPrivs"] == "1", p


# -- tests -----------------------------------------------------------------------------------


def test_serves_an_offered_fd_byte_exact_with_no_privileges(env: Env, s3: Any, bucket: str) -> None:
    big = os.urandom(9 * 1024 * 1024 + 123)
    put(s3, bucket, {"models/m/weights.bin": big, "models/m/config.json": b'{"a": 1}\n'})
    node = env.publish("vol.sock", f"s3://{bucket}/models", **{"metadata-ttl": "indefinite"})
    sidecar = env.start_sidecar()
    assert node.wait_replies(1) == [None], env.log()

    rc, data, err = read_file(f"{node.target}/m/weights.bin")
    assert rc == 0, err
    assert sha256(data) == sha256(big)
    assert read_file(f"{node.target}/m/config.json")[1] == b'{"a": 1}\n'
    assert sorted(os.listdir(f"{node.target}/m")) == ["config.json", "weights.bin"]

    # The sidecar and the child that serves: nobody, no capabilities, no_new_privs.
    children = psutil.Process(sidecar.pid).children()
    assert len(children) == 1
    for pid in (sidecar.pid, children[0].pid):
        assert_unprivileged(pid)

    # Readiness and status live in the fd dir (the root file system is read-only in a pod).
    assert (env.fd_dir / READY_FILE).exists()
    deadline = time.monotonic() + 10
    while True:
        status = json.loads((env.fd_dir / STATUS_FILE).read_text())
        if status["volumes"]["vol.sock"]["state"] == "serving" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["volumes"]["vol.sock"]["state"] == "serving"
    assert status["volumes"]["vol.sock"]["source"] == f"s3://{bucket}/models"
    assert run_objfs("status", "--probe", str(env.fd_dir)).returncode == 0
    assert "serving" in run_objfs("status", str(env.fd_dir)).stdout

    # A restarted node plugin binds the socket anew: the serving child is left alone.
    node.rebind()
    time.sleep(2)
    assert [c.pid for c in psutil.Process(sidecar.pid).children()] == [children[0].pid]
    assert sha256(read_file(f"{node.target}/m/weights.bin")[1]) == sha256(big)
    assert node.replies == [None]


def test_a_socket_gone_briefly_leaves_its_child_serving(env: Env, s3: Any, bucket: str) -> None:
    data = os.urandom(1024 * 1024)
    put(s3, bucket, {"p/file.bin": data})
    node = env.publish("vol.sock", f"s3://{bucket}/p")
    sidecar = env.start_sidecar()
    assert node.wait_replies(1) == [None], env.log()
    children = [c.pid for c in psutil.Process(sidecar.pid).children()]
    assert len(children) == 1

    # A restarting node plugin: the socket file is gone for a few scans, then bound anew.
    os.unlink(node.sock_path)
    time.sleep(1.5)
    node.rebind()
    time.sleep(sidecar_fd._GONE_AFTER_S + 1)
    assert [c.pid for c in psutil.Process(sidecar.pid).children()] == children, env.log()
    assert read_errno(f"{node.target}/file.bin") == sha256(data)
    assert node.replies == [None]
    assert "was removed" not in env.log()


def test_two_volumes_at_once_and_sigterm_stops_both(env: Env, s3: Any, bucket: str) -> None:
    a, b = os.urandom(3 * 1024 * 1024), os.urandom(700_000)
    put(s3, bucket, {"a/file.bin": a, "b/file.bin": b})
    node_a = env.publish("a.sock", f"s3://{bucket}/a")
    node_b = env.publish("b.sock", f"s3://{bucket}/b")
    sidecar = env.start_sidecar()
    assert node_a.wait_replies(1) == [None], env.log()
    assert node_b.wait_replies(1) == [None], env.log()
    assert sha256(read_file(f"{node_a.target}/file.bin")[1]) == sha256(a)
    assert sha256(read_file(f"{node_b.target}/file.bin")[1]) == sha256(b)
    children = psutil.Process(sidecar.pid).children()
    assert len(children) == 2

    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0, env.log()
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    node_a.wait_eofs(1)
    node_b.wait_eofs(1)
    # The mounts stay until the node plugin unpublishes them; nobody serves them any more.
    for node in (node_a, node_b):
        assert is_mounted(node.target)
        assert read_errno(f"{node.target}/file.bin") in (errno.ENOTCONN, errno.ECONNABORTED)
    assert not (env.fd_dir / READY_FILE).exists()
    assert "stopping every mount" in env.log()


def test_killed_sidecar_fails_reads_and_a_restarted_one_takes_over(
    env: Env, s3: Any, bucket: str
) -> None:
    data = os.urandom(5 * 1024 * 1024)
    put(s3, bucket, {"p/file.bin": data})
    node = env.publish("vol.sock", f"s3://{bucket}/p")
    sidecar = env.start_sidecar()
    assert node.wait_replies(1) == [None], env.log()
    path = f"{node.target}/file.bin"
    assert read_errno(path) == sha256(data)

    sidecar.kill()
    sidecar.wait(10)
    # Its child follows it (PR_SET_PDEATHSIG); reads then fail, and never return wrong bytes.
    deadline = time.monotonic() + WAIT_S
    while (result := read_errno(path)) == sha256(data):
        assert time.monotonic() < deadline, "the mount still serves after the sidecar died"
        time.sleep(0.1)
    assert result in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO), result
    node.wait_eofs(1)

    # A new sidecar connects; the node plugin replaces the dead mount and offers it.
    env.start_sidecar()
    assert node.wait_replies(2) == [None, None], env.log()
    assert read_errno(path) == sha256(data)


def test_bad_offers_are_answered_with_an_error_and_retried(env: Env, s3: Any, bucket: str) -> None:
    put(s3, bucket, {"p/x.txt": b"x"})
    unknown = env.publish("unknown.sock", f"s3://{bucket}/p", **{"bogus-option": "1"})
    flag = env.publish("flag.sock", f"s3://{bucket}/p", **{"allow-other": "maybe"})
    missing = env.publish("missing.sock", f"s3://{bucket}-missing/p")
    good = env.publish("good.sock", f"s3://{bucket}/p")
    sidecar = env.start_sidecar()
    assert good.wait_replies(1) == [None], env.log()
    assert "unknown option 'bogus-option'" in str(unknown.wait_replies(1)[0])
    assert "is a flag" in str(flag.wait_replies(1)[0])
    assert str(missing.wait_replies(1)[0]).startswith("bucket "), env.log()
    assert "does not exist" in str(missing.replies[0])
    # Retried with backoff: the same fd is offered again and refused again.
    assert "bogus-option" in str(unknown.wait_replies(2)[1])
    assert read_file(f"{good.target}/x.txt")[1] == b"x"
    assert not (env.fd_dir / READY_FILE).exists()
    assert sidecar.poll() is None

    # Unpublish the good volume: the socket goes away and its child stops.
    child = psutil.Process(sidecar.pid).children()
    good.close()
    deadline = time.monotonic() + WAIT_S
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in child):
        assert time.monotonic() < deadline, "the child of an unpublished volume still runs"
        time.sleep(0.1)
    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0, env.log()


def test_stale_socket_is_skipped_quietly(env: Env, s3: Any, bucket: str) -> None:
    put(s3, bucket, {"p/x.txt": b"x"})
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(env.fd_dir / "stale.sock"))
    stale.close()  # a socket file nobody listens on
    (env.fd_dir / "stale.sock").chmod(0o666)
    node = env.publish("vol.sock", f"s3://{bucket}/p")
    sidecar = env.start_sidecar()
    assert node.wait_replies(1) == [None], env.log()
    deadline = time.monotonic() + 10
    while not (env.fd_dir / READY_FILE).exists():
        assert time.monotonic() < deadline, "a stale socket kept the sidecar from being ready"
        time.sleep(0.1)
    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert "WARNING" not in env.log()


def test_bad_fd_dir_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_objfs("sidecar", "--fd-dir", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "is not a directory" in proc.stderr
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    proc = subprocess.run(
        [*SETPRIV, sys.executable, "-m", "objfs", "sidecar", "--fd-dir", str(locked)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        check=False,
    )
    # tmp_path is 0700 for root: nobody cannot reach it either way.
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "objfs: error:" in proc.stderr


def test_mount_of_a_passed_fd_needs_foreground_and_a_fuse_fd(bucket: str) -> None:
    proc = run_objfs("mount", f"s3://{bucket}", "/dev/fd/5")
    assert proc.returncode == 2
    assert "--foreground" in proc.stderr
    assert proc.stderr.count("\n") == 1
    proc = run_objfs("mount", f"s3://{bucket}", "/dev/fd/57", "--foreground")
    assert proc.returncode == 2
    assert "fd 57 is not open" in proc.stderr
    assert proc.stderr.count("\n") == 1
    proc = run_objfs("mount", f"s3://{bucket}", "/dev/fd/0", "--foreground")
    assert proc.returncode == 2
    assert "is not /dev/fuse" in proc.stderr


def test_mount_arguments_follow_objfs_mount() -> None:
    argv = mount_arguments(
        "s3://b/p",
        {
            "region": "eu-west-1",
            "no-force-path-style": "true",
            "allow-other": "false",
            "no-sign-request": "false",
            "cache-dir": "-odd",
            "csi.storage.k8s.io/pod.uid": "1234",
        },
    )
    assert mount_arguments("s3://b/p", {"force-path-style": "false"}) == ["--no-force-path-style"]
    assert mount_arguments("s3://b/p", {"no-force-path-style": "false"}) == ["--force-path-style"]
    assert mount_arguments("s3://b/p", {"no-sign-request": "true"}) == ["--no-sign-request"]
    assert argv == [
        "--cache-dir=-odd",
        "--no-force-path-style",
        "--region=eu-west-1",
    ]
    for bad, message in (
        ({"bogus": "1"}, "unknown option"),
        ({"foreground": "true"}, "unknown option"),
        ({"daemon-ready-fd": "3"}, "unknown option"),
        ({"allow-other": "perhaps"}, "is a flag"),
        ({"log-level": "loud"}, "invalid choice"),
        ({"max-connections": "many"}, "invalid int"),
    ):
        with pytest.raises(UsageError, match=message):
            mount_arguments("s3://b/p", bad)


# -- `error` only for an fd nothing read --------------------------------------------------------


def run_child(fd: int, source: str, marker: Path, url: str) -> subprocess.Popen[bytes]:
    """The sidecar's child command, serving ``fd``; it marks ``marker`` before pyfuse3.init."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            sidecar_fd._CHILD_CODE,
            "mount",
            source,
            f"/dev/fd/{fd}",
            f"--endpoint-url={url}",
            "--foreground",
        ],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={
            **os.environ,
            "OBJFS_RUNTIME_DIR": str(marker.parent),
            sidecar_fd._FD_USED_ENV: str(marker),
        },
    )


def test_the_child_marks_its_fd_before_init_and_only_then(
    tmp_path: Path, s3_server: LocalServer, s3: Any, bucket: str
) -> None:
    put(s3, bucket, {"p/x.txt": b"x"})
    target = tmp_path / "target"
    target.mkdir()
    fd = fuse_mount(str(target))
    try:
        # Refused by the store check, before the FUSE session: no mark, the fd is untouched.
        marker = tmp_path / "missing" / sidecar_fd.FD_USED_FILE
        marker.parent.mkdir()
        proc = run_child(fd, f"s3://{bucket}-missing/p", marker, s3_server.url)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert b"does not exist" in err
        assert not marker.exists()

        # Past the check: the mark is there before it serves (its status file appears).
        marker = tmp_path / "good" / sidecar_fd.FD_USED_FILE
        marker.parent.mkdir()
        proc = run_child(fd, f"s3://{bucket}/p", marker, s3_server.url)
        try:
            deadline = time.monotonic() + WAIT_S
            while not any(n.endswith(".json") for n in os.listdir(marker.parent)):
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the child did not serve"
                time.sleep(0.05)
            assert marker.exists()
        finally:
            proc.kill()
            proc.communicate(timeout=30)
    finally:
        os.close(fd)
        lazy_umount(str(target))


class _FakeChildWorld:
    """An in-process sidecar with one child (any command) whose offer comes on a socketpair."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sidecar = sidecar_fd.FdSidecar(str(base), str(base))
        self.node_end, conn = socket.socketpair()
        self.node_end.settimeout(WAIT_S)
        self.offer = fdpass.Offer(fd=-1, payload={"source": "s3://b/p"}, conn=conn)
        self.run_dir = base / "run"
        self.run_dir.mkdir()

    def start(self, code: str) -> sidecar_fd._Child:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=self.run_dir)
        child = sidecar_fd._Child(
            name="v.sock",
            proc=proc,
            offer=self.offer,
            source="s3://b/p",
            volume_id="v",
            run_dir=str(self.run_dir),
            started_at=time.monotonic(),
        )
        self.sidecar.children.append(child)
        return child

    def answer(self) -> bytes:
        """What the node plugin reads: b"" is end of file without an answer."""
        deadline = time.monotonic() + WAIT_S
        while self.sidecar.children:
            assert time.monotonic() < deadline, "the child was never reaped"
            self.sidecar._check_children()
            time.sleep(0.05)
        return self.node_end.recv(4096)

    def close(self) -> None:
        for child in self.sidecar.children:
            child.proc.kill()
            child.proc.wait()
        self.node_end.close()
        self.offer.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[_FakeChildWorld]:
    world = _FakeChildWorld(tmp_path)
    try:
        yield world
    finally:
        world.close()


MARK = f"open({sidecar_fd.FD_USED_FILE!r}, 'w').close()\n"


def test_a_child_that_fails_before_init_is_answered_with_its_error(
    fake: _FakeChildWorld,
) -> None:
    fake.start(
        "import sys; print('objfs: error: bucket b does not exist', file=sys.stderr); sys.exit(5)"
    )
    assert fake.answer().startswith(b"error objfs mount stopped (exit status 5)")


@pytest.mark.parametrize(
    "code",
    [
        # Died after init, before the sidecar saw it serve (OOM, a crash): its status file may
        # even be there already.
        MARK + "open('objfs.json', 'w').close(); import os; os.kill(os.getpid(), 9)",
        MARK + "import sys; sys.exit(1)",
        MARK + "import sys; sys.exit(2)",
    ],
)
def test_a_child_that_may_have_read_its_fd_gets_no_answer(fake: _FakeChildWorld, code: str) -> None:
    fake.start(code)
    assert fake.answer() == b""


def test_a_child_that_does_not_serve_in_time_is_answered_only_if_it_never_read_the_fd(
    fake: _FakeChildWorld,
) -> None:
    # Stuck before init (say, in the store check): stopped, then answered with an error.
    child = fake.start("import time; time.sleep(60)")
    child.started_at -= sidecar_fd._READY_TIMEOUT_S + 1
    assert fake.answer().startswith(b"error objfs did not serve within")


def test_a_child_stopped_after_init_gets_no_answer(fake: _FakeChildWorld) -> None:
    child = fake.start(MARK + "import time; time.sleep(60)")
    deadline = time.monotonic() + WAIT_S
    while not (fake.run_dir / sidecar_fd.FD_USED_FILE).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.started_at -= sidecar_fd._READY_TIMEOUT_S + 1
    assert fake.answer() == b""
