"""deploy/k8s/overlays/inference-pool, checked without a cluster: cdb replicas behind the Gateway API Inference
Extension. The InferencePool validates against the InferencePool CRD's own schema (``gaie-inferencepool-crd.yaml``,
vendored), every other object against Kubernetes' (strict); the pool selects the cdb Pods on their HTTP port; the
endpoint picker runs with the pool's name and reads series that cdb really exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.telemetry.metrics import Metrics
from tests.deploy.kustomize import build
from tests.deploy.process_tree import ROOT

K8S = ROOT / "deploy" / "k8s"
CRD = Path(__file__).with_name("gaie-inferencepool-crd.yaml")


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build(K8S / "overlays" / "inference-pool", root=K8S)}


def pool_schema(version: str) -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def test_the_pool_is_valid_under_its_crd_and_a_broken_one_is_not(objects: dict[tuple[str, str], Any]) -> None:
    pool = objects["InferencePool", "cdb"]
    group, _, version = pool["apiVersion"].partition("/")
    assert group == yaml.safe_load(CRD.read_text())["spec"]["group"]
    schema = pool_schema(version)
    jsonschema.validate(pool, schema)
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": "8000"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**pool, "spec": {"targetPorts": pool["spec"]["targetPorts"]}}, schema)  # no selector


@pytest.mark.parametrize("version", ("1.30", kubernetes_validate.utils.latest_version()))
def test_every_other_object_is_valid(objects: dict[tuple[str, str], Any], version: str) -> None:
    for (kind, name), obj in objects.items():
        if kind != "InferencePool":
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kind}/{name} on {version}: {exc.message} at {exc.path}")


def test_the_pool_selects_the_cdb_pods_on_their_http_port(objects: dict[tuple[str, str], Any]) -> None:
    pool, cdb = objects["InferencePool", "cdb"], objects["Deployment", "cdb"]
    pod_labels = cdb["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {
        p["name"]: p["containerPort"] for c in cdb["spec"]["template"]["spec"]["containers"] for p in c.get("ports", ())
    }
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]  # it serves /metrics too
    assert pool["metadata"]["namespace"] == cdb["metadata"]["namespace"] == "cdb"


def test_the_picker_serves_the_pool_and_reads_series_cdb_exports(objects: dict[tuple[str, str], Any]) -> None:
    pool, epp, service = (
        objects["InferencePool", "cdb"],
        objects["Deployment", "cdb-epp"],
        objects["Service", "cdb-epp"],
    )
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert (args["pool-name"], args["pool-namespace"]) == (pool["metadata"]["name"], pool["metadata"]["namespace"])
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    config = yaml.safe_load(objects["ConfigMap", "cdb-epp"]["data"][Path(args["config-file"]).name])
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert extractor["parameters"]["defaultEngine"] == engine["name"]
    exported = {f.name for f in Metrics(model="m").collect()}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert engine[key].split("{")[0] in exported, key
    (source,) = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"] == {"scheme": "http", "path": "/metrics"}
    role = objects["Role", "cdb-epp"]
    assert {"pods", "inferencepools"} <= {r for rule in role["rules"] for r in rule["resources"]}
