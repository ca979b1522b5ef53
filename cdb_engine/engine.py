"""The engine: one scheduler thread driving a ``Scheduler`` with an ``Executor``.

The loop reads in three lines: schedule (issue every op that may run), wait for the next stage result, consume
it. The executor computes on its own thread or processes, so planning overlaps with compute. Callers on other
threads talk to the loop through a command queue; events go back through per-request sinks.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.errors import EngineStopped, Overloaded
from cdb_engine.requests import Detokenizer, Limits, build_policy, resolve_limits, validate
from cdb_engine.setup import StageSetup
from cdb_model.config import ModelConfig
from cdb_model.loader import load_config, load_tokenizer
from cdb_model.presets import preset_config, preset_names
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.plan import Executor, TokenLogprobs
from cdb_scheduler.request import Finished, FinishReason, Request, TokenOut
from cdb_scheduler.scheduler import Scheduler
from cdb_scheduler.stats import SchedulerStats

__all__ = ["Completion", "Engine", "EngineStats", "FinishEvent", "StageSetup", "TokenEvent"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    index: int
    token_id: int
    text: str
    depth: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class FinishEvent:
    request_id: str
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    generated_tokens: int
    total_loop_steps: int
    text: str = ""  # held-back text released at the end
    error: str | None = None
    queue_s: float = 0.0  # submission to first admission (prefill start); 0 if never admitted


Event = TokenEvent | FinishEvent


@dataclass(slots=True)
class Completion:
    """Result of one offline request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    total_loop_steps: int = 0
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() when each token was reported


@dataclass(frozen=True, slots=True)
class EngineStats:
    waiting: int
    running: int
    held_rows: int
    used_kv_blocks: int
    total_kv_blocks: int
    loop_steps: int
    tokens: int
    last_progress_monotonic: float
    healthy: bool
    error: str | None


@dataclass(slots=True)
class _Live:
    name: str
    req: Request
    sink: Callable[[Event], None]
    detok: Detokenizer


def load_model_config(source: str) -> ModelConfig:
    return preset_config(source) if source in preset_names() else load_config(source)


