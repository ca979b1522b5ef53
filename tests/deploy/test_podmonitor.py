"""deploy/k8s/podmonitor.yaml, checked without a cluster: its fields against the part of the Prometheus operator's
PodMonitor schema (monitoring.coreos.com/v1) it uses, strict (a misspelt field fails), and against the rendered
Deployment: it selects the cdb Pods and scrapes the scheduler's named metrics port at the path it serves."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml

from services.telemetry.metrics import Metrics
from services.telemetry.metrics_endpoint import metrics_app
from tests.deploy.kustomize import build
from tests.deploy.process_tree import ROOT

pytestmark = pytest.mark.timeout(30)
K8S = ROOT / "deploy" / "k8s"
PODMONITOR = K8S / "podmonitor.yaml"
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
# The fields of the operator's CRD (example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml) that
# this manifest may use, with their types; anything else is refused.
SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {"name": _NAME, "namespace": _NAME, "labels": _LABELS, "annotations": _LABELS},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _NAME}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def _get(path: str) -> dict[str, Any]:
    """The WSGI environ of ``GET path``."""
    return {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": ""}


@pytest.fixture(scope="module")
def monitor() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(PODMONITOR.read_text())
    return loaded


@pytest.fixture(scope="module")
def pod_template() -> dict[str, Any]:
    (deployment,) = [o for o in build(K8S / "overlays" / "cpu", root=K8S) if o["kind"] == "Deployment"]
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def test_the_podmonitor_fits_the_operators_schema(monitor: dict[str, Any]) -> None:
    jsonschema.validate(monitor, SCHEMA)
    misspelt = {**monitor, "spec": {**monitor["spec"], "podMetricEndpoints": monitor["spec"]["podMetricsEndpoints"]}}
    with pytest.raises(jsonschema.ValidationError):  # the check is strict
        jsonschema.validate(misspelt, SCHEMA)


def test_the_podmonitor_scrapes_the_schedulers_metrics(monitor: dict[str, Any], pod_template: dict[str, Any]) -> None:
    spec = monitor["spec"]
    pod_labels = pod_template["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items(), "selects the cdb Pods"
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert monitor["metadata"]["namespace"] == kustomization["namespace"] == spec["namespaceSelector"]["matchNames"][0]
    assert "podmonitor.yaml" not in kustomization["resources"], "it needs the operator's CRD: applied on its own"
    ports = {p["name"]: p["containerPort"] for c in pod_template["spec"]["containers"] for p in c.get("ports", [])}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == 9464
    status: list[str] = []
    body = b"".join(metrics_app(Metrics())(_get(endpoint["path"]), lambda s, h: status.append(s)))
    assert status == ["200 OK"] and b"# TYPE cdb_requests_waiting gauge" in body
