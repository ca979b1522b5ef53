"""Released checkpoints serve depth-adaptively by default: the threshold in effect per family and where it comes
from, the switch that turns exit off, the one-line summary and the Info fields, the per-request threshold ranges
the API documents, and the dtype default on CUDA."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from cdb.processes import process_resolution
from cdb_bench.random_checkpoint import write_random_checkpoint
from cdb_engine.config import DType, EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import FAMILY_EXIT_THRESHOLD, ThresholdSource, describe, resolve_limits
from cdb_model.loader import load_config
from cdb_scheduler.exit_policy import ExitRule
from services.api.messages import info_to_pb
from services.settings import Resolved, Settings

ROOT = Path(__file__).resolve().parents[2]
# Released configs shrunk to a CPU test's size; every other field (early_exit_threshold 1.0 for Ouro, no exit field
# for Huginn, the depths, the stop ids) is as released.
SHRUNK = {
    "ouro-1.4b": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
    "huginn-0125": {"n_embd": 64, "n_heads": 2, "n_layers_in_recurrent_block": 2, "mean_recurrence": 6},
}
COMMON = {"intermediate_size": 96, "vocab_size": 300, "padded_vocab_size": 300, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random-weight folders in the released layouts, with the released exit settings."""
    out = {}
    for name, shrink in SHRUNK.items():
        folder = tmp_path_factory.mktemp(name)
        overrides = {**shrink, **COMMON, **({"early_exit_threshold": 1.0} if name == "ouro-1.4b" else {})}
        config = write_random_checkpoint(name, folder, overrides=overrides, shard_gb=0.0001)
        assert config.early_exit_threshold == (1.0 if name == "ouro-1.4b" else 0.0)  # the release: full depth
        out[name] = str(folder)
    return out


def limits_of(model: str, **kw: object):  # type: ignore[no-untyped-def]
    cfg = EngineConfig(model=model, **kw)  # type: ignore[arg-type]
    return resolve_limits(cfg, load_config(model))


def test_released_folders_default_to_the_family_threshold(released: dict[str, str]) -> None:
    ouro = limits_of(released["ouro-1.4b"])
    assert (ouro.exit_rule, ouro.exit_threshold, ouro.threshold_source) == (
        ExitRule.HAZARD,
        FAMILY_EXIT_THRESHOLD[ExitRule.HAZARD],
        ThresholdSource.FAMILY_DEFAULT,
    )
    assert ouro.exit_threshold == 0.5 and ouro.early_exit and ouro.model_threshold == 1.0
    huginn = limits_of(released["huginn-0125"])
    assert (huginn.exit_rule, huginn.exit_threshold, huginn.threshold_source) == (
        ExitRule.LATENT_DIFF,
        0.1,
        ThresholdSource.FAMILY_DEFAULT,
    )
    assert huginn.early_exit and huginn.max_depth == 6


def test_a_models_own_exit_threshold_is_kept() -> None:
    shipped = limits_of("ouro-kjv")  # its measured knee, in its config.json
    assert (shipped.exit_threshold, shipped.threshold_source, shipped.early_exit) == (
        0.5,
        ThresholdSource.CHECKPOINT,
        True,
    )
    assert limits_of("huginn-tiny").exit_threshold == 0.2
    assert limits_of("huginn-tiny").threshold_source is ThresholdSource.PRESET
    assert limits_of("ouro-tiny", exit_threshold=0.3).threshold_source is ThresholdSource.OPTION


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_the_explicit_switch_turns_exit_off(released: dict[str, str], name: str) -> None:
    folder = released[name]
    off = limits_of(folder, early_exit=False)
    full = 1.0 if name == "ouro-1.4b" else 0.0
    assert (off.exit_threshold, off.threshold_source, off.early_exit) == (full, ThresholdSource.NO_EARLY_EXIT, False)
    by_value = limits_of(folder, exit_threshold=full)
    assert (by_value.exit_threshold, by_value.threshold_source, by_value.early_exit) == (
        full,
        ThresholdSource.OPTION,
        False,
    )
    with pytest.raises(ValueError, match="--no-early-exit contradicts --exit-threshold"):
        limits_of(folder, early_exit=False, exit_threshold=0.3)
    cfg = process_resolution("scheduler", ["--model", folder, "--no-early-exit"], {}).engine
    assert cfg.early_exit is False and _handed(cfg) == cfg


