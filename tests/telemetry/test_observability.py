"""The scheduler's wiring of metrics and traces around the engine (``services.telemetry.recorder``), no processes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from cdb_scheduler.plan import HeadOp, LoopOp, SamplingParams, Stage, StageOp, StageResult
from services import telemetry
from services.telemetry.metrics import Metrics
from services.telemetry.otlp_receiver import OtlpReceiver
from services.telemetry.recorder import EngineGauges, ObservedExecutor, OpRecorder


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


def test_engine_gauges_sample_at_scrape_time() -> None:
    stats = SimpleNamespace(waiting=2, running=3, used_kv_blocks=5, total_kv_blocks=64, held_rows=3)
    engine = SimpleNamespace(
        stats=lambda: stats, setup=SimpleNamespace(bank_rows=40), sched_stats=SimpleNamespace(refill_events=7)
    )
    m = Metrics()
    m.add_collector(EngineGauges(engine))  # type: ignore[arg-type]
    text = m.render()
    assert "cdb_requests_waiting 2\n" in text and "cdb_requests_running 3\n" in text
    assert "cdb_kv_blocks_used 5\n" in text and "cdb_bank_rows_total 40\n" in text
    engine.sched_stats.refill_events = 10
    m.render()
    assert m.refills.value() == 10  # counted once: deltas of the engine's counter


def test_a_failing_collector_does_not_break_the_scrape() -> None:
    m = Metrics()

    def broken(_: Metrics) -> None:
        raise RuntimeError("no engine")

    m.add_collector(broken)
    assert "cdb_requests_waiting 0\n" in m.render()


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
    assert best < 10, best
