"""``cdb bench serve --dataset prefix-repetition``: the shared-prefix workload, and the cache compared on and off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cdb_bench.cli import main as bench_main

WORKLOAD = ("--dataset", "prefix-repetition", "--prefix-count", "2", "--prefix-len", "64", "--suffixes", "3")
SMALL = ("--suffix-len", "8", "--output-len", "4", "--prefill-chunk-size", "16", "--rates", "8")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    argv = ["serve", "--quick", "--json", "--no-progress", "--target", "in-process", *WORKLOAD, *SMALL, *args]
    assert bench_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_reports_ratios_and_hit_rates(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    s = _run(capsys, "--compare-prefix-caching", "--rounds", "2", "--out", str(tmp_path))
    w = s["workload"]
    assert w["dataset"] == "prefix-repetition" and w["requests"] == 6 and w["mean_prompt_tokens"] == 72
    assert (w["prefix_count"], w["prefix_len"], w["suffixes"], w["suffix_len"]) == (2, 64, 3, 8)
    c = s["prefix_caching"]
    assert c["rounds"] == 2 and c["prefill_chunk_size"] == 16 and c["mode"] == "cdb" and list(c["rates"]) == ["8.0"]
    r = c["rates"]["8.0"]
    for name in ("ttft_p50_on_over_off", "ttft_p99_on_over_off", "throughput_on_over_off"):
        assert len(r[name]["per_round"]) == 2 and all(x is not None and x > 0 for x in r[name]["per_round"]), name
        assert r[name]["median"] > 0
    on, off = r["runs"]["on"], r["runs"]["off"]
    assert len(on) == len(off) == 2
    for run in on:
        pc = run["prefix_cache"]
        assert pc["enabled"] and pc["queries"] == 6 * 72 and 0 < pc["hits"] <= 4 * 64  # first of each prefix: a miss
        assert pc["hit_rate"] == pytest.approx(pc["hits"] / pc["queries"]) and pc["cached_blocks"] > 0
        assert run["completed"] == 6 and run["output_tokens"] == 6 * 4
    for run in off:
        assert run["prefix_cache"] == {"enabled": False, "queries": 0, "hits": 0, "hit_rate": 0.0, "cached_blocks": 0}
        assert run["completed"] == 6
    assert r["hit_rate_on"]["median"] > 0 and r["hit_rate_off"] == {"per_round": [0.0, 0.0], "median": 0.0}
    assert json.loads((tmp_path / "serve.json").read_text())["prefix_caching"] == c


def test_the_dataset_serves_in_a_plain_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    s = _run(capsys, "--modes", "cdb")
    assert s["workload"]["requests"] == 6 and s["workload"]["fit"] is None
    (run,) = s["modes"]["cdb"]["runs"]
    assert run["completed"] == 6 and run["output_tokens"] == 24


def test_the_comparison_needs_the_dataset() -> None:
    with pytest.raises(SystemExit):
        bench_main(["serve", "--quick", "--compare-prefix-caching"])
