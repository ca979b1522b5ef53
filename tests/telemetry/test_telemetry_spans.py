"""Request spans, stage hops, batch spans with links, cancellation and errors, as received over OTLP."""

from __future__ import annotations

import dataclasses

from opentelemetry.trace import SpanContext, TraceFlags

from cdb_engine.config import RequestParams
from cdb_engine.events import FinishEvent, TokenEvent
from cdb_scheduler.plan import HeadOp, LoopOp, PreludeOp, StageResult
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams
from services import telemetry
from services.telemetry.metrics import Metrics
from services.telemetry.otlp_receiver import (
    KIND_CONSUMER,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    OtlpReceiver,
    by_name,
    check_request_trace,
    children,
    format_trace,
    one,
    trace_of,
)
from services.telemetry.request_observer import ObservedRequest

MS = 1_000_000


def _drive_request(traces: telemetry.RequestTraces, rid: int, t0: int, decode_tokens: int = 2, depth: int = 3):
    """A request through validate, queue, prefill (prelude, 1 loop op of 4 steps, head) and ``decode_tokens``
    decode tokens of ``depth`` loop steps each. Timestamps advance by 1 ms per op."""
    span = telemetry.start_request_span(model="ouro-tiny", max_tokens=16, request_id=rid, start_ns=t0)
    span.phase("validate", t0, t0 + MS, {"gen_ai.usage.input_tokens": 5})
    span.set_attribute("gen_ai.usage.input_tokens", 5)
    traces.register(rid, span)
    span.enqueued(t0 + MS)
    t, seq = t0 + 2 * MS, 0

    def op(stage: str, steps: int = 1) -> None:
        nonlocal t, seq
        traces.on_hop(stage, seq, [rid, rid], t, t + MS, 0.0005, steps)
        t, seq = t + MS, seq + 1

    op("prelude"), op("loop", 4), op("head")
    span.first_token(t)
    for _ in range(decode_tokens):
        op("prelude")
        for _ in range(depth):
            op("loop")
        op("head")
    return span, t


def test_request_trace_layout(tracing: OtlpReceiver) -> None:
    traces = telemetry.RequestTraces(detail_tokens=1)
    t0 = telemetry.now_ns()
    span, t = _drive_request(traces, rid=7, t0=t0, decode_tokens=3)
    assert len(traces) == 1
    span.finish("length", output_tokens=4, depths=[4, 3, 3, 3], t_ns=t)
    assert len(traces) == 0
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: any(x.kind == KIND_SERVER for x in s) and len(s) >= 10)
    req = one(spans, "text_completion ouro-tiny")
    mine = trace_of(spans, req.trace_id)
    assert req.kind == KIND_SERVER and req.parent_span_id == "" and req.status_code == STATUS_UNSET
    assert req.attributes == {
        "gen_ai.provider.name": "cdb",
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": "ouro-tiny",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.response.id": "7",
        "gen_ai.response.model": "ouro-tiny",
        "gen_ai.response.finish_reasons": ("length",),
        "cdb.request_id": "7",
        "cdb.loop_steps": 13,
        "cdb.depth.mean": 3.25,
        "cdb.depth.min": 3,
        "cdb.depth.max": 4,
    }
    assert (req.start_ns, req.end_ns) == (t0, t)
    assert [c.name for c in children(mine, req)] == ["validate", "queue", "prefill", "decode"]
    prefill, decode = one(mine, "prefill"), one(mine, "decode")
    assert [c.name for c in children(mine, prefill)] == ["hop prelude", "hop loop", "hop head"]
    prefill_loop = children(mine, prefill)[1]
    assert prefill_loop.attributes["cdb.loop.steps"] == 4 and prefill_loop.attributes["cdb.op.seq"] == 1
    # detail_tokens=1: hops of the first decode token only, its 3 loop steps merged into one span
    assert [c.name for c in children(mine, decode)] == ["hop prelude", "hop loop", "hop head"]
    loop = children(mine, decode)[1]
    assert loop.attributes["cdb.loop.steps"] == 3 and loop.duration_ms == 3.0
    assert loop.attributes["cdb.stage.compute_s"] == 0.0015
    assert one(mine, "queue").duration_ms == 1.0  # enqueued → first op sent
    print(format_trace(mine, req))


