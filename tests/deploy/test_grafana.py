"""deploy/grafana: the dashboard is valid JSON, lays its panels out without overlap, shows depth, refill, occupancy,
throughput and latency, and every PromQL expression reads only series that a real scrape of the scheduler's
/metrics endpoint exports, grouped by labels those series carry."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry.metrics import Metrics
from services.telemetry.metrics_endpoint import serve_metrics
from tests.deploy.process_tree import ROOT

pytestmark = pytest.mark.timeout(30)
DASHBOARD = ROOT / "deploy" / "grafana" / "cdb-dashboard.json"
# What PromQL itself names: functions, aggregations, keywords.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without", "on",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "topk", "bottomk",
    "max_over_time", "clamp_min", "clamp_max", "label_values",
}  # fmt: skip
TARGET_LABELS = {"instance", "job", "pod", "namespace", "container"}  # added by Prometheus to every scraped series
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from _panels(p.get("panels", []))


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", var["query"]["query"]))
    return exprs


def _references(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric name → label names its selectors match on, label names grouped by) of one PromQL expression."""
    grouped: set[str] = set()
    for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouped |= {x.strip() for x in labels.split(",") if x.strip()}
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges: [5m], [$__rate_interval]
    metrics: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", expr):
        metrics.setdefault(name, set()).update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\b\d+(?:\.\d+)?\b", " ", expr)
    for word in IDENT.findall(expr):
        if word not in PROMQL_WORDS:
            metrics.setdefault(word, set())
    return metrics, grouped


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name → its label names, from a real scrape of a ``Metrics`` whose every labelled series is in use."""
    m = Metrics(model="ouro-kjv", max_depth=4)
    m.observe_admitted(5)
    m.observe_token_depth(3)
    m.observe_request_end(0.5, "stop")
    m.observe_request_tokens(5, 1, None)
    m.observe_rejected("RESOURCE_EXHAUSTED")
    m.observe_loop_batch(2, 4, 0.001)
    m.observe_stage_compute("loop", 0.001)
    m.set_exit_threshold(0.5, "hazard", "family-default")
    m.set_stages_attached(True)
    m.inc_engine_cpu("plan", 0.1)
    m.inc_preemptions(1)
    m.set_kv_blocks(1, 4)
    server = serve_metrics(m, "127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_dashboard_is_grafana_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "cdb-overview" and dashboard["schemaVersion"] >= 36
    panels = [p for p in _panels(dashboard["panels"])]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        for t in p.get("targets", []):
            assert t["expr"].strip() and t["refId"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model"}


def test_the_dashboard_shows_this_systems_story(dashboard: dict[str, Any]) -> None:
    by_metric: dict[str, list[str]] = {}
    for p in _panels(dashboard["panels"]):
        for t in p.get("targets", []):
            for name in _references(t["expr"])[0]:
                by_metric.setdefault(name, []).append(p["title"])
    story = {
        "depth": "cdb_served_depth_bucket",
        "refill": "cdb_refill_events_total",
        "occupancy": "cdb_loop_batch_occupancy_sum",
        "throughput": "cdb_generation_tokens_total",
        "latency": "cdb_time_to_first_token_seconds_bucket",
        "e2e latency": "cdb_e2e_request_latency_seconds_bucket",
        "time per output token": "cdb_request_time_per_output_token_seconds_bucket",
        "KV usage": "cdb_kv_cache_usage_perc",
        "queue": "cdb_requests_waiting",
        "preemptions": "cdb_num_preemptions_total",
    }
    missing = {what: name for what, name in story.items() if name not in by_metric}
    assert not missing, missing


def test_every_expression_reads_exported_series(dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    exprs = _expressions(dashboard)
    assert len(exprs) > 20
    for expr in exprs:
        metrics, grouped = _references(expr)
        assert any(name.startswith("cdb_") for name in metrics), expr
        for name, matched in metrics.items():
            assert name in exported, f"{name} is not exported (in {expr!r})"
            assert matched <= exported[name] | TARGET_LABELS, f"{name} has no label {matched - exported[name]}"
        carried = set().union(*(exported[name] for name in metrics)) | TARGET_LABELS
        assert grouped <= carried, f"grouped by {grouped - carried}, which no series of {expr!r} carries"


def test_the_reference_check_can_fail(exported: dict[str, set[str]]) -> None:
    """The parser finds what a wrong expression gets wrong: a misspelt family, a label the series lacks."""
    metrics, grouped = _references('sum by (stage) (rate(cdb_refil_events_total{finish_reason="stop"}[5m]))')
    assert metrics == {"cdb_refil_events_total": {"finish_reason"}} and grouped == {"stage"}
    assert "cdb_refil_events_total" not in exported
    assert "finish_reason" not in exported["cdb_refill_events_total"]
    assert "model_name" in exported["cdb_refill_events_total"]  # every series carries it
    assert "stage" in exported["cdb_stage_compute_seconds_bucket"] and "le" in exported["cdb_served_depth_bucket"]
