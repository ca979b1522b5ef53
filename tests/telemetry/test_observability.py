"""The scheduler's wiring of metrics and traces around the engine (``services.telemetry.recorder``), no processes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from cdb_engine.engine import EngineCpu
from cdb_engine.limits import ThresholdSource
from cdb_scheduler.exit_policy import ExitRule
from cdb_scheduler.plan import HeadOp, LoopOp, Stage, StageOp, StageResult
from cdb_scheduler.sampling import SamplingParams
from services import telemetry
from services.telemetry.metrics import Metrics
from services.telemetry.otlp_receiver import OtlpReceiver
from services.telemetry.recorder import EngineGauges, ObservedExecutor, OpRecorder
from tests.telemetry.test_metrics_endpoint import parse


def loop_op(seq: int, n: int, prefill: bool = False) -> LoopOp:
    return LoopOp(
        seq=seq,
        fences=(),
        kv_updates=(),
        released=(),
        rids=tuple(range(n)),
        positions=(0,) * n,
        rows=tuple(range(n)),
        steps=(0,) * n,
        prefill=prefill,
        num_steps=2 if prefill else 1,
    )


def head_op(seq: int, rids: tuple[int, ...]) -> HeadOp:
    n = len(rids)
    return HeadOp(
        seq=seq,
        fences=(),
        kv_updates=(),
        released=(),
        rids=rids,
        positions=(0,) * n,
        rows=tuple(range(n)),
        sample=(True,) * n,
        sampling=(SamplingParams(),) * n,
        token_index=(0,) * n,
    )


def test_op_observer_feeds_stage_and_loop_batch_metrics() -> None:
    m = Metrics(max_depth=4)
    obs = OpRecorder(m, loop_capacity=4)
    assert obs.contexts_for_op(loop_op(0, 3)) == {}
    obs.on_op_done(loop_op(0, 3, prefill=True), StageResult(Stage.LOOP, 0, 0.002), 1, 2)  # prefill: no batch
    obs.on_op_done(loop_op(1, 3), StageResult(Stage.LOOP, 1, 0.001), 1, 2)
    obs.on_op_done(head_op(0, (0, 1)), StageResult(Stage.HEAD, 0, 0.0005), 1, 2)
    obs.on_op_done(loop_op(2, 2), StageResult(Stage.LOOP, 2, 0.0, error="boom"), 1, 2)  # failed: not counted
    assert m.compute.count("loop") == 2 and m.compute.count("head") == 1 and m.compute.count("prelude") == 0
    assert m.batch_size.count() == 1 and m.batch_size.sum() == 3
    assert m.occupancy.count() == 1 and m.occupancy.sum() == 0.75


@dataclass
class FakeExecutor:
    submitted: list[StageOp] = field(default_factory=list)
    closed: bool = False
    concurrent_stages = False

    def submit(self, op: StageOp) -> None:
        self.submitted.append(op)

    def poll(self, timeout: float | None) -> StageResult | None:
        op = self.submitted.pop(0) if self.submitted else None
        return StageResult(op.stage, op.seq, 0.001) if op is not None else None

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_observed_executor_reports_each_op_once() -> None:
    m = Metrics()
    ex = ObservedExecutor(FakeExecutor(), OpRecorder(m, loop_capacity=8))
    ex.submit(loop_op(0, 4))
    ex.submit(head_op(0, (0, 1, 2, 3)))
    assert ex.poll(0) is not None and ex.poll(0) is not None and ex.poll(0) is None
    assert m.batch_size.count() == 1 and m.compute.count("loop") == 1 and m.compute.count("head") == 1
    ex.close()
    assert isinstance(ex.inner, FakeExecutor) and ex.inner.closed


def test_op_observer_forwards_to_request_traces(tracing: OtlpReceiver) -> None:
    traces = telemetry.RequestTraces()
    span = telemetry.start_request_span(model="m", max_tokens=4, request_id="r")
    traces.register(0, span)
    span.enqueued()
    obs = OpRecorder(Metrics(), loop_capacity=4, traces=traces)
    assert obs.contexts_for_op(head_op(0, (0,))) == {0: span.traceparent}
    obs.on_op_done(head_op(0, (0,)), StageResult(Stage.HEAD, 0, 0.001), 10, 20)
    span.finish("length", 1, [1])
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: any(x.name == "prefill" for x in s))
    assert {"queue", "prefill", "hop head", "decode"} <= {s.name for s in spans}


_SPEC = ("spec_drafts", "spec_accepted", "spec_rejected", "spec_wasted_steps")  # SchedulerStats' speculation


def _fake_engine(**stats: int) -> SimpleNamespace:
    base = dict(waiting=2, running=3, used_kv_blocks=5, total_kv_blocks=64, held_rows=3, recoveries=0, recomputed=0)
    base |= {"cached_kv_blocks": 2}
    st = SimpleNamespace(**(base | stats))
    return SimpleNamespace(
        stats=lambda: st,
        setup=SimpleNamespace(bank_rows=40),
        sched_stats=SimpleNamespace(
            refill_events=7,
            depth_hist={4: 3, 2: 1},
            sched_cpu_s=0.5,
            preemptions=0,
            prefix_queries=40,
            prefix_hits=16,
            **dict.fromkeys(_SPEC, 0),
        ),
        cpu=EngineCpu(thread_s=2.0, submit_s=0.25, dispatch_s=0.75),
        limits=SimpleNamespace(
            exit_threshold=0.5, exit_rule=ExitRule.HAZARD, threshold_source=ThresholdSource.FAMILY_DEFAULT
        ),
        st=st,
    )


def test_engine_gauges_sample_at_scrape_time() -> None:
    engine = _fake_engine()
    m = Metrics()
    m.add_collector(EngineGauges(engine))  # type: ignore[arg-type]
    _, s = parse(m.render())
    assert (s["cdb_requests_waiting"], s["cdb_requests_running"]) == (2, 3)
    assert s["cdb_kv_blocks_used"] == 5 and s["cdb_bank_rows_total"] == 40
    assert s['cdb_exit_threshold{rule="hazard",source="family-default"}'] == 0.5
    assert s["cdb_served_depth_mean"] == 3.5  # (3 tokens at 4 + 1 at 2) / 4
    assert s["cdb_refill_events_total"] == 7 and s["cdb_stage_recoveries_total"] == 0
    assert (s["cdb_prefix_cache_queries_total"], s["cdb_prefix_cache_hits_total"]) == (40, 16)
    assert s["cdb_prefix_cache_blocks"] == 2
    assert "cdb_stages_attached" not in s  # in-process: no stage servers
    engine.sched_stats.refill_events = 10
    engine.st.recoveries, engine.st.recomputed = 2, 5
    engine.sched_stats.depth_hist[1] = 4
    m.render()
    _, s = parse(m.render())  # counted once: deltas of the engine's counters
    assert m.refills.value() == 10 and s["cdb_refill_events_total"] == 10
    assert s["cdb_stage_recoveries_total"] == 2 and s["cdb_recomputed_requests_total"] == 5
    assert s["cdb_served_depth_mean"] == 2.25  # (12 + 2 + 4) / 8
    cpu = {part: s[f'cdb_engine_thread_cpu_seconds_total{{part="{part}"}}'] for part in ("plan", "submit", "dispatch")}
    assert cpu == {"plan": 0.5, "submit": 0.25, "dispatch": 0.75}
    assert s['cdb_engine_thread_cpu_seconds_total{part="other"}'] == 0.5  # the thread's CPU less the named parts


def test_engine_gauges_report_whether_the_stages_are_attached() -> None:
    link = SimpleNamespace(outage=None, broken=None)
    plane = SimpleNamespace(executor=None)  # GrpcExecutorFactory before the engine started
    m = Metrics()
    m.add_collector(EngineGauges(_fake_engine(), plane))  # type: ignore[arg-type]
    assert "cdb_stages_attached" not in parse(m.render())[1]
    plane.executor = link
    assert parse(m.render())[1]["cdb_stages_attached"] == 1
    link.outage = "loop stage lost: connection reset"
    assert parse(m.render())[1]["cdb_stages_attached"] == 0
    link.outage, link.broken = None, "no complete set of stages back within 30s"
    assert parse(m.render())[1]["cdb_stages_attached"] == 0


def test_a_failing_collector_does_not_break_the_scrape() -> None:
    m = Metrics()

    def broken(_: Metrics) -> None:
        raise RuntimeError("no engine")

    m.add_collector(broken)
    assert parse(m.render())[1]["cdb_requests_waiting"] == 0


def test_per_op_cost_without_tracing() -> None:
    """Always-on metrics: what the engine thread pays per op (two histogram observations)."""
    obs, op, res = OpRecorder(Metrics(), loop_capacity=32), loop_op(1, 32), StageResult(Stage.LOOP, 1, 0.001)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(20000):
            obs.contexts_for_op(op)
            obs.on_op_done(op, res, 1, 2)
        best = min(best, (time.perf_counter() - t) / 20000 * 1e6)
    print(f"OpRecorder per op, tracing off: {best:.2f} us")
    assert best < 25, best  # ≈ 6 µs here: the bound catches work per op that grows, not a slow shared machine
