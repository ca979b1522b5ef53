"""Penalties, logit bias and min_tokens through the engine equal the sequential reference (float64): the stages
count each penalized request's tokens on the device from one history seed, in the fused head (Ouro) and in head
ops (Huginn), across preemption and recompute, and the batched sampler applies each row's processing alone."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cdb_engine.config import RequestParams
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams
from tests.engine.test_equivalence import Case, case_config, model64, run_engine, run_reference

pytestmark = pytest.mark.timeout(600)


def penalized_workload(rng: random.Random, n: int) -> list[tuple[list[int], RequestParams]]:
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 24))]  # a small alphabet: repeats happen
        proc = [
            LogitsProcessing(repetition_penalty=1.8),
            LogitsProcessing(frequency_penalty=1.5, presence_penalty=0.5),
            LogitsProcessing(logit_bias=((rng.randrange(3, 259), 8.0),), min_tokens=6, stop_ids=(1, 2)),
            None,
        ][i % 4]
        sampling = SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=rng.randrange(1000), processing=proc)
        out.append((prompt, RequestParams(max_tokens=rng.randint(4, 14), sampling=sampling, ignore_eos=True)))
    return out


@pytest.mark.parametrize(
    ("case", "fused", "blocks"),
    [
        (Case("ouro-tiny", 0.5, "last_exited", "one-ahead", "cdb"), True, None),
        (Case("ouro-tiny", 0.2, "single", "same-step", "cdb"), False, None),
        (Case("huginn-tiny", None, "single", "one-ahead", "cdb"), False, None),
        (Case("ouro-tiny", 0.5, "single", "one-ahead", "cdb"), True, 14),  # a small pool: preemption, recompute
    ],
    ids=["ouro-fused", "ouro-head-ops", "huginn", "ouro-preempted"],
)
def test_processed_sampling_equals_the_reference(case: Case, fused: bool, blocks: int | None) -> None:
    rng = random.Random(11)
    model = model64(case.model)
    cfg = case_config(case, rng, fuse_loop_head=fused)
    if blocks is not None:
        cfg = dataclasses.replace(cfg, num_kv_blocks=blocks, max_num_seqs=6)
    work = penalized_workload(rng, 12)
    got, eng = run_engine(model, cfg, work)
    assert got == run_reference(model, eng, work, cfg)
    if blocks is not None:
        assert eng.scheduler.stats.preemptions > 0, "the small pool should force a preemption"
