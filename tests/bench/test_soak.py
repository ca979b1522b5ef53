"""``cdb bench soak`` end to end on a small run: a stage killed while requests (some cancelled, some with short
deadlines) stream; nothing lost, nothing different from the fault-free run, nothing leaked; JSON and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdb_bench.soak import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_short_soak_loses_nothing_and_writes_its_outputs(tmp_path: Path) -> None:
    argv = ["--requests", "120", "--kill-every", "1", "--max-tokens", "8", "--concurrency", "16", "--seed", "3"]
    assert main([*argv, "--out", str(tmp_path), "--json"]) == 0  # rc 1 if anything was lost, differed or leaked
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["kills"] >= 1 and summary["recovered_requests"] >= 1
    assert summary["lost"] == summary["mismatched"] == summary["leaked"] == 0
    assert sum(summary["fates"].values()) == 120 and summary["fates"]["cancel"] > 0
    assert (tmp_path / "recovery.png").read_bytes()[:4] == b"\x89PNG"
