"""``ObservedRequest``: the metrics and the trace of one public request, fed by the handler and the engine.

It implements ``cdb_engine.events.RequestObserver`` (``queued`` on the engine thread, ``event`` and ``gone`` on
the server's event loop) and adds the handler-side moments: ``validated`` and ``rejected``. The handlers thus
stay protobuf -> engine -> protobuf, and every metric, span and request log line of a request is recorded here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from cdb_engine.config import RequestParams
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_scheduler.request import FinishReason
from services.telemetry.logs import log_request, request_log_on
from services.telemetry.metrics import Metrics
from services.telemetry.setup import now_ns
from services.telemetry.spans import RequestSpan
from services.telemetry.traces import RequestTraces


class ObservedRequest:
    """One request's observations. ``status_name(exc)`` gives the status code name an exception maps to;
    ``request_id`` and ``caller`` (the caller's scope, or a callable giving it) name the request in its log line;
    ``clock`` times it (seconds)."""

    def __init__(
        self,
        metrics: Metrics,
        traces: RequestTraces | None,
        span: RequestSpan,
        *,
        status_name: Callable[[BaseException], str],
        deadline_passed: Callable[[], bool],
        cut: Callable[[], bool],
        request_id: str = "",
        caller: str | Callable[[], str] = "",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.metrics = metrics
        self.traces = traces if span.recording else None
        self.span = span
        self._clock = clock
        self.arrival = clock()
        self.start_ns = now_ns()
        self.depths: list[int] = []
        self._last_token = 0.0
        self._status_name = status_name
        self._deadline_passed = deadline_passed
        self._cut = cut  # the drain deadline passed: a cancel is the server's doing
        self.request_id = request_id
        self._caller = caller
        self._first_token = 0.0
        self.prompt_tokens: int | None = None  # set once admitted: only admitted requests count per request

    # --- handler side ----------------------------------------------------------------------------------------
    def validated(self, input_tokens: int, params: RequestParams | None = None) -> None:
        """The request passed validation: ``input_tokens`` prompt tokens; ``params`` its engine parameters (the
        ``gen_ai.request.*`` values in effect: max tokens, temperature, top_p, top_k, seed)."""
        self.span.phase("validate", self.start_ns, now_ns())
        self.span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        if params is not None:
            self.span.request_params(params.max_tokens, params.sampling)

    def rejected(self, exc: BaseException) -> None:
        code = self._status_name(exc)
        self.metrics.observe_rejected(code)
        self.span.failed(exc, code)
        self.span.finish("error", 0)

    def admitted(self, input_tokens: int) -> None:
        self.prompt_tokens = input_tokens
        self.metrics.observe_admitted(input_tokens)

    def cancelled(self, reason: str) -> None:
        """The request was cancelled by name (``Abort``)."""
        self.span.cancelled(reason)

    # --- RequestObserver -------------------------------------------------------------------------------------
    def queued(self, rid: int) -> None:
        if self.traces is not None:
            self.traces.register(rid, self.span)
            self.span.enqueued()

    def event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            now = self._clock()
            if self._last_token:
                self.metrics.observe_itl(now - self._last_token)
            else:
                self.metrics.observe_ttft(now - self.arrival)
                self._first_token = now
            self._last_token = now
            self.metrics.observe_token_depth(event.depth)
            self.depths.append(event.depth)
        else:
            self._finished(event)

    def gone(self, exc: BaseException | None) -> None:
        if exc is None or isinstance(exc, asyncio.CancelledError | GeneratorExit):
            reason = FinishReason.CANCELLED
            self.span.cancelled("deadline exceeded" if self._deadline_passed() else "client cancelled")
        else:
            reason = FinishReason.ERROR
            self.span.failed(exc, self._status_name(exc))
        self._ended(reason, len(self.depths))
        self.span.finish(reason, len(self.depths), self.depths)

    def _finished(self, ev: FinishEvent) -> None:
        reason = ev.finish_reason
        if ev.queue_s > 0:
            self.metrics.observe_queue_time(ev.queue_s)
        self._ended(reason, ev.generated_tokens)
        if self.span.recording:
            if reason is FinishReason.ERROR:
                self.span.failed(ev.error or "the engine failed the request", "UNAVAILABLE")
            elif reason is FinishReason.CANCELLED and self._cut():
                self.span.cancelled("server shut down before the request finished")
            if ev.spec_drafts:
                self.span.set_attribute("cdb.speculative.drafts", ev.spec_drafts)
                self.span.set_attribute("cdb.speculative.accepted", ev.spec_accepted)
                self.span.set_attribute("cdb.speculative.rejected", ev.spec_rejected)
            self.span.finish(reason, ev.generated_tokens, self.depths, ev.total_loop_steps)

    def _ended(self, reason: FinishReason, generated: int) -> None:
        """The request's end-of-request metrics and its log line (opt-in)."""
        latency = self._clock() - self.arrival
        self.metrics.observe_request_end(latency, reason)
        if self.prompt_tokens is None:
            return
        streamed = len(self.depths)
        tpot = (self._last_token - self._first_token) / (streamed - 1) if streamed > 1 else None
        self.metrics.observe_request_tokens(self.prompt_tokens, generated, tpot)
        if request_log_on():
            caller = self._caller() if callable(self._caller) else self._caller
            mean_depth = sum(self.depths) / streamed if streamed else 0.0
            log_request(self.request_id, caller, self.prompt_tokens, generated, mean_depth, str(reason), latency)
