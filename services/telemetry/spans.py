"""Request spans (scheduler side), fed with plain data.

``traces.RequestTraces`` keys them by the engine's rid for the executor; ``stage_tracer`` records the stage side.

Scheduler server, per request: ``start_request_span`` when the RPC arrives, ``phase`` for validation and
tokenization, ``request_params`` with the validated values in effect, ``RequestTraces.register`` and ``enqueued``
once the engine gave it an id and queued it, ``cancelled``/``failed`` when that happens, and ``finish`` exactly
once at the end (``first_token`` is only a fallback: the head op that samples the first token closes ``prefill``).
gRPC executor, per stage op: ``RequestTraces.contexts_for_op`` when building the message (traceparents of requests
new to that stage), ``RequestTraces.on_op_done`` when its result comes back.
Stage server, per op: ``StageTracer.update`` with the message's contexts and released ids, then ``record_op``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode

from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams
from services.telemetry.setup import STATE, extract_metadata, format_traceparent, now_ns

if TYPE_CHECKING:
    from services.telemetry.traces import RequestTraces

PROVIDER = "cdb"  # gen_ai.provider.name: the serving system, as the conventions name e.g. "openai"


class RequestSpan:
    """One request's SERVER span and its children. Every method is a no-op when the span is not recording
    (tracing off, or the sampler said no), so callers never branch on it."""

    def __init__(self, span: Span, model: str = "", request_id: str = "") -> None:
        self.span = span
        self.model, self.request_id = model, request_id  # for the gen_ai.response.* attributes at the end
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

    def request_params(self, max_tokens: int, sampling: SamplingParams) -> None:
        """The validated request's ``gen_ai.request.*`` values in effect: max tokens and sampling settings."""
        if self.recording and not self._ended:
            self.span.set_attributes(
                {
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.request.temperature": float(sampling.temperature),
                    "gen_ai.request.top_p": float(sampling.top_p),
                    "gen_ai.request.top_k": float(sampling.top_k),  # a double in the conventions
                    # OTLP integers are int64: a uint64 seed above that range as its two's complement
                    "gen_ai.request.seed": sampling.seed - 2**64 if sampling.seed >= 2**63 else sampling.seed,
                }
            )

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
        """End the request: response, usage and depth attributes, close open children, end the span. Idempotent.

        ``depths``: served loop depth of each generated token (``cdb.depth.mean/min/max``); ``loop_steps``: total
        loop steps (default: ``sum(depths)``). ``finish_reason`` ``cancelled`` / ``error`` record the event /
        status if ``cancelled`` / ``failed`` did not.
        """
        if not self.recording or self._ended:
            return
        t = t_ns or now_ns()
        if finish_reason == FinishReason.CANCELLED and not self._marked_cancel:
            self.cancelled("cancelled")
        if finish_reason == FinishReason.ERROR and not self._marked_error:
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
        if self.request_id:
            attrs["gen_ai.response.id"] = self.request_id
        if self.model:
            attrs["gen_ai.response.model"] = self.model
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
    ``metadata``, the RPC's invocation metadata). Named ``"{operation} {model}"`` per the gen_ai conventions;
    ``operation`` is ``text_completion`` (the gRPC API, ``/v1/completions``) or ``chat``."""
    if not STATE.enabled:
        return NOOP_REQUEST_SPAN
    ctx = parent if parent is not None else extract_metadata(metadata) if metadata is not None else None
    attrs: dict[str, Any] = {
        "gen_ai.provider.name": PROVIDER,
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
    return RequestSpan(span, model, "" if request_id is None else str(request_id))
