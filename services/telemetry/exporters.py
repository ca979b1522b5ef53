"""The OTLP span exporters that also take the lean path's encoded requests (``services.telemetry.lean``).

A module of their own, imported only where tracing exports over OTLP (``setup``): the SDK's exporters and their
HTTP and gRPC clients cost a process about 0.1 s to import, and most processes never export.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as OTLPHttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult


class OtlpExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter that also accepts a ready ``ExportTraceServiceRequest``."""

    takes_encoded = True

    def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
        return data if isinstance(data, ExportTraceServiceRequest) else super()._translate_data(data)

    def _count_data(self, data: Any) -> int:
        if isinstance(data, ExportTraceServiceRequest):
            return sum(len(ss.spans) for rs in data.resource_spans for ss in rs.scope_spans)
        return int(super()._count_data(data))


class OtlpHttpExporter(OTLPHttpSpanExporter):
    """The SDK's OTLP/HTTP (protobuf) span exporter that also accepts a ready ``ExportTraceServiceRequest``."""

    takes_encoded = True

    def export(self, spans: Any) -> SpanExportResult:
        if not isinstance(spans, ExportTraceServiceRequest):
            return super().export(spans)
        if self._shutdown:
            return SpanExportResult.FAILURE
        # The body the SDK's export sends for ReadableSpans, here encoded already (its pinned client's one call).
        sent = self._client.export(spans.SerializePartialToString())
        return SpanExportResult.SUCCESS if sent.success else SpanExportResult.FAILURE
