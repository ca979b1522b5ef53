"""The serving benchmark's figures on hand-made timings, and the knee bisection on a synthetic latency curve."""

from __future__ import annotations

import numpy as np
import pytest

from cdb_bench.serve.knee import Knee, find_knee, knee_ratio, latency_cut
from cdb_bench.serve.metrics import (
    RequestRecord,
    Slo,
    describe,
    lag_stats,
    queue_summary,
    request_times,
    summarize_run,
)
from cdb_bench.stats import percentile


def _rec(i: int, arrival: float, tokens: list[float], sent_lag: float = 0.0, error: str | None = None) -> RequestRecord:
    rec = RequestRecord(
        i, arrival, prompt_tokens=5, sent_s=arrival + sent_lag, token_s=tokens, depths=[2] * len(tokens)
    )
    rec.finished_s = tokens[-1] if tokens and error is None else None
    rec.error = error
    return rec


def test_ttft_tpot_itl_e2e_and_normalized_latency_of_one_request() -> None:
    t = request_times(_rec(0, 1.0, [1.5, 1.7, 2.0]))
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.0)
    assert t.tpot == pytest.approx((1.0 - 0.5) / 2)
    assert t.itl == pytest.approx((0.2, 0.3))
    assert t.normalized == pytest.approx(1.0 / 3)
    assert request_times(_rec(1, 0.0, [0.4])).tpot is None


def test_latencies_count_from_the_scheduled_arrival_not_the_send() -> None:
    late = _rec(0, 1.0, [1.5, 2.0], sent_lag=0.25)
    assert request_times(late).ttft == pytest.approx(0.5)
    assert lag_stats([0.25]) == {"mean_s": 0.25, "p99_s": 0.25, "max_s": 0.25}


@pytest.mark.parametrize("q", [0, 37, 50, 90, 99, 100])
def test_percentiles_interpolate_like_numpy(q: float) -> None:
    values = [0.3, 5.0, 1.0, 2.5, 9.0, 0.01, 4.2]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert describe(values)["p90"] == pytest.approx(float(np.percentile(values, 90)))
    assert describe([])["mean"] is None


def test_throughputs_and_goodput_under_the_slo() -> None:
    records = [
        _rec(0, 0.0, [0.1, 0.2, 0.3]),  # TTFT 0.1, TPOT 0.1: meets both
        _rec(1, 0.5, [1.5, 1.6]),  # TTFT 1.0: misses the TTFT SLO
        _rec(2, 1.0, [1.2, 2.0, 3.0, 4.0]),  # TTFT 0.2, TPOT 0.933: misses the TPOT SLO
        _rec(3, 1.5, [1.6, 1.7]),  # meets both
        _rec(4, 2.0, [], error="RuntimeError: boom"),
    ]
    s = summarize_run(records, rate=2.0, slo=Slo(ttft_s=0.5, tpot_s=0.2))
    assert s["duration_s"] == pytest.approx(4.0)  # first arrival at 0 to the last finish
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["RuntimeError: boom"])
    assert s["output_tokens"] == 11
    assert s["output_throughput"] == pytest.approx(11 / 4.0)
    assert s["request_throughput"] == pytest.approx(4 / 4.0)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["ttft_s"]["mean"] == pytest.approx((0.1 + 1.0 + 0.2 + 0.1) / 4)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((0.3 / 3 + 1.1 / 2 + 3.0 / 4 + 0.2 / 2) / 4)
    assert s["itl_s"]["p50"] == pytest.approx(float(np.percentile([0.1, 0.1, 0.1, 0.8, 1.0, 1.0, 0.1], 50)))
    assert s["per_request"]["ttft_s"][4] is None and s["per_request"]["output_tokens"][:2] == [3, 2]
    assert s["mean_depth"] == pytest.approx(2.0)


