"""Synthetic stages: cost SPECs and profiles, drawn depths, and an engine that serves on them."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
import torch

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.synthetic import SyntheticDepths, SyntheticWorker, parse_cost, sampled_ids, synthetic_model
from cdb_model.config import ModelConfig
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.presets import preset_config
from cdb_model.released import OURO_14B
from cdb_scheduler.plan import KVUpdate, LoopHead, LoopOp, Stage, derive_seed
from cdb_scheduler.sampling import SamplingParams


def test_an_explicit_spec_costs_what_it_says_and_stages_left_out_cost_nothing() -> None:
    cost = parse_cost("loop=500:2:40,head=40:0.5:0")
    assert cost.loop.seconds(tokens=64, context=10_000) == pytest.approx(1e-6 * (500 + 2 * 64 + 40 * 10))
    assert cost.head.seconds(tokens=10, context=0) == pytest.approx(1e-6 * 45)
    assert cost.prelude.seconds(tokens=100, context=100) == 0.0


@pytest.mark.parametrize(
    ("spec", "words"),
    [("loop=1:2", "A:B:C"), ("loop=-1:0:0", "A:B:C"), ("coda=1:1:1", "unknown stage role"), ("h200:gpt-9", "model")],
)
def test_a_bad_spec_is_refused_naming_the_problem(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_cost(spec)
    with pytest.raises(ValueError, match=words):
        EngineConfig(synthetic_cost=spec)


def test_the_h200_ouro_profile_follows_the_bandwidth_formula() -> None:
    """Loop op: the looped block's bf16 weights over 4.8 TB/s (~0.51 ms); the head: the LM head (~0.04 ms); KV:
    24 layers x K and V x 2048 x 2 bytes per context token."""
    c = ModelConfig.from_hf(OURO_14B)
    _, loop_params, head_params = c.stage_param_counts()
    cost = parse_cost("h200:ouro-1.4b")
    assert cost.loop.seconds(1, 0) == pytest.approx(2 * loop_params / 4.8e12)
    assert 0.45e-3 < cost.loop.seconds(64, 0) < 0.6e-3  # memory-bound: flat in the batch below the ridge
    assert cost.head.seconds(1, 0) == pytest.approx(2 * head_params / 4.8e12)
    kv_per_token = 24 * 2 * 2048 * 2
    assert cost.loop.seconds(1, 1000) - cost.loop.seconds(1, 0) == pytest.approx(1000 * kv_per_token / 4.8e12)
    assert 0.6e-3 < parse_cost("h200:huginn-3.5b").loop.seconds(1, 0) < 0.8e-3


def test_drawn_depths_have_the_configured_mean_and_minimum() -> None:
    d = SyntheticDepths.parse("2.5:2", "ouro")
    draws = [d.draw(rid, pos, 4) for rid in range(200) for pos in range(50)]
    assert min(draws) == 2 and max(draws) == 4
    assert statistics.fmean(draws) == pytest.approx(2.5, abs=0.03)
    assert SyntheticDepths.parse("", "huginn") == SyntheticDepths(6.0, 3)


@pytest.mark.parametrize("model", ["ouro-tiny", "huginn-tiny"])
def test_an_engine_on_synthetic_stages_serves_the_drawn_depths_with_live_exit_decisions(model: str) -> None:
    depths = "2.5:2" if model == "ouro-tiny" else "4:2"
    cfg = EngineConfig(model=model, synthetic_cost="loop=50:0:0,head=20:0:0", synthetic_depths=depths, max_num_seqs=8)
    with Engine(cfg) as engine:
        outs = engine.generate([[5, 6, 7]] * 12, RequestParams(max_tokens=24, ignore_eos=True))
        mean = engine.sched_stats.mean_depth
        loop_compute = engine.sched_stats.compute_s[Stage.LOOP]
    decode = [d for o in outs for d in o.depths[1:]]
    assert all(len(o.token_ids) == 24 for o in outs)
    want = SyntheticDepths.parse(depths, "").mean
    assert statistics.fmean(decode) == pytest.approx(want, abs=0.25), "the exit rule follows the drawn depths"
    assert mean > 0 and loop_compute == pytest.approx(engine.sched_stats.ops[Stage.LOOP] * 50e-6, rel=0.5)


@pytest.mark.parametrize("depths", [SyntheticDepths(2.5, 2), SyntheticDepths(6.0, 3), SyntheticDepths(4.0, 1)])
def test_vectorised_depth_draws_are_the_integer_mixing_draws(depths: SyntheticDepths) -> None:
    """``draw_many`` (NumPy, per op) gives, token by token, ``MIN + #{j : derive_seed(derive_seed(rid, pos), j) <
    p * 2**63}``: the draw written with the scheduler's own integer mixing, in Python integers."""
    rng = random.Random(5)
    rids = [rng.randrange(1, 10**6) for _ in range(400)]
    positions = [rng.randrange(0, 8192) for _ in range(400)]
    for max_depth in (1, 4, 32):
        lo = min(depths.min, max_depth)
        n = max_depth - lo
        p = min(1.0, max(0.0, (depths.mean - lo) / n)) if n else 0.0
        expected = [
            lo + sum(derive_seed(derive_seed(r, q), j) < p * 2**63 for j in range(n)) for r, q in zip(rids, positions)
        ]
        got = depths.draw_many(np.array(rids, np.uint64), np.array(positions, np.uint64), max_depth)
        assert got.tolist() == expected
        assert depths.draw(rids[0], positions[0], max_depth) == expected[0]


