"""Tracing setup from the standard ``OTEL_*`` environment, W3C context propagation, and lean child spans."""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import sampling as smp
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, Tracer

from services.telemetry.lean import SCOPE, LeanRecorder

log = logging.getLogger(__name__)


class _State:
    """This process's tracing setup (module-level: one per process)."""

    enabled = False
    global_set = False  # the OTel API's global provider may be set once per process
    tracer: Tracer = trace.NoOpTracer()
    provider: TracerProvider | None = None
    lean: LeanRecorder | None = None


STATE = _State()


def enabled() -> bool:
    """True when spans are recorded and exported (``init_tracing`` found an exporter)."""
    return STATE.enabled


def get_tracer() -> Tracer:
    """The tracer made by ``init_tracing``; a no-op tracer before it or when tracing is off."""
    return STATE.tracer


def sampler_from_env() -> tuple[smp.Sampler, float]:
    """``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` → (SDK sampler, ratio for lean root spans)."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    try:
        rate = min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
    except ValueError:
        rate = 1.0
    samplers: dict[str, tuple[smp.Sampler, float]] = {
        "always_on": (smp.ALWAYS_ON, 1.0),
        "always_off": (smp.ALWAYS_OFF, 0.0),
        "parentbased_always_on": (smp.ParentBased(smp.ALWAYS_ON), 1.0),
        "parentbased_always_off": (smp.ParentBased(smp.ALWAYS_OFF), 0.0),
        "traceidratio": (smp.TraceIdRatioBased(rate), rate),
        "parentbased_traceidratio": (smp.ParentBased(smp.TraceIdRatioBased(rate)), rate),
    }
    if name not in samplers:
        log.warning("OTEL_TRACES_SAMPLER=%s is not supported; using parentbased_always_on", name)
        name = "parentbased_always_on"
    return samplers[name]


def _exporters_from_env() -> list[tuple[SpanExporter, SpanExporter]]:
    """One (SDK-path, lean-path) exporter pair per name in ``OTEL_TRACES_EXPORTER`` (unset means none)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    pairs: list[tuple[SpanExporter, SpanExporter]] = []
    for name in os.environ.get("OTEL_TRACES_EXPORTER", "none").lower().split(","):
        name = name.strip()
        if name == "otlp":
            pairs.append(_otlp_pair())
        elif name == "console":
            pairs.append((ConsoleSpanExporter(out=sys.stdout), ConsoleSpanExporter(out=sys.stdout)))
        elif name not in ("none", ""):
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); ignored", name)
    return pairs


def _otlp_pair() -> tuple[SpanExporter, SpanExporter]:
    """OTLP exporters over ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``grpc`` (the default) or ``http/protobuf``
    (``http/json`` is not supported: exported as ``http/protobuf``, which every OTLP/HTTP receiver accepts)."""
    proto = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    from services.telemetry.exporters import OtlpExporter, OtlpHttpExporter

    if proto == "grpc":
        return OtlpExporter(), OtlpExporter()
    if proto != "http/protobuf":
        log.warning("OTLP protocol %r is not supported (grpc, http/protobuf); exporting over http/protobuf", proto)
    return OtlpHttpExporter(), OtlpHttpExporter()


