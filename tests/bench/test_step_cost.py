"""``cdb bench step``: the per-op host costs of a decode loop op (counted, not timed) and the fixed-cost fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdb_bench import step_time

pytestmark = pytest.mark.timeout(300)


def test_step_reports_one_copy_in_and_out_per_decode_op_and_the_fixed_cost_fit(tmp_path: Path) -> None:
    assert (
        step_time.main(["--threads", "1", "--fit-presets", "ouro-tiny", "--repeats", "2", "--out", str(tmp_path)]) == 0
    )
    data = json.loads((tmp_path / "step.json").read_text())
    for model in ("ouro-bench", "huginn-bench"):
        op = data["op_costs"][model]["loop_op_64"]
        assert op["host_tensors"] == 1, "the op's columns are built in one host tensor"
        assert op["syncs_and_copies_out"] == 1, "results come back in one copy, with no other sync"
        assert op["host_to_device_copies"] <= 1
        assert 0 < op["kernels"] < op["dispatcher_calls"]
        assert op["host_us_before_first_kernel"] > 0
    fused = data["op_costs"]["ouro-bench"]["loop_op_fused_head_64"]
    assert fused["syncs_and_copies_out"] == 1  # sampled on the device, tokens and signals in one copy
    for released in ("ouro-1.4b", "huginn-0125"):
        part = data["op_costs"][released]["loop_op_device_part_64"]
        assert part["syncs_and_copies_out"] == 0 and part["host_tensors"] == 0 and part["kernels"] > 100
    fit = data["fixed_cost_fits"]["ouro-tiny"]
    assert fit["widths"] == [1, 2, 4, 8, 16, 32, 64] and len(fit["us_per_op"]) == 7
    assert fit["per_token_us"] > 0 and fit["fixed_in_tokens"] is not None
    assert (tmp_path / "fixed_cost.png").stat().st_size > 0 and (tmp_path / "step.png").stat().st_size > 0
