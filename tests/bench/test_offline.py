"""``cdb bench offline`` on a tiny workload: every mode, the FLOP bounds and the measured depth distribution."""

from __future__ import annotations

import json

from cdb_bench.offline import main


def test_offline_json_reports_bounds_fractions_and_depth_histograms(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--model", "ouro-tiny", "--requests", "6", "--max-num-seqs", "4", "--prompt-len", "4", "8"]
    assert main([*argv, "--output-len", "6", "10", "--depth-mean", "2.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flop_bound_S"] > out["workload_flop_ratio_S_w"] > 1.0  # prompts dilute the per-token bound
    for mode, fig in out["modes"].items():
        hist = {int(d): n for d, n in fig["depth_histogram"].items()}
        assert sum(hist.values()) == fig["tokens"], mode
        assert fig["realized_fraction_of_S_w"] > 0
    assert set(out["modes"]["full-depth"]["depth_histogram"]) == {"4"}
    assert len(out["modes"]["cdb"]["depth_histogram"]) > 1