def init_tracing(default_service_name: str, *, exporter: SpanExporter | None = None) -> Tracer:
    """Set up tracing for this process from the environment and return its tracer. Call once at startup.

    Reads ``OTEL_SDK_DISABLED``; ``OTEL_TRACES_EXPORTER`` = ``otlp`` | ``console`` | ``none`` (a comma list is
    allowed; UNSET MEANS ``none``, unlike the OTel default, so that a default deployment pays nothing and dials
    nowhere); ``OTEL_SERVICE_NAME`` (else ``default_service_name``) and ``OTEL_RESOURCE_ATTRIBUTES``;
    ``OTEL_TRACES_SAMPLER``/``_ARG``; ``OTEL_BSP_*``; and, through the SDK exporter,
    ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``/``HEADERS``/``INSECURE``/``CERTIFICATE``/``TIMEOUT``/``COMPRESSION``
    (OTLP over gRPC), or with ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=http/protobuf`` OTLP over HTTP (port 4318,
    ``/v1/traces``). ``exporter`` replaces the configured exporters (tests, benchmarks). The first enabled setup
    also becomes the OTel API's global tracer provider (for third-party instrumentation); a second call replaces
    this module's setup after flushing the first. Returns a no-op tracer when tracing is off.
    """
    shutdown_tracing()
    pairs = [(exporter, exporter)] if exporter is not None else _exporters_from_env()
    if not pairs:
        return STATE.tracer
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": default_service_name}
    resource = Resource.create(attrs)
    sampler, rate = sampler_from_env()
    provider = TracerProvider(resource=resource, sampler=sampler)
    for sdk_exporter, _ in pairs:
        provider.add_span_processor(BatchSpanProcessor(sdk_exporter))
    STATE.lean = LeanRecorder(resource, [lean for _, lean in pairs], round(rate * (1 << 64)))
    STATE.provider, STATE.tracer, STATE.enabled = provider, provider.get_tracer(SCOPE), True
    if not STATE.global_set:
        trace.set_tracer_provider(provider)
        STATE.global_set = True
    return STATE.tracer


def shutdown_tracing() -> None:
    """Export what is buffered and stop; tracing is off afterwards. Call on process exit."""
    lean, provider = STATE.lean, STATE.provider
    STATE.enabled, STATE.lean, STATE.provider, STATE.tracer = False, None, None, trace.NoOpTracer()
    if lean is not None:
        lean.close()
    if provider is not None:
        provider.shutdown()


def force_flush(timeout_s: float = 10.0) -> None:
    """Export every finished span now (tests; ``shutdown_tracing`` does it at exit)."""
    if STATE.lean is not None:
        STATE.lean.flush()
    if STATE.provider is not None:
        STATE.provider.force_flush(int(timeout_s * 1000))


# ---------------------------------------------------------------------------------------------- propagation


def inject_metadata(metadata: Iterable[tuple[str, str]] = (), context: Context | None = None) -> list[tuple[str, str]]:
    """``metadata`` plus the W3C headers (``traceparent``, ``tracestate``, ``baggage``) of ``context`` (default:
    the current context) as gRPC call metadata. Works with any tracer provider, so clients may use it too."""
    out = list(metadata)
    if trace.get_current_span(context).get_span_context().is_valid:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=context)
        out.extend(carrier.items())
    return out


def extract_metadata(metadata: Iterable[Any] | None) -> Context:
    """The remote parent carried by gRPC metadata, e.g. ``servicer_context.invocation_metadata()``."""
    carrier = {str(k): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def format_traceparent(span_context: SpanContext) -> str:
    """W3C ``traceparent`` header value of ``span_context``; empty string when it is invalid."""
    if not span_context.is_valid:
        return ""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def parse_traceparent(value: str) -> SpanContext | None:
    """The remote span context named by a W3C ``traceparent`` value; None when empty or malformed."""
    parts = value.split("-") if value else []
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or (parts[0] == "00" and len(parts) != 4):
        return None
    if len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def context_from_traceparent(value: str) -> Context:
    """A context whose current span is the remote parent named by ``value`` (an empty context if none)."""
    parent = parse_traceparent(value)
    return trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else Context()


def now_ns() -> int:
    """Wall-clock nanoseconds since the epoch: the time base of every span timestamp."""
    return time.time_ns()


def record_span(
    name: str,
    parent: SpanContext,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
    *,
    error: str | None = None,
    span_id: int = 0,
    kind: SpanKind = SpanKind.INTERNAL,
) -> None:
    """Record a finished child of ``parent`` through the lean path; nothing when tracing is off or the parent is
    not sampled. Pass ``span_id`` (e.g. from ``new_ids``) when other spans must name this one as their parent.
    ``error`` sets status ERROR with that description."""
    lean = STATE.lean
    if lean is not None and parent.trace_flags.sampled:
        sid = span_id or random.getrandbits(64) or 1
        attrs = dict(attributes) if attributes else {}
        lean.add(("s", name, kind, parent.trace_id, sid, parent.span_id, start_ns, end_ns, attrs, error))
