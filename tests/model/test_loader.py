"""Checkpoint loading: shards, stage subsets, tied heads, optional gates, and one test per error."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cdb_model.base import StageNotLoadedError
from cdb_model.loader import (
    CheckpointError,
    CheckpointNotFoundError,
    MissingConfigError,
    MissingTensorsError,
    MissingWeightsError,
    ShapeMismatchError,
    UnexpectedTensorsError,
    UnknownModelTypeError,
    load_model,
    load_tokenizer,
)
from cdb_model.tokenizer import ByteTokenizer, HFTokenizer
from cdb_scheduler.plan import Stage

from .conftest import golden_dir

Edit = Callable[[dict[str, torch.Tensor]], None]


def make_ckpt(tmp: Path, name: str, edit: Edit | None = None, config: dict | None = None) -> Path:
    """A copy of golden checkpoint ``name`` in ``tmp``, tensors and config edited."""
    src = golden_dir(name)
    tensors = load_file(str(src / "model.safetensors"))
    if edit:
        edit(tensors)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


def _shard(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_sharded_equals_single(tmp_path: Path, name: str) -> None:
    folder = make_ckpt(tmp_path / name, name)
    single = load_model(str(folder)).state_dict()
    _shard(folder)
    sharded = load_model(str(folder)).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_stage_subsets() -> None:
    ouro = str(golden_dir("ouro-tiny"))
    full = load_model(ouro).state_dict()
    loop = load_model(ouro, stages={Stage.LOOP})
    names = set(loop.state_dict())
    assert not any(n.startswith(("lm_head", "model.embed_tokens")) for n in names)
    assert all(torch.equal(t, full[n]) for n, t in loop.state_dict().items())
    with pytest.raises(StageNotLoadedError, match="HEAD"):
        loop.logits(torch.zeros(1, 64))
    head = load_model(ouro, stages={Stage.HEAD})
    assert set(head.state_dict()) == {"lm_head.weight", "model.embed_tokens.weight"}  # the head embeds refills
    assert torch.equal(head.embed_input(torch.tensor([5])), full["model.embed_tokens.weight"][5:6])
    huginn = load_model(str(golden_dir("huginn-tiny")), stages={Stage.HEAD}, dtype=torch.float64)
    names = set(huginn.state_dict())
    assert "transformer.wte.weight" in names  # the tied LM head
    other_stages = ("transformer.prelude", "transformer.core_block", "transformer.adapter")
    assert not any(n.startswith(other_stages) for n in names)
    assert huginn.dtype == torch.float64


def test_tied_head_optional(tmp_path: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["lm_head.weight"]

    model = load_model(str(make_ckpt(tmp_path, "huginn-tiny", drop)))
    ref = load_model(str(golden_dir("huginn-tiny")))
    h = torch.randn(3, 64)
    torch.testing.assert_close(model.logits(h), ref.logits(h))


def test_lookahead_gate_detected(tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.lookahead_exit_gate.weight"] = torch.randn(1, 64)
        t["model.lookahead_exit_gate.bias"] = torch.zeros(1)

    model = load_model(str(make_ckpt(tmp_path, "ouro-tiny", add)))
    assert model.config.has_lookahead_gate
    from cdb_model.attention import DenseKVCache

    rows = model.prelude(torch.tensor([5, 6]), torch.arange(2), None, [-1, -1])
    _, _, lookahead = model.loop_step(rows, torch.arange(2), torch.zeros(2), DenseKVCache().access([0, 1], 0))
    assert lookahead is not None and lookahead.shape == (2,)


def test_error_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_error_missing_config(tmp_path: Path) -> None:
    folder = make_ckpt(tmp_path, "ouro-tiny")
    (folder / "config.json").unlink()
    with pytest.raises(MissingConfigError, match=r"missing config\.json"):
        load_model(str(folder))


def test_error_config_field(tmp_path: Path) -> None:
    folder = make_ckpt(tmp_path, "ouro-tiny")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MissingConfigError, match="hidden_size"):
        load_model(str(folder))


def test_error_missing_weights(tmp_path: Path) -> None:
    folder = make_ckpt(tmp_path, "ouro-tiny")
    (folder / "model.safetensors").unlink()
    with pytest.raises(MissingWeightsError, match=r"model\.safetensors"):
        load_model(str(folder))


def test_error_missing_shard(tmp_path: Path) -> None:
    folder = make_ckpt(tmp_path, "huginn-tiny")
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingWeightsError, match=r"model-00002-of-00002\.safetensors"):
        load_model(str(folder))


def test_error_unknown_model_type(tmp_path: Path) -> None:
    folder = make_ckpt(tmp_path, "ouro-tiny", config={"model_type": "llama"})
    with pytest.raises(UnknownModelTypeError, match="'llama'"):
        load_model(str(folder))


def test_error_missing_tensors(tmp_path: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.up_proj.weight"], t["model.norm.weight"]

    with pytest.raises(MissingTensorsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight, model\.norm\.weight"):
        load_model(str(make_ckpt(tmp_path, "ouro-tiny", drop)), stages={Stage.HEAD})


def test_error_unexpected_tensors(tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["transformer.extra.weight"] = torch.zeros(2)

    with pytest.raises(UnexpectedTensorsError, match=r"transformer\.extra\.weight"):
        load_model(str(make_ckpt(tmp_path, "huginn-tiny", add)))


def test_error_shape_mismatch(tmp_path: Path) -> None:
    def bad(t: dict[str, torch.Tensor]) -> None:
        t["transformer.adapter.weight"] = torch.zeros(64, 64)

    with pytest.raises(ShapeMismatchError, match=r"'transformer\.adapter\.weight'.*\[64, 64\].*\[64, 128\]"):
        load_model(str(make_ckpt(tmp_path, "huginn-tiny", bad)))


def test_errors_are_checkpoint_errors() -> None:
    for cls in (
        CheckpointNotFoundError,
        MissingConfigError,
        MissingWeightsError,
        UnknownModelTypeError,
        MissingTensorsError,
        UnexpectedTensorsError,
        ShapeMismatchError,
    ):
        assert issubclass(cls, CheckpointError)


def test_load_tokenizer(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("ouro-tiny"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(golden_dir("ouro-tiny"))), ByteTokenizer)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = make_ckpt(tmp_path, "ouro-tiny")
    tok.save(str(folder / "tokenizer.json"))
    loaded = load_tokenizer(str(folder))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("hello world") == [1, 2]
    assert loaded.stop_token_ids == (0, 2) and loaded.eos_token_id == 0
    shutil.rmtree(folder)
