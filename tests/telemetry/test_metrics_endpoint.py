"""Metrics: the typed API, the Prometheus text and OpenMetrics formats, and real scrapes of the HTTP endpoint."""

from __future__ import annotations

import gzip
import re
import threading
import timeit
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from services.telemetry.metrics import CONTENT_TYPE, Metrics
from services.telemetry.metrics_endpoint import MetricsServer, metrics_address_from_env, serve_metrics

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# Every cdb family with its type: the names dashboards, alerts and the autoscaler read.
CDB_FAMILIES = {
    "cdb_time_to_first_token_seconds": "histogram",
    "cdb_inter_token_latency_seconds": "histogram",
    "cdb_e2e_request_latency_seconds": "histogram",
    "cdb_request_queue_time_seconds": "histogram",
    "cdb_requests_waiting": "gauge",
    "cdb_requests_running": "gauge",
    "cdb_loop_batch_occupancy": "histogram",
    "cdb_loop_batch_size": "histogram",
    "cdb_served_depth": "histogram",
    "cdb_served_depth_mean": "gauge",
    "cdb_exit_threshold": "gauge",
    "cdb_refill_events_total": "counter",
    "cdb_spec_drafts_total": "counter",
    "cdb_spec_verified_total": "counter",
    "cdb_spec_wasted_loop_steps_total": "counter",
    "cdb_loop_decode_compute_seconds_total": "counter",
    "cdb_stage_compute_seconds": "histogram",
    "cdb_stages_attached": "gauge",
    "cdb_stage_recoveries_total": "counter",
    "cdb_recomputed_requests_total": "counter",
    "cdb_kv_blocks_used": "gauge",
    "cdb_kv_blocks_total": "gauge",
    "cdb_bank_rows_used": "gauge",
    "cdb_bank_rows_total": "gauge",
    "cdb_requests_finished_total": "counter",
    "cdb_requests_rejected_total": "counter",
    "cdb_prompt_tokens_total": "counter",
    "cdb_generation_tokens_total": "counter",
    "cdb_loop_steps_total": "counter",
    "cdb_model_info": "gauge",
    "cdb_engine_thread_cpu_seconds_total": "counter",
    "cdb_synthetic_stages": "gauge",
    "cdb_kv_cache_usage_perc": "gauge",
    "cdb_num_preemptions_total": "counter",
    "cdb_prefix_cache_queries_total": "counter",
    "cdb_prefix_cache_hits_total": "counter",
    "cdb_prefix_cache_blocks": "gauge",
    "cdb_request_time_per_output_token_seconds": "histogram",
    "cdb_request_prompt_tokens": "histogram",
    "cdb_request_generation_tokens": "histogram",
}
_LABELLED_COUNTERS = (
    "cdb_requests_finished_total",
    "cdb_requests_rejected_total",
    "cdb_engine_thread_cpu_seconds_total",
    "cdb_spec_verified_total",
)

M = 'model_name="ouro-tiny"'  # the request series' label, last
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


MODEL_NAME = re.compile(r',?model_name="(?:[^"\\]|\\.)*"')


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """Minimal Prometheus 0.0.4 parser: (metric family → type, 'name{labels}' → value). Asserts well-formed (the
    library's own parser too), and that every cdb series carries ``model_name``; each sample is under its key both
    with and without that label (``name{le="1.0"}`` and ``name{le="1.0",model_name="m"}``)."""
    assert list(parse_prometheus(text))
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
            key = m.group(1) + (m.group(2) or "")
            samples[key] = float(m.group(3))
            if m.group(1).startswith("cdb_") and not m.group(1).endswith("_created"):
                assert "model_name=" in key, f"a cdb series without model_name: {line!r}"
                bare = MODEL_NAME.sub("", key).replace("{,", "{").replace("{}", "")
                samples.setdefault(bare, float(m.group(3)))
    return types, samples


@pytest.fixture
def server() -> Iterator[tuple[Metrics, MetricsServer]]:
    metrics = Metrics(model="ouro-tiny", max_depth=4)
    srv = serve_metrics(metrics, "127.0.0.1:0")
    yield metrics, srv
    srv.close()


