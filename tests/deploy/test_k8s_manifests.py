"""deploy/k8s, checked without a cluster: both overlays rendered (``tests/deploy/kustomize.py``, a strict subset
of kustomize), every object validated offline against the Kubernetes OpenAPI schemas (``kubernetes_validate``,
strict: unknown fields fail), the Pod's processes compared with docker-compose.yml's, and (slow) the cpu Pod's
containers started directly on loopback as the compose test starts the compose services. The frontends overlay (a
front-end container serving the public ports, the scheduler a sidecar) is checked the same ways at the end."""

from __future__ import annotations

import os
import re
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cdb_engine.config import DType
from services.telemetry.metrics import Metrics
from tests.deploy.compose_file import (
    CDB_SERVICES,
    FRONTEND_SERVICE,
    FRONTENDS_OVERRIDE,
    GPU_OVERRIDE,
    LINK_DIR,
    STAGES,
    command_argv,
    flag_values,
    interpolate,
    load,
    merge,
)
from tests.deploy.effective_config import check_consistent, effective
from tests.deploy.kustomize import KustomizeError, build
from tests.deploy.process_tree import ROOT, ProcessSpec, ProcessTree, Remap, run_once

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes the manifests need (native sidecars: 1.29; the preStop sleep action: 1.30) and the newest
# whose schemas kubernetes_validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
OBJECTS = {
    ("Namespace", "cdb"),
    ("ConfigMap", "cdb-config"),
    ("ConfigMap", "cdb-env"),
    ("PersistentVolumeClaim", "cdb-models"),
    ("Deployment", "cdb"),
    ("Service", "cdb"),
    ("Service", "cdb-headless"),
    ("PodDisruptionBudget", "cdb"),
    ("HorizontalPodAutoscaler", "cdb"),
}
READY_WAIT_S = 240


def _render(overlay: str) -> list[dict[str, Any]]:
    return build(K8S / "overlays" / overlay, root=K8S)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: _render(name) for name in OVERLAYS}


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(objects, "Deployment", "cdb")["spec"]["template"]["spec"]
    return spec


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


