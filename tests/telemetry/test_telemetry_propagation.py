"""W3C trace context through gRPC metadata and through traceparent strings, and the env-driven setup."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

from services import telemetry
from services.telemetry.otlp_receiver import KIND_SERVER, OtlpReceiver, one


def test_traceparent_round_trip() -> None:
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True, TraceFlags(1))
    text = telemetry.format_traceparent(ctx)
    assert text == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    back = telemetry.parse_traceparent(text)
    assert back is not None and back.is_remote
    assert (back.trace_id, back.span_id, int(back.trace_flags)) == (ctx.trace_id, ctx.span_id, 1)
    unsampled = telemetry.parse_traceparent(text[:-2] + "00")
    assert unsampled is not None and not unsampled.trace_flags.sampled


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "garbage",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",
    ],
)
def test_traceparent_rejects_malformed(bad: str) -> None:
    assert telemetry.parse_traceparent(bad) is None
    assert not trace.get_current_span(telemetry.context_from_traceparent(bad)).get_span_context().is_valid


def test_invalid_context_formats_empty() -> None:
    assert telemetry.format_traceparent(trace.INVALID_SPAN_CONTEXT) == ""


def test_metadata_round_trip(tracing: OtlpReceiver) -> None:
    with telemetry.get_tracer().start_as_current_span("client") as span:
        md = telemetry.inject_metadata([("x-other", "1")])
    assert md[0] == ("x-other", "1")
    assert dict(md)["traceparent"] == telemetry.format_traceparent(span.get_span_context())
    parent = trace.get_current_span(telemetry.extract_metadata(md)).get_span_context()
    assert (parent.trace_id, parent.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)


def test_inject_without_active_span_adds_nothing() -> None:
    assert telemetry.inject_metadata([("a", "b")]) == [("a", "b")]
    assert not trace.get_current_span(telemetry.extract_metadata(None)).get_span_context().is_valid


def test_context_crosses_a_real_grpc_call(tracing: OtlpReceiver) -> None:
    """Client span → metadata → server extracts it and starts the request SERVER span under it."""

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        span = telemetry.start_request_span(
            model="m", max_tokens=8, metadata=context.invocation_metadata(), request_id="r1"
        )
        span.finish("stop", output_tokens=0)
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call: Any = channel.unary_unary("/t.T/Echo")
            with telemetry.get_tracer().start_as_current_span("client call"):
                assert call(b"x", metadata=telemetry.inject_metadata(), timeout=5) == b"x"
    finally:
        server.stop(None)
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 2)
    client, srv = one(spans, "client call"), one(spans, "text_completion m")
    assert srv.kind == KIND_SERVER
    assert (srv.trace_id, srv.parent_span_id) == (client.trace_id, client.span_id)
    assert srv.service == "cdb-test" and srv.attributes["cdb.request_id"] == "r1"


def test_unset_exporter_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tracer = telemetry.init_tracing("x")
    assert not telemetry.enabled()
    assert isinstance(tracer, trace.NoOpTracer)
    assert telemetry.start_request_span(model="m", max_tokens=1) is telemetry.NOOP_REQUEST_SPAN


@pytest.mark.parametrize("setting", [{"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}])
def test_explicitly_off(monkeypatch: pytest.MonkeyPatch, setting: dict[str, str]) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    for key, value in setting.items():
        monkeypatch.setenv(key, value)
    telemetry.init_tracing("x")
    assert not telemetry.enabled()


def test_console_exporter(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "console-svc")
    telemetry.init_tracing("ignored-default")
    span = telemetry.start_request_span(model="m", max_tokens=4)
    span.phase("validate", 1, 2)
    span.finish("stop", output_tokens=1, depths=[3])
    telemetry.shutdown_tracing()
    out = capsys.readouterr().out
    assert '"name": "text_completion m"' in out and '"name": "validate"' in out
    assert "console-svc" in out


def test_service_name_default_and_sampler_off(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    telemetry.init_tracing("cdb-default-name")
    span = telemetry.start_request_span(model="m", max_tokens=4)
    assert not span.recording and span.traceparent == ""
    span.finish("stop", output_tokens=0)
    stage = telemetry.StageTracer("loop")
    stage.record(0, [1, 2], 1, 2, 0.001)  # no sampled request, root sampler off: dropped
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    telemetry.init_tracing("cdb-default-name")  # flushes the first setup (nothing), starts a new one
    telemetry.start_request_span(model="m2", max_tokens=4).finish("stop", output_tokens=0)
    telemetry.force_flush()
    spans = receiver.wait_for(lambda s: len(s) >= 1)
    assert [s.name for s in spans] == ["text_completion m2"]
    assert spans[0].service == "cdb-default-name"