def test_vectorised_head_ids_are_the_integer_mixing_ids_past_the_stop_ids() -> None:
    """``sampled_ids`` (NumPy, per op) gives, token by token, ``derive_seed(derive_seed(seed, rid), index) % vocab``
    moved up past the stop ids, written in Python integers (negative seeds as their 64-bit patterns)."""
    rng = random.Random(11)
    vocab, stops = 16, frozenset({0, 1, 2, 5, 15})  # small: many draws land on stop ids, some on runs of them
    seeds = [rng.choice([-1, rng.randrange(-(2**63), 2**63)]) for _ in range(500)]
    rids = [rng.randrange(1, 10**9) for _ in range(500)]
    index = [rng.randrange(0, 5000) for _ in range(500)]
    expected = []
    for seed, rid, i in zip(seeds, rids, index):
        token = derive_seed(derive_seed(seed, rid), i) % vocab
        while token in stops:
            token = (token + 1) % vocab
        expected.append(token)
    assert sampled_ids(seeds, rids, index, vocab, stops).tolist() == expected
    assert any(derive_seed(derive_seed(s, r), i) % vocab in stops for s, r, i in zip(seeds, rids, index))


def _loop_worker() -> SyntheticWorker:
    cfg = preset_config("ouro-tiny")
    model = synthetic_model(cfg, "loop=0:0:0", "", "cpu", torch.float32)
    layout = KVLayout(KVPolicy.DEPTH_INDEXED, 4)
    return SyntheticWorker(model, Stage.LOOP, torch.zeros(8, cfg.bank_width), layout, 64, 16)


def test_a_synthetic_op_over_a_position_without_its_kv_block_fails_naming_the_request() -> None:
    worker = _loop_worker()
    worker.tables.apply([KVUpdate(7, (0,)), KVUpdate(9, (1, 2))])  # request 7: positions 0..15; 9: 0..31

    def op(seq: int, positions: tuple[int, int]) -> LoopOp:
        return LoopOp(seq, (), (), (), (7, 9), positions, (0, 1), (0, 0))

    assert worker.execute(op(0, (15, 31))).signals  # every position has its block
    with pytest.raises(IndexError, match="request 7: position 16 has no KV block"):
        worker.execute(op(1, (16, 31)))
    with pytest.raises(IndexError, match="request 9: position 32 has no KV block"):
        worker.execute(op(2, (3, 32)))
    with pytest.raises(KeyError, match="no block table for request 11"):
        worker.execute(LoopOp(3, (), (), (), (7, 11), (0, 0), (0, 1), (0, 0)))


def test_a_launch_leaves_what_the_device_computes_to_the_ops_finish() -> None:
    """A GPU computes an op's tokens after its launch returns: a synthetic launch writes no token, so launching
    op k+1 while op k runs does not hold op k's reply; preparing or finishing the op writes them, in launch order."""
    worker = _loop_worker()
    worker.tables.apply([KVUpdate(7, (0,)), KVUpdate(9, (1,))])
    head = LoopHead(
        rids=(7, 9),
        positions=(3, 5),
        rows=(2, 3),
        sampling=(SamplingParams(seed=4),) * 2,
        token_index=(0, 1),
        embed_ids=(-1, -1),
    )
    first = worker.launch(LoopOp(0, (), (), (), (7, 9), (3, 5), (0, 1), (0, 0), head=head))
    second = worker.launch(LoopOp(1, (), (), (), (7, 9), (4, 6), (0, 1), (0, 0)))
    assert worker.tokens[2:4].tolist() == [0, 0]  # launched, not computed
    done = first()
    assert done.seq == 0 and len(done.token_ids) == 2 and worker.tokens[2:4].tolist() == list(done.token_ids)
    assert second().seq == 1


def test_a_prefill_chunk_reads_its_requests_context_once_where_decode_tokens_read_their_own() -> None:
    """Modelled KV reads: each decode token reads its request's context; a prefill chunk's queries read it together
    (flash attention), so a chunk over positions 16..31 reads 32 positions per loop step, not 16 x 24.5."""
    cfg = preset_config("ouro-tiny")
    model = synthetic_model(cfg, "loop=0:0:1000", "", "cpu", torch.float32)  # 1 µs per context position
    worker = SyntheticWorker(model, Stage.LOOP, torch.zeros(40, cfg.bank_width), KVLayout(KVPolicy.SINGLE, 4), 64, 16)
    worker.tables.apply([KVUpdate(7, (0, 1)), KVUpdate(9, (2,))])
    chunk = tuple(range(16, 32))
    prefill = LoopOp(0, (), (), (), (7,) * 16, chunk, tuple(range(16)), (0,) * 16, prefill=True, num_steps=3)
    assert worker.launch(prefill).seconds == pytest.approx(3 * 32e-6)
    decode = LoopOp(1, (), (), (), (7, 9), (31, 5), (0, 1), (0, 0))
    assert worker.launch(decode).seconds == pytest.approx((32 + 6) * 1e-6)
    two = LoopOp(2, (), (), (), (7, 7, 9, 9), (30, 31, 4, 5), (0, 1, 2, 3), (0,) * 4, prefill=True, num_steps=1)
    assert worker.launch(two).seconds == pytest.approx((32 + 6) * 1e-6)
