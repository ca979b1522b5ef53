"""The engine: one scheduler thread driving a ``Scheduler`` with an ``Executor``.

The loop reads in three lines: schedule (issue every op that may run), wait for the next stage result, consume
it. The executor computes on its own thread or processes, so planning overlaps with compute. Callers on other
threads talk to the loop through a command queue; events go back through per-request sinks.

Request ids: the caller's ``request_id`` (str) is registered synchronously in ``submit`` (so an ``abort`` issued
right after ``submit`` always finds it); the scheduler knows the request by the engine's ``rid`` (int).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import msgspec

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.detokenizer import TextOutput
from cdb_engine.errors import EngineStopped, InvalidRequest, Overloaded
from cdb_engine.events import Completion, EngineStats, Event, FinishEvent, RequestObserver, TokenEvent
from cdb_engine.limits import Limits
from cdb_engine.memory import sized
from cdb_engine.prepare import RequestPreparer
from cdb_engine.setup import StageSetup
from cdb_engine.stream import RequestStream
from cdb_scheduler.plan import Executor, StageLoss
from cdb_scheduler.request import Finished, FinishReason, Request, TokenOut
from cdb_scheduler.scheduler import Scheduler
from cdb_scheduler.stats import SchedulerStats

__all__ = ["Completion", "Engine", "EngineStats", "FinishEvent", "StageSetup", "TokenEvent"]

log = logging.getLogger("cdb.engine")


@dataclass(slots=True)
class EngineCpu:
    """CPU seconds of the engine thread, by part: planning is ``SchedulerStats.sched_cpu_s`` (``schedule`` and
    ``on_result``); ``submit_s`` hands ops to the executor (transport: op encoding and queueing; the scheduler
    calls it as each op is issued, ``SchedulerStats.emit_cpu_s``); ``dispatch_s``
    turns tokens into events for their requests (streaming: detokenization and the sinks); ``thread_s`` is the
    thread's whole CPU (the rest: commands and polling)."""

    start_s: float = 0.0
    thread_s: float = 0.0
    submit_s: float = 0.0
    dispatch_s: float = 0.0


@dataclass(slots=True)
class _Live:
    request_id: str
    req: Request
    sink: Callable[[Event], None]
    out: TextOutput | None  # None: the caller makes the text (``submit(detokenize=False)``)
    resumed: int = 0  # a resumed stream's tokens (``RequestParams.resume_tokens``) and their loop steps: in the
    resumed_steps: int = 0  # scheduler's counts, not in this request's usage


