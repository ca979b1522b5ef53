"""Metrics: the typed API, the Prometheus text format, and a real scrape of the HTTP endpoint."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from services.telemetry.metrics import CONTENT_TYPE, Metrics, MetricsServer, metrics_address_from_env, serve_metrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """Minimal Prometheus 0.0.4 parser: (metric family → type, 'name{labels}' → value). Asserts well-formed."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
        elif line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
        else:
            m = SAMPLE.match(line)
            assert m, f"malformed sample line: {line!r}"
            family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
            assert m.group(1) in types or family in types, f"sample before its TYPE: {line!r}"
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return types, samples


@pytest.fixture
def server() -> Iterator[tuple[Metrics, MetricsServer]]:
    metrics = Metrics(model="ouro-tiny", max_depth=4)
    srv = serve_metrics(metrics, "127.0.0.1:0")
    yield metrics, srv
    srv.close()


def _get(srv: MetricsServer, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_scrape_reports_what_was_observed(server: tuple[Metrics, MetricsServer]) -> None:
    metrics, srv = server
    metrics.observe_admitted(prompt_tokens=7)
    metrics.observe_queue_time(0.003)
    metrics.observe_ttft(0.02)
    for gap in (0.004, 0.006):
        metrics.observe_itl(gap)
    for depth in (4, 2, 2):
        metrics.observe_token_depth(depth)
    metrics.observe_request_end(0.05, "stop")
    metrics.observe_request_end(0.5, "cancelled")
    metrics.observe_rejected("RESOURCE_EXHAUSTED")
    metrics.observe_loop_batch(size=6, capacity=8)
    metrics.observe_stage_compute("loop", 0.0008)
    metrics.observe_stage_compute("head", 0.0003)
    metrics.inc_refills(3)
    metrics.set_queue_sizes(waiting=2, running=5)
    metrics.set_kv_blocks(used=10, total=64)
    metrics.set_bank_rows(used=5, total=40)

    status, ctype, text = _get(srv, "/metrics")
    assert status == 200 and ctype == CONTENT_TYPE
    types, s = parse(text)
    assert types["cdb_time_to_first_token_seconds"] == "histogram"
    assert types["cdb_requests_waiting"] == "gauge"
    assert types["cdb_refill_events_total"] == "counter"
    assert s['cdb_time_to_first_token_seconds_bucket{le="0.01"}'] == 0
    assert s['cdb_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert s['cdb_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert s["cdb_time_to_first_token_seconds_sum"] == 0.02
    assert s["cdb_inter_token_latency_seconds_count"] == 2
    assert s["cdb_request_queue_time_seconds_count"] == 1
    assert s['cdb_served_depth_bucket{le="2"}'] == 2 and s['cdb_served_depth_bucket{le="4"}'] == 3
    assert s["cdb_generation_tokens_total"] == 3 and s["cdb_loop_steps_total"] == 8
    assert s["cdb_prompt_tokens_total"] == 7
    assert s['cdb_requests_finished_total{finish_reason="stop"}'] == 1
    assert s['cdb_requests_finished_total{finish_reason="cancelled"}'] == 1
    assert s['cdb_requests_rejected_total{code="RESOURCE_EXHAUSTED"}'] == 1
    assert s["cdb_e2e_request_latency_seconds_count"] == 2
    assert s['cdb_loop_batch_occupancy_bucket{le="0.7"}'] == 0
    assert s['cdb_loop_batch_occupancy_bucket{le="0.8"}'] == 1
    assert s['cdb_loop_batch_size_bucket{le="8"}'] == 1
    assert s['cdb_stage_compute_seconds_count{stage="loop"}'] == 1
    assert s['cdb_stage_compute_seconds_bucket{stage="head",le="0.0005"}'] == 1
    assert s["cdb_refill_events_total"] == 3
    assert (s["cdb_requests_waiting"], s["cdb_requests_running"]) == (2, 5)
    assert (s["cdb_kv_blocks_used"], s["cdb_kv_blocks_total"]) == (10, 64)
    assert (s["cdb_bank_rows_used"], s["cdb_bank_rows_total"]) == (5, 40)
    assert s['cdb_model_info{model="ouro-tiny"}'] == 1


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    m = Metrics(max_depth=3)
    for v in (1, 1, 2, 3, 5):  # 5 is above every bound: only +Inf
        m.depth.observe(v)
    _, s = parse(m.render())
    assert [s[f'cdb_served_depth_bucket{{le="{b}"}}'] for b in ("1", "2", "3", "+Inf")] == [2, 3, 4, 5]
    assert s["cdb_served_depth_count"] == 5 and s["cdb_served_depth_sum"] == 12


def test_label_values_are_escaped() -> None:
    m = Metrics(model='we"ird\\name\n')
    _, s = parse(m.render())
    assert s['cdb_model_info{model="we\\"ird\\\\name\\n"}'] == 1


def test_fresh_metrics_render_and_other_paths(server: tuple[Metrics, MetricsServer]) -> None:
    _, srv = server
    types, s = parse(_get(srv, "/metrics")[2])
    assert len(types) == 21 and s["cdb_requests_running"] == 0
    assert _get(srv, "/")[0] == 200
    assert _get(srv, "/nope")[0] == 404


def test_concurrent_observations_are_not_lost() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(5000):
            m.observe_itl(0.001)
            m.inc_refills()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.itl.count() == 20000 and m.refills.value() == 20000


def test_address_from_env() -> None:
    assert metrics_address_from_env({}) is None
    assert metrics_address_from_env({"CDB_METRICS_ADDR": ""}) is None
    assert metrics_address_from_env({"CDB_METRICS_ADDR": "0.0.0.0:9464"}) == "0.0.0.0:9464"
