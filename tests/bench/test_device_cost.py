"""``cdb_bench.device_cost``: measured decode loop ops against the synthetic profile that models them (here on the
CPU, a preset: the numbers mean nothing, the shape of the report does)."""

from __future__ import annotations

import pytest
import torch

from cdb_bench.device_cost import loop_model, measure, profile_table
from cdb_engine.synthetic_cost import profile_cost
from cdb_model.presets import preset_config


def test_each_point_is_measured_against_the_profile_with_and_without_graphs() -> None:
    model = loop_model(preset_config("ouro-tiny"), "cpu", torch.float32)
    cost = profile_cost("h200", "ouro-1.4b")
    for graphs in (None, True):  # (True on a CPU: the padded graph buffers, run eagerly)
        rows = measure(model, cost, widths=(1, 4), contexts=(16, 32), repeats=2, graphs=graphs)
        assert [(r["context"], r["width"]) for r in rows] == [(16, 1), (16, 4), (32, 1), (32, 4)]
        for r in rows:
            assert r["modelled_us"] == round(cost.loop.seconds(r["width"], r["width"] * r["context"]) * 1e6, 1)
            assert 0 < r["fastest_us"] <= r["measured_us"]
            assert r["measured_over_modelled"] == pytest.approx(r["measured_us"] / r["modelled_us"], rel=0.01)
    assert "aten::" in profile_table(model, 2, 16, None, ops=1)  # the profiler's table by op
