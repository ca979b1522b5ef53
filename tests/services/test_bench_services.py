"""``cdb bench services`` runs end to end on a tiny workload and reports its figures."""

from __future__ import annotations

import pytest

from cdb_bench.services import bench_services
from cdb_engine.config import EngineConfig, RequestParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_bench_services_reports_ratio_idle_fraction_and_rtt() -> None:
    cfg = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=128)
    requests = [([5 + i, 6, 7], RequestParams(max_tokens=8, ignore_eos=True)) for i in range(6)]
    out = bench_services(cfg, requests, public_api=True, pings=10, repeats=1)
    assert out["in_process"]["tokens"] == out["stages"]["tokens"] == out["public_api"]["tokens"] == 48
    assert out["throughput_ratio_stages_over_in_process"] > 0
    assert 0.0 <= out["loop_idle_fraction_stages"] <= 1.0
    assert out["loop_stream_rtt"]["p50_ms"] > 0 and out["stages"]["loop_ops"] > 0


def test_bench_tracing_compares_tracing_on_and_off() -> None:
    from cdb_bench.services import bench_tracing

    cfg = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=128)
    requests = [([5 + i, 6, 7], RequestParams(max_tokens=6, ignore_eos=True)) for i in range(4)]
    out = bench_tracing(cfg, requests, repeats=1)
    assert out["tracing_off"][0]["tokens"] == out["tracing_on"][0]["tokens"] == 24
    assert out["throughput_ratio_on_over_off"] > 0 and out["cpu_per_token_ratio_on_over_off"] > 0
    assert out["sink_received"]["spans"] > 8  # the tracing-on tree exported (requests, hops, batch spans)
