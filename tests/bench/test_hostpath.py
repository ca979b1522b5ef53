"""``cdb bench hostpath --quick``: the deployed tree on synthetic stages, both consumers, figures in range."""

from __future__ import annotations

import json

import pytest

from cdb_bench.hostpath import main, medians, reaction_split, scaled_cost
from cdb_scheduler.plan import Stage
from services.telemetry.probe import HopLog


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
        assert p["loop_stage_cpu_us_per_op"] > 0
    split = points[0]["reaction_split_us"]  # in-process: the engine's hand-overs are timed
    assert list(split) == ["stage_reply", "ring", "to_engine", "engine", "send_cpu"]
    assert all(part is not None and part["p50"] >= 0 and part["mean"] >= 0 for part in split.values())
    assert "reaction_split_us" not in points[1]
    assert all(p["gc"]["collections"] >= p["gc"]["full"] >= 0 for p in points[:1])  # the scheduler's, in-process
    assert all(p["idle_max_us"] >= 0 for p in points)
    for p in points:  # the machine's CPU over the window: the tree (and the clients) kept it partly busy
        host = p["host"]
        assert host["cores"] >= 1 and 0.0 < host["busy"] <= 1.05 and 0.0 <= host["steal"] <= 1.0
        assert host["cpu_us_per_op"] > p["loop_stage_cpu_us_per_op"]  # (the loop stage's is part of it)
        assert 0.0 < host["eta_bound"] <= 1.0


def _run(family: str, op_us: float, eta: float, round_: int) -> dict[str, object]:
    return {
        "family": family,
        "cost": f"loop={op_us}:0:0",
        "op_us": op_us,
        "width": 64,
        "consumer": "in-process",
        "fuse_loop_head": True,
        "transport": "rings",
        "frontends": 0,
        "round": round_,
        "eta": eta,
        "tokens_per_s": 1000 * eta,
        "of_ideal": eta,
        "sched_cpu_us_per_step": {"process": 600 - 100 * eta},
        "loop_stage_cpu_us_per_op": 500.0,
        "idle_us_per_op": {"op_arrived_late": 10.0, "fences": 0.0, "stage_preparation": 100 * round_},
        "reaction_us": {"p50": 600.0},
        "host": {"cores": 2, "busy": 0.7, "steal": 0.01, "cpu_us_per_op": 1100.0, "eta_bound": 0.9},
    }


def test_rounds_give_each_point_its_median_and_range() -> None:
    rows = [_run("ouro", 500, eta, r) for r, eta in enumerate((0.6, 0.2, 0.7))]
    rows += [_run("huginn", 500, eta, r) for r, eta in enumerate((0.5, 0.4, 0.45))]
    got = medians(rows)
    assert [(m["family"], m["runs"]) for m in got] == [("ouro", 3), ("huginn", 3)]
    assert got[0]["eta"] == {"median": 0.6, "min": 0.2, "max": 0.7}  # one bad run moves the median little
    assert got[1]["tokens_per_s"]["median"] == pytest.approx(450)
    assert got[0]["idle_stage_preparation_us"] == {"median": 100, "min": 0, "max": 200}


def test_the_reaction_split_follows_each_loop_reply_to_the_op_it_lets_the_engine_send() -> None:
    # loop ops 0..3 end at 1000, 2000, 3000, 4000 us; pipeline depth 2: reply k lets op k + 2 go out
    ops = [[seq, 64, 0, 0, 0, 0, 1_000_000 * (seq + 1), 500_000] for seq in range(4)]
    hops = HopLog()
    for seq in range(2):  # written 10 us after the end, read 20 us later, polled 30 us later
        end = ops[seq][6]
        hops.replies.append((Stage.LOOP, seq, end + 10_000, end + 30_000, end + 60_000))
    hops.replies.append((Stage.HEAD, 0, 0, 0, 0))  # not a loop reply: not counted
    hops.sent.extend([(Stage.LOOP, 2, 1_000_000 + 460_000, 30_000), (Stage.LOOP, 3, 2_000_000 + 40_000, 50_000)])
    hops.sent.append((Stage.LOOP, 9, 20_000_000, 1_000_000))  # sent after the window: not counted  (op 3: early)
    split = reaction_split(ops, hops, (0, 10_000_000), depth=2)
    assert split["stage_reply"] == {"p50": 10.0, "mean": 10.0}
    assert split["ring"] == {"p50": 20.0, "mean": 20.0}
    assert split["to_engine"] == {"p50": 30.0, "mean": 30.0}
    assert split["engine"] == {"p50": 200.0, "mean": 200.0}  # 400 us after its reply was polled, and 0 (sent before)
    assert split["send_cpu"] == {"p50": 40.0, "mean": 40.0}
