"""The Kubernetes manifests in k8s/: valid against the Kubernetes schemas (offline, with
kubernetes-validate), complete kustomizations, and consistent with objfs itself (options it
accepts, probes on the right path, sizes that fit their limits)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from objfs.cli import _mount_config, build_parser
from objfs.config import parse_size
from objfs.sidecar import FLAG_OPTIONS, VALUE_OPTIONS, sidecar_command

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
# The first release with native sidecars on by default, and the newest schemas bundled.
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))
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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) missing")
@pytest.mark.parametrize("folder", ["k8s", "k8s/sidecar", "k8s/node"])
def test_kustomize_builds_valid_objects(folder: str) -> None:
    res = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    assert docs
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
    config = _mount_config(args)  # sizes, the metrics address, the source: all valid
    assert config.allow_other  # the model server may run as another user
    assert config.metrics_addr == f"0.0.0.0:{container['ports'][0]['containerPort']}"
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["objfs", "status", "--probe", mountpoint]
    security = container["securityContext"]
    assert security["privileged"] is True  # required for Bidirectional propagation
    # The memory limit covers the budget, the disk-cache write queue outside it (at most a
    # quarter of the budget) and the daemon's own overhead.
    limit = parse_size(container["resources"]["limits"]["memory"].replace("i", ""), option="x")
    assert limit >= config.memory_limit_bytes * 5 // 4 + (512 << 20)
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
    assert 'ENTRYPOINT ["objfs"]' in final
    assert 'CMD ["sidecar"]' in final
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {"*", "!pyproject.toml", "!README.md", "!objfs/"} <= set(ignore)
