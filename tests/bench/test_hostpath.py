"""``cdb bench hostpath --quick``: the deployed tree on synthetic stages, both consumers, figures in range."""

from __future__ import annotations

import json

import pytest

from cdb_bench.hostpath import main, scaled_cost


def test_scaled_costs_keep_the_profile_head_to_loop_ratio() -> None:
    assert scaled_cost("ouro", 1000) == "loop=1000:0:0,head=81.6:0:0"
    assert scaled_cost("huginn", 500).startswith("loop=500:0:0,head=347.2:0:0,prelude=241.5")


@pytest.mark.timeout(120)
def test_quick_hostpath_reports_the_busy_fraction_and_the_cpu_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--seconds", "1", "--warmup", "0.5", "--json", "--consumers", "in-process", "api"]
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["consumer"] for p in points] == ["in-process", "api"]
    for p in points:
        assert 0.0 < p["eta"] <= 1.0
        assert p["tokens_per_s"] > 0 and p["loop_ops"] > 0
        assert p["mean_depth"] == pytest.approx(2.5, abs=0.3)  # the drawn depths, through live exit decisions
        assert p["mean_loop_op_us"] == pytest.approx(500 + 41, rel=0.2)  # the loop op plus its fused head
        cpu = p["sched_cpu_us_per_step"]
        assert set(cpu) >= {"plan", "submit", "dispatch", "engine_other", "other_threads", "process"}
        assert cpu["plan"] > 0 and cpu["process"] >= cpu["plan"]
