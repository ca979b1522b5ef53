"""The workload FLOP ratio S_w and the scheduler-cost benchmark."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from cdb_bench.flops import request_flops, workload_flop_ratio
from cdb_bench.scheduler_cost import scheduler_cpu_per_step
from cdb_model.presets import preset_config


def test_full_depth_everywhere_gives_one_and_fewer_steps_give_more() -> None:
    mc = preset_config("ouro-bench")
    assert workload_flop_ratio(mc, [8, 16], [[4] * 10, [4] * 3], 4) == pytest.approx(1.0)
    shallow = workload_flop_ratio(mc, [8], [[1] * 50], 4)
    deeper = workload_flop_ratio(mc, [8], [[3] * 50], 4)
    assert shallow > deeper > 1.0


def test_s_w_approaches_the_papers_bound_without_prompts_and_attention() -> None:
    """A one-token prompt and a modest output: prefill and attention are small, so S_w is close to S."""
    mc = preset_config("ouro-bench")
    f0, fr = mc.param_counts()
    s = (f0 + 4 * fr) / (f0 + 2 * fr)
    assert workload_flop_ratio(mc, [1], [[2] * 60], 4) == pytest.approx(s, rel=0.05)


def test_prompt_tokens_cost_the_same_in_both_modes_and_dilute_the_ratio() -> None:
    mc = preset_config("huginn-bench")
    short = workload_flop_ratio(mc, [4], [[6] * 20], 16)
    long = workload_flop_ratio(mc, [400], [[6] * 20], 16)
    assert short > long > 1.0
    assert request_flops(mc, 10, [], 16) < request_flops(mc, 11, [], 16)


def test_scheduler_cpu_per_step_is_measured_in_steady_state() -> None:
    fig = scheduler_cpu_per_step(max_num_seqs=16, max_depth=4, steps=200, depth_mean=2.5)
    assert fig["loop_steps"] >= 150 and 0 < fig["sched_cpu_s_per_step"] < 0.05
    assert fig["occupancy"] > 0.8, "steady state keeps the loop batch full"
    assert "chunk_ratios" not in fig  # no reference step to divide by


def test_live_exits_with_the_fused_head_plan_as_a_deployed_ouro_does() -> None:
    fig = scheduler_cpu_per_step(max_num_seqs=16, max_depth=4, steps=300, depth_mean=2.5, live=True, fused=True)
    assert fig["loop_steps"] >= 200 and 0 < fig["sched_cpu_s_per_step"] < 0.05
    assert fig["occupancy"] > 0.8
    assert fig["mean_depth"] == pytest.approx(2.5, abs=0.2)  # the drawn depths, through one-ahead gate decisions
    replayed = scheduler_cpu_per_step(max_num_seqs=16, max_depth=4, steps=300, depth_mean=2.5)
    assert replayed["mean_depth"] == pytest.approx(2.5, abs=0.3)  # (drawn from 1: a different distribution)


def test_the_reference_step_is_timed_after_every_chunk_of_the_steady_window() -> None:
    calls: list[int] = []

    def probe() -> float:
        calls.append(1)
        return 2.0  # ms

    fig = scheduler_cpu_per_step(max_num_seqs=16, max_depth=4, steps=400, depth_mean=2.5, probe=probe, chunks=4)
    assert len(calls) == len(fig["chunk_ratios"]) == len(fig["chunk_step_ms"]) in (3, 4)  # the last may fall short
    assert fig["chunk_step_ms"] == [2.0] * len(calls) and all(r > 0 for r in fig["chunk_ratios"])
    assert fig["ratio_median"] == statistics.median(fig["chunk_ratios"])


def test_the_scheduler_benchmark_writes_json_and_a_plot(tmp_path: Path) -> None:
    from cdb_bench.scheduler_cost import main as scheduler_main

    argv = ["--model", "ouro-tiny", "--max-num-seqs", "8", "16", "--steps", "50", "--out", str(tmp_path), "--json"]
    assert scheduler_main([*argv, "--no-progress"]) == 0
    data = json.loads((tmp_path / "scheduler.json").read_text())
    assert [w["max_num_seqs"] for w in data["widths"]] == [8, 16]
    assert (data["exits"], data["fuse_loop_head"]) == ("replay", False)
    assert (tmp_path / "scheduler.png").read_bytes()[:4] == b"\x89PNG"
