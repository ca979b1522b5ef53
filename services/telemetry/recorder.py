"""The scheduler process's wiring of ``services.telemetry.metrics`` and the tracing helpers around the engine.

- ``OpRecorder``: per stage op, on the engine thread (the gRPC executor calls it; ``ObservedExecutor`` does for
  the in-process executor): stage compute and loop-batch metrics always, trace contexts and hop spans when
  tracing is on (``RequestTraces``).
- ``EngineGauges``: a ``Metrics`` collector sampled at scrape time (queue sizes, KV blocks and usage, bank rows, the
  exit threshold in effect, the mean served depth, refill events, preemptions, stage recoveries, whether the stages
  are attached), so that the engine's hot path pays nothing for them.

The per-request part (request span, TTFT, ITL, ...) lives in ``services.telemetry.request_observer``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol

from cdb_engine.engine import Engine
from cdb_scheduler.plan import Executor, LoopOp, Stage, StageLoss, StageOp, StageResult
from services.telemetry.metrics import Metrics
from services.telemetry.probe import OpTimes
from services.telemetry.traces import RequestTraces

_NO_CONTEXTS: Mapping[int, str] = {}


class OpRecorder:
    """``services.telemetry.probe.OpObserver`` feeding per-op metrics and, when given, the request traces.

    Cost per op with tracing off: two histogram observations (≈1.5 µs) and one call that returns at once."""

    __slots__ = ("capacity", "metrics", "traces")

    def __init__(self, metrics: Metrics, loop_capacity: int, traces: RequestTraces | None = None) -> None:
        self.metrics = metrics
        self.capacity = loop_capacity  # max_num_seqs: the loop batch width
        self.traces = traces

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str]:
        traces = self.traces
        return traces.contexts_for_op(op) if traces is not None else _NO_CONTEXTS

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        if not result.error:
            self.metrics.observe_stage_compute(op.stage.role, result.compute_s)
            if isinstance(op, LoopOp) and not op.prefill:
                self.metrics.observe_loop_batch(len(op.rids), self.capacity, result.compute_s)
        if self.traces is not None:
            self.traces.on_op_done(op, result, sent_ns, done_ns)


class ObservedExecutor:
    """An ``Executor`` that reports each op and its result to an ``OpRecorder`` through an ``OpTimes`` probe (the
    gRPC executor calls its own probe; this wraps the in-process one). Single poller, as the engine drives it."""

    def __init__(self, inner: Executor, observer: OpRecorder) -> None:
        self.inner = inner
        self.observer = observer
        self._times = OpTimes(observer)

    def submit(self, op: StageOp) -> None:
        self._times.queued(op)
        self.inner.submit(op)

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        result = self.inner.poll(timeout)
        if isinstance(result, StageLoss):
            self._times.lost()  # every op issued before is void
        elif result is not None:
            self._times.polled(result)
        return result

    @property
    def concurrent_stages(self) -> bool:
        return self.inner.concurrent_stages

    def completed(self, stage: Stage) -> int:
        return self.inner.completed(stage)

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


class StageLink(Protocol):
    """What the gRPC executor tells of its stages (``services.transport.executor.GrpcExecutor``)."""

    @property
    def outage(self) -> str | None:
        """Why a stage is lost while it is being re-attached; None while every stage is attached."""
        ...

    @property
    def broken(self) -> str | None:
        """Why the executor gave up for good; None while it serves."""
        ...


class StagePlane(Protocol):
    """Where the gRPC executor is found once the engine built it (``GrpcExecutorFactory``)."""

    @property
    def executor(self) -> StageLink | None: ...


class EngineGauges:
    """``Metrics`` collector: samples the engine's counters at each scrape (thread-safe; scrapes may overlap).

    ``stages``: the stage plane of a microservices deployment (``GrpcExecutorFactory``), for
    ``cdb_stages_attached``; None in-process (no stage servers: the gauge is not exported)."""

    def __init__(self, engine: Engine, stages: StagePlane | None = None) -> None:
        self.engine = engine
        self.stages = stages
        self._lock = threading.Lock()
        self._refills = self._recoveries = self._recomputed = self._preemptions = 0
        self._prefix = (0, 0)  # prefix-cache tokens queried and hit, reported so far
        self._cpu = dict.fromkeys(("plan", "submit", "dispatch", "other"), 0.0)
        self._spec = (0, 0, 0, 0)  # drafts, accepted, rejected, wasted steps reported so far

    def __call__(self, m: Metrics) -> None:
        engine = self.engine
        st = engine.stats()
        m.set_queue_sizes(st.waiting, st.running)
        m.set_kv_blocks(st.used_kv_blocks, st.total_kv_blocks)
        m.set_bank_rows(st.held_rows, engine.setup.bank_rows)
        limits = engine.limits
        m.set_exit_threshold(limits.exit_threshold, str(limits.exit_rule), str(limits.threshold_source))
        sched = engine.sched_stats
        hist = dict(sched.depth_hist)  # one C-level copy: the engine thread may add a depth meanwhile
        tokens = sum(hist.values())
        m.set_mean_depth(sum(d * n for d, n in hist.items()) / tokens if tokens else 0.0)
        executor = self.stages.executor if self.stages is not None else None
        if executor is not None:
            m.set_stages_attached(executor.outage is None and executor.broken is None)
        with self._lock:
            refills = sched.refill_events
            if refills > self._refills:
                m.inc_refills(refills - self._refills)
                self._refills = refills
            spec = (sched.spec_drafts, sched.spec_accepted, sched.spec_rejected, sched.spec_wasted_steps)
            if spec != self._spec:
                m.inc_speculation(*(max(0, a - b) for a, b in zip(spec, self._spec)))
                self._spec = tuple(max(a, b) for a, b in zip(spec, self._spec))  # type: ignore[assignment]
            queries, hits = max(sched.prefix_queries, self._prefix[0]), max(sched.prefix_hits, self._prefix[1])
            m.record_prefix_cache(queries - self._prefix[0], hits - self._prefix[1], st.cached_kv_blocks)
            self._prefix = (queries, hits)
            preemptions = sched.preemptions
            if preemptions > self._preemptions:
                m.inc_preemptions(preemptions - self._preemptions)
                self._preemptions = preemptions
            cpu = engine.cpu
            parts = {"plan": sched.sched_cpu_s, "submit": cpu.submit_s, "dispatch": cpu.dispatch_s}
            parts["other"] = max(self._cpu["other"], cpu.thread_s - sum(parts.values()))
            for part, total in parts.items():
                m.inc_engine_cpu(part, total - self._cpu[part])
                self._cpu[part] = max(total, self._cpu[part])
            recoveries, recomputed = max(st.recoveries, self._recoveries), max(st.recomputed, self._recomputed)
            m.inc_recoveries(recoveries - self._recoveries, recomputed - self._recomputed)
            self._recoveries, self._recomputed = recoveries, recomputed
