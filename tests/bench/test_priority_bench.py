"""``cdb bench priority --quick`` on synthetic stages: every policy's figures, per class, come back in the JSON and
the plot (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdb_bench.priority import main
from cdb_bench.priority_report import CLASSES, POLICIES


@pytest.mark.timeout(120)
def test_quick_priority_bench_reports_every_policy_per_class(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out, png = tmp_path / "priority.json", tmp_path / "priority.png"
    argv = ["--quick", "--seconds", "0.4", "--max-num-seqs", "8", "--light-requests", "16", "--capacity-requests", "40"]
    argv += ["--json", "--no-progress", "--out", str(out), "--plot", str(png)]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == s and png.stat().st_size > 0
    assert s["bench"] == "priority" and s["synthetic_cost"] and s["capacity_rps"] > 0 and s["rounds"] == 1
    light = s["light_load"]
    assert light["failed"] == 0 and light["top"]["requests"] > 0 and light["top"]["ttft_p50_s"] > 0
    assert set(s["top_ttft_p50_over_light"]) == set(s["top_within_2x_of_light"]) == set(POLICIES)
    assert tuple(s["policies"]) == POLICIES
    for f in s["policies"].values():
        assert f["failed"] == 0 and f["top_ttft_p50_over_light"]["median"] > 0
        assert f["top_ttft_p90_over_light"]["median"] >= f["top_ttft_p50_over_light"]["median"]
        for c in ("all", *CLASSES):
            assert f["goodput_over_fifo"][c]["requests"]["median"] is not None
            assert f["goodput_over_fifo"][c]["tokens"]["median"] > 0
        assert set(f["mean_depth"]) == set(f["not_started_at_end"]) == set(CLASSES)
        assert all(d >= 1 for d in f["mean_depth"].values())
        assert f["waiting_at_end"] is not None
        (run,) = f["runs"]
        for c in CLASSES:
            assert run[c]["requests"] > 0 and run[c]["ttft_p50_s"] > 0 and run[c]["tokens_per_s"] > 0
        assert run["top"]["requests"] + run["low"]["requests"] == run["all"]["requests"]
    assert s["policies"]["fifo"]["goodput_over_fifo"]["all"]["tokens"]["median"] == 1.0
