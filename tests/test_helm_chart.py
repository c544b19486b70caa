"""The Helm chart k8s/charts/objfs (its CSI driver part), rendered and linted by Helm's own
engine (helm-python-sdk, no helm binary, no cluster): with its defaults it is k8s/csi, every
value shows up where it should, every object validates against the Kubernetes schemas, objfs
accepts the node plugin's arguments, and the schema refuses bad values by name."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import HelmValuesError, lint

from objfs.config import parse_size
from objfs.csi import DRIVER_NAME
from objfs.errors import ObjfsError
from tests.helpers import chart as helm
from tests.test_k8s_manifests import VERSIONS, check_csi_node_plugin, mount_of

CSI = helm.GROUPS["csi"]
NAMESPACE = CSI.namespace
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
MICROK8S = "/var/snap/microk8s/common/var/lib/kubelet"

# Values files a user might give, by name: each must lint clean, render objects the
# Kubernetes schemas accept, and keep the node plugin consistent.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-node-cache": {"nodeCache": {"enabled": False}},
    "microk8s": {"kubeletDir": MICROK8S},
    "images": {
        "image": {"registry": "registry.example.com/ml", "tag": "0.2.0", "pullPolicy": "Always"},
        "nodeDriverRegistrar": {"image": {"registry": "mirror.example.com:5000", "tag": "v2.18.0"}},
        "livenessprobe": {"image": {"registry": "", "repository": "livenessprobe"}},
        "imagePullSecrets": [{"name": "registry-example"}],
    },
    "scheduling": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"example.com/gpu": "true"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                    ]
                }
            }
        },
        "priorityClassName": "objfs-node",
        "podAnnotations": {"example.com/team": "ml-platform"},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}},
    },
    "resources": {
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "nodeDriverRegistrar": {"resources": {"requests": {"cpu": 0.01, "memory": "32Mi"}}},
        "livenessprobe": {"resources": {"limits": {"memory": "100Mi", "cpu": "100m"}}},
    },
    "others": {
        "nodeCache": {"path": "/mnt/nvme/objfs-cache", "size": "1.5Ti"},
        "logLevel": "debug",
        "priorityClassName": "",
        "tolerations": [],
        "nodeSelector": None,  # {} would merge with the default, null drops it
        "updateStrategy": {"type": "OnDelete"},
    },
}


def rendered_csi(values: dict[str, Any]) -> dict[str, str]:
    return helm.render(values, namespace=NAMESPACE)


def csi_objects(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The CSI part's objects by kind (one of each)."""
    rendered = rendered_csi(values)
    found: dict[str, dict[str, Any]] = {}
    for path, text in rendered.items():
        if path.startswith("templates/csi/"):
            for doc in helm.documents(text):
                assert doc["kind"] not in found, doc["kind"]
                found[doc["kind"]] = doc
    assert set(found) == {"CSIDriver", "ServiceAccount", "DaemonSet"}
    return found


