"""``cdb bench speculative --quick``: every variant reproduces the tokens and depths of no speculation, and the
figures it reports are consistent with each other."""

from __future__ import annotations

import json

import pytest

from cdb_bench.speculative import main


def test_quick_speculative_bench_reports_exact_variants(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["--quick", "--json", "--no-progress", "--out", str(tmp_path)]) == 0
    s = json.loads(capsys.readouterr().out)
    variants = s["variants"]
    assert list(variants) == ["off", "depth 1", "auto"]
    assert all(v["same_tokens_and_depths"] for v in variants.values())
    assert variants["off"]["drafts"] == 0 and variants["depth 1"]["drafts"] > 0
    d1 = variants["depth 1"]
    assert d1["loop_ops_per_token_over_off"] == pytest.approx(
        d1["loop_ops_per_token"] / variants["off"]["loop_ops_per_token"]
    )
    assert 0 <= d1["acceptance"] <= 1 and 0 < d1["break_even_acceptance"] <= 1
    assert {p.name for p in tmp_path.iterdir()} >= {"speculative.json", "loop_ops_per_token.png", "speedup.png"}