def test_batch_spans_are_linked_roots(tracing: OtlpReceiver) -> None:
    a = telemetry.start_request_span(model="m", max_tokens=4)
    b = telemetry.start_request_span(model="m", max_tokens=4)
    traces = telemetry.RequestTraces()
    traces.register(1, a)
    traces.register(2, b)
    # scheduler side: contexts go to each stage once, and again after the stage released the request
    assert traces.contexts_for("loop", [1, 2, 3]) == {1: a.traceparent, 2: b.traceparent}
    assert traces.contexts_for("loop", [1, 2]) == {}
    assert traces.contexts_for("head", [2]) == {2: b.traceparent}
    assert traces.contexts_for("loop", [1], released=[1]) == {1: a.traceparent}
    # stage side
    stage = telemetry.StageTracer("loop")
    stage.update({1: a.traceparent, 2: b.traceparent, 3: ""})
    assert len(stage) == 2
    t = telemetry.now_ns()
    op = LoopOp(
        seq=5,
        fences=(),
        kv_updates=(),
        released=(),
        rids=(1, 2, 2),
        positions=(3, 4, 5),
        rows=(0, 1, 1),
        steps=(0, 0, 0),
        prefill=True,
        num_steps=4,
    )
    stage.record_op(op, t, t + 2 * MS, 0.002)
    stage.update({}, released=[1])
    stage.record(6, [1, 2], t + 2 * MS, t + 3 * MS, 0.001, error="boom")
    a.finish("stop", output_tokens=0)
    b.finish("stop", output_tokens=0)
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(by_name(s, "batch loop")) == 2 and len(s) >= 4)
    first, second = sorted(by_name(spans, "batch loop"), key=lambda s: s.attributes["cdb.op.seq"])
    ids = {(s.trace_id, s.span_id) for s in by_name(spans, "text_completion m")}
    assert first.parent_span_id == "" and first.kind == KIND_CONSUMER
    assert set(first.links) == ids and len(first.links) == 2  # deduplicated
    assert first.trace_id not in {t for t, _ in ids}
    assert first.attributes == {
        "cdb.stage": "loop",
        "cdb.op.seq": 5,
        "cdb.batch.size": 3,
        "cdb.batch.requests": 2,
        "cdb.stage.compute_s": 0.002,
        "cdb.loop.prefill": True,
        "cdb.loop.num_steps": 4,
    }
    assert first.duration_ms == 2.0
    assert len(second.links) == 1 and second.status_code == STATUS_ERROR and second.status_message == "boom"