def pod_spec(values: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = csi_objects(values)["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def containers_of(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_spec(values)["containers"]}


def without_namespace(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"].pop("namespace", None)
    return doc


def chart_metadata() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((helm.CHART_DIR / "Chart.yaml").read_text())
    return doc


def test_chart_metadata() -> None:
    meta = chart_metadata()
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == helm.CHART_NAME == helm.CHART_DIR.name
    assert meta["version"] == "0.1.0"
    assert meta["appVersion"] == "0.1.0"
    assert meta["kubeVersion"] == ">=1.29.0-0"  # native sidecars, as the examples need
    assert meta["description"]
    assert helm.chart().metadata["name"] == "objfs"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_is_clean(variant: str, version: str) -> None:
    report = lint(helm.CHART_DIR, VARIANTS[variant], strict=True, kube_version=f"v{version}")
    assert report["errors"] == []
    # Infos only (Helm recommends an icon); no warning, no error.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_validate(variant: str, version: str) -> None:
    docs = helm.objects(rendered_csi(VARIANTS[variant]))
    assert len(docs) == 3
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_node_plugin_fits_together(variant: str) -> None:
    """The checks of the kustomize directory's DaemonSet (test_k8s_manifests.py), on each
    render: objfs's own parser takes the arguments, and the paths agree."""
    found = csi_objects(VARIANTS[variant])
    args = check_csi_node_plugin(
        found["DaemonSet"], found["ServiceAccount"], found["CSIDriver"]["metadata"]["name"]
    )
    assert args.command == "csi"
    merged = helm.chart().merge_values(VARIANTS[variant])
    assert args.kubelet_dir == merged["kubeletDir"]
    assert args.log_level == merged["logLevel"]
    if merged["nodeCache"]["enabled"]:
        assert args.node_cache_dir == merged["nodeCache"]["path"]
        assert args.node_cache_size == merged["nodeCache"]["size"]
    else:
        assert args.node_cache_dir is None


def test_the_driver_name_is_the_one_objfs_uses() -> None:
    found = csi_objects({})
    assert found["CSIDriver"]["metadata"]["name"] == DRIVER_NAME
    assert found["DaemonSet"]["metadata"]["name"] == "objfs-csi-node"


def test_defaults_render_the_kustomize_directory() -> None:
    """k8s/csi/X.yaml is templates/csi/X.yaml rendered with the defaults, as parsed objects
    (the namespace left to the kustomization), and k8s/csi/kustomization.yaml lists them."""
    rendered = rendered_csi({})
    templates = helm.group_templates(CSI)
    assert [Path(t).name for t in templates] == [
        "csidriver.yaml",
        "node-daemonset.yaml",
        "serviceaccount.yaml",
    ]
    for template in templates:
        on_disk = helm.documents((CSI.target / Path(template).name).read_text())
        assert on_disk == [without_namespace(d) for d in helm.documents(rendered[template])]
        assert all("namespace" not in doc["metadata"] for doc in on_disk)
    kustomization = yaml.safe_load((CSI.target / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    listed = [r for r in kustomization["resources"] if r.endswith(".yaml")]
    assert sorted(listed) == sorted(Path(t).name for t in templates)
    # The kustomization's image override still applies: the rendered image is named objfs.
    (image,) = kustomization["images"]
    assert containers_of({})["objfs-csi"]["image"] == f"{image['name']}:{image['newTag']}"


def test_generated_files_are_a_fresh_render() -> None:
    """Fails after an edit of k8s/csi/*.yaml by hand, or of the chart without
    `make manifests`."""
    assert helm.check([CSI]) == []
    for path, text in helm.generated(CSI).items():
        first, second = text.splitlines()[:2]
        assert first.startswith("# Generated by `make manifests` from the Helm chart")
        assert "edit the chart, not this file" in second
        assert path.read_text() == text


def test_check_reports_a_hand_edit(tmp_path: Path) -> None:
    copy_of_csi = dataclasses.replace(CSI, target=tmp_path)
    assert helm.write([copy_of_csi]) == sorted(tmp_path.iterdir())
    assert helm.check([copy_of_csi]) == []
    daemonset = tmp_path / "node-daemonset.yaml"
    daemonset.write_text(daemonset.read_text().replace("maxUnavailable: 10%", "maxUnavailable: 1"))
    (problem,) = helm.check([copy_of_csi])
    assert "node-daemonset.yaml differs" in problem
    (tmp_path / "csidriver.yaml").unlink()
    assert len(helm.check([copy_of_csi])) == 2
    assert helm.write([copy_of_csi]) == [tmp_path / "csidriver.yaml", daemonset]
    assert helm.check([copy_of_csi]) == []


def test_generator_groups() -> None:
    assert CSI.target == helm.K8S / "csi"
    assert CSI.namespace == "kube-system"
    engine = helm.GROUPS["cache-engine"]
    assert engine.target == helm.K8S / "cache-engine"
    assert engine.namespace == "objfs"
    assert engine.values == {"cacheEngine": {"enabled": True}}
    assert engine.templates == helm.CHART_DIR / "templates" / "cache-engine"


def test_a_group_without_templates_writes_nothing(tmp_path: Path) -> None:
    empty = helm.Group("no-such-folder", tmp_path / "out", "objfs")
    assert helm.generated(empty) == {}
    assert helm.write([empty]) == []
    assert not (tmp_path / "out").exists()


def test_generator_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert helm.main(["--check", "csi"]) == 0
    with pytest.raises(SystemExit):
        helm.main(["--check", "no-such-group"])
    with pytest.raises(SystemExit):
        helm.main(["csi"])  # --write or --check
    capsys.readouterr()


def test_namespace_is_stripped_only_where_the_templates_put_it() -> None:
    text = "metadata:\n  name: a\n  namespace: kube-system\nspec:\n  namespace: kube-system\n"
    assert helm.strip_namespace(text, "kube-system") == (
        "metadata:\n  name: a\nspec:\n  namespace: kube-system\n"
    )
    with pytest.raises(helm.GeneratorError):
        helm.strip_namespace("metadata: {name: a, namespace: kube-system}\n", "kube-system")
    with pytest.raises(helm.GeneratorError):
        helm.strip_namespace("metadata:\n  name: a\n  namespace: other\n", "kube-system")


def test_namespaced_objects_follow_the_release_namespace() -> None:
    rendered = helm.render({}, namespace="storage")
    by_kind = {d["kind"]: d for d in helm.objects(rendered)}
    assert by_kind["ServiceAccount"]["metadata"]["namespace"] == "storage"
    assert by_kind["DaemonSet"]["metadata"]["namespace"] == "storage"
    assert "namespace" not in by_kind["CSIDriver"]["metadata"]  # cluster-wide
    assert "-n storage rollout status daemonset/objfs-csi-node" in rendered["templates/NOTES.txt"]


def test_without_the_node_cache() -> None:
    rendered = rendered_csi({"nodeCache": {"enabled": False}})
    daemonset = rendered["templates/csi/node-daemonset.yaml"]
    assert "node-cache" not in daemonset
    assert "/var/lib/objfs/csi-cache" not in daemonset
    spec = pod_spec({"nodeCache": {"enabled": False}})
    objfs = {c["name"]: c for c in spec["containers"]}["objfs-csi"]
    assert not [a for a in objfs["args"] if a.startswith("--node-cache")]
    assert [m["name"] for m in objfs["volumeMounts"]] == ["kubelet-dir", "plugin-dir", "dev-fuse"]
    assert [v["name"] for v in spec["volumes"]] == [
        "kubelet-dir",
        "plugin-dir",
        "registration-dir",
        "dev-fuse",
    ]
    assert "Node cache: off" in rendered["templates/NOTES.txt"]


def test_node_cache_values() -> None:
    values = {"nodeCache": {"path": "/mnt/nvme/objfs", "size": "2T"}}
    objfs = containers_of(values)["objfs-csi"]
    args = objfs["args"]
    assert args[args.index("--node-cache-dir") + 1] == "/mnt/nvme/objfs"
    assert args[args.index("--node-cache-size") + 1] == "2T"
    assert mount_of(objfs, "node-cache")["mountPath"] == "/mnt/nvme/objfs"
    notes = rendered_csi(values)["templates/NOTES.txt"]
    assert "Node cache: /mnt/nvme/objfs on each node, 2T at most" in notes


def test_every_kubelet_path_follows_kubelet_dir() -> None:
    values = {"kubeletDir": MICROK8S}
    rendered = rendered_csi(values)
    for path, text in rendered.items():
        # Comments and NOTES.txt included (the new dir itself ends in /var/lib/kubelet).
        assert DEFAULT_KUBELET_DIR not in text.replace(MICROK8S, "<kubelet>"), path
    spec = pod_spec(values)
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert volumes["kubelet-dir"] == MICROK8S
    assert volumes["plugin-dir"] == f"{MICROK8S}/plugins/{DRIVER_NAME}"
    assert volumes["registration-dir"] == f"{MICROK8S}/plugins_registry"
    containers = {c["name"]: c for c in spec["containers"]}
    objfs = containers["objfs-csi"]
    assert objfs["args"][objfs["args"].index("--kubelet-dir") + 1] == MICROK8S
    assert mount_of(objfs, "kubelet-dir")["mountPath"] == MICROK8S
    registrar = containers["node-driver-registrar"]["args"]
    assert f"--kubelet-registration-path={MICROK8S}/plugins/{DRIVER_NAME}/csi.sock" in registrar
    # With the default, the same places name /var/lib/kubelet.
    default = rendered_csi({})["templates/csi/node-daemonset.yaml"]
    assert default.count(DEFAULT_KUBELET_DIR) == rendered[
        "templates/csi/node-daemonset.yaml"
    ].count(MICROK8S)


def test_images() -> None:
    default = containers_of({})
    assert default["objfs-csi"]["image"] == f"objfs:{chart_metadata()['appVersion']}"
    assert all("imagePullPolicy" not in c for c in default.values())
    assert "imagePullSecrets" not in pod_spec({})
    values = VARIANTS["images"]
    containers = containers_of(values)
    assert containers["objfs-csi"]["image"] == "registry.example.com/ml/objfs:0.2.0"
    assert containers["objfs-csi"]["imagePullPolicy"] == "Always"
    assert containers["node-driver-registrar"]["image"] == (
        "mirror.example.com:5000/sig-storage/csi-node-driver-registrar:v2.18.0"
    )
    assert containers["livenessprobe"]["image"] == "livenessprobe:v2.19.0"
    assert "imagePullPolicy" not in containers["livenessprobe"]
    assert pod_spec(values)["imagePullSecrets"] == [{"name": "registry-example"}]
    notes = rendered_csi(values)["templates/NOTES.txt"]
    assert "image: registry.example.com/ml/objfs:0.2.0" in notes


def test_scheduling_overrides() -> None:
    values = VARIANTS["scheduling"]
    spec = pod_spec(values)
    assert spec["tolerations"] == values["tolerations"]
    # Maps merge with the defaults, as Helm does.
    assert spec["nodeSelector"] == {**values["nodeSelector"], "kubernetes.io/os": "linux"}
    assert pod_spec({"nodeSelector": {"kubernetes.io/os": None, "gpu": "a"}})["nodeSelector"] == {
        "gpu": "a"
    }
    assert spec["affinity"] == values["affinity"]
    assert spec["priorityClassName"] == "objfs-node"
    daemonset = csi_objects(values)["DaemonSet"]
    assert daemonset["spec"]["template"]["metadata"]["annotations"] == values["podAnnotations"]
    assert daemonset["spec"]["updateStrategy"] == values["updateStrategy"]
    # The selector never changes with the values (it cannot change on an installed one).
    assert daemonset["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "objfs-csi-node"}
    }
    # Empty values leave the fields out.
    others = VARIANTS["others"]
    spec = pod_spec(others)
    for key in ("priorityClassName", "tolerations", "nodeSelector", "affinity"):
        assert key not in spec, key
    daemonset = csi_objects(others)["DaemonSet"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert "annotations" not in daemonset["spec"]["template"]["metadata"]


def test_defaults_schedule_everywhere_first() -> None:
    spec = pod_spec({})
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["priorityClassName"] == "system-node-critical"
    assert "affinity" not in spec
    daemonset = csi_objects({})["DaemonSet"]
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "10%"},
    }


def test_resources_overrides() -> None:
    values = VARIANTS["resources"]
    containers = containers_of(values)
    assert containers["objfs-csi"]["resources"] == values["resources"]
    # Maps merge with the defaults, as Helm does: the registrar keeps its memory limit.
    assert containers["node-driver-registrar"]["resources"] == {
        "requests": {"cpu": 0.01, "memory": "32Mi"},
        "limits": {"memory": "64Mi"},
    }
    assert containers["livenessprobe"]["resources"]["limits"] == {"memory": "100Mi", "cpu": "100m"}


def test_log_level() -> None:
    assert "--log-level" not in containers_of({})["objfs-csi"]["args"]  # info, objfs's default
    args = containers_of({"logLevel": "debug"})["objfs-csi"]["args"]
    assert args[args.index("--log-level") + 1] == "debug"


def test_notes() -> None:
    notes = rendered_csi({})["templates/NOTES.txt"]
    assert f"driver: {DRIVER_NAME}" in notes
    assert "kubectl -n kube-system rollout status daemonset/objfs-csi-node" in notes
    assert "Node cache: /var/lib/objfs/csi-cache on each node, 200G at most" in notes
    assert "Kubelet dir: /var/lib/kubelet" in notes
    assert "k8s/csi/example" in notes
    # The README section it points at exists.
    readme = (helm.ROOT / "k8s" / "README.md").read_text()
    assert "### The CSI driver: mount on the node, serve unprivileged in the pod\n" in readme
    assert '"The CSI driver: mount on the\nnode, serve unprivileged in the pod"' in notes
    # The snippet is a pod spec fragment that the API accepts.
    start = notes.index("  initContainers:")
    end = notes.index("\n\n", start)
    fragment = yaml.safe_load(notes[start:end])
    (vllm,) = fragment["containers"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "notes"},
        "spec": {**fragment, "containers": [{**vllm, "image": "app:1"}]},
    }
    for version in VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    volumes = {v["name"]: v for v in fragment["volumes"]}
    assert volumes["models"]["csi"]["driver"] == DRIVER_NAME
    (sidecar,) = fragment["initContainers"]
    assert sidecar["args"] == ["sidecar", "--fd-dir", mount_of(sidecar, "objfs-fd")["mountPath"]]
    assert "emptyDir" in volumes["objfs-fd"]
    assert "medium" not in volumes["objfs-fd"]["emptyDir"]


# (values, the part of Helm's message that names the key)
BAD_VALUES = {
    "relative kubeletDir": ({"kubeletDir": "var/lib/kubelet"}, "at '/kubeletDir'"),
    "kubeletDir with a trailing slash": ({"kubeletDir": "/var/lib/kubelet/"}, "at '/kubeletDir'"),
    "kubeletDir not a string": ({"kubeletDir": 1}, "at '/kubeletDir'"),
    "relative node cache path": ({"nodeCache": {"path": "csi-cache"}}, "at '/nodeCache/path'"),
    "size lots": ({"nodeCache": {"size": "lots"}}, "at '/nodeCache/size'"),
    "size zero": ({"nodeCache": {"size": "0G"}}, "at '/nodeCache/size'"),
    "size negative": ({"nodeCache": {"size": "-200G"}}, "at '/nodeCache/size'"),
    "size a number": ({"nodeCache": {"size": 200}}, "at '/nodeCache/size'"),
    "enabled a string": ({"nodeCache": {"enabled": "yes"}}, "at '/nodeCache/enabled'"),
    "unknown top-level key": ({"kubeletDirectory": "/x"}, "'kubeletDirectory' not allowed"),
    "unknown nested key": ({"nodeCache": {"sise": "1G"}}, "'sise' not allowed"),
    "maxSurge": (
        {"updateStrategy": {"rollingUpdate": {"maxSurge": 1}}},
        "'maxSurge' not allowed",
    ),
    "negative maxUnavailable": (
        {"updateStrategy": {"rollingUpdate": {"maxUnavailable": -1}}},
        "at '/updateStrategy/rollingUpdate/maxUnavailable'",
    ),
    "unknown update strategy": (
        {"updateStrategy": {"type": "Recreate"}},
        "at '/updateStrategy/type'",
    ),
    "negative memory": (
        {"resources": {"limits": {"memory": "-1Gi"}}},
        "at '/resources/limits/memory'",
    ),
    "negative cpu": (
        {"livenessprobe": {"resources": {"requests": {"cpu": -1}}}},
        "at '/livenessprobe/resources/requests/cpu'",
    ),
    "tolerations not a list": ({"tolerations": "all"}, "at '/tolerations'"),
    "toleration typo": (
        {"tolerations": [{"operater": "Exists"}]},
        "'operater' not allowed",
    ),
    "nodeSelector number": ({"nodeSelector": {"gpu": 1}}, "at '/nodeSelector/gpu'"),
    "image tag a number": ({"image": {"tag": 1.0}}, "at '/image/tag'"),
    "pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    "sidecar without a tag": (
        {"nodeDriverRegistrar": {"image": {"tag": ""}}},
        "at '/nodeDriverRegistrar/image/tag'",
    ),
    "log level": ({"logLevel": "verbose"}, "at '/logLevel'"),
    "priority class a number": ({"priorityClassName": 5}, "at '/priorityClassName'"),
    "pull secret a string": ({"imagePullSecrets": ["registry"]}, "at '/imagePullSecrets/0'"),
    "cacheEngine.enabled a string": (
        {"cacheEngine": {"enabled": "true"}},
        "at '/cacheEngine/enabled'",
    ),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_the_schema_refuses_bad_values(case: str) -> None:
    values, named = BAD_VALUES[case]
    with pytest.raises(HelmValuesError) as refused:
        helm.render(values)
    assert named in str(refused.value)
    assert "don't meet the specifications of the schema" in str(refused.value)
    # `helm lint` says the same.
    report = lint(helm.CHART_DIR, values, strict=True)
    assert any(named in error for error in report["errors"]), report


@pytest.mark.parametrize("size", ["200G", "1.5T", "500Gi", "64GiB", "100g", "2048M", "10GB"])
def test_node_cache_sizes_the_schema_takes_objfs_takes(size: str) -> None:
    args = containers_of({"nodeCache": {"size": size}})["objfs-csi"]["args"]
    assert args[args.index("--node-cache-size") + 1] == size
    assert parse_size(size, option="--node-cache-size") > 0


@pytest.mark.parametrize(
    "size", ["lots", "G", "1e3G", "200 G", "-1G", "0.5G", "200", "12X", "99999999T"]
)
def test_node_cache_sizes_the_schema_refuses(size: str) -> None:
    with pytest.raises(HelmValuesError, match="/nodeCache/size"):
        helm.render({"nodeCache": {"size": size}})
    # Stricter than objfs (a unit and a value from 1 are required), never looser.
    if size in ("lots", "G", "1e3G", "-1G", "12X", "99999999T"):
        with pytest.raises(ObjfsError):
            parse_size(size, option="--node-cache-size")


def test_defaults_pass_the_schema() -> None:
    helm.chart().validate_schema(helm.chart().values)
    for values in VARIANTS.values():
        helm.chart().validate_schema(helm.chart().merge_values(values))


def test_every_value_has_a_comment() -> None:
    """values.yaml documents each top-level key with the comment lines right above it."""
    lines = (helm.CHART_DIR / "values.yaml").read_text().splitlines()
    keys = [i for i, line in enumerate(lines) if line and line[0] not in "# -"]
    assert len(keys) == len(helm.chart().values)
    for i in keys:
        assert lines[i - 1].startswith("#"), f"values.yaml:{i + 1}: {lines[i]}"


def test_the_helpers_exist() -> None:
    helpers = (helm.CHART_DIR / "templates" / "_helpers.tpl").read_text()
    for name in ("name", "fullname", "labels", "selectorLabels", "image"):
        assert f'define "objfs.{name}"' in helpers
    assert (helm.CHART_DIR / ".helmignore").exists()