def _get(srv: MetricsServer, path: str, **headers: str) -> tuple[int, str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            body = resp.read()
            if resp.headers["Content-Encoding"] == "gzip":
                body = gzip.decompress(body)
            return resp.status, resp.headers["Content-Type"], body.decode()
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
    metrics.observe_loop_batch(size=6, capacity=8, compute_s=0.0008)
    metrics.observe_stage_compute("loop", 0.0008)
    metrics.observe_stage_compute("head", 0.0003)
    metrics.inc_refills(3)
    metrics.inc_speculation(drafts=5, accepted=3, rejected=1, wasted_steps=4)
    metrics.set_queue_sizes(waiting=2, running=5)
    metrics.set_kv_blocks(used=10, total=64)
    metrics.set_bank_rows(used=5, total=40)

    status, ctype, text = _get(srv, "/metrics")
    assert status == 200 and ctype == CONTENT_TYPE
    types, s = parse(text)
    assert types["cdb_time_to_first_token_seconds"] == "histogram"
    assert types["cdb_requests_waiting"] == "gauge"
    assert types["cdb_refill_events_total"] == "counter"
    assert s[f'cdb_time_to_first_token_seconds_bucket{{le="0.01",{M}}}'] == 0
    assert s[f'cdb_time_to_first_token_seconds_bucket{{le="0.025",{M}}}'] == 1
    assert s[f'cdb_time_to_first_token_seconds_bucket{{le="+Inf",{M}}}'] == 1
    assert s[f"cdb_time_to_first_token_seconds_sum{{{M}}}"] == 0.02
    assert s[f"cdb_inter_token_latency_seconds_count{{{M}}}"] == 2
    assert s[f"cdb_request_queue_time_seconds_count{{{M}}}"] == 1
    assert s['cdb_served_depth_bucket{le="2.0"}'] == 2 and s['cdb_served_depth_bucket{le="4.0"}'] == 3
    assert s["cdb_generation_tokens_total"] == 3 and s["cdb_loop_steps_total"] == 8
    assert s["cdb_prompt_tokens_total"] == 7
    assert s[f'cdb_requests_finished_total{{finish_reason="stop",{M}}}'] == 1
    assert s[f'cdb_requests_finished_total{{finish_reason="cancelled",{M}}}'] == 1
    assert s[f'cdb_requests_rejected_total{{code="RESOURCE_EXHAUSTED",{M}}}'] == 1
    assert s[f"cdb_e2e_request_latency_seconds_count{{{M}}}"] == 2
    assert s['cdb_loop_batch_occupancy_bucket{le="0.7"}'] == 0
    assert s['cdb_loop_batch_occupancy_bucket{le="0.8"}'] == 1
    assert s['cdb_loop_batch_size_bucket{le="8.0"}'] == 1
    assert s['cdb_stage_compute_seconds_count{stage="loop"}'] == 1
    assert s['cdb_stage_compute_seconds_bucket{le="0.0005",stage="head"}'] == 1
    assert s["cdb_refill_events_total"] == 3
    assert s["cdb_spec_drafts_total"] == 5 and s["cdb_spec_wasted_loop_steps_total"] == 4
    assert s[f'cdb_spec_verified_total{{{M},outcome="accepted"}}'] == 3
    assert s[f'cdb_spec_verified_total{{{M},outcome="rejected"}}'] == 1
    assert s["cdb_loop_decode_compute_seconds_total"] == pytest.approx(0.0008)
    assert (s["cdb_requests_waiting"], s["cdb_requests_running"]) == (2, 5)
    assert (s["cdb_kv_blocks_used"], s["cdb_kv_blocks_total"]) == (10, 64)
    assert s["cdb_kv_cache_usage_perc"] == 10 / 64
    assert (s["cdb_bank_rows_used"], s["cdb_bank_rows_total"]) == (5, 40)
    assert s['cdb_model_info{model="ouro-tiny"}'] == 1


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    m = Metrics(max_depth=3)
    for v in (1, 1, 2, 3, 5):  # 5 is above every bound: only +Inf
        m.depth.observe(v)
    _, s = parse(m.render())
    assert [s[f'cdb_served_depth_bucket{{le="{b}"}}'] for b in ("1.0", "2.0", "3.0", "+Inf")] == [2, 3, 4, 5]
    assert s["cdb_served_depth_count"] == 5 and s["cdb_served_depth_sum"] == 12


def test_label_values_are_escaped() -> None:
    m = Metrics(model='we"ird\\name\n')
    _, s = parse(m.render())
    assert s['cdb_model_info{model="we\\"ird\\\\name\\n"}'] == 1


def test_fresh_metrics_render_and_other_paths(server: tuple[Metrics, MetricsServer]) -> None:
    _, srv = server
    types, s = parse(_get(srv, "/metrics")[2])
    created = {  # the library's _created series: of unlabelled counters and histograms until a labelled one is used
        f"{name.removesuffix('_total')}_created": "gauge"
        for name, kind in CDB_FAMILIES.items()
        if kind != "gauge" and name not in ("cdb_stage_compute_seconds", *_LABELLED_COUNTERS)
    }
    unset = {k: v for k, v in CDB_FAMILIES.items() if k != "cdb_stages_attached"}  # exported once set
    assert {name: kind for name, kind in types.items() if name.startswith("cdb_")} == unset | created
    assert s["cdb_requests_running"] == 0 and s["cdb_refill_events_total"] == 0
    assert not any(k.startswith("cdb_exit_threshold") for k in s)  # no series before the collector sets one
    assert _get(srv, "/")[0] == 200
    assert _get(srv, "/nope")[0] == 404


def test_process_platform_and_gc_collectors_are_in_the_registry() -> None:
    types, s = parse(Metrics().render())
    assert types["process_cpu_seconds_total"] == "counter" and s["process_resident_memory_bytes"] > 0
    assert any(k.startswith("python_info{") for k in s)
    assert 'python_gc_objects_collected_total{generation="0"}' in s


def test_openmetrics_is_negotiated_on_the_accept_header(server: tuple[Metrics, MetricsServer]) -> None:
    metrics, srv = server
    metrics.inc_refills(2)
    metrics.observe_stage_compute("loop", 0.0008)
    status, ctype, text = _get(srv, "/metrics", Accept="application/openmetrics-text; version=1.0.0")
    assert status == 200 and ctype.startswith(OPENMETRICS) and text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(text)}  # raises on malformed input
    assert families["cdb_refill_events"].type == "counter"
    (total,) = [x for x in families["cdb_refill_events"].samples if x.name == "cdb_refill_events_total"]
    assert total.value == 2
    assert families["cdb_stage_compute_seconds"].type == "histogram"
    # the same through the API, and the text format by default or for a plain-text Accept
    body, ctype = metrics.exposition("application/openmetrics-text")
    assert ctype.startswith(OPENMETRICS) and body.decode().endswith("# EOF\n")
    assert metrics.exposition(None)[1] == metrics.exposition("text/plain")[1] == CONTENT_TYPE
    assert metrics.exposition(None)[0].decode().startswith("# HELP cdb_time_to_first_token_seconds ")