def test_plan_op_helpers(tracing: OtlpReceiver) -> None:
    span = telemetry.start_request_span(model="m", max_tokens=4)
    traces = telemetry.RequestTraces()
    traces.register(9, span)
    span.enqueued()
    t = telemetry.now_ns()
    ops = [
        PreludeOp(
            seq=0,
            fences=(),
            kv_updates=(),
            released=(),
            rids=(9,),
            token_ids=(1,),
            positions=(0,),
            rows=(0,),
            init_seeds=(-1,),
        ),
        LoopOp(
            seq=0,
            fences=(),
            kv_updates=(),
            released=(),
            rids=(9,),
            positions=(0,),
            rows=(0,),
            steps=(0,),
            prefill=True,
            num_steps=4,
        ),
        HeadOp(
            seq=0,
            fences=(),
            kv_updates=(),
            released=(),
            rids=(9,),
            positions=(0,),
            rows=(0,),
            sample=(True,),
            sampling=(SamplingParams(),),
            token_index=(0,),
        ),
    ]
    decode_prelude = dataclasses.replace(ops[0], seq=1, positions=(1,))
    for i, op in enumerate([*ops, decode_prelude]):
        assert traces.contexts_for_op(op) == ({9: span.traceparent} if i < 3 else {})
        traces.on_op_done(op, StageResult(stage=op.stage, seq=0, compute_s=0.001), t + i * MS, t + (i + 1) * MS)
    span.first_token(t + 5 * MS)  # the server streamed it late: no effect, the sampling head hop closed prefill
    span.finish("stop", output_tokens=1, depths=[4], t_ns=t + 6 * MS)
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 8)
    req = one(spans, "text_completion m")
    prefill, decode = one(spans, "prefill"), one(spans, "decode")
    assert [c.name for c in children(spans, prefill)] == ["hop prelude", "hop loop", "hop head"]
    assert children(spans, prefill)[1].attributes["cdb.loop.steps"] == 4
    assert prefill.parent_span_id == decode.parent_span_id == req.span_id
    assert (prefill.duration_ms, decode.start_ns) == (3.0, t + 3 * MS)
    assert [c.name for c in children(spans, decode)] == ["hop prelude"]


def test_cancelled_request(tracing: OtlpReceiver) -> None:
    span = telemetry.start_request_span(model="m", max_tokens=4)
    traces = telemetry.RequestTraces()
    traces.register(1, span)
    span.enqueued()
    span.cancelled("deadline exceeded")
    span.finish("cancelled", output_tokens=0)
    span.finish("stop", output_tokens=9)  # idempotent
    other = telemetry.start_request_span(model="m2", max_tokens=4)
    other.finish("cancelled", output_tokens=2)  # the event is recorded even without cancelled()
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 3)
    req = one(spans, "text_completion m")
    assert req.status_code == STATUS_UNSET
    assert req.events == [("cancelled", {"cdb.cancel.reason": "deadline exceeded"})]
    assert req.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert one(spans, "queue").parent_span_id == req.span_id  # closed at the end, never dequeued
    assert [e for e, _ in one(spans, "text_completion m2").events] == ["cancelled"]
    assert len(traces) == 0


def test_failed_request(tracing: OtlpReceiver) -> None:
    span = telemetry.start_request_span(model="m", max_tokens=4)
    span.failed(RuntimeError("stage loop died"), "UNAVAILABLE")
    span.finish("error", output_tokens=1)
    plain = telemetry.start_request_span(model="m2", max_tokens=4)
    plain.finish("error", output_tokens=0)
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 2)
    req = one(spans, "text_completion m")
    assert req.status_code == STATUS_ERROR and req.status_message == "stage loop died"
    assert req.attributes["error.type"] == "UNAVAILABLE"
    assert [name for name, _ in req.events] == ["exception"]
    assert one(spans, "text_completion m2").status_code == STATUS_ERROR


def test_remote_parent_from_traceparent(tracing: OtlpReceiver) -> None:
    parent = SpanContext(0x1234, 0x5678, True, TraceFlags(1))
    ctx = telemetry.context_from_traceparent(telemetry.format_traceparent(parent))
    telemetry.start_request_span(model="m", max_tokens=1, parent=ctx).finish("stop", output_tokens=0)
    telemetry.record_span("standalone", parent, 1, 2, {"k": [1, 2]})
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 2)
    req, child = one(spans, "text_completion m"), one(spans, "standalone")
    assert (req.trace_id, req.parent_span_id) == (f"{0x1234:032x}", f"{0x5678:016x}")
    assert (child.parent_span_id, child.attributes) == (f"{0x5678:016x}", {"k": (1, 2)})


