"""Greedy generation of the golden models through the reference path and through the stage workers, and the
workers' equivalence with the reference under adaptive exits, every KV policy, sampling and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from cdb_model.attention import MissingKVError
from cdb_model.base import LoopedLM
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.presets import build_preset
from cdb_model.reference import reference_generate
from cdb_model.tokenizer import ByteTokenizer
from cdb_scheduler.exit_policy import ExitPolicy, FixedDepth, Horizon, LatentDiff, OuroHazard, ReplayDepth
from cdb_scheduler.sampling import SamplingParams

from .driver import drive_workers

Golden = tuple[LoopedLM, dict[str, torch.Tensor]]


@pytest.mark.parametrize("which", ["ouro", "huginn"])
def test_golden_greedy_generation(which: str, request: pytest.FixtureRequest) -> None:
    model, e = request.getfixturevalue(f"{which}_golden")
    depth = model.config.max_depth  # Ouro 4 (total_ut_steps), Huginn 8 (mean_recurrence), zero initial state
    prompts = e["input_ids"].tolist()
    expected = [row[len(prompts[0]) :] for row in e["generated_ids"].tolist()]
    layout = KVLayout(KVPolicy.DEPTH_INDEXED, depth)
    for b, prompt in enumerate(prompts):
        out = reference_generate(model, prompt, max_new_tokens=8, policy=FixedDepth(depth, depth), kv_layout=layout)
        assert out.tokens == expected[b]
        assert out.depths == [depth] * 8
    for chunk, arrivals in ((None, [0, 0]), (5, [0, 2])):
        outs = drive_workers(
            model,
            prompts,
            max_new_tokens=8,
            policy=FixedDepth(depth, depth),
            layout=layout,
            prefill_chunk_size=chunk,
            arrivals=arrivals,
        )
        assert [o.tokens for o in outs] == expected


PROMPTS = ["The looped model", "Hi", "abc def ghi jkl mno", "0123456789"]


def _policy(model: LoopedLM, horizon: Horizon, min_depth: int = 1) -> ExitPolicy:
    c = model.config
    if c.arch == "ouro":
        return OuroHazard(c.early_exit_threshold, c.max_depth, min_depth, horizon=horizon)
    return LatentDiff(c.early_exit_threshold, c.max_depth, min_depth, horizon=horizon)


@pytest.fixture(scope="module")
def tiny64() -> dict[str, LoopedLM]:
    return {n: build_preset(n, dtype=torch.float64) for n in ("ouro-tiny", "huginn-tiny")}


@pytest.mark.parametrize(
    ("name", "policy", "horizon", "sampling", "chunk", "init_seed"),
    [
        ("ouro-tiny", KVPolicy.LAST_EXITED, Horizon.SAME_STEP, SamplingParams(), None, -1),
        ("ouro-tiny", KVPolicy.SINGLE, Horizon.ONE_AHEAD, SamplingParams(temperature=0.8, top_p=0.9, seed=3), 3, -1),
        ("ouro-tiny", KVPolicy.FIRST_THEN_SHARED, Horizon.SAME_STEP, SamplingParams(temperature=1.0, seed=5), 4, -1),
        ("huginn-tiny", KVPolicy.LAST_EXITED, Horizon.ONE_AHEAD, SamplingParams(temperature=1.0, top_k=20), 4, 11),
        ("huginn-tiny", KVPolicy.SINGLE, Horizon.SAME_STEP, SamplingParams(), None, 7),
        ("huginn-tiny", KVPolicy.FIRST_THEN_SHARED, Horizon.SAME_STEP, SamplingParams(temperature=0.7), 5, -1),
    ],
)
def test_workers_match_reference(
    tiny64: dict[str, LoopedLM],
    name: str,
    policy: KVPolicy,
    horizon: Horizon,
    sampling: SamplingParams,
    chunk: int | None,
    init_seed: int,
) -> None:
    model = tiny64[name]
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    layout = KVLayout(policy, model.config.max_depth, shared_after=2)
    min_depth = 2 if policy is KVPolicy.FIRST_THEN_SHARED else 1  # first_then_shared(k) needs min depth >= k
    outs = drive_workers(
        model,
        prompts,
        max_new_tokens=10,
        policy=_policy(model, horizon, min_depth),
        layout=layout,
        sampling=sampling,
        prefill_chunk_size=chunk,
        init_seed=init_seed,
        arrivals=[0, 1, 1, 4],
    )
    refs = []
    for p in prompts:
        refs.append(
            reference_generate(
                model,
                p,
                max_new_tokens=10,
                policy=_policy(model, horizon, min_depth),
                kv_layout=layout,
                sampling=sampling,
                prefill_chunk_size=chunk,
                init_seed=init_seed,
            )
        )
    assert [o.tokens for o in outs] == [r.tokens for r in refs]
    assert [o.depths for o in outs] == [r.depths for r in refs]
    assert len({d for r in refs for d in r.depths[1:]}) >= 2, "exit depths should vary"


def test_reference_replay_and_stop(tiny64: dict[str, LoopedLM]) -> None:
    model = tiny64["ouro-tiny"]
    layout = KVLayout(KVPolicy.LAST_EXITED, 4)
    prompt = ByteTokenizer().encode("replay")
    out = reference_generate(
        model, prompt, max_new_tokens=6, policy=ReplayDepth(4), kv_layout=layout, replay_depths=[1, 2, 3, 4, 2]
    )
    assert out.depths == [4, 1, 2, 3, 4, 2]
    stop = out.tokens[2]
    cut = reference_generate(
        model,
        prompt,
        max_new_tokens=6,
        policy=ReplayDepth(4),
        kv_layout=layout,
        replay_depths=[1, 2, 3, 4, 2],
        stop_token_ids=[stop],
    )
    assert cut.tokens == out.tokens[: out.tokens.index(stop) + 1]


def test_reference_refuses_missing_depth_kv(tiny64: dict[str, LoopedLM]) -> None:
    """depth_indexed with early exits leaves deeper slots unwritten: the reference fails loudly."""
    model = tiny64["ouro-tiny"]
    with pytest.raises(MissingKVError, match="never written"):
        reference_generate(
            model,
            ByteTokenizer().encode("xy"),
            max_new_tokens=6,
            policy=ReplayDepth(4),
            kv_layout=KVLayout(KVPolicy.DEPTH_INDEXED, 4),
            replay_depths=[1, 4, 4, 4, 4],
        )
