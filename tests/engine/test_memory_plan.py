"""The hardware chosen for the user: ``--device auto`` and the KV pool sized to memory, with the device and memory
probes faked at their seams (``cdb_engine.hardware``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from unittest import mock

import pytest

from cdb_engine import hardware
from cdb_engine.config import DType, EngineConfig
from cdb_engine.memory import CPU_KV_TOKENS, GIB, MemoryPlanError, plan_memory, sized
from cdb_engine.preflight import ConfigError, check_config
from cdb_model.config import ModelConfig
from cdb_model.released import HUGINN_0125, OURO_14B

RELEASED = {"ouro-1.4b": OURO_14B, "huginn-0125": HUGINN_0125}


@pytest.fixture
def gpu() -> Iterator[mock.MagicMock]:
    """One CUDA device of 80 GiB (``gpu.return_value`` changes it)."""
    with mock.patch.object(hardware, "cuda_memory", return_value=(80 * GIB,)) as probe:
        yield probe


def released(name: str) -> ModelConfig:
    return ModelConfig.from_hf(RELEASED[name], name=name)


def test_auto_device_is_cuda_where_a_device_is_visible_and_cpu_elsewhere(gpu: mock.MagicMock) -> None:
    on_gpu = EngineConfig()
    assert (on_gpu.device, on_gpu.dtype) == ("cuda", DType.BFLOAT16)
    gpu.return_value = ()
    on_cpu = EngineConfig()
    assert (on_cpu.device, on_cpu.dtype) == ("cpu", DType.FLOAT32)
    assert EngineConfig(device="cpu").device == "cpu"  # given: kept, whatever the machine has


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_kv_pool_grows_with_the_device_and_the_plan_fits_its_budget(gpu: mock.MagicMock, name: str) -> None:
    mc, cfg = released(name), EngineConfig(device="cuda", max_num_seqs=64, max_total_tokens=4096)
    plans = []
    for gib in (80, 141):
        gpu.return_value = (gib * GIB,)
        plan = plan_memory(cfg, mc)
        assert plan.weights + plan.working + plan.kv <= plan.budget == int(0.9 * gib * GIB)
        assert plan.budget - plan.weights - plan.working - plan.kv < plan.block_bytes or plan.blocks == plan.max_blocks
        plans.append(plan)
    assert plans[0].blocks < plans[1].blocks
    assert plans[0].weights == plans[1].weights > 2 * GIB  # bf16 weights of a 1.4B / 3.5B model, per stage set


def test_a_plan_that_cannot_hold_one_sequence_is_refused_naming_the_numbers(gpu: mock.MagicMock) -> None:
    gpu.return_value = (24 * GIB,)
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(EngineConfig(device="cuda"), released("ouro-1.4b"))  # 65,536 positions x 4 depth slots
    text = str(err.value)
    assert "65,536 tokens" in text and "24.00 GiB" in text and "--max-model-len" in text and "\n" not in text
    fits = plan_memory(EngineConfig(device="cuda", max_total_tokens=8192), released("ouro-1.4b"))
    assert fits.blocks * fits.block_size >= 8192


def test_weights_beyond_the_budget_are_refused(gpu: mock.MagicMock) -> None:
    gpu.return_value = (4 * GIB,)
    with pytest.raises(MemoryPlanError, match=r"leaves 0\.0 MiB for the KV cache after weights"):
        plan_memory(EngineConfig(device="cuda", max_total_tokens=1024), released("huginn-0125"))


def test_a_given_pool_is_checked_against_the_budget(gpu: mock.MagicMock) -> None:
    mc = released("ouro-1.4b")
    fits = plan_memory(EngineConfig(device="cuda", max_total_tokens=4096), mc)
    with pytest.raises(MemoryPlanError, match="--num-kv-blocks"):
        plan_memory(EngineConfig(device="cuda", max_total_tokens=4096, num_kv_blocks=fits.blocks * 100), mc)
    given = EngineConfig(device="cuda", max_total_tokens=4096, num_kv_blocks=512)
    assert plan_memory(given, mc).blocks == 512 and sized(given) is given


def test_kv_cache_memory_sets_the_pool_alone(gpu: mock.MagicMock) -> None:
    mc = released("ouro-1.4b")
    cfg = EngineConfig(device="cuda", max_total_tokens=4096, kv_cache_memory=8 * GIB)
    plan = plan_memory(cfg, mc)
    assert plan.kv <= 8 * GIB < plan.kv + plan.block_bytes


def test_a_cpu_pool_is_capped_unless_its_memory_is_given(gpu: mock.MagicMock) -> None:
    gpu.return_value = ()
    plan = plan_memory(EngineConfig(model="ouro-tiny", max_num_seqs=64))
    assert plan.device == "cpu" and plan.blocks * plan.block_size == CPU_KV_TOKENS
    bigger = plan_memory(EngineConfig(model="ouro-tiny", max_num_seqs=64, kv_cache_memory=GIB))
    assert bigger.blocks == bigger.max_blocks > plan.blocks  # every sequence at its longest


def test_the_preflight_returns_the_config_with_its_pool_sized(gpu: mock.MagicMock) -> None:
    cfg = check_config(EngineConfig(model="ouro-tiny", device="cuda"))
    assert cfg.num_kv_blocks == plan_memory(EngineConfig(model="ouro-tiny", device="cuda")).blocks
    gpu.return_value = (1 << 20,)  # 1 MiB: not even the CUDA contexts fit
    with pytest.raises(ConfigError, match=r"leaves 0\.0 MiB for the KV cache"):
        check_config(EngineConfig(model="ouro-tiny", device="cuda"))


def test_cdb_serve_refuses_a_plan_that_cannot_fit_before_any_child_starts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cdb", "serve", "--device", "cpu", "--kv-cache-memory", "1000", "--no-http"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "kv_cache_memory 0.0 MiB for the KV cache" in lines[0] and "--max-model-len" in lines[0]


def test_vllm_spellings_of_the_memory_options_parse() -> None:
    import argparse

    from cdb_engine.options import add_engine_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_args(parser, {})
    args = parser.parse_args(["--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "9"])
    assert (args.max_total_tokens, args.gpu_memory_utilization, args.kv_cache_memory) == (4096, 0.5, 9)
