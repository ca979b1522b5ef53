"""The training pipeline on a tiny model and a shipped text snippet (no network, no Debian package)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cdb_model.loader import load_model, load_tokenizer
from cdb_model.ouro import OuroLM
from cdb_scheduler.exit_policy import ExitPolicy, Horizon, OuroHazard
from cdb_train import corpus
from cdb_train.card import write_card
from cdb_train.lookahead import LookaheadArgs, distill_loss, measure, run, served_depths
from cdb_train.model import exit_log_pdf
from cdb_train.train import TrainArgs, train

SNIPPET = Path(__file__).parent / "data" / "kjv_genesis_1_2.txt"


def _lzw_compress(data: bytes, max_bits: int = 16) -> bytes:
    """Unix ``compress`` LZW (block mode, no header): the encoder the decoder under test mirrors."""
    table = {bytes([i]): i for i in range(256)}
    free, n_bits, codes = 257, 9, []  # (code, width)
    w = b""
    for byte in data:
        wc = w + bytes([byte])
        if wc in table:
            w = wc
            continue
        codes.append((table[w], n_bits))
        if free < 1 << max_bits:
            table[wc] = free
            free += 1
            if free > (1 << n_bits) and n_bits < max_bits:
                codes.append((None, n_bits))  # width change: pad the group
                n_bits += 1
        w = bytes([byte])
    if w:
        codes.append((table[w], n_bits))
    out = bytearray()
    acc, nacc, group_bits = 0, 0, 0
    for code, width in codes:
        if code is None:  # flush the current group of `width` bytes
            pad = (-group_bits) % (width * 8)
            nacc += pad
            group_bits = 0
            continue
        acc |= code << nacc
        nacc += width
        group_bits += width
        while nacc >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nacc -= 8
    if nacc:
        out.append(acc & 0xFF)
    return bytes(out)


def test_lzw_round_trip() -> None:
    text = SNIPPET.read_bytes() * 3  # > 512 and > 1024 codes: crosses the 9 -> 10 -> 11 bit widths
    assert corpus.lzw_decompress(_lzw_compress(text)) == text
    assert corpus.lzw_decompress(_lzw_compress(b"abababababab")) == b"abababababab"  # the KwKwK case


def test_parse_and_split() -> None:
    text = "Title line\nGe1:1 In the  beginning.\nGe1:2 And.\nGe2:1 Thus.\n1Sm3:4 That the LORD called.\n"
    chapters = corpus.parse_chapters(text)
    assert [(c.book, c.chapter, c.verses) for c in chapters] == [
        ("Ge", 1, ("In the beginning.", "And.")),
        ("Ge", 2, ("Thus.",)),
        ("1Sm", 3, ("That the LORD called.",)),
    ]
    train, held = corpus.split_chapters(chapters, every=2, offset=1)
    assert [c.chapter for c in train] == [1, 3] and [c.chapter for c in held] == [2]
    with pytest.raises(corpus.CorpusError):
        corpus.parse_chapters("title\nnot a verse\n")


def test_exit_pdf_matches_policy_cdf() -> None:
    logits = torch.randn(4, 50)
    pdf = exit_log_pdf(logits).exp()
    torch.testing.assert_close(pdf.sum(0), torch.ones(50))
    lam = torch.sigmoid(logits)
    policy: ExitPolicy = OuroHazard(0.5, 4)
    for i in range(50):
        st = policy.new_state()
        for s in range(3):
            policy.observe(st, s, float(lam[s, i]))
            assert st.cdf == pytest.approx(float(pdf[: s + 1, i].sum()), abs=1e-5)


def test_exact_lookahead_agrees_with_same_step() -> None:
    """A lookahead equal to the next step's hazard makes one-ahead decisions equal same-step ones (min depth 2)."""
    hazard = torch.rand(4, 300)
    exact = torch.cat([hazard[1:], torch.zeros(1, 300)])
    for q in (0.2, 0.5, 0.7):
        same2 = served_depths(hazard, None, q, Horizon.SAME_STEP, 2)
        assert torch.equal(served_depths(hazard, exact, q, Horizon.ONE_AHEAD, 1), same2)
        late = served_depths(hazard, None, q, Horizon.ONE_AHEAD, 1)
        same = served_depths(hazard, None, q, Horizon.SAME_STEP, 1)
        assert torch.equal(late, (same + 1).clamp(2, 4))  # the same-step gate read one step late
    from cdb_train.evaluate import StepScores

    m = measure(StepScores(torch.zeros(4, 300), torch.zeros(4, 300), hazard, exact), 0.5)
    assert m["agreement_tokens"] == 1.0 and m["agreement_decisions"] == 1.0


