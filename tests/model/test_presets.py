"""Presets, config parsing and parameter counts, the byte tokenizer, reduced precision and CUDA."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cdb_model.attention import DenseKVCache
from cdb_model.config import ModelConfig, UnknownModelTypeError
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model
from cdb_model.presets import build_preset, preset_config, preset_names
from cdb_model.reference import reference_generate
from cdb_model.released import HUGINN_0125 as HUGINN
from cdb_model.released import OURO_14B
from cdb_model.tokenizer import ByteTokenizer
from cdb_scheduler.exit_policy import FixedDepth, Horizon, LatentDiff, OuroHazard
from cdb_scheduler.plan import Stage
from cdb_scheduler.sampling import SamplingParams

from .conftest import golden_dir
from .driver import drive_workers


def test_released_configs_and_param_counts() -> None:
    ouro = ModelConfig.from_hf(OURO_14B)
    assert (ouro.arch, ouro.max_depth, ouro.head_dim, ouro.bank_width) == ("ouro", 4, 128, 2048)
    assert ouro.stop_token_ids == (0, 2)
    f0, fr = ouro.param_counts()
    assert abs(f0 / 1e9 - 0.10) < 0.01 and abs(fr / 1e9 - 1.23) < 0.02 and abs(f0 / fr - 0.08) < 0.005
    huginn = ModelConfig.from_hf(HUGINN)
    assert (huginn.arch, huginn.max_depth, huginn.head_dim, huginn.bank_width) == ("huginn", 32, 96, 10560)
    assert huginn.stop_token_ids == (65504, 65505, 65508)
    f0, fr = huginn.param_counts()
    assert abs(f0 / 1e9 - 1.93) < 0.02 and abs(fr / 1e9 - 1.64) < 0.02 and abs(f0 / fr - 1.18) < 0.01
    with pytest.raises(UnknownModelTypeError, match="'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_param_counts_match_modules() -> None:
    for name in ("ouro-tiny", "huginn-tiny"):
        c = preset_config(name)
        f0, fr = c.param_counts()
        loop = sum(p.numel() for p in build_preset(name, stages={Stage.LOOP}).parameters())
        if c.arch == "ouro":
            assert fr == loop + c.hidden_size * 0  # layers + norm + gate
            assert f0 == c.hidden_size + c.vocab_size * c.hidden_size
        else:
            head = sum(p.numel() for p in build_preset(name, stages={Stage.HEAD}).parameters())  # coda, ln_f, wte
            prelude_blocks = c.num_prelude_layers * (fr - 2 * c.hidden_size**2) // c.num_loop_layers
            assert fr == loop and f0 == head + prelude_blocks


def test_bench_ratios() -> None:
    f0, fr = preset_config("ouro-bench").param_counts()
    assert abs(f0 / fr - 0.08) < 0.01 and preset_config("ouro-bench").max_depth == 4
    f0, fr = preset_config("huginn-bench").param_counts()
    assert abs(f0 / fr - 1.18) < 0.02 and preset_config("huginn-bench").max_depth == 16
    assert preset_names() == ["ouro-tiny", "huginn-tiny", "ouro-bench", "huginn-bench"]


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "ouro-bench", "huginn-bench"])
def test_presets_build_and_subsets_share_weights(name: str) -> None:
    full = build_preset(name).state_dict()
    for stage in Stage:
        part = build_preset(name, stages={stage}).state_dict()
        assert part and all(torch.equal(t, full[k]) for k, t in part.items())


def test_varied_exit_depths() -> None:
    tok = ByteTokenizer()
    prompts = ["The quick brown fox", "Hello, world!", "def f(x): return x"]
    for name in ("ouro-tiny", "huginn-tiny"):
        model = build_preset(name)
        c = model.config
        depths: list[int] = []
        for i, p in enumerate(prompts):
            q = c.early_exit_threshold
            policy = (
                OuroHazard(q, c.max_depth, horizon=Horizon.SAME_STEP)
                if c.arch == "ouro"
                else LatentDiff(q, c.max_depth, horizon=Horizon.SAME_STEP)
            )
            out = reference_generate(
                model,
                tok.encode(p),
                max_new_tokens=12,
                policy=policy,
                kv_layout=KVLayout(KVPolicy.LAST_EXITED, c.max_depth),
                sampling=SamplingParams(temperature=1.0, seed=i),
            )
            depths += out.depths[1:]
        assert len(set(depths)) >= 3, (name, depths)
    # Ouro hazards spread widely (roughly 0.1 - 0.9).
    model = build_preset("ouro-tiny")
    ids = torch.tensor(tok.encode(" ".join(prompts)))
    p = torch.arange(len(ids))
    rows = model.prelude(ids, p, None, [-1] * len(ids))
    cache, hazards = DenseKVCache(), []
    for s in range(4):
        rows, hazard, _ = model.loop_step(rows, p, p * 0 + s, cache.access(p.tolist(), s))
        hazards.append(hazard)
    q10, q90 = torch.quantile(torch.cat(hazards), torch.tensor([0.1, 0.9])).tolist()
    assert q10 < 0.15 and q90 > 0.6


def test_huginn_seeded_initial_state() -> None:
    model = build_preset("huginn-tiny")
    H = model.config.hidden_size
    kv = DenseKVCache()
    rows = model.prelude(torch.tensor([10, 11, 12]), torch.arange(3), kv.access(range(3), 0), [5, -1, 5])
    s0 = rows[:, :H]
    assert torch.equal(s0[0], s0[2]) and torch.count_nonzero(s0[1]) == 0
    std = (2 / (5 * H)) ** 0.5 * H**0.5
    assert s0[0].abs().max() <= 3 * std + 1e-6 and 0.5 * std < s0[0].std() < 1.5 * std
    alone = model.prelude(torch.tensor([7]), torch.tensor([0]), DenseKVCache().access([0], 0), [5])
    assert torch.equal(alone[0, :H], s0[0])  # the state depends on the seed only, never on the batch


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    text = "héllo <|im_start|>wörld<|im_end|>"
    ids = tok.encode(text)
    assert ids[:2] == [ord("h") + 3, 0xC3 + 3] and 1 in ids and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "héllo wörld"
    assert tok.decode([300, 400]) == ""
    assert tok.stop_token_ids == (0, 2) and tok.eos_token_id == 0 and tok.vocab_size == 512


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_bfloat16_cpu_close_to_float32(name: str) -> None:
    """The same code in bf16 (stage workers and reference): logits stay close to float32."""
    tok = ByteTokenizer()
    prompt = tok.encode("bf16 check")
    ref = build_preset(name)
    low = build_preset(name, dtype=torch.bfloat16)
    c = ref.config
    layout = KVLayout(KVPolicy.DEPTH_INDEXED, c.max_depth)
    a = reference_generate(ref, prompt, max_new_tokens=4, policy=FixedDepth(c.max_depth, c.max_depth), kv_layout=layout)
    outs = drive_workers(low, [prompt], max_new_tokens=4, policy=FixedDepth(c.max_depth, c.max_depth), layout=layout)
    assert len(a.tokens) == len(outs[0].tokens) == 4
    p = torch.arange(len(prompt))
    x32 = ref.prelude(torch.tensor(prompt), p, DenseKVCache().access(p.tolist(), 0), [-1] * len(prompt))
    x16 = low.prelude(torch.tensor(prompt), p, DenseKVCache().access(p.tolist(), 0), [-1] * len(prompt))
    assert x16.dtype == torch.bfloat16
    c32, c16 = DenseKVCache(), DenseKVCache()
    for s in range(c.max_depth):
        x32, _, _ = ref.loop_step(x32, p, p * 0 + s, c32.access(p.tolist(), s))
        x16, sig, _ = low.loop_step(x16, p, p * 0 + s, c16.access(p.tolist(), s))
        assert sig.dtype == torch.float32 and x16.dtype == torch.bfloat16
    l32 = ref.logits(ref.coda(x32, p, DenseKVCache().access(p.tolist(), 0)))
    l16 = low.logits(low.coda(x16, p, DenseKVCache().access(p.tolist(), 0)))
    assert l16.dtype == torch.float32
    assert (l16 - l32).abs().max() < 0.15 * l32.abs().max()
    assert outs[0].tokens[0] in torch.topk(l32[-1], 5).indices.tolist()  # random weights: near-ties may flip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_cuda_workers(name: str) -> None:
    """The same code on CUDA: float32 golden greedy ids exactly, bf16 runs and stays close to float32."""
    folder = golden_dir(name)
    e = load_file(str(folder / "expected.safetensors"))
    model = load_model(str(folder), device="cuda")
    depth = model.config.max_depth
    layout = KVLayout(KVPolicy.DEPTH_INDEXED, depth)
    prompts = e["input_ids"].tolist()
    outs = drive_workers(model, prompts, max_new_tokens=8, policy=FixedDepth(depth, depth), layout=layout)
    assert [o.tokens for o in outs] == [row[len(prompts[0]) :] for row in e["generated_ids"].tolist()]
    low = load_model(str(folder), device="cuda", dtype=torch.bfloat16)
    outs = drive_workers(low, prompts, max_new_tokens=8, policy=FixedDepth(depth, depth), layout=layout)
    assert all(len(o.tokens) == 8 for o in outs)
    p = torch.arange(len(prompts[0]), device="cuda")
    logits = []
    for m in (model, low):
        x = m.prelude(torch.tensor(prompts[0], device="cuda"), p, DenseKVCache().access(p.tolist(), 0), [-1] * len(p))
        cache = DenseKVCache()
        for s in range(depth):
            x, _, _ = m.loop_step(x, p, p * 0 + s, cache.access(p.tolist(), s))
        logits.append(m.logits(m.coda(x, p, DenseKVCache().access(p.tolist(), 0))))
    assert (logits[0] - logits[1]).abs().max() < 0.15 * logits[0].abs().max()