class Engine:
    """Continuous depth batching over an executor (in-process by default)."""

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[StageSetup], Executor] | None = None,
    ) -> None:
        self.config = config
        self.model_config = load_model_config(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.limits: Limits = resolve_limits(config, self.model_config)
        mc = self.model_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_depth=self.limits.max_depth,
                mode=Mode(config.mode),
                max_num_seqs=config.max_num_seqs,
                num_kv_blocks=config.num_kv_blocks,
                kv_block_size=config.kv_block_size,
                prefill_token_budget=config.prefill_token_budget,
                prefill_chunk_size=config.prefill_chunk_size,
                min_coda_batch_size=self.limits.min_coda_batch_size,
                loop_pipeline_depth=config.loop_pipeline_depth,
                copy_on_exit=config.kv_policy == "last_exited",
                coda_has_kv=mc.num_coda_layers > 0,
            )
        )
        self.setup = StageSetup(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            bank_rows=config.max_num_seqs + config.prefill_token_budget,
            bank_width=mc.bank_width,
            kv_policy=config.kv_policy,
            kv_shared_after=config.kv_shared_after,
            max_depth=self.limits.max_depth,
            num_kv_blocks=config.num_kv_blocks,
            kv_block_size=config.kv_block_size,
        )
        self._factory = executor_factory
        self._executor: Executor | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._by_name: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._active = 0  # submitted and not finished (admission cap)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self.error: str | None = None
        self.last_progress = time.monotonic()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Engine:
        if self._thread is not None:
            return self
        if self._factory is None:
            from cdb_engine.inprocess import InProcessExecutor

            self._executor = InProcessExecutor(self.setup, num_threads=self.config.num_threads)
        else:
            self._executor = self._factory(self.setup)
        self._thread = threading.Thread(target=self._run, name="cdb-scheduler", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Refuse new work, let running requests finish for up to ``drain_timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._active and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.01)
        for name in list(self._by_name):
            self.abort(name, "cancelled")
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
        return validate(self.limits, self.tokenizer, prompt, params, self.config.kv_policy)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        sink: Callable[[Event], None],
        request_id: str | None = None,
        *,
        force: bool = False,
        on_queued: Callable[[int], None] | None = None,
    ) -> str:
        """Queue a validated request; ``sink`` receives its events on the engine thread.

        ``force`` skips the admission cap (offline batch jobs queue everything at once). ``on_queued(internal_id)``
        runs on the engine thread when the scheduler takes the request (tracing keys its stage ops by that id)."""
        if not self._accepting or self._thread is None or self.error:
            raise EngineStopped(self.error or "the engine is not accepting requests")
        with self._lock:
            if not force and self._active >= self.config.max_num_seqs + self.config.max_waiting:
                raise Overloaded(
                    f"{self._active} requests in the system (max_num_seqs {self.config.max_num_seqs} + "
                    f"max_waiting {self.config.max_waiting})"
                )
            self._active += 1
        rid = next(self._ids)
        name = request_id or f"req-{rid}"
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.stop_token_ids)
        req = Request(
            id=rid,
            prompt=list(prompt_ids),
            max_tokens=params.max_tokens,
            policy=build_policy(self.limits, params.exit_threshold),
            sampling=params.sampling,
            stop_token_ids=frozenset(stop),
            init_seed=self.config.init_seed,
            replay_depths=list(params.replay_depths) if params.replay_depths is not None else None,
            arrival=time.monotonic(),
        )
        live = _Live(name, req, sink, Detokenizer(self.tokenizer, params.stop_strings))

        def add() -> None:
            self._live[rid] = live
            self._by_name[name] = rid
            self.scheduler.add(req)
            if on_queued is not None:
                on_queued(rid)

        self._command(add)
        return name

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """End a request (thread-safe); True if it was known."""
        rid = self._by_name.get(request_id)
        if rid is None:
            return False
        self._command(lambda: self._dispatch(self.scheduler.abort(rid, FinishReason(reason))))
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
        try:
            while not self._stopping:
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                for op in sched.schedule():
                    ex.submit(op)
                res = ex.poll(None)
                if res is not None:
                    self.last_progress = time.monotonic()
                    self._dispatch(sched.on_result(res))
        except Exception as exc:  # a scheduler bug must not hang clients: fail everything loudly
            traceback.print_exc()
            self.error = f"engine loop failed: {type(exc).__name__}: {exc}"
            for rid in list(self._live):
                self._dispatch(sched.abort(rid, FinishReason.ERROR))

    def _dispatch(self, events: Sequence[TokenOut | Finished]) -> None:
        for ev in events:
            live = self._live.get(ev.request_id)
            if live is None:
                continue
            if isinstance(ev, TokenOut):
                text, stopped = live.detok.push(ev.token_id)
                ok = self._emit(live, TokenEvent(live.name, ev.index, ev.token_id, text, ev.depth, ev.logprobs))
                if stopped or not ok:
                    reason = FinishReason.STOP if stopped else FinishReason.CANCELLED
                    self._dispatch(self.scheduler.abort(ev.request_id, reason))
                continue
            del self._live[ev.request_id]
            self._by_name.pop(live.name, None)
            with self._lock:
                self._active -= 1
            tail = live.detok.flush() if ev.reason is not FinishReason.STOP else ""
            self._emit(
                live,
                FinishEvent(
                    live.name,
                    ev.reason.value,
                    live.req.prompt_len,
                    ev.generated,
                    ev.loop_steps,
                    tail,
                    ev.error,
                    live.req.admitted - live.req.arrival if live.req.admitted else 0.0,
                ),
            )

    @staticmethod
    def _emit(live: _Live, event: Event) -> bool:
        """Hand an event to the request's sink; a failing sink (its caller is gone) ends only that request."""
        try:
            live.sink(event)
        except Exception as exc:
            print(f"cdb: dropping request {live.name}: its event sink failed: {exc!r}", file=sys.stderr)
            return False
        return True

    # ----------------------------------------------------------------- APIs
    async def stream(
        self, prompt: str | list[int], params: RequestParams, request_id: str | None = None
    ) -> AsyncIterator[Event]:
        """Validate, submit and yield the request's events; leaving the iterator early aborts the request."""
        ids = self.validate(prompt, params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        name = self.submit(ids, params, sink, request_id)
        finished = False
        try:
            while not finished:
                ev = await events.get()
                finished = isinstance(ev, FinishEvent)
                yield ev
        finally:
            if not finished:
                self.abort(name)

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
                if isinstance(ev, TokenEvent):
                    out.token_ids.append(ev.token_id)
                    out.depths.append(ev.depth)
                    out.text += ev.text
                    out.logprobs.append(ev.logprobs)
                    out.token_times.append(time.perf_counter())
                else:
                    out.text += ev.text
                    out.finish_reason = ev.finish_reason
                    out.total_loop_steps = ev.total_loop_steps
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
            total_kv_blocks=s.blocks.total,
            loop_steps=s.stats.loop_steps,
            tokens=s.stats.tokens,
            last_progress_monotonic=self.last_progress,
            healthy=self.error is None and self._thread is not None and self._thread.is_alive(),
            error=self.error,
        )

    @property
    def sched_stats(self) -> SchedulerStats:
        return self.scheduler.stats
