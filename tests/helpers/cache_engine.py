"""The cache engine's nginx configuration as the Helm chart renders it (k8s/charts/objfs,
files/nginx.conf), for the tests and benchmarks that run it: rendered by Helm's engine with
the values a test gives, its three runtime placeholders filled as the StatefulSet's start
script fills them, and nginx started the way that script starts it (in its run folder).

A test on one machine changes only what a cluster gives each instance for itself: its
peers' addresses (``peers``: each ``set $objfs_peer`` target in order, instead of names
through a resolver; tests/test_cache_engine.py also runs the names through a DNS server) and,
where instances share ports on loopback, the address each listens on.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import chart

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
PEER_LINE = re.compile(r"^(\s*set \$objfs_peer )(\S+);$", re.M)
# The start script's envsubst list (statefulset.yaml).
PLACEHOLDERS = ("RESOLVER", "POD_NAMESPACE", "CACHE_DIR")


def render_chart(values: dict[str, Any], namespace: str = "objfs") -> dict[str, str]:
    """Every template of the chart rendered with ``values`` (:func:`chart.render`), by its
    path in the chart; the engine's namespace by default."""
    return chart.render(values, namespace=namespace)


def merged_engine_values(values: dict[str, Any]) -> dict[str, Any]:
    """``cacheEngine`` of the chart's defaults with ``values`` over them."""
    merged: dict[str, Any] = chart.chart().merge_values(values)["cacheEngine"]
    return merged


def engine_values(**cache_engine: Any) -> dict[str, Any]:
    return {"cacheEngine": {"enabled": True, **cache_engine}}


def rendered_template(values: dict[str, Any] | None = None, namespace: str = "objfs") -> str:
    """The ConfigMap's nginx.conf.template: the configuration with its placeholders."""
    rendered = render_chart(values or engine_values(), namespace)
    text = rendered["templates/cache-engine/configmap.yaml"]
    doc = yaml.safe_load(text)
    return str(doc["data"]["nginx.conf.template"])


def fill(template: str, env: dict[str, str]) -> str:
    """envsubst '${RESOLVER} ${POD_NAMESPACE} ${CACHE_DIR}': those names, nothing else."""
    for name in PLACEHOLDERS:
        template = template.replace("${" + name + "}", env[name])
    return template


def peer_targets(conf: str) -> list[str]:
    """The host:port each instance's hop reaches, in ring order."""
    return [target for _, target in PEER_LINE.findall(conf)]


def set_peers(conf: str, peers: list[str]) -> str:
    """Each instance's hop reaches ``peers[i]`` (host:port) instead of its cluster name."""
    found = PEER_LINE.findall(conf)
    assert len(found) == len(peers), (found, peers)
    targets = iter(peers)
    return PEER_LINE.sub(lambda m: f"{m.group(1)}{next(targets)};", conf)


def listen_on(conf: str, address: str) -> str:
    """Every TCP ``listen PORT;`` bound to ``address`` only (instances sharing ports)."""
    return re.sub(r"^(\s*listen )(\d+);$", rf"\g<1>{address}:\g<2>;", conf, flags=re.M)


def write_conf(
    run_dir: Path,
    origin: str,
    router_port: int,
    cache_port: int,
    peers: list[str] | None = None,
    slice_size: str = "4m",
    max_size: str = "1g",
) -> Path:
    """One instance's nginx.conf in ``run_dir``: the router on ``router_port``, the cache
    server on ``cache_port``, slices hashed over ``peers`` (host:port of every instance's
    cache server; this one alone by default), the store at ``origin`` (host:port, http)."""
    peers = peers or [f"127.0.0.1:{cache_port}"]
    values = engine_values(
        replicas=len(peers),
        origin={"url": f"http://{origin}"},
        ports={"router": router_port, "cache": cache_port},
        sliceSize=slice_size.lower(),
        cacheMaxSize=max_size,
    )
    env = {"RESOLVER": "127.0.0.1", "POD_NAMESPACE": "objfs", "CACHE_DIR": str(run_dir / "cache")}
    conf = set_peers(fill(rendered_template(values), env), peers)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "nginx.conf"
    path.write_text(conf)
    return path


def nginx_command(run_dir: Path, *, root: bool = True) -> list[str]:
    """nginx in the foreground as the start script runs it: prefix and working directory
    ``run_dir`` (start it with ``cwd=run_dir``). As root, workers run as root too (the cache
    folder is under pytest's private tmp)."""
    extra = "daemon off; user root;" if root else "daemon off;"
    return [NGINX, "-e", "stderr", "-p", f"{run_dir}/", "-c", "nginx.conf", "-g", extra]


def check(run_dir: Path) -> subprocess.CompletedProcess[str]:
    """``nginx -t`` of run_dir/nginx.conf, run where nginx would run."""
    return subprocess.run(
        [NGINX, "-t", "-e", "stderr", "-p", f"{run_dir}/", "-c", "nginx.conf"],
        cwd=run_dir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def wait_listening(proc: subprocess.Popen[bytes], host: str, port: int) -> None:
    """Until nginx (``proc``) accepts connections on host:port; fails if it exits first (with
    its stderr, when it is a pipe) or takes over 15 s."""
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None:
                err = proc.communicate()[1] if proc.stderr is not None else b""
                raise AssertionError(f"nginx exited: {(err or b'').decode()}") from None
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.05)
