"""Request spans (scheduler side) and batch spans (stage side), fed with plain data.

Scheduler server, per request: ``start_request_span`` when the RPC arrives, ``phase`` for validation and
tokenization, ``RequestTraces.register`` and ``enqueued`` once the engine gave it an id and queued it,
``cancelled``/``failed`` when that happens, and ``finish`` exactly once at the end (``first_token`` is only a
fallback: the head op that samples the first token closes ``prefill``).
gRPC executor, per stage op: ``RequestTraces.contexts_for_op`` when building the message (traceparents of requests
new to that stage), ``RequestTraces.on_op_done`` when its result comes back.
Stage server, per op: ``StageTracer.update`` with the message's contexts and released ids, then ``record_op``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode

from cdb_scheduler.plan import HeadOp, LoopOp, StageOp, StageResult
from services.telemetry.lean import link_field
from services.telemetry.setup import STATE, extract_metadata, format_traceparent, now_ns, parse_traceparent


class RequestSpan:
    """One request's SERVER span and its children. Every method is a no-op when the span is not recording
    (tracing off, or the sampler said no), so callers never branch on it."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.context: SpanContext = span.get_span_context()
        self.recording = span.is_recording() and self.context.trace_flags.sampled
        self.traceparent = format_traceparent(self.context) if self.recording else ""
        self._queue_start = 0
        self._prefill: tuple[int, int] | None = None  # (start_ns, span id) while prefill is open
        self._decode: tuple[int, int] | None = None  # (start_ns, span id) after the first token
        self._loop: list[Any] | None = None  # merged loop hop: [start, end, steps, compute_s, seq, parent, error]
        self._detail_left = 0
        self._owner: tuple[RequestTraces, int] | None = None
        self._marked_cancel = self._marked_error = self._ended = False

    def _child(
        self,
        name: str,
        parent_id: int,
        start: int,
        end: int,
        attrs: dict[str, Any],
        error: str | None = None,
        span_id: int = 0,
    ) -> None:
        lean = STATE.lean
        if lean is not None:
            sid = span_id or random.getrandbits(64) or 1
            lean.add(("s", name, SpanKind.INTERNAL, self.context.trace_id, sid, parent_id, start, end, attrs, error))

    def phase(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """A finished child span of the request (``"validate"``, ``"tokenize"``, ...)."""
        if self.recording and not self._ended:
            self._child(name, self.context.span_id, start_ns, end_ns, dict(attributes or {}), error)

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute on the SERVER span (e.g. ``gen_ai.usage.input_tokens`` once tokenized)."""
        if self.recording and not self._ended:
            self.span.set_attribute(key, value)

    def enqueued(self, t_ns: int | None = None) -> None:
        """The request entered the waiting queue; the ``queue`` span ends when its first stage op is sent."""
        if self.recording and not self._ended:
            self._queue_start = t_ns or now_ns()

    def _end_queue(self, t: int) -> None:
        if self._queue_start:
            self._child("queue", self.context.span_id, self._queue_start, t, {})
            self._queue_start = 0

    def hop(
        self,
        stage: str,
        seq: int,
        start_ns: int,
        end_ns: int,
        compute_s: float,
        steps: int = 1,
        error: str | None = None,
        sampled: bool = False,
    ) -> None:
        """One stage op that served this request: sent at ``start_ns``, result back at ``end_ns``.

        The first hop ends ``queue`` and opens ``prefill``; the first head hop that ``sampled`` a token of this
        request ends ``prefill`` and opens ``decode``. Consecutive loop ops merge into one ``hop loop`` span
        (``cdb.loop.steps``, summed ``cdb.stage.compute_s``, ``cdb.op.seq`` of the first op).
        """
        if not self.recording or self._ended:
            return
        if self._prefill is None and self._decode is None:
            self._end_queue(start_ns)
            self._prefill = (start_ns, random.getrandbits(64) or 1)
        parent = (self._decode or self._prefill or (0, self.context.span_id))[1]
        if stage == "loop":
            lp = self._loop
            if lp is None:
                self._loop = [start_ns, end_ns, steps, compute_s, seq, parent, error]
            else:
                lp[1], lp[2], lp[3], lp[6] = end_ns, lp[2] + steps, lp[3] + compute_s, lp[6] or error
            return
        self._flush_loop()
        attrs = {"cdb.stage": stage, "cdb.op.seq": seq, "cdb.stage.compute_s": compute_s}
        self._child(f"hop {stage}", parent, start_ns, end_ns, attrs, error)
        if stage != "head":
            return
        if self._decode is None:
            if sampled:
                self._open_decode(end_ns)
        else:
            self._detail_left -= 1
            if self._detail_left <= 0:
                self._unwatch()

    def _flush_loop(self) -> None:
        lp, self._loop = self._loop, None
        if lp is not None:
            start, end, steps, compute_s, seq, parent, error = lp
            attrs = {"cdb.stage": "loop", "cdb.op.seq": seq, "cdb.loop.steps": steps, "cdb.stage.compute_s": compute_s}
            self._child("hop loop", parent, start, end, attrs, error)

    def first_token(self, t_ns: int | None = None) -> None:
        """The first token is out: ends ``prefill``, opens ``decode``, unless the head hop that sampled it did
        already (with ``RequestTraces.on_op_done``, this call is only a fallback)."""
        if self.recording and not self._ended and self._decode is None:
            self._open_decode(t_ns or now_ns())

    def _open_decode(self, t: int) -> None:
        self._flush_loop()
        self._end_queue(t)
        if self._prefill is not None:
            self._child("prefill", self.context.span_id, self._prefill[0], t, {}, span_id=self._prefill[1])
            self._prefill = None
        self._decode = (t, random.getrandbits(64) or 1)
        if self._detail_left <= 0:
            self._unwatch()

    def cancelled(self, reason: str = "client cancelled") -> None:
        """Record an event ``cancelled`` (client cancel, disconnect, deadline, Abort). Status stays UNSET: a
        client's cancel is not a server error. Then call ``finish(finish_reason="cancelled", ...)``."""
        if self.recording and not self._ended:
            self.span.add_event("cancelled", {"cdb.cancel.reason": reason})
            self._marked_cancel = True

    def failed(self, error: BaseException | str, error_type: str | None = None) -> None:
        """Set status ERROR (with the exception recorded when given) and ``error.type``; then ``finish``."""
        if not self.recording or self._ended:
            return
        if isinstance(error, BaseException):
            self.span.record_exception(error)
        self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.set_attribute("error.type", error_type or type(error).__name__)
        self._marked_error = True

    def finish(
        self,
        finish_reason: str,
        output_tokens: int,
        depths: Sequence[int] = (),
        loop_steps: int | None = None,
        t_ns: int | None = None,
    ) -> None:
        """End the request: usage and depth attributes, close open children, end the span. Idempotent.

        ``depths``: served loop depth of each generated token (``cdb.depth.mean/min/max``); ``loop_steps``: total
        loop steps (default: ``sum(depths)``). ``finish_reason`` ``cancelled`` / ``error`` record the event /
        status if ``cancelled`` / ``failed`` did not.
        """
        if not self.recording or self._ended:
            return
        t = t_ns or now_ns()
        if finish_reason == "cancelled" and not self._marked_cancel:
            self.cancelled("cancelled")
        if finish_reason == "error" and not self._marked_error:
            self.failed("request failed", "error")
        self._flush_loop()
        self._end_queue(t)
        if self._prefill is not None:
            self._child("prefill", self.context.span_id, self._prefill[0], t, {}, span_id=self._prefill[1])
        if self._decode is not None:
            self._child("decode", self.context.span_id, self._decode[0], t, {}, span_id=self._decode[1])
        attrs: dict[str, Any] = {
            "gen_ai.response.finish_reasons": (finish_reason,),
            "gen_ai.usage.output_tokens": output_tokens,
            "cdb.loop_steps": sum(depths) if loop_steps is None else loop_steps,
        }
        if depths:
            attrs.update({"cdb.depth.mean": sum(depths) / len(depths), "cdb.depth.min": min(depths)})
            attrs["cdb.depth.max"] = max(depths)
        self.span.set_attributes(attrs)
        self._ended = True
        self.span.end(end_time=t)
        if self._owner is not None:
            self._owner[0]._forget(self._owner[1])

    def _unwatch(self) -> None:
        if self._owner is not None:
            self._owner[0]._watch.discard(self._owner[1])


NOOP_REQUEST_SPAN = RequestSpan(trace.INVALID_SPAN)


def start_request_span(
    *,
    model: str,
    max_tokens: int,
    metadata: Iterable[Any] | None = None,
    parent: Context | None = None,
    input_tokens: int | None = None,
    request_id: str | int | None = None,
    operation: str = "text_completion",
    start_ns: int | None = None,
) -> RequestSpan:
    """Start the SERVER span of one request, child of the caller's context (``parent``, else extracted from
    ``metadata``, the RPC's invocation metadata). Named ``"{operation} {model}"`` per the gen_ai conventions."""
    if not STATE.enabled:
        return NOOP_REQUEST_SPAN
    ctx = parent if parent is not None else extract_metadata(metadata) if metadata is not None else None
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_tokens,
    }
    if input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = input_tokens
    if request_id is not None:
        attrs["cdb.request_id"] = str(request_id)
    name = f"{operation} {model}"
    span = STATE.tracer.start_span(name, context=ctx, kind=SpanKind.SERVER, attributes=attrs, start_time=start_ns)
    return RequestSpan(span)


