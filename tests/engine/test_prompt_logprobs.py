"""Prompt scoring (``RequestParams.prompt_logprobs``) and prefill-only requests (``max_tokens`` 0).

The logprob of prompt token p+1 is computed from position p's hidden state after the full-depth prefill (the
depth the prompt's KV is written at), the coda and the LM head: it equals the sequential reference's, whatever
the batch, the chunking and the preemptions, and is reported exactly once.
"""

from __future__ import annotations

import random

import pytest
import torch

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.inprocess import shared_model_factory
from cdb_model.base import LoopedLM
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model
from cdb_model.reference import reference_prompt_logprobs
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams

pytestmark = pytest.mark.timeout(240)

_MODELS: dict[str, LoopedLM] = {}


def model64(name: str) -> LoopedLM:
    if name not in _MODELS:
        _MODELS[name] = load_model(name, dtype=torch.float64)
    return _MODELS[name]


def config(model: str, **kw: object) -> EngineConfig:
    base = dict(
        model=model,
        dtype="float64",
        max_num_seqs=3,
        num_kv_blocks=256,
        kv_block_size=4,
        prefill_chunk_size=16,
        prefill_token_budget=32,
        num_threads=1,
    )
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def scoring(max_tokens: int, logprobs: int = 0, seed: int = 0) -> RequestParams:
    sampling = SamplingParams(temperature=0.8, seed=seed, logprobs=logprobs, return_logprob=True)
    return RequestParams(max_tokens=max_tokens, sampling=sampling, ignore_eos=True, prompt_logprobs=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("model", ["ouro-tiny", "huginn-tiny"])
def test_prompt_logprobs_are_the_full_depth_references_in_any_batch(model: str) -> None:
    work = prompts(7)
    cfg = config(model)
    with Engine(cfg, shared_model_factory(model64(model))) as eng:
        batched = eng.generate(work, [scoring(3, seed=i) for i in range(len(work))])
        alone = [eng.generate([p], scoring(3, seed=i))[0] for i, p in enumerate(work)]
        layout = KVLayout(KVPolicy(cfg.kv_policy), eng.limits.max_depth, cfg.kv_shared_after)
        max_depth = eng.limits.max_depth
    for prompt, b, a in zip(work, batched, alone):
        ref = reference_prompt_logprobs(
            model64(model), prompt, max_depth=max_depth, kv_layout=layout, prefill_chunk_size=16
        )
        assert len(b.prompt_logprobs) == len(prompt) - 1
        assert [lp.logprob for lp in b.prompt_logprobs] == pytest.approx(ref, abs=1e-9)
        assert b.prompt_logprobs == a.prompt_logprobs, "the batch changed a prompt logprob"
        assert (b.token_ids, b.depths) == (a.token_ids, a.depths)


def test_scoring_changes_no_generated_token() -> None:
    work = prompts(5, seed=1)
    with Engine(config("ouro-tiny"), shared_model_factory(model64("ouro-tiny"))) as eng:
        scored = eng.generate(work, [scoring(6, seed=i) for i in range(5)])
        plain = eng.generate(
            work, [RequestParams(max_tokens=6, sampling=scoring(6, seed=i).sampling, ignore_eos=True) for i in range(5)]
        )
    assert [(o.token_ids, o.depths) for o in scored] == [(o.token_ids, o.depths) for o in plain]
    assert all(not o.prompt_logprobs for o in plain)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing() -> None:
    work = prompts(6, seed=2)
    with Engine(config("ouro-tiny"), shared_model_factory(model64("ouro-tiny"))) as eng:
        zero = eng.generate(work, scoring(0, logprobs=3))
        one = eng.generate(work, scoring(1, logprobs=3))
        bare = eng.generate(work, RequestParams(max_tokens=0))
        eng.scheduler.check_invariants()
        stats = eng.stats()
    assert stats.held_rows == 0 and stats.used_kv_blocks == 0, "resources held after prefill-only requests"
    for prompt, z, o, b in zip(work, zero, one, bare):
        assert z.finish_reason is FinishReason.LENGTH and z.token_ids == [] and z.text == ""
        assert z.prompt_logprobs == o.prompt_logprobs and len(z.prompt_logprobs) == len(prompt) - 1
        for lp, target in zip(z.prompt_logprobs, prompt[1:]):
            assert len(lp.top_ids) == 3 and lp.top_logprobs[0] >= lp.logprob
            assert (target in lp.top_ids) == (lp.logprob >= lp.top_logprobs[-1])
        assert b.finish_reason is FinishReason.LENGTH and b.token_ids == [] and b.prompt_logprobs == []


def test_prompt_logprobs_survive_preemption_and_are_reported_once() -> None:
    # a pool this small preempts: a recomputed request scores its prompt again only if it had reported nothing
    work = prompts(10, seed=3)
    cfg = config("ouro-tiny", num_kv_blocks=24, max_num_seqs=8)
    roomy = config("ouro-tiny")
    with Engine(cfg, shared_model_factory(model64("ouro-tiny"))) as eng:
        tight = eng.generate(work, [scoring(12, seed=i) for i in range(10)])
        preemptions = eng.sched_stats.preemptions
    with Engine(roomy, shared_model_factory(model64("ouro-tiny"))) as eng:
        free = eng.generate(work, [scoring(12, seed=i) for i in range(10)])
    assert preemptions > 0, "the workload did not preempt"
    for t, f in zip(tight, free):
        assert t.prompt_logprobs == f.prompt_logprobs
        assert (t.token_ids, t.depths) == (f.token_ids, f.depths)
