"""The lean path's hand-written OTLP encoding equals protobuf's, and tracing costs stay small.

The cost bounds are loose (a loaded 2-core CI box); they catch regressions by an order of magnitude, such as an
SDK span per op sneaking into the hot path. ``-s`` prints the measured figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from cdb_scheduler.plan import LoopOp, StageResult
from services import telemetry
from services.telemetry.lean import link_field, span_bytes
from services.telemetry.otlp_receiver import OtlpReceiver


def test_hand_encoding_matches_protobuf() -> None:
    ctx = SpanContext(0xABC, 0xDEF, True, TraceFlags(1))
    attrs = {"s": "loop", "b": True, "i": 300, "neg": -5, "f": 0.25, "arr": [1, 2], "long": "x" * 200}
    span = (
        "batch loop",
        SpanKind.CONSUMER,
        2**127 + 3,
        2**63 + 9,
        77,
        1_700_000_000_000_000_000,
        2**63 + 1,
        attrs,
        [(ctx, link_field(ctx))],
        "failed: x",
    )
    expected = PbSpan(
        trace_id=(2**127 + 3).to_bytes(16, "big"),
        span_id=(2**63 + 9).to_bytes(8, "big"),
        parent_span_id=(77).to_bytes(8, "big"),
        name="batch loop",
        kind=PbSpan.SPAN_KIND_CONSUMER,
        start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=2**63 + 1,
        attributes=[
            KeyValue(key="s", value=AnyValue(string_value="loop")),
            KeyValue(key="b", value=AnyValue(bool_value=True)),
            KeyValue(key="i", value=AnyValue(int_value=300)),
            KeyValue(key="neg", value=AnyValue(int_value=-5)),
            KeyValue(key="f", value=AnyValue(double_value=0.25)),
            KeyValue(
                key="arr", value=AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(int_value=2)]))
            ),
            KeyValue(key="long", value=AnyValue(string_value="x" * 200)),
        ],
        links=[PbSpan.Link(trace_id=(0xABC).to_bytes(16, "big"), span_id=(0xDEF).to_bytes(8, "big"), flags=0x301)],
        status=PbStatus(code=PbStatus.STATUS_CODE_ERROR, message="failed: x"),
        flags=0x101,
    )
    assert PbSpan.FromString(span_bytes(span)) == expected


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(3):  # best of three: other processes share these cores
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


B = 32
OP = LoopOp(
    seq=1,
    fences=(),
    kv_updates=(),
    released=(),
    rids=tuple(range(B)),
    positions=(0,) * B,
    rows=tuple(range(B)),
    steps=(0,) * B,
)
RESULT = StageResult(stage=OP.stage, seq=1, compute_s=0.001)


def _lifecycle() -> None:
    span = telemetry.start_request_span(model="m", max_tokens=4)
    span.phase("validate", 1, 2)
    span.enqueued()
    span.first_token()
    span.finish("stop", 3, (1, 2, 3))


def test_tracing_off_costs_nothing_measurable() -> None:
    assert not telemetry.enabled()
    stage, traces = telemetry.StageTracer("loop"), telemetry.RequestTraces()
    costs = {
        "StageTracer.record_op": _per_call_us(lambda: stage.record_op(OP, 1, 2, 0.001), 20000),
        "RequestTraces.on_op_done": _per_call_us(lambda: traces.on_op_done(OP, RESULT, 1, 2), 20000),
        "RequestTraces.contexts_for_op": _per_call_us(lambda: traces.contexts_for_op(OP), 20000),
        "request lifecycle": _per_call_us(_lifecycle, 20000),
    }
    print({k: f"{v:.2f} us" for k, v in costs.items()})
    assert max(costs.values()) < 3.0, costs


@pytest.mark.slow
def test_tracing_on_per_op_cost(tracing: OtlpReceiver) -> None:
    """A batch span of 32 traced requests: recording (stage's hot path) and export (background thread)."""
    traces, stage = telemetry.RequestTraces(detail_tokens=0), telemetry.StageTracer("loop")
    requests = [telemetry.start_request_span(model="m", max_tokens=4) for _ in range(B)]
    for rid, span in enumerate(requests):
        traces.register(rid, span)
    stage.update(traces.contexts_for_op(OP))
    lean = telemetry.setup.STATE.lean
    assert lean is not None
    lean._max = 10**6  # keep every record for this measurement
    n = 2000
    hot = _per_call_us(lambda: stage.record_op(OP, 1, 2, 0.001), n)
    queued = list(lean._q)
    lean._q.clear()
    t = time.perf_counter()
    spans = [s for s in map(lean._normalize, queued) if s is not None]
    lean.encode(spans)
    export = (time.perf_counter() - t) / len(queued) * 1e6
    watched = _per_call_us(lambda: traces.on_op_done(OP, RESULT, 1, 2), n)  # 32 requests in prefill: hops
    for span in requests:
        span.first_token()  # detail_tokens=0: no decode hops
    scheduler = _per_call_us(lambda: traces.on_op_done(OP, RESULT, 1, 2), n)
    print(
        f"batch span, 32 links: record {hot:.2f} us, encode {export:.2f} us; scheduler per op: "
        f"{watched:.2f} us with 32 requests in prefill, {scheduler:.2f} us in decode"
    )
    # Bounds on growth, not on a shared machine's speed: the encode runs on the export thread (≈ 50-70 µs here).
    assert hot < 25 and export < 250 and watched < 50 and scheduler < 3