def test_queue_summary_over_samples() -> None:
    q = queue_summary([(0.0, 0, 1), (0.1, 3, 4), (0.2, 1, 4)], 0.1)
    assert (q["max_waiting"], q["mean_waiting"], q["max_running"]) == (3, pytest.approx(4 / 3), 4)
    assert q["samples"][1] == [0.1, 3, 4]


def _curve(rate: float) -> float:
    """An M/M/1-like mean normalized latency: 10 ms/token at no load, unbounded at 10 req/s."""
    return 0.01 / (1 - rate / 10) if rate < 10 else float("inf")


def test_knee_bisects_between_the_highest_passing_and_lowest_failing_rate() -> None:
    swept = {r: _curve(r) for r in (2.0, 4.0, 6.0, 10.0, 12.0)}
    asked: list[float] = []

    def measure(rate: float) -> float:
        asked.append(rate)
        return _curve(rate)

    knee = find_knee(swept, bound=0.05, steps=10, measure=measure)  # the true knee: 1 - r/10 = 0.2, r = 8
    assert knee.rate is not None and knee.failing is not None
    assert knee.rate < 8.0 <= knee.failing and knee.failing - knee.rate == pytest.approx(4.0 / 2**10)
    assert asked[0] == 8.0 and len(asked) == 10 and not knee.censored
    assert find_knee(swept, bound=0.05, steps=0, measure=measure).rate == 6.0


def test_knee_when_every_rate_passes_or_none_does() -> None:
    def never(rate: float) -> float:
        raise AssertionError("nothing to bisect")

    assert find_knee({1.0: 0.01, 2.0: 0.02}, 0.05, 5, never) == Knee(2.0, None, True, 0, 0.05)
    assert find_knee({1.0: 0.1, 2.0: None}, 0.05, 5, never).rate is None


def test_knee_ratio_and_latency_cut() -> None:
    knees = {"cdb": Knee(7.2, 7.5, False, 3, 0.1), "full-depth": Knee(4.8, 5.0, False, 3, 0.1)}
    assert knee_ratio(knees) == pytest.approx(1.5)
    assert knee_ratio({"cdb": knees["cdb"]}) is None
    assert latency_cut(0.02, 0.05) == pytest.approx(0.6)
    assert latency_cut(None, 0.05) is None


def test_op_counters_read_from_the_scheduler_exposition_and_their_delta() -> None:
    from cdb_bench.serve.metrics import op_summary
    from cdb_bench.serve.targets import parse_counters
    from services.telemetry.metrics import Metrics

    m = Metrics("m", max_depth=4)
    before = parse_counters(m.render())
    assert before.ops == {"prelude": 0, "loop": 0, "head": 0} and before.loop_ops == 0
    for size in (6, 2):
        m.observe_loop_batch(size=size, capacity=8, compute_s=0.004)
        m.observe_stage_compute("loop", 0.004)
    m.observe_stage_compute("loop", 0.01)  # a prefill loop op: compute, no decode batch
    m.observe_stage_compute("head", 0.002)
    m.observe_stage_compute("prelude", 0.001)
    cost = parse_counters(m.render()).delta(before)
    assert cost.ops == {"prelude": 1, "loop": 3, "head": 1} and (cost.loop_ops, cost.loop_tokens) == (2, 8)
    assert cost.compute_s["loop"] == pytest.approx(0.018) and cost.compute_s["head"] == pytest.approx(0.002)
    assert cost.loop_decode_s == pytest.approx(0.008)
    o = op_summary(cost, output_tokens=8, wall_s=0.1)
    assert o["loop_decode_op_ms"] == pytest.approx(4.0) and o["loop_prefill_ops"] == 1
    assert o["loop_prefill_op_ms"] == pytest.approx(10.0)
    assert o["tokens_per_loop_op"] == 4 and o["tokens_per_head_op"] == 8
    loop = o["stages"]["loop"]
    assert loop["mean_op_ms"] == pytest.approx(6.0) and loop["busy"] == pytest.approx(0.18)
