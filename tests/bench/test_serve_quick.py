"""``cdb bench serve --quick`` end to end: in-process (all three modes) and one deployment mode via the public API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cdb_bench.cli import main as bench_main

STATS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_latency_s")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert bench_main(["serve", "--quick", "--json", "--no-progress", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _check_run(run: dict[str, Any], rate: float, requests: int) -> None:
    assert run["rate"] == rate and run["requests"] == requests and run["completed"] == requests
    for key in ("output_throughput", "request_throughput", "goodput", "duration_s"):
        assert run[key] > 0, key
    for key in LATENCIES:
        assert all(run[key][s] is not None and run[key][s] >= 0 for s in STATS), key
    assert run["ttft_s"]["p50"] <= run["ttft_s"]["p99"] <= run["e2e_s"]["p99"]
    per = run["per_request"]
    assert len(per["normalized_latency_s"]) == requests and None not in per["tpot_s"]
    q = run["queue"]
    times = [t for t, _, _ in q["samples"]]
    assert times and times == sorted(times) and all(w >= 0 and r >= 0 for _, w, r in q["samples"])
    assert q["interval_s"] == 0.1 and q["max_running"] == max(r for _, _, r in q["samples"])
    assert set(run["client_lag"]) == {"mean_s", "p99_s", "max_s"} and run["client_lag"]["max_s"] >= 0


def _check_common(s: dict[str, Any], modes: list[str]) -> None:
    assert s["config"]["quick"] and s["config"]["rates"] == [8.0, 24.0] and s["model"]["name"] == "ouro-tiny"
    assert s["workload"]["depth"] == {"mean": 2.5, "min": 1, "max": 4}
    assert list(s["modes"]) == modes
    tokens = {m: [r["output_tokens"] for r in s["modes"][m]["runs"]] for m in modes}
    assert len({t for ts in tokens.values() for t in ts}) == 1  # the same requests for every mode and rate
    for m in modes:
        runs = s["modes"][m]["runs"]
        assert [r["rate"] for r in runs] == [8.0, 24.0]
        for r in runs:
            _check_run(r, r["rate"], s["workload"]["requests"])
        assert s["modes"][m]["knee"]["bound"] == s["config"]["latency_bound_s"]
        assert s["knees"][m] == s["modes"][m]["knee"]["rate"]
    assert s["client_lag"]["max_s"] is not None


def _check_ops(run: dict[str, Any]) -> None:
    """A run's op costs: every generated token sampled by one head op, loop ops carry tokens, compute is spent."""
    o = run["ops"]
    assert set(o["stages"]) == {"prelude", "loop", "head"}
    assert o["stages"]["prelude"]["ops"] >= 1 and o["loop_decode_ops"] >= 1  # a prelude op per prompt at least
    assert o["stages"]["loop"]["ops"] >= o["loop_decode_ops"]  # prefill loop ops too
    assert o["tokens_per_head_op"] == pytest.approx(run["output_tokens"] / o["stages"]["head"]["ops"])
    assert 1 <= o["tokens_per_loop_op"] <= 8  # at most max_num_seqs (quick: 8)
    assert o["loop_prefill_ops"] == o["stages"]["loop"]["ops"] - o["loop_decode_ops"] >= 1  # one prompt at least
    assert o["loop_decode_op_ms"] > 0 and o["loop_prefill_op_ms"] > 0
    for st in o["stages"].values():
        assert st["compute_s"] > 0 and st["mean_op_ms"] > 0 and 0 < st["busy"] < 1


