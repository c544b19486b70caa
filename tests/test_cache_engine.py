"""Data GETs through a shared cache engine (``--cache-proxy``): the shipped nginx
configuration (``k8s/cache-engine/nginx.conf.template``) run for real in front of moto, with a
counting proxy between nginx and moto that sees every byte the origin sends.

What is checked: two nodes (two mounts, each with its own disk cache) loading the same files
at once fetch them about once from the origin, byte-exact; the engine killed in the middle of
a load costs no error (the store answers directly); an object replaced between two loads is
never served the old version's bytes; no signature reaches a log; the engine's address is
checked at the command line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.cache_engine import CacheEngine, parse_engine_url
from objfs.errors import UsageError
from tests.conftest import Mount, fresh_status, load_at_once, put_many, run_objfs, sha256
from tests.helpers.proxy import Proxy

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "k8s" / "cache-engine" / "nginx.conf.template"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
PART = "4M"  # the mounts' --part-size and the engine's slice size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render(run_dir: Path, origin_port: int, listen: int, cache: int) -> Path:
    """The shipped template for one instance on loopback in front of ``origin_port``."""
    return render_conf(
        run_dir, f"127.0.0.1:{origin_port}", f"127.0.0.1:{listen}", f"127.0.0.1:{cache}"
    )


def render_conf(
    run_dir: Path,
    origin: str,
    listen: str,
    cache: str,
    nodes: list[str] | None = None,
    slice_size: str = PART,
) -> Path:
    """The shipped template as envsubst would fill it: the router on ``listen``, the cache
    server on ``cache``, slices hashed over ``nodes`` (the cache servers of every instance,
    this one alone by default), the store at ``origin`` (host:port, http)."""
    values = {
        "LISTEN_PORT": listen,
        "CACHE_PORT": cache,
        "CACHE_NODES": " ".join(f"server {n};" for n in (nodes or [cache])),
        "ORIGIN_URL": f"http://{origin}",
        "ORIGIN_HOST": origin,
        "CACHE_DIR": str(run_dir / "cache"),
        "CACHE_MAX_SIZE": "1g",
        "SLICE_SIZE": slice_size.lower(),
        "RUN_DIR": str(run_dir),
    }
    text = TEMPLATE.read_text()
    for name, value in values.items():
        text = text.replace("${" + name + "}", value)
    assert "${" not in text.split("# Security")[1], "a placeholder was left unfilled"
    conf = run_dir / "nginx.conf"
    conf.write_text(text)
    return conf


class Engine:
    """nginx with the shipped configuration, in front of ``origin``; ``url`` is the router."""

    def __init__(self, run_dir: Path, origin: Proxy) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.listen, self.cache = _free_port(), _free_port()
        self.conf = render(run_dir, origin.port, self.listen, self.cache)
        self.url = f"http://127.0.0.1:{self.listen}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            # As root, workers run as root too: the cache folder is under pytest's private
            # tmp. Its own session, so that kill() ends the workers with the master.
            [NGINX, "-c", str(self.conf), "-p", str(self.run_dir), "-g", "daemon off; user root;"],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.listen), timeout=0.5).close()
                return
            except OSError:
                assert self.proc.poll() is None, self.proc.communicate()[1].decode()
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to nginx's process group: the master and its workers (ours, by PID)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def access_log(self) -> str:
        path = self.run_dir / "access.log"
        return path.read_text() if path.exists() else ""


@pytest.fixture
def origin(s3_server: Any) -> Iterator[Proxy]:
    """A counting proxy in front of moto: the store as objfs and the engine see it."""
    port = int(s3_server.url.rsplit(":", 1)[1])
    with Proxy(port) as proxy:
        yield proxy


@pytest.fixture
def engine(origin: Proxy, tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path / "nginx", origin)
    e.start()
    try:
        yield e
    finally:
        e.kill()


def _node(mount_s3: Any, bucket: str, origin: Proxy, engine: Engine, name: str, tmp: Path) -> Mount:
    m: Mount = mount_s3(
        f"s3://{bucket}/m",
        "--endpoint-url",
        origin.url,
        "--cache-proxy",
        engine.url,
        "--part-size",
        PART,
        "--cache-dir",
        str(tmp / f"cache-{name}"),
        "--metadata-ttl",
        "1",
    )
    return m


# -- the engine's address and state ------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("http://cache:8080", "http://cache:8080"),
        ("https://cache.example/objfs/", "https://cache.example/objfs"),
        (" http://10.0.0.1 ", "http://10.0.0.1"),
    ],
)
def test_an_engine_address_is_kept_without_a_trailing_slash(value: str, expected: str) -> None:
    assert parse_engine_url(value) == expected


@pytest.mark.parametrize(
    "value",
    ["cache:8080", "ftp://cache", "http://u:p@cache", "http://cache/?x=1", "http://c:99999"],
)
def test_a_bad_engine_address_is_a_usage_error(value: str) -> None:
    with pytest.raises(UsageError, match="--cache-proxy"):
        parse_engine_url(value)


def test_a_failed_engine_is_left_alone_then_tried_again() -> None:
    e = CacheEngine("http://cache:8080", retry_after_s=0.2)
    signed = "https://store:9000/bucket/key?X-Amz-Signature=abc&X-Amz-Credential=x"
    assert e.route(signed) == "http://cache:8080/bucket/key?X-Amz-Signature=abc&X-Amz-Credential=x"
    e.failed("connection refused")
    assert e.route(signed) is None
    time.sleep(0.25)
    assert e.route(signed) is not None
    e.served(5)
    e.direct(7)
    e.signed()
    assert e.statistics() == {
        "bytes_via_engine": 5,
        "bytes_direct": 7,
        "failures": 1,
        "urls_signed": 1,
        "down": 0,
    }


def test_the_command_refuses_a_bad_engine_address(mnt: Path) -> None:
    res = run_objfs("mount", "s3://models/m", str(mnt), "--cache-proxy", "cache:8080")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1
    assert "--cache-proxy" in res.stderr


# -- the shipped nginx configuration --------------------------------------------------------------


def test_the_shipped_nginx_configuration_is_valid(tmp_path: Path) -> None:
    conf = render(tmp_path, 9000, _free_port(), _free_port())
    res = subprocess.run(
        [NGINX, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    text = conf.read_text()
    assert "$args" not in text
    assert "$request_uri" not in text
    assert "$query_string" not in text
    assert "proxy_cache_key $uri|$http_if_match|$http_range;" in text


# -- through a real engine -----------------------------------------------------------------------


def test_two_nodes_loading_at_once_fetch_the_files_once_from_the_origin(
    s3: Any, bucket: str, origin: Proxy, engine: Engine, mount_s3: Any, tmp_path: Path
) -> None:
    files = {f"m/shard{i}.bin": os.urandom(24 * MiB + 1000 * i) for i in range(2)}
    put_many(s3, bucket, files)
    nodes = [_node(mount_s3, bucket, origin, engine, n, tmp_path) for n in ("a", "b")]
    origin.reset_stats()
    assert load_at_once(nodes, {key[2:]: data for key, data in files.items()}) == []
    total = sum(len(d) for d in files.values())
    sent = origin.stats.response_bytes
    assert sent <= 1.1 * total, f"the origin sent {sent / total:.2f}x the files"
    for m in nodes:
        status = fresh_status(m.path)
        assert status["cache_engine"]["bytes_via_engine"] == total
        assert status["cache_engine"]["failures"] == 0
    # Every range asked of the engine (objfs's) and of its cache server (the router's
    # slices) lies within one part, from a block boundary: the engine fetches each part of
    # the store once, whole.
    ranges = re.findall(r"range=bytes=(\d+)-(\d+)", engine.access_log())
    assert len(ranges) >= 2 * total // (4 * MiB)
    for first, last in ((int(a), int(b)) for a, b in ranges):
        assert first % MiB == 0, (first, last)
        assert first // (4 * MiB) == last // (4 * MiB), (first, last)
    # No signature in any log: objfs's nor the engine's.
    for text in (engine.access_log(), *(m.log() for m in nodes)):
        assert "X-Amz-Signature" not in text
        assert "Signature=" not in text


def test_the_engine_killed_in_the_middle_of_a_load_costs_no_error(
    s3: Any, bucket: str, origin: Proxy, engine: Engine, mount_s3: Any, tmp_path: Path
) -> None:
    data = os.urandom(40 * MiB + 77)
    put_many(s3, bucket, {"m/big.bin": data})
    m = _node(mount_s3, bucket, origin, engine, "a", tmp_path)
    with open(m.path / "big.bin", "rb") as f:
        head = f.read(8 * MiB)
        engine.kill()
        rest = f.read()
    assert sha256(head + rest) == sha256(data)
    status = fresh_status(m.path)
    assert status["cache_engine"]["failures"] >= 1
    assert status["cache_engine"]["bytes_direct"] > 0
    assert "cache engine" in m.log()
    assert "reading from the store directly" in m.log()


def test_a_replaced_object_is_never_served_the_old_versions_bytes(
    s3: Any, bucket: str, origin: Proxy, engine: Engine, mount_s3: Any, tmp_path: Path
) -> None:
    old, new = os.urandom(10 * MiB), os.urandom(10 * MiB)
    put_many(s3, bucket, {"m/r.bin": old})
    a = _node(mount_s3, bucket, origin, engine, "a", tmp_path)
    assert sha256((a.path / "r.bin").read_bytes()) == sha256(old)
    s3.put_object(Bucket=bucket, Key="m/r.bin", Body=new)
    b = _node(mount_s3, bucket, origin, engine, "b", tmp_path)
    assert sha256((b.path / "r.bin").read_bytes()) == sha256(new)
    time.sleep(1.5)  # past node a's metadata TTL
    assert sha256((a.path / "r.bin").read_bytes()) == sha256(new)


def test_engine_process_is_ours(engine: Engine) -> None:
    """The fixture's nginx runs in the foreground as this test's child, and stops with it."""
    assert engine.proc is not None
    assert engine.proc.poll() is None
    engine.proc.send_signal(signal.SIGTERM)
    assert engine.proc.wait(timeout=15) == 0