def test_check_request_trace_helper(tracing: OtlpReceiver) -> None:
    """The helper the multi-process tests use, on a single-process run."""
    traces = telemetry.RequestTraces()
    span, t = _drive_request(traces, rid=3, t0=telemetry.now_ns())
    stages = {s: telemetry.StageTracer(s) for s in ("prelude", "loop", "head")}
    for name, stage in stages.items():
        stage.update(traces.contexts_for(name, [3]))
        stage.record(0, [3], t, t + MS, 0.001)
    span.finish("stop", output_tokens=3, depths=[4, 3, 3], t_ns=t)
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: len(s) >= 3 + 4 + 3 * 3)
    check_request_trace(
        spans, one(spans, "text_completion ouro-tiny"), stage_services=dict.fromkeys(stages, "cdb-test")
    )


def test_observed_request_records_the_gen_ai_conventions(tracing: OtlpReceiver) -> None:
    """The handler-side path (``ObservedRequest``): request values in effect, response and usage, and metrics."""
    metrics, traces = Metrics(model="ouro-tiny"), telemetry.RequestTraces()
    span = telemetry.start_request_span(model="ouro-tiny", max_tokens=0, request_id="chat-1", operation="chat")
    observer = ObservedRequest(
        metrics, traces, span, status_name=lambda e: "INTERNAL", deadline_passed=lambda: False, cut=lambda: False
    )
    sampling = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=11)
    observer.validated(3, RequestParams(max_tokens=8, sampling=sampling))
    observer.admitted(3)
    observer.queued(1)
    for i, depth in enumerate((4, 2)):
        observer.event(TokenEvent("chat-1", i, 100 + i, "x", depth, None))
    finish = FinishEvent("chat-1", FinishReason.STOP, 3, 2, 6, queue_s=0.001)
    finish.spec_drafts, finish.spec_accepted, finish.spec_rejected = 3, 2, 1
    observer.event(finish)
    telemetry.force_flush()
    req = one(tracing.wait_for(lambda s: any(x.kind == KIND_SERVER for x in s)), "chat ouro-tiny")
    want = {
        "gen_ai.provider.name": "cdb",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "ouro-tiny",
        "gen_ai.request.max_tokens": 8,  # the value in effect, not the 0 (unset) known at arrival
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 40.0,
        "gen_ai.request.seed": 11,
        "gen_ai.response.id": "chat-1",
        "gen_ai.response.model": "ouro-tiny",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 2,
        "cdb.request_id": "chat-1",
        "cdb.loop_steps": 6,
        "cdb.speculative.drafts": 3,
        "cdb.speculative.accepted": 2,
        "cdb.speculative.rejected": 1,
    }
    assert {k: req.attributes.get(k) for k in want} == want
    assert metrics.generated_tokens.value() == 2 and metrics.finished.value("stop") == 1
    assert metrics.ttft.count() == 1 and metrics.itl.count() == 1 and metrics.queue.count() == 1


def test_request_params_are_optional_and_noop_when_not_recording() -> None:
    span = telemetry.start_request_span(model="m", max_tokens=4)  # tracing off: the no-op span
    span.request_params(4, SamplingParams())
    observer = ObservedRequest(
        Metrics(), None, span, status_name=lambda e: "INTERNAL", deadline_passed=lambda: False, cut=lambda: False
    )
    observer.validated(2)
    observer.validated(2, RequestParams())
    assert not span.recording


def test_a_seed_above_int64_is_exported_as_its_twos_complement(tracing: OtlpReceiver) -> None:
    """OTLP integers are int64; the API's seeds are uint64: the largest still exports (and the batch with it)."""
    span = telemetry.start_request_span(model="ouro-tiny", max_tokens=4, request_id="big-seed")
    span.request_params(4, SamplingParams(seed=2**64 - 1))
    span.finish("stop", 0)
    telemetry.force_flush()
    req = one(tracing.wait_for(lambda s: any(x.kind == KIND_SERVER for x in s)), "text_completion ouro-tiny")
    assert req.attributes["gen_ai.request.seed"] == -1
