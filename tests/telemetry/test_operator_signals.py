"""Operators' signals: the KV-cache usage ratio, the model label on request series, per-request TPOT and token
histograms, preemptions, latency buckets to hours (and from the settings), and OTLP over HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from cdb_engine.events import FinishEvent, TokenEvent
from cdb_scheduler.request import FinishReason
from services import telemetry
from services.settings.checks import SettingsError, parse_buckets
from services.settings.source import load_settings
from services.telemetry.exporters import OtlpHttpExporter
from services.telemetry.metric_series import LATENCY_BUCKETS
from services.telemetry.metrics import Metrics
from services.telemetry.recorder import EngineGauges
from services.telemetry.request_observer import ObservedRequest
from tests.telemetry.test_metrics_endpoint import parse

pytestmark = pytest.mark.timeout(30)
MODEL = 'model_name="ouro-kjv"'


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _observer(metrics: Metrics, clock: Clock) -> ObservedRequest:
    return ObservedRequest(
        metrics,
        None,
        telemetry.NOOP_REQUEST_SPAN,
        status_name=lambda e: "INTERNAL",
        deadline_passed=lambda: False,
        cut=lambda: False,
        request_id="r1",
        caller="anon",
        clock=clock,
    )


def test_kv_cache_usage_is_a_ratio() -> None:
    m = Metrics()
    m.set_kv_blocks(used=0, total=0)  # before the pool exists: 0, not a division by zero
    assert m.kv_usage.value() == 0.0
    m.set_kv_blocks(used=48, total=64)
    _, s = parse(m.render())
    assert s["cdb_kv_cache_usage_perc"] == 0.75
    m.set_kv_blocks(used=64, total=64)
    assert m.kv_usage.value() == 1.0


def test_every_series_carries_the_model_name() -> None:
    m = Metrics(model="ouro-kjv")
    m.set_stages_attached(True)
    text = m.render()
    cdb = [ln for ln in text.splitlines() if ln.startswith("cdb_") and "_created" not in ln.split(" ")[0]]
    assert cdb and all(f"{MODEL}" in ln for ln in cdb), [ln for ln in cdb if MODEL not in ln]
    _, fresh = parse(text)
    # every request histogram exists (at zero) from the start, with the model's label
    for name in (
        "cdb_time_to_first_token_seconds",
        "cdb_inter_token_latency_seconds",
        "cdb_e2e_request_latency_seconds",
        "cdb_request_queue_time_seconds",
        "cdb_request_time_per_output_token_seconds",
        "cdb_request_prompt_tokens",
        "cdb_request_generation_tokens",
    ):
        assert fresh[f"{name}_count{{{MODEL}}}"] == 0, name
    m.observe_request_end(1.5, "stop")
    m.observe_rejected("INVALID_ARGUMENT")
    _, s = parse(m.render())
    assert s[f'cdb_requests_finished_total{{finish_reason="stop",{MODEL}}}'] == 1
    assert s[f'cdb_requests_rejected_total{{code="INVALID_ARGUMENT",{MODEL}}}'] == 1
    assert s[f"cdb_e2e_request_latency_seconds_count{{{MODEL}}}"] == 1
    assert m.finished.value("stop") == 1  # the typed API still takes only the caller's labels
    assert s['cdb_requests_waiting{model_name="ouro-kjv"}'] == 0  # the gauges too (a gateway reads them per model)
    assert s['cdb_stages_attached{model_name="ouro-kjv"}'] == 1


def test_a_finished_request_records_tpot_and_token_counts() -> None:
    m, clock = Metrics(model="ouro-kjv"), Clock()
    obs = _observer(m, clock)
    obs.admitted(7)
    for i, (t, depth) in enumerate(((100.5, 4), (100.7, 2), (101.3, 3))):
        clock.t = t
        obs.event(TokenEvent("r1", i, 10 + i, "x", depth, None))
    clock.t = 101.4
    obs.event(FinishEvent("r1", FinishReason.LENGTH, 7, 3, 9))
    assert m.tpot.count() == 1 and m.tpot.sum() == pytest.approx((101.3 - 100.5) / 2)
    assert m.request_prompt_tokens.sum() == 7 and m.request_generation_tokens.sum() == 3
    assert m.e2e.sum() == pytest.approx(1.4) and m.ttft.sum() == pytest.approx(0.5)
    _, s = parse(m.render())
    assert s[f'cdb_request_prompt_tokens_bucket{{le="5.0",{MODEL}}}'] == 0
    assert s[f'cdb_request_prompt_tokens_bucket{{le="10.0",{MODEL}}}'] == 1
    assert s[f'cdb_request_generation_tokens_bucket{{le="2.0",{MODEL}}}'] == 0
    assert s[f'cdb_request_generation_tokens_bucket{{le="5.0",{MODEL}}}'] == 1


def test_one_token_has_no_tpot_and_a_cancel_counts_its_tokens() -> None:
    m, clock = Metrics(), Clock()
    obs = _observer(m, clock)
    obs.admitted(4)
    obs.event(TokenEvent("r1", 0, 5, "x", 2, None))
    clock.t = 103.0
    obs.gone(None)  # the client left after one token
    assert m.tpot.count() == 0 and m.request_generation_tokens.sum() == 1 and m.request_prompt_tokens.sum() == 4
    assert m.finished.value("cancelled") == 1
    never_admitted = _observer(m, clock)
    never_admitted.gone(RuntimeError("boom"))
    assert m.request_prompt_tokens.count() == 1  # only admitted requests have per-request token counts


def _engine(preemptions: int) -> SimpleNamespace:
    stats = SimpleNamespace(
        waiting=0, running=0, used_kv_blocks=3, total_kv_blocks=4, held_rows=0, recoveries=0, recomputed=0
    )
    stats.cached_kv_blocks = 1
    spec = dict.fromkeys(("spec_drafts", "spec_accepted", "spec_rejected", "spec_wasted_steps"), 0)
    sched = SimpleNamespace(refill_events=0, depth_hist={}, sched_cpu_s=0.0, preemptions=preemptions, **spec)
    sched.prefix_queries, sched.prefix_hits = 0, 0
    limits = SimpleNamespace(exit_threshold=0.5, exit_rule="hazard", threshold_source="family-default")
    cpu = SimpleNamespace(thread_s=0.0, submit_s=0.0, dispatch_s=0.0)
    return SimpleNamespace(
        stats=lambda: stats, sched_stats=sched, setup=SimpleNamespace(bank_rows=8), limits=limits, cpu=cpu
    )


def test_preemptions_and_kv_usage_are_sampled_from_the_engine() -> None:
    engine = _engine(preemptions=2)
    m = Metrics()
    m.add_collector(EngineGauges(engine))  # type: ignore[arg-type]
    _, s = parse(m.render())
    assert s["cdb_num_preemptions_total"] == 2 and s["cdb_kv_cache_usage_perc"] == 0.75
    engine.sched_stats.preemptions = 5
    _, s = parse(m.render())
    _, s = parse(m.render())  # a second scrape adds nothing new
    assert s["cdb_num_preemptions_total"] == 5


def test_latency_buckets_reach_hours_and_follow_the_settings() -> None:
    m = Metrics()
    for family in (m.e2e, m.queue, m.ttft):
        assert family.bounds[0] == 0.001 and family.bounds[-1] == 7200.0, family.name
    assert m.itl.bounds == m.tpot.bounds == tuple(float(b) for b in LATENCY_BUCKETS)
    m.observe_request_end(1800.0, "stop")  # a half-hour request lands below +Inf
    _, s = parse(m.render())
    assert s['cdb_e2e_request_latency_seconds_bucket{le="1800.0",model_name=""}'] == 1
    assert s['cdb_e2e_request_latency_seconds_bucket{le="1200.0",model_name=""}'] == 0

    settings = load_settings({"CDB_REQUEST_LATENCY_BUCKETS": "0.5, 5,50", "CDB_TOKEN_LATENCY_BUCKETS": "0.01,0.1"})
    custom = Metrics.from_settings("m", 4, settings)
    assert custom.e2e.bounds == custom.queue.bounds == custom.ttft.bounds == (0.5, 5.0, 50.0)
    assert custom.itl.bounds == custom.tpot.bounds == (0.01, 0.1)
    assert Metrics.from_settings("m", 4, load_settings({})).e2e.bounds == m.e2e.bounds


@pytest.mark.parametrize("spec", ["1,x", "5,1", "0,1", "1,1", "-1", "inf"])
def test_bad_bucket_settings_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_buckets(spec)
    with pytest.raises(SettingsError, match="CDB_REQUEST_LATENCY_BUCKETS"):
        load_settings({"CDB_REQUEST_LATENCY_BUCKETS": spec})


# --- OTLP over HTTP ---------------------------------------------------------------------------------------------


class _Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, ExportTraceServiceRequest]] = []
        self.got = threading.Condition()
        super().__init__(("127.0.0.1", 0), _Handler)

    def spans(self) -> list[str]:
        return [
            s.name for _, _, r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans
        ]


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.got:
            self.server.requests.append((self.path, self.headers["Content-Type"], request))
            self.server.got.notify_all()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_traces_export_over_otlp_http(receiver: _Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.server_address[1]}")
    telemetry.init_tracing("cdb-test")
    try:
        assert telemetry.enabled()
        span = telemetry.start_request_span(model="ouro-kjv", max_tokens=2, request_id="http-1")
        span.phase("tokenize", telemetry.now_ns(), telemetry.now_ns())  # a lean child span
        span.finish("stop", 0)
        telemetry.force_flush()
        # force_flush returns once both exporters sent: the SDK's (the request span) and the lean path's (its child)
        assert sorted(receiver.spans()) == ["text_completion ouro-kjv", "tokenize"]
        paths = {(path, ctype) for path, ctype, _ in receiver.requests}
        assert paths == {("/v1/traces", "application/x-protobuf")}
    finally:
        telemetry.shutdown_tracing()


def test_the_protocol_chooses_the_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.telemetry.exporters import OtlpExporter
    from services.telemetry.setup import _otlp_pair

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert all(isinstance(e, OtlpExporter) for e in _otlp_pair())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert all(isinstance(e, OtlpHttpExporter) for e in _otlp_pair())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # the per-signal variable wins
    assert all(isinstance(e, OtlpExporter) for e in _otlp_pair())


def test_vllm_names_are_opt_in_and_carry_the_same_samples() -> None:
    from services.settings import Settings
    from services.telemetry.vllm_names import NAMES

    plain = Metrics.from_settings("ouro-kjv", 4, Settings())
    assert "vllm:" not in plain.render()
    m = Metrics.from_settings("ouro-kjv", 4, Settings(metrics_vllm_names=True))
    m.set_queue_sizes(waiting=3, running=2)
    m.set_kv_blocks(used=16, total=64)
    m.observe_admitted(prompt_tokens=9)
    m.observe_ttft(0.02)
    m.observe_request_end(0.5, "stop")
    _, s = parse(m.render())
    assert s[f"vllm:num_requests_waiting{{{MODEL}}}"] == 3 and s[f"vllm:num_requests_running{{{MODEL}}}"] == 2
    assert s[f"vllm:kv_cache_usage_perc{{{MODEL}}}"] == s[f"vllm:gpu_cache_usage_perc{{{MODEL}}}"] == 0.25
    assert s[f"vllm:prompt_tokens_total{{{MODEL}}}"] == 9
    assert s[f"vllm:time_to_first_token_seconds_count{{{MODEL}}}"] == 1
    assert s[f'vllm:request_success_total{{finish_reason="stop",{MODEL}}}'] == 1
    assert {n for names in NAMES.values() for n in names} <= {k.split("{")[0].removesuffix("_total") for k in s} | {
        k.split("{")[0].rsplit("_", 1)[0] for k in s
    }


def test_a_scrape_within_the_cache_time_gets_the_last_body() -> None:
    cached, fresh = Metrics(model="ouro-kjv", cache_s=3600.0), Metrics(model="ouro-kjv")
    for m in (cached, fresh):
        m.set_queue_sizes(waiting=1, running=1)
        first = m.exposition(None)[0]
        m.set_queue_sizes(waiting=7, running=1)
        again = m.exposition(None)[0]
        assert (again == first) is (m is cached)
    assert b"cdb_requests_waiting" in cached.exposition("application/openmetrics-text")[0]  # per format
    assert parse(cached.render())[1]["cdb_requests_waiting"] == 7  # render(): never cached