def test_gzip_and_name_filter_of_the_library_app(server: tuple[Metrics, MetricsServer]) -> None:
    metrics, srv = server
    metrics.add_collector(lambda m: m.set_queue_sizes(waiting=4, running=1))
    status, _, text = _get(srv, "/metrics?name[]=cdb_requests_waiting", **{"Accept-Encoding": "gzip"})
    types, s = parse(text)
    assert status == 200 and types == {"cdb_requests_waiting": "gauge"}
    assert s == {"cdb_requests_waiting": 4, f"cdb_requests_waiting{{{M}}}": 4}


def test_each_metrics_has_its_own_registry() -> None:
    a, b = Metrics(model="a"), Metrics(model="b")
    a.inc_refills(3)
    assert a.refills.value() == 3 and b.refills.value() == 0
    assert 'cdb_model_info{model="b"}' in parse(b.render())[1] and 'cdb_model_info{model="a"}' not in b.render()


def test_sampled_gauges_and_counters() -> None:
    m = Metrics()
    m.set_exit_threshold(0.5, "hazard", "family-default")
    m.set_exit_threshold(0.3, "hazard", "option")  # replaces the series: one threshold is in effect
    m.set_mean_depth(2.75)
    m.set_stages_attached(False)
    m.inc_recoveries(1, recomputed=3)
    m.inc_recoveries(0)
    _, s = parse(m.render())
    assert s['cdb_exit_threshold{rule="hazard",source="option"}'] == 0.3
    assert 'cdb_exit_threshold{rule="hazard",source="family-default"}' not in s
    assert s["cdb_served_depth_mean"] == 2.75 and s["cdb_stages_attached"] == 0
    assert s["cdb_stage_recoveries_total"] == 1 and s["cdb_recomputed_requests_total"] == 3
    m.set_stages_attached(True)
    assert m.stages_attached.value() == 1


def test_wrong_label_count_is_a_clear_error() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="Incorrect label count"):
        m.compute.observe(0.1)  # the stage label is missing
    with pytest.raises(ValueError, match="Incorrect label count"):
        m.finished.inc(1, "stop", "extra")


def test_cost_per_observation() -> None:
    """The hot-path figures of the module docstring (``-s`` prints them); the bound is loose (a loaded box)."""
    m, n = Metrics(), 20000
    cost = {
        "histogram observe": min(timeit.repeat(lambda: m.observe_itl(0.004), number=n, repeat=3)) / n * 1e6,
        "labelled counter inc": min(timeit.repeat(lambda: m.finished.inc(1, "stop"), number=n, repeat=3)) / n * 1e6,
    }
    print(", ".join(f"{k}: {v:.2f} us" for k, v in cost.items()))
    assert all(v < 5 for v in cost.values()), cost


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


def test_the_endpoint_serves_a_bounded_number_of_connections_and_closes_idle_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections past ``MAX_CONNECTIONS`` are closed at once (no thread each); a connection that sends nothing
    is closed after ``CONNECTION_TIMEOUT_S``; then scrapes are served again."""
    import socket

    import services.telemetry.metrics_endpoint as endpoint

    monkeypatch.setattr(endpoint, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(endpoint._QuietHandler, "timeout", 0.5)
    srv = MetricsServer(Metrics(), "127.0.0.1", 0)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", srv.port))  # (accepted after them: connections queue in order)
        extra.settimeout(5)
        assert extra.recv(1) == b"", "closed at once: over the cap"
        extra.close()
        for sock in idle:
            sock.settimeout(5)
            assert sock.recv(1) == b"", "an idle connection is closed after the timeout"
            sock.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as resp:
            assert resp.status == 200
    finally:
        srv.close()