def test_quick_in_process_reports_every_figure(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    s = _run(capsys, "--target", "in-process", "--repeats", "2", "--out", str(tmp_path))
    _check_common(s, ["cdb", "no-refill", "full-depth"])
    for m in s["modes"].values():
        for run in m["runs"]:
            _check_ops(run)
    assert len(s["repeats"]) == 2 and s["repeats"][0]["modes"] == s["modes"]  # the first repeat is the top level
    a = s["across_repeats"]
    for mode in s["modes"]:
        for rate in (8.0, 24.0):
            per = [next(r for r in f["modes"][mode]["runs"] if r["rate"] == rate) for f in s["repeats"]]
            nl = a["mean_normalized_latency_s"][mode][str(rate)]
            assert nl["per_repeat"] == [r["normalized_latency_s"]["mean"] for r in per]
            assert nl["min"] <= nl["median"] <= nl["max"] and nl["median"] == pytest.approx(sum(nl["per_repeat"]) / 2)
    ratios = a["cdb_nl_over"]["no-refill"]["8.0"]["per_repeat"]
    expect = [a["mean_normalized_latency_s"][m]["8.0"]["per_repeat"] for m in ("cdb", "no-refill")]
    assert ratios == pytest.approx([x / y for x, y in zip(*expect)])
    assert a["knees"]["cdb"]["per_repeat"] == [f["knees"]["cdb"] for f in s["repeats"]]
    fd = s["modes"]["full-depth"]["runs"]
    assert all(r["mean_depth"] == 4.0 for r in fd)  # full depth ignores the replayed depths
    assert all(r["mean_depth"] < 3.5 for r in s["modes"]["cdb"]["runs"])  # cdb serves them (mean 2.5 + prefill)
    hist = s["modes"]["cdb"]["runs"][0]["depth_histogram"]  # the measured depth distribution, served depth -> tokens
    assert set(hist) <= {"1", "2", "3", "4"} and len(hist) > 1 and sum(hist.values()) > 0
    ratio = s["knee_ratio_cdb_over_full_depth"]
    assert ratio == pytest.approx(s["knees"]["cdb"] / s["knees"]["full-depth"])
    cut = s["cut_at_full_depth_knee"]
    assert cut["rate"] == s["knees"]["full-depth"] and set(cut["cut"]) == {"cdb", "no-refill"}
    nl = cut["normalized_latency_s"]
    assert cut["cdb"] == pytest.approx(1 - nl["cdb"] / nl["full-depth"])
    saved = json.loads((tmp_path / "serve.json").read_text())
    itls = saved["modes"]["cdb"]["runs"][0]["per_request"]["itl_s"]
    outs = saved["modes"]["cdb"]["runs"][0]["per_request"]["output_tokens"]
    assert [len(x) for x in itls] == [n - 1 for n in outs]
    small = json.loads((tmp_path / "summary.json").read_text())  # every figure, no per-request lists
    assert small["across_repeats"] == saved["across_repeats"] and "per_request" not in small["modes"]["cdb"]["runs"][0]
    second = [f["repeats"][1]["modes"]["cdb"]["runs"][0] for f in (small, saved)]
    assert second[0]["ops"] == second[1]["ops"] and "per_request" in second[1]
    for name in ("nl_vs_rate.png", "ttft_p99_vs_rate.png", "nl_cdf_at_knee.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_deployment_one_mode_through_the_public_api(capsys: pytest.CaptureFixture[str]) -> None:
    s = _run(capsys, "--target", "deployment", "--modes", "cdb")
    _check_common(s, ["cdb"])
    for run in s["modes"]["cdb"]["runs"]:
        _check_ops(run)  # read from the scheduler's Prometheus exposition
    assert s["config"]["target"] == "deployment"
    assert all(r["mean_depth"] < 3.5 for r in s["modes"]["cdb"]["runs"])  # replayed depths crossed the API
    assert s["knee_ratio_cdb_over_full_depth"] is None and s["cut_at_full_depth_knee"] is None


def test_quick_on_synthetic_stages_runs_every_mode_at_modelled_op_costs(capsys: pytest.CaptureFixture[str]) -> None:
    cost = "loop=2000:0:0,head=200:0:0,prelude=200:0:0"
    s = _run(capsys, "--target", "in-process", "--modes", "cdb,full-depth", "--synthetic-cost", cost)
    assert s["config"]["synthetic_cost"] == cost
    _check_common(s, ["cdb", "full-depth"])
    for m in s["modes"].values():
        for run in m["runs"]:
            # A decode loop op costs its modelled 2 ms whatever its batch (a flat cost, as on a GPU below saturation),
            # plus 0.2 ms when it carries Ouro's fused head.
            assert 2.0 <= run["ops"]["loop_decode_op_ms"] <= 2.2 + 1e-9
