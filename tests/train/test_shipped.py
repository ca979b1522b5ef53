"""The shipped checkpoint ``models/ouro-kjv``: it loads, its tokenizer round-trips, its recorded figures hold, and
the training forward equals the serving / reference path on its weights."""

from __future__ import annotations

import json

import pytest
import torch

from cdb_model.attention import DenseKVCache
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_tokenizer
from cdb_model.ouro import OuroLM
from cdb_model.reference import reference_generate
from cdb_model.tokenizer import HFTokenizer
from cdb_scheduler.exit_policy import FixedDepth
from cdb_train.evaluate import score, summarise
from cdb_train.model import loop_forward

from .conftest import FOLDER


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((FOLDER / "metrics.json").read_text())


def test_files_and_config(model: OuroLM) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "loss.png",
        "metrics.json",
    ):
        assert (FOLDER / name).is_file(), name
    total = sum(p.stat().st_size for p in FOLDER.iterdir())
    assert total < 10 * 2**20, f"checkpoint folder is {total / 2**20:.1f} MiB"
    cfg = json.loads((FOLDER / "config.json").read_text())
    assert cfg["model_type"] == "ouro" and cfg["architectures"] == ["OuroForCausalLM"]
    c = model.config
    assert c.arch == "ouro" and c.max_depth == 4 and c.has_lookahead_gate
    assert 0.0 < c.early_exit_threshold < 1.0
    assert c.stop_token_ids == (0, 2)
    tok_cfg = json.loads((FOLDER / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|endoftext|>" and "<|im_start|>" in tok_cfg["chat_template"]


def test_tokenizer_round_trip() -> None:
    tok = load_tokenizer(str(FOLDER))
    assert isinstance(tok, HFTokenizer)
    for text in (
        "In the beginning God created the heaven and the earth.",
        "Looped models think deeper on harder tokens.\n  Ünïcödé & émojis 🙂 too!",
    ):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]


def test_heldout_sample_perplexity(model: OuroLM, metrics: dict) -> None:
    recorded = metrics["heldout_sample"]
    text = (FOLDER / recorded["file"]).read_text().rstrip("\n")
    ids = load_tokenizer(str(FOLDER)).encode(text)
    assert len(ids) == recorded["tokens"] + 1
    got = summarise(score(model, torch.tensor([ids])), model.config.early_exit_threshold)
    for d, (a, b) in enumerate(zip(got["ppl_per_depth"], recorded["ppl_per_depth"], strict=True)):
        assert a == pytest.approx(b, rel=2e-3), f"depth {d + 1}"
    assert got["ppl_mixture"] == pytest.approx(recorded["ppl_mixture"], rel=2e-3)
    # The model learned something: deeper is better, and far better than chance.
    ppl = metrics["heldout"]["ppl_per_depth"]
    assert ppl[-1] < ppl[0] and ppl[-1] < model.config.vocab_size / 20


def test_training_forward_equals_stage_calls(model: OuroLM) -> None:
    """Batched teacher-forcing forward == token-by-token decode through the dense KV cache (reference path)."""
    ids = load_tokenizer(str(FOLDER)).encode("And God said, Let there be light: and there was light.")[:12]
    with torch.no_grad():
        out = loop_forward(model, torch.tensor([ids]))
        cache = DenseKVCache()
        for p, t in enumerate(ids):
            rows = model.prelude(torch.tensor([t]), torch.tensor([p]), None, [-1])
            for s in range(model.config.max_depth):
                rows, hazard, lookahead = model.loop_step(
                    rows, torch.tensor([p]), torch.tensor([s]), cache.access([p], s)
                )
                torch.testing.assert_close(rows[0], out.states[s][p], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(hazard[0], torch.sigmoid(out.gate_logits[s, p]), atol=1e-5, rtol=1e-4)
                assert lookahead is not None and out.lookahead is not None
                torch.testing.assert_close(lookahead[0], out.lookahead[s, p], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                model.logits(rows)[0], model.logits(out.states[-1][p : p + 1])[0], atol=1e-3, rtol=1e-4
            )


def test_reference_generate_matches_greedy_forward(model: OuroLM) -> None:
    prompt = load_tokenizer(str(FOLDER)).encode("And the LORD said unto Moses,")
    depth = model.config.max_depth
    ref = reference_generate(
        model,
        prompt,
        max_new_tokens=8,
        policy=FixedDepth(depth, depth),
        kv_layout=KVLayout(KVPolicy.DEPTH_INDEXED, depth),
    )
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            h = loop_forward(model, torch.tensor([seq])).states[-1][-1:]
            seq.append(int(model.logits(h).argmax(-1)))
    assert ref.tokens == seq[len(prompt) :]
