"""OpenTelemetry tracing for cdb, configured only by the standard ``OTEL_*`` environment variables.

One request is one trace::

    text_completion <model>        SERVER span in the scheduler: gen_ai.* and cdb.* attributes (an SDK span)
    ├── validate, tokenize, ...    phase(): timed steps before admission
    ├── queue                      enqueued() → the first stage op serving the request is sent
    ├── prefill                    first op sent → first_token()
    │   └── hop prelude|loop|head  op sent → its result back (consecutive loop steps merged into one hop)
    └── decode                     first_token() → finish()
        └── hop ...                for the first ``detail_tokens`` decode tokens
    batch prelude|loop|head        a ROOT span per stage op in the stage process, LINKED to the request spans it
                                   served, with the stage's compute time and batch size

Context crosses processes as W3C ``traceparent``: in gRPC metadata from clients to the scheduler, and as plain
strings in stage messages (once per request and stage). ``cdb_scheduler`` never imports this package: the
services call it with plain data (request ids, stage names, op sequence numbers, nanosecond timestamps).

Off by default (``OTEL_TRACES_EXPORTER`` unset or ``none``): every helper then returns at its first line. On,
only the request span is an SDK span; per-op spans go through ``lean`` (see there for the measured reason).
"""

from services.telemetry.lean import new_ids
from services.telemetry.setup import (
    context_from_traceparent,
    enabled,
    extract_metadata,
    force_flush,
    format_traceparent,
    get_tracer,
    init_tracing,
    inject_metadata,
    now_ns,
    parse_traceparent,
    record_span,
    shutdown_tracing,
)
from services.telemetry.spans import NOOP_REQUEST_SPAN, RequestSpan, start_request_span
from services.telemetry.stage_tracer import StageTracer
from services.telemetry.traces import RequestTraces

__all__ = [
    "NOOP_REQUEST_SPAN",
    "RequestSpan",
    "RequestTraces",
    "StageTracer",
    "context_from_traceparent",
    "enabled",
    "extract_metadata",
    "force_flush",
    "format_traceparent",
    "get_tracer",
    "init_tracing",
    "inject_metadata",
    "new_ids",
    "now_ns",
    "parse_traceparent",
    "record_span",
    "shutdown_tracing",
    "start_request_span",
]
