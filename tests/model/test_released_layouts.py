"""The released Ouro-1.4B and Huginn-0125 configs built on the meta device: every tensor name and shape the loader
expects (the upstream checkpoint keys), the parameter counts and KV sizes docs/deployment.md's memory figures use, and
the loader's checks against a header-only checkpoint in that layout. No weights, no network."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cdb_model.config import ModelConfig
from cdb_model.loader import MissingTensorsError, ShapeMismatchError, expected_tensors, load_model
from cdb_model.released import HUGINN_0125, OURO_14B
from cdb_scheduler.plan import Stage


def ouro_keys(layers: int, h: int, heads: int, kv_heads: int, d: int, i: int, vocab: int) -> dict[str, tuple]:
    """The upstream Ouro checkpoint keys and shapes, written out from the release's layout."""
    keys: dict[str, tuple] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (vocab, h),
    }
    for n in range(layers):
        p = f"model.layers.{n}."
        keys |= {
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv_heads * d, h),
            p + "self_attn.v_proj.weight": (kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            keys[p + norm + ".weight"] = (h,)
    return keys


def huginn_keys(prelude: int, core: int, coda: int, h: int, heads: int, i: int, vocab: int) -> dict[str, tuple]:
    """The upstream Huginn (Raven) checkpoint keys and shapes; the tied LM head is the embedding."""
    keys: dict[str, tuple] = {
        "transformer.wte.weight": (vocab, h),
        "transformer.adapter.weight": (h, 2 * h),
        "transformer.ln_f.weight": (h,),
    }
    for group, n in (("prelude", prelude), ("core_block", core), ("coda", coda)):
        for b in range(n):
            p = f"transformer.{group}.{b}."
            keys |= {p + f"norm_{k}.weight": (h,) for k in range(1, 5)}
            keys |= {
                p + "attn.Wqkv.weight": (3 * h, h),
                p + "attn.qk_bias": (2, 1, heads, h // heads),
                p + "attn.proj.weight": (h, h),
                p + "mlp.fc.weight": (2 * i, h),
                p + "mlp.proj.weight": (h, i),
            }
    return keys


def test_ouro_14b_names_and_shapes_on_meta() -> None:
    c = ModelConfig.from_hf(OURO_14B)
    got = expected_tensors(c)
    assert got == ouro_keys(24, 2048, 16, 16, 128, 5632, 49152)
    total = sum(math.prod(s) for s in got.values())
    assert total == 1_434_652_673  # docs/deployment.md: 2.87 GB in bf16, 5.74 GB in fp32
    f0, fr = c.param_counts()
    assert total == f0 + fr + 49152 * 2048 - 2048  # + the embedding lookup, - the final norm counted in both
    assert c.kv_bytes_per_token(loop_slots=4, dtype_bytes=2) == 768 * 2**10  # last_exited / depth_indexed
    assert c.kv_bytes_per_token(loop_slots=1, dtype_bytes=2) == 192 * 2**10  # single


def test_huginn_0125_names_and_shapes_on_meta() -> None:
    c = ModelConfig.from_hf(HUGINN_0125)
    got = expected_tensors(c)
    assert got == huginn_keys(2, 4, 2, 5280, 55, 17920, 65536)
    total = sum(math.prod(s) for s in got.values())
    assert total == 3_564_976_800  # docs/deployment.md: 7.13 GB in bf16, 14.26 GB in fp32
    assert c.max_depth == 32 and c.head_dim == 96
    per_layer = 2 * 5280 * 2  # K and V of one layer and slot, bf16
    assert c.kv_bytes_per_token(loop_slots=32, dtype_bytes=2) == (4 + 4 * 32) * per_layer
    assert c.kv_bytes_per_token(loop_slots=16, dtype_bytes=2) == (4 + 4 * 16) * per_layer


SHRINK = {
    "ouro": {**OURO_14B, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16},
    "huginn": {**HUGINN_0125, "n_embd": 32, "n_heads": 2},
}
COMMON = {"intermediate_size": 48, "vocab_size": 64, "padded_vocab_size": 64, "num_hidden_layers": 2}


def _write(folder: Path, raw: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_the_loader_takes_exactly_the_upstream_layout(arch: str, tmp_path: Path) -> None:
    """A checkpoint holding exactly the upstream keys (shrunken released config) loads; one missing key or one
    wrong shape is refused by name."""
    raw = {**SHRINK[arch], **COMMON}
    c = ModelConfig.from_hf(raw)
    keys = (
        ouro_keys(2, 32, 2, 2, 16, 48, 64)
        if arch == "ouro"
        else huginn_keys(2, 4, 2, 32, 2, 48, 64) | {"lm_head.weight": (64, 32)}  # the release stores the tie too
    )
    tensors = {k: torch.zeros(s) for k, s in keys.items()}
    lm = load_model(str(_write(tmp_path / "ok", raw, tensors)), stages={Stage.HEAD})
    assert lm.config == replace(c, name="ok") and set(lm.state_dict()) <= set(keys)
    name = "model.norm.weight" if arch == "ouro" else "transformer.adapter.weight"
    with pytest.raises(MissingTensorsError, match=name.replace(".", r"\.")):
        load_model(str(_write(tmp_path / "missing", raw, {k: t for k, t in tensors.items() if k != name})))
    bad = dict(tensors, **{name: torch.zeros(3)})
    with pytest.raises(ShapeMismatchError, match=name.replace(".", r"\.")):
        load_model(str(_write(tmp_path / "shape", raw, bad)))
