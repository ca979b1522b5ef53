"""``cdb bench soak --quick`` end to end: two replicas stream requests (some cancelled, some with short deadlines)
while a stage is killed, a stage frozen (SIGSTOP) and a scheduler killed; nothing lost, nothing different from the
fault-free run (float64, and the float32 reference agrees), nothing leaked once idle; JSON and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdb_bench.soak import KINDS, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_short_soak_loses_nothing_and_writes_its_outputs(tmp_path: Path) -> None:
    # rc 1 if anything was lost, differed, leaked or stayed unrecovered
    assert main(["--quick", "--seed", "3", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["config"]["replicas"] == 2 and summary["requests"] == 120
    for kind in KINDS:  # each fault kind happened at least once, and each one healed
        assert summary["faults"][kind]["count"] >= 1, kind
        assert summary["faults"][kind]["unrecovered"] == 0, kind
    assert summary["faults"]["stage_freeze"]["not_killed"] == 0  # the watchdog killed every frozen stage
    assert summary["recovered_requests"] >= 1
    assert summary["lost"] == summary["mismatched"] == summary["leaked"] == 0
    assert summary["mismatched_float64_reference"] == 0
    assert summary["tree_dtype"] == "float64" and summary["recomputation_exact_in_served_dtype"] is None
    assert sum(summary["fates"].values()) == 120 and summary["fates"]["cancel"] > 0
    assert (tmp_path / "recovery.png").read_bytes()[:4] == b"\x89PNG"
