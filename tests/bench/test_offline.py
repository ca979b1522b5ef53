"""``cdb bench offline`` on a tiny workload: every mode, the FLOP bounds and the measured depth distribution."""

from __future__ import annotations

import json
from pathlib import Path

from cdb_bench.offline import main


def test_offline_json_reports_bounds_fractions_and_depth_histograms(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    argv = ["--model", "ouro-tiny", "--requests", "6", "--max-num-seqs", "4", "--prompt-len", "4", "8"]
    assert main([*argv, "--output-len", "6", "10", "--depth-mean", "2.5", "--json", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "offline: " in captured.err  # the progress bar, also with --json
    assert json.loads((tmp_path / "offline.json").read_text()) == out
    for plot in ("throughput", "occupancy", "depth_histogram"):
        assert (tmp_path / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    assert out["flop_bound_S"] > out["workload_flop_ratio_S_w"] > 1.0  # prompts dilute the per-token bound
    for mode, fig in out["modes"].items():
        hist = {int(d): n for d, n in fig["depth_histogram"].items()}
        assert sum(hist.values()) == fig["tokens"], mode
        assert fig["realized_fraction_of_S_w"] > 0
    assert set(out["modes"]["full-depth"]["depth_histogram"]) == {"4"}
    assert len(out["modes"]["cdb"]["depth_histogram"]) > 1


def test_the_services_benchmark_writes_its_json_and_throughput_plot(tmp_path: Path) -> None:
    from cdb_bench.services import write_outputs

    summary = {
        "model": "ouro-bench",
        "requests": 128,
        "max_num_seqs": 32,
        "throughput_ratios_stages_over_in_process": [0.97, 1.12, 0.89],
        "throughput_ratio_stages_over_in_process": 0.97,
        "throughput_ratio_public_api_over_in_process": 0.95,
    }
    paths = write_outputs(summary, tmp_path)
    assert [p.name for p in paths] == ["services.json", "throughput.png"]
    assert json.loads(paths[0].read_text()) == summary and paths[1].read_bytes()[:4] == b"\x89PNG"