class RequestTraces:
    """Scheduler-side map request id → ``RequestSpan``: which traceparents each stage still needs, and stage
    hops. Hop spans are kept for the prefill and the first ``detail_tokens`` decode tokens of each traced
    request (the per-token hops of a long generation would cost more than the 3 % budget; the stage batch spans
    cover every op). Every method returns at once when no traced request is live. ``register``,
    ``contexts_for*`` and ``on_*`` belong to the thread that drives the executor; ``RequestSpan.finish`` (which
    unregisters) may run on another thread: the per-op paths tolerate a request ending under them."""

    def __init__(self, detail_tokens: int = 4) -> None:
        self.detail_tokens = detail_tokens
        self._spans: dict[int, RequestSpan] = {}
        self._watch: set[int] = set()  # requests whose hops are still recorded
        self._unsent: dict[str, set[int]] = {}  # per stage: registered requests whose context it has not got

    def register(self, request_id: int, span: RequestSpan) -> None:
        """Track ``span`` under the scheduler's ``request_id``; ``span.finish`` forgets it."""
        if not span.recording or span._ended:
            return
        span._owner, span._detail_left = (self, request_id), self.detail_tokens
        self._spans[request_id] = span
        self._watch.add(request_id)
        for unsent in list(self._unsent.values()):
            unsent.add(request_id)

    def get(self, request_id: int) -> RequestSpan | None:
        """The live traced request span of ``request_id``, if any."""
        return self._spans.get(request_id)

    def __len__(self) -> int:
        return len(self._spans)

    def _forget(self, request_id: int) -> None:
        self._spans.pop(request_id, None)
        self._watch.discard(request_id)
        for unsent in list(self._unsent.values()):
            unsent.discard(request_id)

    def contexts_for(self, stage: str, request_ids: Iterable[int], released: Iterable[int] = ()) -> dict[int, str]:
        """Traceparents to put in the next message to ``stage`` (ops to one stage are sent in order): those of
        the op's requests that the stage does not hold, i.e. never sent or dropped with ``released``."""
        if not self._spans:
            return {}
        unsent = self._unsent.get(stage)
        if unsent is None:
            unsent = self._unsent[stage] = set(self._spans)
        for rid in released:
            if rid in self._spans:
                unsent.add(rid)
        hits = unsent.intersection(request_ids) if unsent else ()
        if not hits:
            return {}
        unsent.difference_update(hits)
        spans = self._spans
        return {rid: span.traceparent for rid in hits if (span := spans.get(rid)) is not None}

    def contexts_for_op(self, op: StageOp) -> dict[int, str]:
        """``contexts_for`` of a plan op (stage name, its requests, its ``released`` ids)."""
        return self.contexts_for(op.stage.name.lower(), op.request_ids, op.released)

    def on_hop(
        self,
        stage: str,
        seq: int,
        request_ids: Iterable[int],
        start_ns: int,
        end_ns: int,
        compute_s: float,
        steps: int = 1,
        error: str | None = None,
        sampled: Iterable[int] = (),
    ) -> None:
        """Stage op ``seq`` of ``stage`` (sent at ``start_ns``, result at ``end_ns``) served ``request_ids``;
        for a head op, ``sampled`` are the requests it sampled a token for."""
        if not self._watch:
            return
        spans, got = self._spans, set(sampled)
        for rid in self._watch.intersection(request_ids):
            if (span := spans.get(rid)) is not None:  # it may have finished on another thread meanwhile
                span.hop(stage, seq, start_ns, end_ns, compute_s, steps, error, rid in got)

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        """``on_hop`` of a plan op and its result."""
        if self._watch:
            steps = op.num_steps if isinstance(op, LoopOp) and op.prefill else 1
            sampled = [r for r, s in zip(op.request_ids, op.sample) if s] if isinstance(op, HeadOp) else ()
            stage = op.stage.name.lower()
            self.on_hop(stage, op.seq, op.request_ids, sent_ns, done_ns, result.compute_s, steps, result.error, sampled)