def test_distill_loss_minimum() -> None:
    torch.manual_seed(0)
    teacher = torch.rand(4, 64, dtype=torch.float64)
    exact = torch.logit(teacher[1:3])
    loss, logged = distill_loss(exact, teacher)
    assert logged["cdf_l1"] == pytest.approx(0.0, abs=1e-9)
    for delta in (-0.3, 0.3):
        worse, _ = distill_loss(exact + delta, teacher)
        assert float(worse) > float(loss)
    # The hazard of step 0 only matters folded: a student off at step 1 costs less when lambda_0 is high.
    high = teacher.clone()
    high[0] = 0.95
    low = teacher.clone()
    low[0] = 0.05
    off = exact + torch.tensor([[0.5], [0.0]], dtype=torch.float64)
    gap_high = float(distill_loss(off, high)[0] - distill_loss(exact, high)[0])
    gap_low = float(distill_loss(off, low)[0] - distill_loss(exact, low)[0])
    assert 0 < gap_high < gap_low


def _snippet_docs() -> tuple[list[str], list[str]]:
    docs = corpus.read_documents(SNIPPET)
    verses = [v for d in docs for v in d.split("\n")]
    return ["\n".join(verses[i : i + 6]) for i in range(0, len(verses) - 6, 6)], ["\n".join(verses[-6:])]


def _tiny_args(out: Path, steps: int = 40) -> TrainArgs:
    train_docs, held_docs = _snippet_docs()
    return TrainArgs(
        out=out,
        vocab_size=300,
        hidden=32,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate=64,
        seq=32,
        batch=8,
        steps=steps,
        lr=1e-2,
        warmup=5,
        eval_every=20,
        eval_windows=2,
        sample_verses=3,
        train_docs=train_docs,
        heldout_docs=held_docs,
    )


def test_tiny_training_is_reproducible(tmp_path: Path) -> None:
    for name in ("a", "b"):
        train(_tiny_args(tmp_path / name, steps=6))
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_tiny_training_run(tmp_path: Path) -> None:
    train_docs, held_docs = _snippet_docs()
    out = tmp_path / "tiny"
    metrics = train(_tiny_args(out))
    log = json.loads((out / "training_log.json").read_text())
    first, last = log["train"][0], log["train"][-1]
    assert last["loss"] < first["loss"] - 0.5
    model = load_model(str(out))
    assert isinstance(model, OuroLM) and model.config.num_kv_heads == 1 and not model.config.has_lookahead_gate
    tok = load_tokenizer(str(out))
    assert tok.decode(tok.encode(held_docs[0])) == held_docs[0]
    assert len(metrics["heldout"]["ppl_per_depth"]) == 4

    la = run(
        LookaheadArgs(
            model=out, batches=3, batch=4, seq=32, updates_per_batch=3, train_docs=train_docs, heldout_docs=held_docs
        )
    )
    assert load_model(str(out)).config.has_lookahead_gate
    rows = la["lookahead"]["by_threshold"]
    assert {r["threshold"] for r in rows} >= {0.5}
    for r in rows:
        assert 2.0 <= r["mean_depth_one_ahead_lookahead"] <= 4.0
        assert r["mean_depth_one_ahead_same_gate"] >= r["mean_depth_same_step"]
    write_card(out)
    assert (out / "loss.png").stat().st_size > 1000
    assert "Lookahead gate" in (out / "README.md").read_text()