class Engine:
    """Continuous depth batching over an executor (in-process by default)."""

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[StageSetup], Executor] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """``on_fatal(error)``: called on the engine thread if the loop itself fails, after every live request has
        been failed (a server exits non-zero there, so that it is restarted instead of refusing everything)."""
        self.config = config = sized(config)  # (num_kv_blocks auto: the KV pool sized to memory)
        self.prep = RequestPreparer.of(config)
        self.model_config = self.prep.model_config
        self.tokenizer = self.prep.tokenizer
        self.limits: Limits = self.prep.limits
        self.scheduler = Scheduler(self.limits.scheduler_config(config, self.model_config))
        self.setup = StageSetup.of(config, self.model_config, self.limits.max_depth)
        self._factory = executor_factory
        self._on_fatal = on_fatal
        self._executor: Executor | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # engine thread only
        self._by_id: dict[str, int] = {}  # request_id -> rid, under _lock
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ended_early = False  # a request ended while its tokens were handed out (engine thread)
        self._accepting = True
        self.error: str | None = None
        self.last_progress = time.monotonic()
        self.cpu = EngineCpu()  # written by the engine thread only

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Engine:
        if self._thread is not None:
            return self
        if self._factory is None:
            from cdb_engine.inprocess import in_process_executor

            self._executor = in_process_executor(self.config, self.setup, self.model_config)
        else:
            self._executor = self._factory(self.setup)
        if self._executor.concurrent_stages:
            self.scheduler.stage_progress = self._executor.completed
        self._thread = threading.Thread(target=self._run, name="cdb-scheduler", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Refuse new work, let running requests finish for up to ``drain_timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._by_id and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.01)  # a bounded drain wait on the engine thread's progress
        for request_id in list(self._by_id):
            self.abort(request_id, FinishReason.CANCELLED)
        self._stopping = True
        if self._executor is not None:
            self._executor.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._executor is not None:
            self._executor.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- requests
    def validate(self, prompt: str | list[int], params: RequestParams) -> list[int]:
        return self.prep.validate(prompt, params)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        sink: Callable[[Event], None],
        request_id: str | None = None,
        *,
        force: bool = False,
        on_queued: Callable[[int], None] | None = None,
        detokenize: bool = True,
        output: TextOutput | None = None,
    ) -> str:
        """Queue a validated request; ``sink`` receives its events on the engine thread. Returns its request id.

        ``force`` skips the admission cap (offline batch jobs queue everything at once). ``on_queued(rid)`` runs on
        the engine thread when the scheduler takes the request (tracing keys its stage ops by that id).
        ``detokenize=False``: its events carry no text and its stop strings are the caller's to find (a front-end
        process makes the text with ``RequestPreparer.output(params)`` and aborts the request with
        ``FinishReason.STOP``), so the engine thread spends nothing on text. ``output``: the request's text made
        already with ``prep.output(params)`` (a resumed stream's is primed off the caller's event loop)."""
        if not self._accepting or self._thread is None or self.error:
            raise EngineStopped(self.error or "the engine is not accepting requests")
        rid = next(self._rids)
        request_id = request_id or f"req-{rid}"
        cap = self.config.max_num_seqs + self.config.max_waiting
        with self._lock:
            if request_id in self._by_id:
                raise InvalidRequest("request_id", f"{request_id!r} is already used by a live request")
            if not force and len(self._by_id) >= cap:
                raise Overloaded(
                    f"{len(self._by_id)} requests in the system (max_num_seqs {self.config.max_num_seqs} + "
                    f"max_waiting {self.config.max_waiting})"
                )
            self._by_id[request_id] = rid
        try:
            req = self.prep.request(rid, prompt_ids, params)
            out = output if output is not None else self.prep.output(params)  # (checks resumed tokens too)
            resumed = len(params.resume_tokens), sum(params.resume_depths)
            live = _Live(request_id, req, sink, out if detokenize else None, *resumed)
        except InvalidRequest:
            with self._lock:
                del self._by_id[request_id]
            raise

        def add() -> None:
            self._live[rid] = live
            self.scheduler.add(live.req)
            if on_queued is not None:
                on_queued(rid)

        self._command(add)
        return request_id

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request (thread-safe); True if it was live. Ordered after its own submission. Its id is free again
        at once: a client that retries with it (a stream resumed after its front end died) is not refused while this
        one's end is still on its way to the engine thread."""
        with self._lock:
            rid = self._by_id.pop(request_id, None)
        if rid is None:
            return False
        self._command(lambda: self._dispatch(self.scheduler.abort(rid, reason)))
        return True

    def _command(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        if self._executor is not None:
            self._executor.wake()

    # ----------------------------------------------------------------- the loop
    def _run(self) -> None:
        ex = self._executor
        assert ex is not None
        sched = self.scheduler
        self.cpu.start_s = time.thread_time()
        cpu, clock = self.cpu, time.thread_time
        # A result's tokens are handed out after the ops it lets the scheduler plan are submitted: detokenizing
        # and delivering them overlaps the stages' work instead of delaying it. A request they end (a stop
        # string, a caller gone) leaves the scheduler before it plans again.
        events: Sequence[TokenOut | Finished] = ()
        try:
            while not self._stopping:
                self._run_commands()
                sched.schedule(ex.submit)  # (each loop op is submitted as soon as it is formed)
                cpu.submit_s = sched.stats.emit_cpu_s
                t1 = clock()
                if events:
                    self._ended_early = False
                    self._dispatch(events)
                    events = ()
                    cpu.dispatch_s += clock() - t1
                    if self._ended_early:
                        continue  # slots were freed: plan again before waiting
                res = ex.poll(None)
                if isinstance(res, StageLoss):
                    log.warning("%s: recomputing %d running requests", res.reason, len(sched.running))
                    self._dispatch(sched.recover())
                elif res is not None:
                    self.last_progress = time.monotonic()
                    events = sched.on_result(res)
                cpu.thread_s = clock() - cpu.start_s
            self._dispatch(events)
        except Exception as exc:  # the loop cannot go on: fail every live request, then tell the owner (on_fatal)
            log.exception("engine loop failed")
            self.error = f"engine loop failed: {type(exc).__name__}: {exc}"
            for rid, live in list(self._live.items()):
                try:
                    self._dispatch(sched.abort(rid, FinishReason.ERROR))
                except Exception:  # the scheduler's state is broken too: end the request's stream directly
                    if rid in self._live:
                        self._on_finish(live, Finished(rid, FinishReason.ERROR, len(live.req.output), 0, self.error))
            if self._on_fatal is not None:
                self._on_fatal(self.error)

    def _run_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _dispatch(self, events: Sequence[TokenOut | Finished]) -> None:
        now = time.time_ns() if events else 0  # the tokens of one stage result share their time
        for ev in events:
            live = self._live.get(ev.rid)
            if live is None:
                continue
            if isinstance(ev, TokenOut):
                self._on_token(live, ev, now)
            else:
                self._on_finish(live, ev)

    def _on_token(self, live: _Live, ev: TokenOut, now: int) -> None:
        out = live.out
        text = (out.token_text(ev.token_id, ev.depth) or "") if out is not None else ""
        stopped = out is not None and out.stopped
        token = TokenEvent(live.request_id, ev.index, ev.token_id, text, ev.depth, ev.logprobs, now)
        if ev.index == 0 and live.req.score_prompt:
            token = msgspec.structs.replace(token, prompt_logprobs=tuple(live.req.prompt_logprobs))
        ok = self._emit(live, token)
        if stopped or not ok:
            reason = FinishReason.STOP if stopped else FinishReason.CANCELLED
            self._ended_early = True
            self._dispatch(self.scheduler.abort(ev.rid, reason))

    def _on_finish(self, live: _Live, ev: Finished) -> None:
        del self._live[ev.rid]
        with self._lock:
            if self._by_id.get(live.request_id) == ev.rid:  # (an aborted request's id may serve another already)
                del self._by_id[live.request_id]
        req = live.req
        queue_s = req.admitted - req.arrival if req.admitted else 0.0
        generated, steps = ev.generated - live.resumed, max(0, ev.loop_steps - live.resumed_steps)  # (this request's)
        finish = FinishEvent(live.request_id, ev.reason, req.prompt_len, generated, steps, "", ev.error, queue_s)
        finish.resumed_tokens = live.resumed
        if live.out is not None:
            finish = live.out.finish(finish)  # the text held back
        if (spec := req.spec) is not None:
            finish.spec_drafts, finish.spec_accepted, finish.spec_rejected = spec.drafts, spec.accepted, spec.rejected
        if req.score_prompt and ev.generated == 0:  # no token carried the prompt's logprobs
            finish = msgspec.structs.replace(finish, prompt_logprobs=tuple(req.prompt_logprobs))
        self._emit(live, finish)

    @staticmethod
    def _emit(live: _Live, event: Event) -> bool:
        """Hand an event to the request's sink; a failing sink (its caller is gone) ends only that request."""
        try:
            live.sink(event)
        except Exception:
            log.warning("dropping request %s: its event sink failed", live.request_id, exc_info=True)
            return False
        return True

    # ----------------------------------------------------------------- APIs
    def open_stream(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        request_id: str | None = None,
        *,
        observer: RequestObserver | None = None,
        output: TextOutput | None = None,
    ) -> RequestStream:
        """Submit validated ids now (raising ``Overloaded``, ``EngineStopped`` or ``InvalidRequest`` at once) and
        return the request's event stream; call from a running event loop. See ``RequestStream``; ``output``: as
        ``submit``'s."""
        stream = RequestStream(lambda: self.abort(stream.request_id), observer)
        on_queued = observer.queued if observer is not None else None
        stream.request_id = self.submit(prompt_ids, params, stream.sink, request_id, on_queued=on_queued, output=output)
        return stream

    async def stream(
        self, prompt: str | list[int], params: RequestParams, request_id: str | None = None
    ) -> AsyncIterator[Event]:
        """Validate, submit and yield the request's events; leaving the iterator early aborts the request."""
        async with self.open_stream(self.validate(prompt, params), params, request_id) as events:
            async for ev in events:
                yield ev

    def generate(
        self, prompts: Sequence[str | list[int]], params: RequestParams | Sequence[RequestParams]
    ) -> list[Completion]:
        """Offline batch: run every prompt to completion (the engine must be started)."""
        plist = [params] * len(prompts) if isinstance(params, RequestParams) else list(params)
        done = threading.Semaphore(0)
        outs: list[Completion] = []
        for prompt, p in zip(prompts, plist):
            ids = self.validate(prompt, p)
            out = Completion("", ids)
            outs.append(out)

            def sink(ev: Event, out: Completion = out) -> None:
                if out.record(ev):
                    done.release()

            out.request_id = self.submit(ids, p, sink, force=True)
        for _ in outs:
            done.acquire()
        return outs

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            waiting=len(s.waiting),
            running=len(s.running),
            held_rows=s.rows.num_used,
            used_kv_blocks=s.blocks.num_used,
            cached_kv_blocks=s.blocks.num_cached,
            total_kv_blocks=s.blocks.total,
            loop_steps=s.stats.loop_steps,
            tokens=s.stats.tokens,
            last_progress_monotonic=self.last_progress,
            healthy=self.error is None and self._thread is not None and self._thread.is_alive(),
            error=self.error,
            recoveries=s.stats.recoveries,
            recomputed=s.stats.recomputed,
        )

    @property
    def sched_stats(self) -> SchedulerStats:
        return self.scheduler.stats