class StageTracer:
    """Stage-side batch spans: one root span ``batch <stage>`` per op, linked to the request span of every
    sampled request it served. Keeps request id → link, fed by the traceparents in stage messages."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._name = f"batch {stage}"
        self._links: dict[int, tuple[SpanContext, bytes]] = {}

    def __len__(self) -> int:
        return len(self._links)

    def update(self, contexts: Mapping[int, str], released: Iterable[int] = ()) -> None:
        """Apply one message: forget ``released`` requests first, then learn ``contexts`` (id → traceparent)."""
        links = self._links
        for rid in released:
            links.pop(rid, None)
        if contexts and STATE.enabled:
            for rid, value in contexts.items():
                ctx = parse_traceparent(value)
                if ctx is not None and ctx.trace_flags.sampled:
                    links[rid] = (ctx, link_field(ctx))

    def record(
        self,
        seq: int,
        request_ids: Sequence[int],
        start_ns: int,
        end_ns: int,
        compute_s: float,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Record op ``seq`` (computed from ``start_ns`` to ``end_ns``; one entry of ``request_ids`` per token)."""
        lean = STATE.lean
        if lean is None:
            return
        links = list(map(self._links.get, request_ids)) if self._links else None
        lean.add(("b", self._name, seq, links, len(request_ids), start_ns, end_ns, compute_s, attributes, error))

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        """``record`` of a plan op; loop ops add ``cdb.loop.prefill`` and ``cdb.loop.num_steps``."""
        if STATE.lean is None:
            return
        extra = {"cdb.loop.prefill": op.prefill, "cdb.loop.num_steps": op.num_steps} if isinstance(op, LoopOp) else None
        self.record(op.seq, op.request_ids, start_ns, end_ns, compute_s, extra, error)