def test_served_depths_default_adaptive_and_full_with_the_switch(released: dict[str, str]) -> None:
    """End to end in the engine: the released Ouro layout serves some tokens early by default, none with the
    switch (every token after the full-depth prefill's first at depth max_depth)."""
    base = EngineConfig(model=released["ouro-1.4b"], dtype="float64", max_num_seqs=4, num_kv_blocks=64, kv_block_size=8)
    prompts: list[str | list[int]] = [[5, 6, 7], [40, 41], [100, 3, 9, 12], [7]]
    params = RequestParams(max_tokens=12, ignore_eos=True)
    depths = {}
    for label, cfg in (("default", base), ("off", replace(base, early_exit=False))):
        with Engine(cfg) as eng:
            depths[label] = [d for c in eng.generate(prompts, params) for d in c.depths]
            info = info_to_pb(eng, "in_process", 8)
        assert info.early_exit is (label == "default") and info.exit_rule == "hazard"
        assert info.exit_summary == describe(eng.limits) and info.exit_threshold == eng.limits.exit_threshold
        assert info.mean_served_depth == pytest.approx(sum(depths[label]) / len(depths[label]))
    assert min(depths["default"]) < 4 and set(depths["off"]) == {4}
    assert info.exit_threshold_source == "no-early-exit" and info.exit_threshold == 1.0


def test_describe_is_one_line_naming_the_threshold_and_its_source(released: dict[str, str]) -> None:
    lines = {
        "family": describe(limits_of(released["ouro-1.4b"])),
        "huginn": describe(limits_of(released["huginn-0125"])),
        "checkpoint": describe(limits_of("ouro-kjv")),
        "off": describe(limits_of(released["ouro-1.4b"], early_exit=False)),
        "fixed": describe(limits_of("ouro-tiny", exit_rule="fixed", fixed_depth=2)),
        "full-depth mode": describe(limits_of("ouro-tiny", mode="full-depth")),
    }
    assert all("\n" not in line for line in lines.values())
    assert lines["family"].startswith("early exit on: Ouro exit-gate CDF q = 0.5 (family default")
    assert "early_exit_threshold 1 serves full depth" in lines["family"] and "--no-early-exit" in lines["family"]
    assert lines["huginn"].startswith("early exit on: latent-diff q = 0.1 (family default")
    assert "q = 0.5 (the checkpoint's early_exit_threshold)" in lines["checkpoint"]
    assert lines["off"].startswith("early exit off: every token at full depth 4") and "--no-early-exit" in lines["off"]
    assert lines["fixed"] == "early exit fixed: every token at depth 2 of 4 (exit rule fixed)"
    assert lines["full-depth mode"] == "early exit off: every token at full depth 4 (mode full-depth)"


def _proto_exit_threshold_comment() -> str:
    proto = (ROOT / "protos" / "cdb_api" / "v1" / "generation.proto").read_text()
    block = re.search(r"((?:  //.*\n)+)  optional double exit_threshold = 8;", proto)
    assert block is not None
    return " ".join(line.strip().lstrip("/").strip() for line in block.group(1).splitlines())


@pytest.mark.parametrize(
    ("model", "accepted", "refused"),
    [
        ("ouro-tiny", [1e-9, 0.5, 1.0], [0.0, -0.1, 1.0001, math.nan, math.inf]),
        ("huginn-tiny", [0.0, 0.28, 1.0, 5.0], [-1e-9, math.nan, math.inf]),
    ],
)
def test_per_request_threshold_ranges_match_the_api(model: str, accepted: list, refused: list) -> None:
    """The proto documents (0, 1] for the hazard rule and >= 0 for latent-diff, finite; validation agrees."""
    comment = _proto_exit_threshold_comment()
    assert '"hazard"' in comment and "q in (0, 1], 1 = full depth" in comment
    assert '"latent-diff"' in comment and "q >= 0, 0 = full depth" in comment and "finite" in comment
    eng = Engine(EngineConfig(model=model, num_kv_blocks=64))  # validation only: never started
    for q in accepted:
        assert eng.validate([5, 6], RequestParams(max_tokens=2, exit_threshold=q)) == [5, 6]
    for q in refused:
        with pytest.raises(InvalidRequest) as info:
            eng.validate([5, 6], RequestParams(max_tokens=2, exit_threshold=q))
        assert info.value.field == "exit_threshold"


def test_dtype_defaults_to_bfloat16_on_cuda_only() -> None:
    assert EngineConfig().dtype is DType.FLOAT32
    assert EngineConfig(device="cuda").dtype is DType.BFLOAT16
    assert EngineConfig(device="cuda:1").dtype is DType.BFLOAT16
    explicit = EngineConfig(device="cuda", dtype="float32")
    assert explicit.dtype is DType.FLOAT32
    for cfg in (explicit, EngineConfig(device="cuda"), EngineConfig(dtype="float64")):
        assert _handed(cfg) == cfg
    assert process_resolution("scheduler", ["--device", "cuda"], {}).engine.dtype is DType.BFLOAT16
    assert process_resolution("scheduler", ["--device", "cuda", "--dtype", "float32"], {}).engine == explicit


def _handed(config: EngineConfig) -> EngineConfig:
    """``config`` as a launcher's child reads it back from the document it was handed."""
    return Resolved.from_json(Resolved(Settings(), config).to_json()).engine