def _env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps first, then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command and args (``$$`` escapes; an unknown variable stays)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def _argv(objects: list[dict[str, Any]], container: dict[str, Any]) -> list[str]:
    env = _env(objects, container)
    return [_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


def _quantity(value: str | int) -> float:
    """A Kubernetes resource quantity (``250m``, ``2``, ``512Mi``, ``1G``) as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(value))
    assert m, value
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    scale.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})
    return float(m[1]) * scale[m[2]]


def _compose_services(overlay: str, model: str) -> dict[str, Any]:
    compose = load()
    if overlay == "gpu":
        compose = merge(compose, load(GPU_OVERRIDE))
    services: dict[str, Any] = interpolate(compose, {"CDB_MODEL": model})["services"]
    return services


# --- the renderer ---------------------------------------------------------------------------------------------


def _write(directory: Path, files: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = content if isinstance(content, str) else yaml.safe_dump_all(content, sort_keys=False)
        (directory / name).write_text(text)
    return directory


DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "d"},
    "spec": {
        "selector": {"matchLabels": {"k": "v"}},
        "template": {
            "metadata": {"labels": {"k": "v"}},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "reg:5000/img:v1",
                        "env": [{"name": "A", "value": "a"}, {"name": "B", "value": "b"}, {"name": "C", "value": "c"}],
                        "args": ["--one"],
                    }
                ],
                "hostAliases": [{"ip": "127.0.0.2", "hostnames": ["a"]}],
            },
        },
    },
}
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"selector": {"k": "v"}}}


SMP_PATCH = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec:
  template:
    spec:
      containers:
        - name: c
          env:
            - {name: B, value: b2}
            - {name: D, value: d}
            - {name: A, $patch: delete}
          args: [--two]
        - {name: z, image: "other:1"}
"""
SUBSET_KUSTOMIZATION = """
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: x
resources: [objects.yaml, ns.yaml]
labels:
  - pairs: {p: q}
    includeSelectors: true
  - pairs: {t: u}
images:
  - {name: "reg:5000/img", newTag: v2}
  - {name: other, digest: "sha256:abc"}
patches:
  - path: smp.yaml
  - target: {group: apps, version: v1, kind: Deployment, name: d}
    patch: |-
      - {op: test, path: /spec/template/spec/containers/0/name, value: c}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --three}
      - {op: add, path: /metadata/annotations, value: {a/b: "1"}}
  - target: {kind: Service}
    patch: |-
      apiVersion: v1
      kind: Service
      metadata: {name: any}
      spec:
        type: null
        selector: {$patch: replace, only: this}
"""


def test_renderer_applies_the_supported_subset(tmp_path: Path) -> None:
    """The results kustomize itself gives for these inputs (checked against kustomize v5's library)."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}}
    files = {"kustomization.yaml": SUBSET_KUSTOMIZATION, "smp.yaml": SMP_PATCH}
    _write(tmp_path, {**files, "objects.yaml": [DEPLOYMENT, SERVICE], "ns.yaml": [namespace]})
    deployment, service, ns = build(tmp_path)

    assert ns["metadata"] == {"name": "x", "labels": {"p": "q", "t": "u"}}, "a Namespace takes the namespace's name"
    labels = {"p": "q", "t": "u"}
    assert deployment["metadata"] == {"name": "d", "namespace": "x", "labels": labels, "annotations": {"a/b": "1"}}
    assert deployment["spec"]["selector"] == {"matchLabels": {"k": "v", "p": "q"}}
    assert deployment["spec"]["template"]["metadata"]["labels"] == {"k": "v", "p": "q"}
    c, z = deployment["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [{"name": "B", "value": "b2"}, {"name": "D", "value": "d"}, {"name": "C", "value": "c"}]
    assert c["args"] == ["--two", "--three"], "args are replaced whole, then appended to"
    assert c["image"] == "reg:5000/img:v2" and z == {"name": "z", "image": "other@sha256:abc"}
    assert service["metadata"]["name"] == "s" and service["spec"]["selector"] == {"only": "this", "p": "q"}
    assert "type" not in service["spec"]


def _smp(spec: str) -> dict[str, Any]:
    return {"patches": [{"patch": f"apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: d}}\nspec: {spec}"}]}


def _json6902(kind: str, op: str) -> dict[str, Any]:
    return {"patches": [{"target": {"kind": kind}, "patch": f"- {op}"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"configMapGenerator": [{"name": "x"}]}, "configMapGenerator"),
        ({"patchesStrategicMerge": ["p.yaml"]}, "patchesStrategicMerge"),
        ({"namePrefix": "a-"}, "namePrefix"),
        ({"resources": ["../outside.yaml"]}, "outside"),
        (_json6902("Deployment", "{op: move, from: /a, path: /b}"), "move"),
        (_json6902("Deployment", "{op: test, path: /kind, value: Pod}"), "test failed"),
        (_json6902("Job", "{op: remove, path: /spec}"), "matches no object"),
        (_smp("{template: {spec: {hostAliases: [{ip: 127.0.0.3}]}}}"), "not known"),
        (_smp("{$retainKeys: [a]}"), "directive"),
        ({"images": [{"name": "img", "newImage": "x"}]}, "images"),
    ],
)
def test_renderer_rejects_what_it_does_not_implement(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["d.yaml"]}
    (tmp_path / "outside.yaml").write_text(yaml.safe_dump(SERVICE))
    _write(tmp_path / "k", {"kustomization.yaml": [{**kustomization, **change}], "d.yaml": [DEPLOYMENT]})
    with pytest.raises(KustomizeError, match=message):
        build(tmp_path / "k")


# --- schemas --------------------------------------------------------------------------------------------------


def test_overlays_render_the_same_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        assert {(o["kind"], o["metadata"]["name"]) for o in objects} == OBJECTS
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "cdb", obj["kind"]
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cdb"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid(rendered: dict[str, list[dict[str, Any]]], overlay: str, version: str) -> None:
    for obj in rendered[overlay]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay} {obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at {exc.path}")


def test_validation_catches_mistakes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Strict schemas constrain for real: an unknown (misspelt) field, a wrong type."""
    version = K8S_VERSIONS[-1]
    deployment = _one(rendered["cpu"], "Deployment", "cdb")
    bad = merge(deployment, {"spec": {"template": {"spec": {"terminationGracePeriod": 60}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    bad = merge(deployment, {"spec": {"template": {"spec": {"shareProcessNamespace": "yes"}}}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


# --- the Pod --------------------------------------------------------------------------------------------------


def test_the_stages_are_sidecars_of_the_scheduler(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    pod = _pod(rendered[overlay])
    assert [c["name"] for c in pod["initContainers"]] == list(STAGES)
    assert all(c["restartPolicy"] == "Always" for c in pod["initContainers"]), "restartable: native sidecars"
    assert [c["name"] for c in pod["containers"]] == ["scheduler"]
    assert len({c["image"] for c in _containers(pod).values()}) == 1
    expected = {"cpu": "cdb:latest", "gpu": "cdb:gpu"}[overlay]
    assert pod["containers"][0]["image"] == expected


def test_each_process_runs_the_compose_command(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Same ``python -m cdb stage|scheduler`` argv as docker-compose.yml (plus its GPU override for gpu)."""
    objects = rendered[overlay]
    containers = _containers(_pod(objects))
    model = _one(objects, "ConfigMap", "cdb-config")["data"]["CDB_MODEL"]
    compose = _compose_services(overlay, model)
    for name in CDB_SERVICES:
        assert _argv(objects, containers[name]) == command_argv(compose[name]), name


def test_the_engine_configuration_is_one_config_map(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Every container reads cdb-config (envFrom), which holds the engine options; the gpu overlay sets the
    device there, once."""
    objects = rendered[overlay]
    data = _one(objects, "ConfigMap", "cdb-config")["data"]
    assert all(k.startswith("CDB_") for k in data)
    assert {"CDB_MODEL", "CDB_DTYPE", "CDB_EXIT_THRESHOLD", "CDB_MAX_NUM_SEQS"} <= set(data)
    assert data.get("CDB_DEVICE") == ("cuda" if overlay == "gpu" else None)
    for name, container in _containers(_pod(objects)).items():
        assert {"configMapRef": {"name": "cdb-config"}} in container["envFrom"], name
        assert not any(e["name"] in data for e in container.get("env", [])), f"{name} overrides the shared config"


def test_the_pods_processes_run_the_compose_config(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Command AND environment of each container, resolved by the processes' own parsers: the four agree, the
    scheduler runs the config the launcher would give its children, and it is compose's (same model)."""
    objects = rendered[overlay]
    containers = _containers(_pod(objects))
    pod = {name: (_argv(objects, c), _env(objects, c)) for name, c in containers.items()}
    config = check_consistent(pod)
    compose = _compose_services(overlay, config.model)
    assert config == check_consistent({n: (command_argv(compose[n]), compose[n]["environment"]) for n in pod})
    if overlay == "gpu":
        assert (config.device, config.dtype) == ("cuda", DType.BFLOAT16), "the bank on the stages' device"
    else:
        assert (config.device, config.dtype) == ("cpu", DType.FLOAT32)


def test_probes(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    containers = _containers(_pod(objects))
    data = _one(objects, "ConfigMap", "cdb-env")["data"]
    compose = _compose_services(overlay, _one(objects, "ConfigMap", "cdb-config")["data"]["CDB_MODEL"])
    scheduler = containers["scheduler"]
    listen = _argv(objects, scheduler)[_argv(objects, scheduler).index("--listen") + 1]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        # Native gRPC probes (grpc.health.v1) on the public port, which needs no API key for them.
        assert scheduler[kind]["grpc"] == {"port": int(listen.rsplit(":", 1)[1])}, kind
        for role in STAGES:
            # A gRPC probe dials the Pod IP and the stages listen on loopback only: the compose healthcheck
            # command, run inside the container.
            assert containers[role][kind]["exec"]["command"] == compose[role]["healthcheck"]["test"][1:], role
    liveness = scheduler["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > float(data["CDB_STAGE_DOWN_LIMIT_S"]), (
        "a stage restart must not get the scheduler killed before its own stage-down limit"
    )
    for container in containers.values():
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "time to load a model"


def test_shared_memory_models_and_secret(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    pod = _pod(objects)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert _quantity(volumes["shm"]["emptyDir"]["sizeLimit"]) >= 256 * 2**20
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "cdb-models", "readOnly": True}
    assert _one(objects, "PersistentVolumeClaim", "cdb-models")["spec"]["resources"]["requests"]["storage"]
    secret = volumes["stage-secret"]["secret"]
    assert secret["secretName"] == "cdb-stage-secret" and secret["defaultMode"] == 0o400
    assert secret["items"] == [{"key": "stage-secret", "path": "stage-secret"}]
    secret_file = _one(objects, "ConfigMap", "cdb-env")["data"]["CDB_STAGE_SECRET_FILE"]
    # services.stage_secret accepts a group-readable file (fsGroup makes a Secret's 0400 a 0440) under /etc/cdb/.
    assert secret_file.startswith("/etc/cdb/")
    for name, container in _containers(pod).items():
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "shm", name
        assert mounts["/models"] == {"name": "models", "mountPath": "/models", "readOnly": True}, name
        assert secret_file == mounts[secret_file.rsplit("/", 1)[0]]["mountPath"] + "/stage-secret", name
        assert mounts[secret_file.rsplit("/", 1)[0]]["readOnly"] is True, name
        assert _env(objects, container)["CDB_STAGE_SECRET_FILE"] == secret_file, name


def test_non_root_and_read_only(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    pod = _pod(rendered[overlay])
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert user, "the image's numeric USER"
    uid, gid = user.groups()
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (int(uid), int(gid), int(gid))
    assert pod["automountServiceAccountToken"] is False
    for name, container in _containers(pod).items():
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp", "/dev/shm"}, "its writable paths"
        assert _env(rendered[overlay], container)["HOME"] == "/tmp", "caches go to the writable /tmp"


def test_resources(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for name, container in _containers(_pod(rendered[overlay])).items():
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert 0 < _quantity(requests[resource]) <= _quantity(limits[resource]), (name, resource)
        if overlay == "gpu":
            # One GPU replica per container; on a node with one time-sliced GPU they are one physical device.
            assert limits["nvidia.com/gpu"] == 1, name
        else:
            assert "nvidia.com/gpu" not in limits, name


def test_gpu_overlay_shares_one_device(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = _pod(rendered["gpu"])
    assert pod["shareProcessNamespace"] is True, "CUDA IPC between the containers' processes"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "4"}
    assert sum(c["resources"]["limits"]["nvidia.com/gpu"] for c in _containers(pod).values()) == 4
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["tolerations"][:2] == _pod(rendered["cpu"])["tolerations"], "the base tolerations stay"
    strategy = _one(rendered["gpu"], "Deployment", "cdb")["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}, "no spare GPU for a surge Pod"
    assert "shareProcessNamespace" not in _pod(rendered["cpu"])


def test_termination_drains(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    pod = _pod(objects)
    pre_stop = _containers(pod)["scheduler"]["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(_one(objects, "ConfigMap", "cdb-env")["data"]["CDB_DRAIN_TIMEOUT_S"])
    # The stages stop after the scheduler (sidecars), so the grace covers preStop + drain + the stages' stop.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    assert all("lifecycle" not in _containers(pod)[role] for role in STAGES)


def test_services(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    deployment = _one(objects, "Deployment", "cdb")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    named_ports = {p["name"]: p["containerPort"] for p in _containers(_pod(objects))["scheduler"]["ports"]}
    assert named_ports == {"grpc": 50051, "http": 8000, "metrics": 9464}
    cluster_ip, headless = _one(objects, "Service", "cdb"), _one(objects, "Service", "cdb-headless")
    assert cluster_ip["spec"]["type"] == "ClusterIP" and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False, "clients see ready Pods only"
    for service, ports in ((cluster_ip, {"grpc", "http"}), (headless, {"grpc", "http", "metrics"})):
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert {p["name"] for p in service["spec"]["ports"]} == ports
        for port in service["spec"]["ports"]:
            assert named_ports[port["targetPort"]] == port["port"]
        assert {p["appProtocol"] for p in service["spec"]["ports"] if p["name"] == "grpc"} == {"kubernetes.io/h2c"}
    assert deployment["spec"]["selector"]["matchLabels"] == cluster_ip["spec"]["selector"]


def test_disruption_budget_and_autoscaler(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = rendered[overlay]
    deployment = _one(objects, "Deployment", "cdb")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    pdb = _one(objects, "PodDisruptionBudget", "cdb")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    hpa = _one(objects, "HorizontalPodAutoscaler", "cdb")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cdb"}
    assert hpa["minReplicas"] > pdb["spec"]["maxUnavailable"] and hpa["maxReplicas"] > hpa["minReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    assert metric["pods"]["metric"]["name"] == Metrics().waiting.name == "cdb_requests_waiting"
    assert _one(objects, "Deployment", "cdb")["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9464",
        "prometheus.io/path": "/metrics",
    }


def test_prometheus_adapter_rule_serves_the_hpa_metric() -> None:
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    name = Metrics().waiting.name
    assert rule["seriesQuery"].startswith(name + "{") and re.fullmatch(rule["name"]["matches"], name)
    assert rule["name"]["as"] == name
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "by (<<.GroupBy>>)" in rule["metricsQuery"]


def test_deployment_page_documents_running_on_kubernetes() -> None:
    page = (ROOT / "docs" / "deployment.md").read_text()
    section = page[page.index("## Running on Kubernetes") :]
    section = section[: section.find("\n## ", 1)]
    for needle in ("kubectl apply -k deploy/k8s/overlays/cpu", "cdb-stage-secret", "cdb-headless", "cdb-models"):
        assert needle in section, needle
    assert (K8S / "README.md").is_file()


# --- the cpu Pod's containers, run here -----------------------------------------------------------------------


class PodTree(ProcessTree):
    """An overlay's Pod (cpu: the default) as local processes: each container's command, args (``$(VAR)``
    expanded) and environment, with its ports on free loopback ports and its volume mounts on local folders."""

    def __init__(self, workdir: Path, overlay: str = "cpu") -> None:
        objects = _render(overlay)
        pod = _pod(objects)
        (workdir / "tmp").mkdir()
        (workdir / "secret").mkdir()
        (workdir / "link-secret").mkdir()
        (workdir / "link").mkdir(mode=0o700)
        mounts = {m["name"]: m["mountPath"] for c in _containers(pod).values() for m in c["volumeMounts"]}
        paths = {"/tmp": workdir / "tmp", "/models": ROOT / "models", mounts["stage-secret"]: workdir / "secret"}
        for volume in ("link", "link-secret"):
            if volume in mounts:
                paths[mounts[volume]] = workdir / volume
        self.remap = Remap.free((50051, 50061, 50062, 50063, 8000, 9464), paths)
        # The Secret's content, made as docs/deployment.md says: cdb secret --out FILE --link-out FILE.
        secret_file, link_file = workdir / "secret" / "stage-secret", workdir / "link-secret" / "link-secret"
        made = run_once(
            ["python", "-m", "cdb", "secret", "--out", str(secret_file), "--link-out", str(link_file)], os.environ
        )
        assert made.returncode == 0, made.stderr
        assert stat.S_IMODE(secret_file.stat().st_mode) == stat.S_IMODE(link_file.stat().st_mode) == 0o600
        specs = []
        self.public = ""  # the container serving the public port (the one probed over gRPC)
        for name, container in _containers(pod).items():
            env = {**os.environ, **{k: self.remap(v) for k, v in _env(objects, container).items()}}
            argv = [self.remap(a) for a in _argv(objects, container)]
            probe = container["readinessProbe"]
            if "grpc" in probe:
                addr = f"127.0.0.1:{self.remap.ports[probe['grpc']['port']]}"
                self.public = name
            else:
                addr = self.remap(probe["exec"]["command"][3])
            specs.append(ProcessSpec(name, argv, env, addr))
        super().__init__(specs, workdir)
        self.metrics_port = self.remap.ports[9464]
        self.http_port = self.remap.ports[8000]


@pytest.fixture(scope="module", params=("cpu", "frontends"))
def pod_tree(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodTree]:
    t = PodTree(tmp_path_factory.mktemp(f"k8s-pod-{request.param}"), str(request.param))
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.slow
@pytest.mark.timeout(READY_WAIT_S + 120)
def test_the_pods_containers_serve_on_loopback(pod_tree: PodTree) -> None:
    """Each container ready through its probe, in the order the Pod starts them (the sidecars, then the main
    container); a generation through the public port's container; the autoscaler's metric on the metrics port."""
    from clients.sync_client import Client

    for name in pod_tree.procs:
        run = pod_tree.probe(name, READY_WAIT_S)
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}\n--- log:\n{pod_tree.tail(name)}"
        assert pod_tree.procs[name].poll() is None, f"{name} exited:\n{pod_tree.tail(name)}"
    with Client(pod_tree.addr[pod_tree.public], timeout=60) as client:
        result = client.generate("And God said", max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4
    with urllib.request.urlopen(f"http://127.0.0.1:{pod_tree.metrics_port}/metrics", timeout=10) as resp:
        assert f"# TYPE {Metrics().waiting.name} gauge" in resp.read().decode(), "the autoscaler's metric"


# --- overlays/frontends: the public ports in a front-end container ----------------------------------------------


@pytest.fixture(scope="module")
def front_objects() -> list[dict[str, Any]]:
    return _render("frontends")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_frontends_overlay_is_valid(front_objects: list[dict[str, Any]], version: str) -> None:
    assert {(o["kind"], o["metadata"]["name"]) for o in front_objects} == OBJECTS
    for obj in front_objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"frontends {obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at {exc.path}")


def test_with_a_front_end_the_scheduler_is_the_last_sidecar_and_runs_the_compose_overrides_commands(
    rendered: dict[str, list[dict[str, Any]]], front_objects: list[dict[str, Any]]
) -> None:
    """Start order stages → scheduler → front end, stop order the reverse (the front end, the main container,
    drains first); the stages unchanged from the cpu Pod; the scheduler's and the front end's commands those of
    deploy/docker-compose.frontends.yml (one front end here: no ``--join``), meeting in the link volume; one engine
    config for all five."""
    pod, cpu = _pod(front_objects), _pod(rendered["cpu"])
    assert [c["name"] for c in pod["initContainers"]] == [*STAGES, "scheduler"]
    assert all(c["restartPolicy"] == "Always" for c in pod["initContainers"]), "native sidecars"
    assert [c["name"] for c in pod["containers"]] == [FRONTEND_SERVICE]
    assert pod["initContainers"][:3] == cpu["initContainers"], "the stages as in the cpu Pod"
    containers = _containers(pod)
    assert len({c["image"] for c in containers.values()}) == 1
    model = _one(front_objects, "ConfigMap", "cdb-config")["data"]["CDB_MODEL"]
    compose = interpolate(merge(load(), load(FRONTENDS_OVERRIDE)), {"CDB_MODEL": model})["services"]
    sched_argv = _argv(front_objects, containers["scheduler"])
    front_argv = _argv(front_objects, containers[FRONTEND_SERVICE])
    assert sched_argv == command_argv(compose["scheduler"])
    assert front_argv == [a for a in command_argv(compose[FRONTEND_SERVICE]) if a != "--join"]
    (link,) = flag_values(sched_argv, "--link")
    assert flag_values(front_argv, "--link") == [link] and link.startswith(f"unix:{LINK_DIR}/")
    assert {v["name"]: v for v in pod["volumes"]}["link"]["emptyDir"]["medium"] == "Memory"
    for name in ("scheduler", FRONTEND_SERVICE):
        mounts = {m["mountPath"]: m["name"] for m in containers[name]["volumeMounts"]}
        assert mounts[LINK_DIR] == "link" and mounts["/models"] == "models", name
    front_mounts = {m["name"]: m["mountPath"] for m in containers[FRONTEND_SERVICE]["volumeMounts"]}
    front_env = _env(front_objects, containers[FRONTEND_SERVICE])
    assert "stage-secret" not in front_mounts and front_env["CDB_STAGE_SECRET_FILE"] == "", "it reaches no stage"
    assert front_env["CDB_LINK_SECRET_FILE"] == front_mounts["link-secret"] + "/link-secret"
    engine = {n: effective(_argv(front_objects, c), _env(front_objects, c)).engine for n, c in containers.items()}
    assert len(set(map(repr, engine.values()))) == 1, "the five processes run one engine config"


def test_with_a_front_end_it_holds_the_public_ports_and_probes(front_objects: list[dict[str, Any]]) -> None:
    containers = _containers(_pod(front_objects))
    front, sched = containers[FRONTEND_SERVICE], containers["scheduler"]
    assert {p["name"]: p["containerPort"] for p in front["ports"]} == {"grpc": 50051, "http": 8000}
    assert {p["name"]: p["containerPort"] for p in sched["ports"]} == {"metrics": 9464}
    for service in (_one(front_objects, "Service", "cdb"), _one(front_objects, "Service", "cdb-headless")):
        for port in service["spec"]["ports"]:  # named target ports: found in whichever container declares them
            assert port["targetPort"] in {"grpc", "http", "metrics"}
    assert _env(front_objects, front)["CDB_HTTP_ADDR"] == "0.0.0.0:8000"
    assert _env(front_objects, sched)["CDB_METRICS_ADDR"] == "0.0.0.0:9464"
    listen = flag_values(_argv(front_objects, sched), "--listen")[0]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert front[kind]["grpc"] == {"port": 50051}, kind
        assert sched[kind]["exec"]["command"] == ["python", "-m", "services.healthcheck", listen, "--timeout", "3"]
    pre_stop = front["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(_one(front_objects, "ConfigMap", "cdb-env")["data"]["CDB_DRAIN_TIMEOUT_S"])
    assert _pod(front_objects)["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    assert "lifecycle" not in sched, "the front end drains; the scheduler stops after it"


def test_deployment_page_documents_the_frontends_overlay() -> None:
    assert "deploy/k8s/overlays/frontends" in (ROOT / "docs" / "deployment.md").read_text()
    assert "overlays/frontends" in (K8S / "README.md").read_text()
