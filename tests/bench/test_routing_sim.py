"""The routing study's parts: the cost fit, the workload's deep fraction, the policies, the simulation against hand
computations, the default decision, and ``cdb bench routing --quick`` end to end (given costs, no measurement)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from cdb_bench.cli import main as bench_main
from cdb_bench.routing.costs import StepCosts, fit_line
from cdb_bench.routing.policies import (
    LeastOutstanding,
    RoundRobin,
    Segregation,
    balanced_split,
    make_policy,
)
from cdb_bench.routing.report import decide
from cdb_bench.routing.sim import simulate, summarize
from cdb_bench.routing.workload import DEEP_THRESHOLD, RequestView, RoutedRequest, make_workload
from cdb_bench.serve.requests import ServeRequest

COSTS = StepCosts(loop_base_s=1.0, loop_per_token_s=0.5, head_base_s=0.25, head_per_token_s=0.125, max_depth=4)


def req(i: int, arrival: float, prompt: int, depths: tuple[int, ...], deep: bool = False) -> RoutedRequest:
    """A request with ``len(depths) + 1`` output tokens (token 0 from the prefill)."""
    return RoutedRequest(ServeRequest(i, arrival, (5,) * prompt, len(depths) + 1, depths), deep)


def test_fit_line_recovers_a_line_and_clips_at_zero() -> None:
    a, c, worst = fit_line([1, 2, 4, 8], [1.5, 2.0, 3.0, 5.0])
    assert a == pytest.approx(1.0) and c == pytest.approx(0.5) and worst == pytest.approx(0.0, abs=1e-12)
    assert fit_line([1, 2], [2.0, 1.0])[1] == 0.0
    with pytest.raises(ValueError):
        fit_line([1], [1.0])
    with pytest.raises(ValueError, match="max_depth"):
        StepCosts(1.0, 0.0, 0.0, 0.0, max_depth=0)


def test_one_request_costs_its_prefill_then_one_step_per_loop_step_and_a_head_per_token() -> None:
    (out,) = simulate([req(0, 2.0, 3, (2, 1, 3))], RoundRobin(), COSTS, replicas=1, width=4)
    prefill = 4 * (1.0 + 0.5 * 3) + (0.25 + 0.125)  # r · loop(p) + head(1)
    decode = 6 * (1.0 + 0.5 * 1) + 3 * (0.25 + 0.125)  # six loop steps over one token, three heads
    assert out.first_s == pytest.approx(2.0 + prefill) and out.ttft_s == pytest.approx(prefill)
    assert out.finish_s == pytest.approx(2.0 + prefill + decode)
    assert out.tokens == 4 and out.normalized_s == pytest.approx((prefill + decode) / 4)


def test_a_full_replica_queues_and_a_wider_one_batches() -> None:
    a, b = req(0, 0.0, 2, (1,)), req(1, 0.0, 2, (1,))
    prefill, step = COSTS.prefill_s(2), COSTS.decode_step_s(1, 1)
    first, second = simulate([a, b], RoundRobin(), COSTS, replicas=1, width=1)
    assert first.finish_s == pytest.approx(prefill + step)
    assert second.first_s == pytest.approx(first.finish_s + prefill)  # waited for the only slot
    wide = simulate([a, b], RoundRobin(), COSTS, replicas=1, width=2)
    # prefill a, one step of a alone (alternation), prefill b, then b's step alone: a left after its step
    assert wide[0].finish_s == pytest.approx(prefill + step)
    assert wide[1].first_s == pytest.approx(2 * prefill + step)
    c = req(2, 0.0, 2, (3,))
    d = req(3, 0.0, 2, (1,))
    both = simulate([c, d], RoundRobin(), COSTS, replicas=1, width=2)
    # c prefill, c step 1/3, d prefill, then steps over two tokens: d exits at the first, c at the second
    t = prefill + COSTS.decode_step_s(1, 0) + prefill + COSTS.decode_step_s(2, 1)
    assert both[1].finish_s == pytest.approx(t)
    assert both[0].finish_s == pytest.approx(t + COSTS.decode_step_s(1, 1))


def test_policies_pick_as_documented() -> None:
    view = RequestView(prompt_tokens=4, max_tokens=10, exit_threshold=None)
    rr = RoundRobin()
    assert [rr.pick(view, [9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    lo = LeastOutstanding()
    assert lo.pick(view, [3, 1, 2]) == 1
    assert sorted(lo.pick(view, [1, 1, 1]) for _ in range(3)) == [0, 1, 2]  # ties rotate
    seg = Segregation(replicas=3, heavy_replicas=1, long_tokens=50)
    deep = RequestView(4, 10, DEEP_THRESHOLD)
    assert seg.is_heavy(deep) and seg.is_heavy(RequestView(4, 50, None)) and not seg.is_heavy(view)
    assert seg.pick(deep, [5, 0, 0]) == 0  # the heavy group, however busy
    assert seg.pick(view, [0, 4, 2]) == 2  # least outstanding among the light ones
    with pytest.raises(ValueError, match="heavy_replicas"):
        Segregation(3, 3, 10)
    with pytest.raises(ValueError, match="policy"):
        make_policy("random", 3)


def test_balanced_split_matches_the_heavy_share_to_the_heavy_replicas() -> None:
    views = [RequestView(4, n, None) for n in (10, 10, 10, 10, 100, 100)]
    work = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]  # the long ones hold half the work
    assert balanced_split(views, work, replicas=2) == (1, 100, 0.5)
    heavy, cut, share = balanced_split(views, work, replicas=4)
    assert (heavy, cut) == (2, 100) and share == 0.5


def test_workload_marks_a_deep_fraction_at_full_depth() -> None:
    wl = make_workload(200, deep_fraction=0.25, depth=(2.5, 2, 4), seed=3)
    deep = [r for r in wl.requests if r.deep]
    assert len(deep) == 50
    assert all(set(r.depths) == {4} and r.view.exit_threshold == DEEP_THRESHOLD for r in deep)
    assert all(2 <= d <= 4 for r in wl.requests if not r.deep for d in r.depths)
    assert all(len(r.depths) == r.serve.max_tokens - 1 for r in wl.requests)
    half = [r.serve.arrival_s / 2 for r in wl.at(1.0)]
    assert [r.serve.arrival_s for r in wl.at(2.0)] == pytest.approx(half)
    assert wl.capacity(COSTS, 3, 8) == pytest.approx(3 * wl.capacity(COSTS, 1, 8))


def test_every_request_finishes_and_least_outstanding_beats_round_robin_near_saturation() -> None:
    costs = StepCosts(0.8e-3, 0.17e-3, 2e-5, 7e-6, max_depth=4)
    wl = make_workload(1500, seed=1)
    rate = 0.95 * wl.capacity(costs, 3, 8)
    results = {}
    for name in ("round-robin", "least-outstanding"):
        done = simulate(wl.at(rate), make_policy(name, 3), costs, replicas=3, width=8)
        assert all(o.tokens == r.serve.max_tokens for o, r in zip(done, wl.requests))
        results[name] = summarize(done, replicas=3)
        assert sum(results[name]["per_replica_requests"]) == 1500
    assert results["round-robin"]["per_replica_requests"] == [500, 500, 500]
    rr, lo = (results[p]["normalized_latency_s"]["mean"] for p in ("round-robin", "least-outstanding"))
    assert lo < rr  # queueing at a busy replica while another has free slots is what round-robin pays for


def _result(cuts: list[float], live: list[float] | None) -> dict:
    base = [{"normalized_latency_s": {"mean": 1.0}} for _ in cuts]
    best = [{"normalized_latency_s": {"mean": 1.0 - c}} for c in cuts]
    out: dict = {
        "ranking": ["least-outstanding", "round-robin"],
        "sim": {"loads": [0.3, 0.5, 0.9][: len(cuts)], "policies": {"round-robin": base, "least-outstanding": best}},
        "live": None,
    }
    if live is not None:
        out["live"] = {
            "rates": [5.0],
            "runs": {
                "round-robin": [[{"normalized_latency_s": {"mean": 1.0}} for _ in live]],
                "least-outstanding": [[{"normalized_latency_s": {"mean": 1.0 - c}} for c in live]],
            },
        }
    return out


def test_the_default_changes_only_for_a_clear_margin() -> None:
    assert decide(_result([0.0, 0.2, 0.3], None), 0.1, 0.5)["ship"] is True  # below min_load does not count
    assert decide(_result([0.2, 0.05, 0.3], None), 0.1, 0.5)["default"] == "round-robin"
    assert decide(_result([0.2, 0.2, 0.3], [0.15, 0.02]), 0.1, 0.5)["ship"] is False  # one live repeat falls short
    shipped = decide(_result([0.2, 0.2, 0.3], [0.15, 0.12]), 0.1, 0.5)
    assert shipped["ship"] is True and shipped["default"] == "least-outstanding"


def test_cdb_bench_routing_quick_prints_the_figures_and_the_decision(tmp_path: object) -> None:
    out = io.StringIO()
    argv = ["routing", "--quick", "--costs", "0.5,0.02,0.01,0.002", "--requests", "200", "--json"]
    with redirect_stdout(out):
        assert bench_main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads(out.getvalue())
    assert set(result["sim"]["policies"]) == {"round-robin", "least-outstanding", "segregation"}
    for runs in result["sim"]["policies"].values():
        assert [r["rate"] for r in runs] == pytest.approx(result["sim"]["rates"])
        assert all(r["normalized_latency_s"]["mean"] > 0 and r["ttft_s"]["p99"] > 0 for r in runs)
    assert result["costs"]["source"] == "given (--costs)" and result["live"] is None
    assert sorted(result["ranking"]) == sorted(result["sim"]["policies"])
    assert result["decision"]["default"] in ("round-robin", result["ranking"][0])
    assert {p.name for p in tmp_path.iterdir()} == {"routing.json", "routing.png"}  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        bench_main(["routing", "--policies", "least-outstanding"])  # round-robin is the baseline
