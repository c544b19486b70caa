"""The Helm chart's cache engine (k8s/charts/objfs, cacheEngine.enabled), rendered by Helm's
own engine (helm-python-sdk): valid Kubernetes objects that fit together for the default
values and the variants that matter, pods within the Restricted profile, a configuration
Debian's nginx accepts whole (slice, auth_request and the peers' names resolved at run time:
no `resolve`, which needs 1.27.3), rendered by the instances' own start script, and bad values
refused with a message naming the value. tests/test_cache_engine.py runs it in front of a
store; tests/test_fleet.py runs two instances in network namespaces.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from objfs.config import MountConfig
from objfs.options import build_parser, mount_config
from tests.helpers import cache_engine, chart
from tests.test_k8s_manifests import VERSIONS, nginx_size, restricted_violations

CE = "templates/cache-engine/"


def objects(values: dict[str, Any], namespace: str = "objfs") -> dict[tuple[str, str], Any]:
    """(kind, name) -> object of every cache-engine template rendered with ``values``."""
    found: dict[tuple[str, str], Any] = {}
    for path, text in cache_engine.render_chart(values, namespace).items():
        if not path.startswith(CE):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def container(found: dict[tuple[str, str], Any]) -> dict[str, Any]:
    (nginx,) = found[("StatefulSet", "objfs-cache")]["spec"]["template"]["spec"]["containers"]
    return dict(nginx)


def conf_of(found: dict[tuple[str, str], Any]) -> str:
    return str(found[("ConfigMap", "objfs-cache-nginx")]["data"]["nginx.conf.template"])


VARIANTS = {
    "default": {},
    "one instance": {"replicas": 1},
    "five instances, other ports": {"replicas": 5, "ports": {"router": 9000, "cache": 9001}},
    "aws origin": {"origin": {"url": "https://s3.eu-west-1.amazonaws.com"}},
    "its own namespace": {"namespace": "objfs-cache"},
    "registry, scheduling": {
        "image": {"registry": "mirror.example:5000/library", "tag": "1.27.4"},
        "nodeSelector": {"node.kubernetes.io/pool": "cache"},
        "tolerations": [{"key": "cache", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "high",
        "clientNamespaceSelector": {"matchLabels": {"team": "ml"}},
    },
}


def test_a_null_client_selector_admits_every_namespace() -> None:
    found = objects(cache_engine.engine_values(clientNamespaceSelector=None))
    clients = found[("NetworkPolicy", "objfs-cache")]["spec"]["ingress"][0]
    assert clients["from"][0]["namespaceSelector"] == {}


def test_names_that_yaml_would_read_as_booleans_stay_strings() -> None:
    found = objects(
        cache_engine.engine_values(storage={"className": "on"}, priorityClassName="yes")
    )
    statefulset = found[("StatefulSet", "objfs-cache")]["spec"]
    assert statefulset["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "on"
    assert statefulset["template"]["spec"]["priorityClassName"] == "yes"


def test_disabled_by_default_renders_no_engine() -> None:
    assert objects({}) == {}
    assert objects({"cacheEngine": {"enabled": False}}) == {}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engine_renders_valid_objects_that_fit_together(variant: str) -> None:
    values = cache_engine.engine_values(**VARIANTS[variant])
    found = objects(values, namespace="models-cache")
    merged = cache_engine.merged_engine_values(values)
    assert {kind for kind, _ in found} == {"ConfigMap", "Service", "StatefulSet", "NetworkPolicy"}
    for doc in found.values():
        assert doc["metadata"]["namespace"] == (merged["namespace"] or "models-cache")
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    statefulset = found[("StatefulSet", "objfs-cache")]
    spec = statefulset["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    assert statefulset["spec"]["replicas"] == merged["replicas"]
    nginx = container(found)
    registry = merged["image"]["registry"]
    assert nginx["image"] == (f"{registry}/" if registry else "") + (
        f"{merged['image']['repository']}:{merged['image']['tag']}"
    )
    ports = {p["name"]: p["containerPort"] for p in nginx["ports"]}
    assert ports == merged["ports"]
    # Services, policy and configuration agree on the ports and on the names.
    router = found[("Service", "objfs-cache")]["spec"]
    peers = found[("Service", "objfs-cache-peers")]["spec"]
    assert statefulset["spec"]["serviceName"] == "objfs-cache-peers"
    assert peers["clusterIP"] == "None"
    assert router["ports"][0]["port"] == ports["router"]
    assert peers["ports"][0]["port"] == ports["cache"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert router["selector"] == peers["selector"] == labels
    policy = found[("NetworkPolicy", "objfs-cache")]["spec"]
    clients, instances = policy["ingress"]
    assert [p["port"] for p in clients["ports"]] == [ports["router"]]
    assert clients["from"][0]["namespaceSelector"] == merged["clientNamespaceSelector"]
    assert [p["port"] for p in instances["ports"]] == [ports["cache"]]
    assert instances["from"] == [{"podSelector": {"matchLabels": labels}}]
    conf = conf_of(found)
    assert f"listen {ports['router']};" in conf
    assert f"listen {ports['cache']};" in conf
    # One ring entry and one hop per instance, by its name in the headless Service.
    n = merged["replicas"]
    assert re.findall(r"server unix:(peer-\d+\.sock) max_fails", conf) == [
        f"peer-{i}.sock" for i in range(n)
    ]
    assert cache_engine.peer_targets(conf) == [
        f"objfs-cache-{i}.objfs-cache-peers.${{POD_NAMESPACE}}.svc.cluster.local:{ports['cache']}"
        for i in range(n)
    ]
    # The configuration's checksum rolls the instances when it changes.
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["objfs.dev/nginx-conf-sha256"])
    origin = merged["origin"]["url"]
    host = origin.split("://", 1)[1]
    assert conf.count(f"proxy_pass {origin};") == 2
    assert conf.count(f"proxy_set_header Host {host};") == 2
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert spec.get(key) == (merged[key] or None), key


def test_a_changed_configuration_changes_the_checksum() -> None:
    def checksum(**values: Any) -> str:
        found = objects(cache_engine.engine_values(**values))
        annotations = found[("StatefulSet", "objfs-cache")]["spec"]["template"]["metadata"]
        return str(annotations["annotations"]["objfs.dev/nginx-conf-sha256"])

    assert checksum() == checksum()
    assert checksum() != checksum(sliceSize="16m")
    assert checksum() != checksum(replicas=4)


def test_the_default_slice_is_objfs_part_size() -> None:
    merged = cache_engine.merged_engine_values(cache_engine.engine_values())
    slice_size = nginx_size(merged["sliceSize"])
    assert slice_size == MountConfig.part_size_bytes
    args = build_parser().parse_args(["mount", "s3://bucket/prefix", "/mnt"])
    assert slice_size == mount_config(args).part_size_bytes
    assert f"slice {merged['sliceSize']};" in cache_engine.rendered_template()


def test_the_storage_cap_stays_below_the_claim() -> None:
    found = objects(cache_engine.engine_values())
    (claim,) = found[("StatefulSet", "objfs-cache")]["spec"]["volumeClaimTemplates"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    capacity = int(size[:-2]) << {"Gi": 30, "Ti": 40}[size[-2:]]
    merged = cache_engine.merged_engine_values(cache_engine.engine_values())
    assert nginx_size(merged["cacheMaxSize"]) <= 0.9 * capacity
    mounts = {m["name"]: m["mountPath"] for m in container(found)["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container(found)["env"]}
    assert Path(env["CACHE_DIR"]).parent == Path(mounts[claim["metadata"]["name"]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_debians_nginx_accepts_the_whole_configuration(variant: str, tmp_path: Path) -> None:
    """nginx -t of every variant's configuration as the start script fills it, with an
    origin that resolves here (the peers are resolved later, by nginx's resolver)."""
    values = cache_engine.engine_values(**VARIANTS[variant])
    values["cacheEngine"]["origin"] = {"url": "http://127.0.0.1:9"}
    env = {"RESOLVER": "[fd00:10:96::a]", "POD_NAMESPACE": "objfs", "CACHE_DIR": str(tmp_path)}
    (tmp_path / "nginx.conf").write_text(
        cache_engine.fill(cache_engine.rendered_template(values), env)
    )
    res = cache_engine.check(tmp_path)
    assert res.returncode == 0, res.stderr
    # The modules it needs, which the official image has too.
    text = (tmp_path / "nginx.conf").read_text()
    assert "\n            slice " in text
    assert "auth_request /.objfs-authorize;" in text
    assert " resolve;" not in text


def start_script(found: dict[tuple[str, str], Any]) -> str:
    nginx = container(found)
    assert nginx["command"] == ["/bin/sh", "-c"]
    (script,) = nginx["args"]
    return str(script)


@pytest.mark.parametrize(
    ("nameserver", "resolver"), [("10.96.0.10", "10.96.0.10"), ("fd00:10:96::a", "[fd00:10:96::a]")]
)
def test_the_start_script_fills_the_placeholders_and_nothing_else(
    tmp_path: Path, nameserver: str, resolver: str
) -> None:
    """The container's script, run here with its paths moved under tmp_path and nginx left
    out: the nginx.conf it writes."""
    found = objects(cache_engine.engine_values())
    script = start_script(found)
    (listed,) = re.findall(r"envsubst '([^']*)'", script)
    assert listed.split() == ["${" + n + "}" for n in cache_engine.PLACEHOLDERS]
    conf = conf_of(found)
    placeholders = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", conf))
    assert placeholders == set(cache_engine.PLACEHOLDERS)
    nginx = container(found)
    mounts = {m["name"]: m for m in nginx["volumeMounts"]}
    assert mounts["template"]["readOnly"] is True
    template_path = f"{mounts['template']['mountPath']}/nginx.conf.template"
    exec_line = next(line for line in script.splitlines() if line.startswith("exec nginx "))
    assert exec_line == """exec nginx -e stderr -p "$RUN_DIR/" -c nginx.conf -g 'daemon off;'"""
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"search objfs.svc.cluster.local\nnameserver {nameserver}\n")
    template = tmp_path / "template"
    template.write_text(conf)
    for old, new in (
        ("/etc/resolv.conf", str(resolv)),
        (template_path, str(template)),
        (exec_line, "exit 0"),
    ):
        assert old in script
        script = script.replace(old, new)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {e["name"]: e["value"] for e in nginx["env"] if "value" in e}
    # The run folder is the emptyDir, the slices' folder on the claim.
    volumes = {
        v["name"]: v
        for v in found[("StatefulSet", "objfs-cache")]["spec"]["template"]["spec"]["volumes"]
    }
    (run_mount,) = [m for m in nginx["volumeMounts"] if m["mountPath"] == env["RUN_DIR"]]
    assert "emptyDir" in volumes[run_mount["name"]]
    env.update(
        RUN_DIR=str(run_dir), CACHE_DIR=str(tmp_path / "slices"), POD_NAMESPACE="models",
        PATH="/usr/bin:/bin",
    )  # fmt: skip
    res = subprocess.run(
        ["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    text = (run_dir / "nginx.conf").read_text()
    assert "${" not in text
    assert text == cache_engine.fill(
        conf, {"RESOLVER": resolver, "POD_NAMESPACE": "models", "CACHE_DIR": env["CACHE_DIR"]}
    )
    for variable in ("$uri", "$http_if_match", "$slice_range", "$http_range", "$objfs_peer"):
        assert variable in text, variable
    assert f"resolver {resolver} valid=10s;" in text
    assert ".objfs-cache-peers.models.svc.cluster.local:8081;" in text
    # Logs go to the container's output, never to the size-limited emptyDir.
    assert (run_dir / "access.log").readlink() == Path("/dev/stdout")
    assert (run_dir / "error.log").readlink() == Path("/dev/stderr")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": 0}, "/cacheEngine/replicas"),
        ({"replicas": "3"}, "/cacheEngine/replicas"),
        ({"origin": {"url": "http://minio:9000/bucket"}}, "/cacheEngine/origin/url"),
        ({"origin": {"url": "minio:9000"}}, "/cacheEngine/origin/url"),
        ({"sliceSize": "8MB"}, "/cacheEngine/sliceSize"),
        ({"cacheMaxSize": "lots"}, "/cacheEngine/cacheMaxSize"),
        ({"ports": {"router": 70000}}, "/cacheEngine/ports/router"),
        ({"storage": {"size": "500GB"}}, "/cacheEngine/storage/size"),
        ({"clusterDomain": "Cluster Local"}, "/cacheEngine/clusterDomain"),
        ({"replica": 3}, "replica"),
        ({"namespace": "Objfs_Cache"}, "/cacheEngine/namespace"),
        ({"storage": {"className": "Local NVMe"}}, "/cacheEngine/storage/className"),
        ({"image": {"registry": "reg/"}}, "/cacheEngine/image/registry"),
        # Helm drops a key set to null: the schema asks for it back, instead of an image
        # "nginx:", an empty ring or a peer name ending in ".svc.".
        ({"image": {"tag": None}}, "tag"),
        ({"replicas": None}, "replicas"),
        ({"sliceSize": None}, "sliceSize"),
        ({"clusterDomain": None}, "clusterDomain"),
        ({"ports": {"router": None}}, "router"),
    ],
)
def test_bad_engine_values_are_refused_by_the_schema(values: dict[str, Any], message: str) -> None:
    from helm_python.errors import HelmValuesError

    with pytest.raises(HelmValuesError) as refused:
        cache_engine.render_chart(cache_engine.engine_values(**values))
    assert message in str(refused.value)


def test_the_router_and_cache_ports_must_differ() -> None:
    from helm_python.errors import HelmRenderError

    with pytest.raises(HelmRenderError) as refused:
        cache_engine.render_chart(cache_engine.engine_values(ports={"router": 8080, "cache": 8080}))
    assert "cacheEngine.ports.router and cacheEngine.ports.cache must differ" in str(refused.value)


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_is_clean_with_the_engine(variant: str) -> None:
    from helm_python import lint

    values = cache_engine.engine_values(**VARIANTS[variant])
    for kube_version in ("v1.29.0", "v1.37.0"):
        report = lint(chart.CHART_DIR, values, strict=True, kube_version=kube_version)
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
