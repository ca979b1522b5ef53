"""``check_config``: a bad model path, an unknown preset, a broken checkpoint, a bad device, dtype or exit setting
gives one clear line before anything starts; good configurations pass without reading weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cdb_engine.config import EngineConfig
from cdb_engine.preflight import ConfigError, check_config

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT.parent / "shared" / "golden" / "ouro-tiny"


def one_line_error(config: EngineConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(config)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint folder in the released layout, sharded, with the shipped model's tokenizer files."""
    if not GOLDEN.is_dir():
        pytest.skip(f"golden checkpoints not found at {GOLDEN}")
    out = tmp_path / "ckpt"
    out.mkdir()
    shutil.copy(GOLDEN / "config.json", out / "config.json")
    shutil.copy(GOLDEN / "model.safetensors", out / "model-00001-of-00002.safetensors")
    shutil.copy(GOLDEN / "model.safetensors", out / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ROOT / "models" / "ouro-kjv" / name, out / name)
    return out


@pytest.mark.parametrize("model", ["ouro-tiny", "huginn-bench", "ouro-kjv"])
def test_good_configurations_pass(model: str) -> None:
    check_config(EngineConfig(model=model))


def test_a_good_folder_passes(folder: Path) -> None:
    check_config(EngineConfig(model=str(folder), max_num_seqs=4))


def test_bad_model_sources(tmp_path: Path, folder: Path) -> None:
    missing = one_line_error(EngineConfig(model=str(tmp_path / "nope")))
    assert missing.startswith("--model ") and "does not exist" in missing and "nope" in missing
    preset = one_line_error(EngineConfig(model="ouro-huge"))
    assert "'ouro-huge'" in preset and "ouro-tiny" in preset  # names the presets there are
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in one_line_error(EngineConfig(model=str(folder)))
    (folder / "model.safetensors.index.json").write_text("{")
    assert "safetensors index" in one_line_error(EngineConfig(model=str(folder)))
    (folder / "model.safetensors.index.json").unlink()
    assert "missing weights file" in one_line_error(EngineConfig(model=str(folder)))


def test_bad_config_files(folder: Path) -> None:
    (folder / "generation_config.json").write_text('{"eos_token_id": "end"}')
    assert "eos_token_id" in one_line_error(EngineConfig(model=str(folder)))
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer_config.json").write_text("[not json")
    assert "tokenizer_config.json is not valid JSON" in one_line_error(EngineConfig(model=str(folder)))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "unknown model_type 'llama'" in one_line_error(EngineConfig(model=str(folder)))


def test_bad_devices() -> None:
    assert "--device must be cpu, cuda or cuda:N; got 'gpu'" in one_line_error(EngineConfig(device="gpu"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    message = one_line_error(EngineConfig(device=f"cuda:{count}"))
    assert f"--device cuda:{count}: this machine has" in message


def test_bad_dtype_and_choices_fail_when_the_config_is_built() -> None:
    with pytest.raises(ValueError, match=r"^dtype must be one of float32, float64, bfloat16, float16; got 'fp8'$"):
        EngineConfig(dtype="fp8")  # type: ignore[arg-type]


def test_exit_settings_the_model_refuses() -> None:
    assert "(0, 1]" in one_line_error(EngineConfig(model="ouro-tiny", exit_threshold=0.0))
    assert "depth_indexed" in one_line_error(EngineConfig(model="ouro-tiny", kv_policy="depth_indexed"))
    assert "hazard" in one_line_error(EngineConfig(model="huginn-tiny", exit_rule="hazard"))
