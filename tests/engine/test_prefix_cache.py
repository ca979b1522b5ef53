"""Automatic prefix caching: outputs and served depths with the cache equal those without it, for every KV policy,
greedy and seeded, with hits at every block boundary; hits and queries counted in tokens; cached blocks evicted only
when free blocks run out and never while held; a recomputation and a stage loss stay exact."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.inprocess import shared_model_factory
from cdb_model.kv import KVPolicy
from cdb_scheduler.allocators import BlockAllocator
from cdb_scheduler.sampling import SamplingParams

from .test_equivalence import model64

BLOCK = 8  # = prefill_chunk_size: a hit may end at any block boundary
BASE = EngineConfig(
    model="ouro-tiny",
    dtype="float64",
    max_num_seqs=8,
    num_kv_blocks=256,
    kv_block_size=BLOCK,
    prefill_chunk_size=BLOCK,
    prefill_token_budget=64,
    exit_threshold=0.5,
)
_DRAW = random.Random(5)
SHARED = [_DRAW.randrange(3, 259) for _ in range(4 * BLOCK)]


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """A first wave that writes the shared prefix, then prompts that share 1, 2, 3 and 4 blocks of it (and the whole
    of it plus one token: the last chunk is always computed), each with a tail of its own."""
    rng = random.Random(6)
    first = [[*SHARED, 7, 8, 9]]
    then = [SHARED[: k * BLOCK] + [rng.randrange(3, 259) for _ in range(rng.randint(1, 12))] for k in (1, 2, 3, 4)]
    then += [[*SHARED, 11], SHARED[: 2 * BLOCK + 3]]
    return first, then


def params(seeded: bool, i: int) -> RequestParams:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i) if seeded else SamplingParams()
    return RequestParams(max_tokens=10, sampling=sampling, ignore_eos=True)


def run(cfg: EngineConfig, seeded: bool) -> tuple[list, Engine]:
    first, then = workload()
    with Engine(cfg, shared_model_factory(model64(cfg.model))) as eng:
        outs = eng.generate(first, [params(seeded, 0)])  # its prefill's blocks are cached when it ends
        outs += eng.generate(then, [params(seeded, i + 1) for i in range(len(then))])
        eng.scheduler.check_invariants()
        stats = eng.stats()
        assert stats.held_rows == 0 and stats.used_kv_blocks == 0, "resources held after drain"
        return [(o.token_ids, o.depths) for o in outs], eng


def policy_config(kv_policy: str) -> EngineConfig:
    cfg = replace(BASE, kv_policy=kv_policy)
    if kv_policy == KVPolicy.DEPTH_INDEXED:
        cfg = replace(cfg, mode="full-depth")
    if kv_policy == KVPolicy.FIRST_THEN_SHARED:
        cfg = replace(cfg, min_depth=cfg.kv_shared_after)
    return cfg


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kv_policy", [p.value for p in KVPolicy])
def test_outputs_and_depths_are_the_same_with_the_cache_and_without(kv_policy: str, seeded: bool) -> None:
    cfg = policy_config(kv_policy)
    cached, eng = run(cfg, seeded)
    plain, off = run(replace(cfg, enable_prefix_caching=False), seeded)
    assert cached == plain
    first, then = workload()
    hits = eng.sched_stats.prefix_hits
    assert hits == (1 + 2 + 3 + 4 + 4 + 2) * BLOCK, "a hit at every block boundary the prompts share"
    assert eng.sched_stats.prefix_queries == sum(map(len, first + then))
    assert off.sched_stats.prefix_hits == off.sched_stats.prefix_queries == 0


def test_a_full_pool_evicts_cached_blocks_and_stays_exact() -> None:
    """A pool barely larger than a wave of requests: waves of new prefixes evict the cached blocks of older ones
    (never one a request holds: the invariants hold after every step), a prefix seen again hits while it is still
    cached, and every output is the one without the cache."""
    draw = random.Random(8)
    prefixes = {name: [draw.randrange(3, 259) for _ in range(3 * BLOCK)] for name in "ABCD"}
    waves = [[prefixes[name] + [3 + i] * (i + 1) for i in range(4)] for name in "ABACDA"]
    outs, stats = {}, {}
    for caching in (True, False):
        cfg = replace(BASE, num_kv_blocks=16, enable_prefix_caching=caching)
        with Engine(cfg, shared_model_factory(model64("ouro-tiny"))) as eng:
            got = []
            for k, wave in enumerate(waves):
                got += eng.generate(wave, [params(i % 2 == 1, 10 * k + i) for i in range(4)])
                eng.scheduler.check_invariants()
            outs[caching] = [(o.token_ids, o.depths) for o in got]
            stats[caching] = (eng.scheduler.blocks.evictions, eng.sched_stats.prefix_hits)
    assert outs[True] == outs[False]
    evictions, hits = stats[True]
    assert evictions > 0 and hits > 0, stats


def test_blocks_are_counted_by_reference_and_cached_ones_go_last() -> None:
    blocks = BlockAllocator(4, BLOCK)
    a = blocks.allocate(1, 2)
    assert a == [0, 1]
    blocks.register(0, b"h0")
    blocks.share([0])  # a second request reuses block 0
    blocks.free(1, a)
    assert blocks.owners() == {0: 1} and blocks.num_free == 3
    blocks.free(2, [0])
    assert blocks.num_free == 4 and blocks.cached([b"h0", b"h1"]) == [0]
    assert blocks.allocate(3, 3) == [1, 2, 3] and blocks.cached([b"h0"]) == [0]  # never-cached blocks first
    assert blocks.allocate(4, 1) == [0] and blocks.cached([b"h0"]) == [] and blocks.evictions == 1
    blocks.register(0, b"h0")
    blocks.free(4, [0])
    blocks.clear_cache()  # a stage loss: the KV is gone
    assert blocks.cached([b"h0"]) == [] and blocks.num_free == 1


def test_a_stage_loss_drops_the_cache() -> None:
    with Engine(BASE, shared_model_factory(model64("ouro-tiny"))) as eng:
        eng.generate([[*SHARED, 5]], [params(False, 0)])
        assert eng.scheduler.blocks.num_cached == len(SHARED) // BLOCK
    sched = eng.scheduler  # (the engine is stopped: its scheduler is ours)
    assert sched.recover() == [] and sched.blocks.num_cached == 0


def test_only_requests_of_the_same_cache_salt_share_cached_blocks() -> None:
    """vLLM's ``cache_salt``: a tenant's requests hit only what requests of its own salt cached (and none without
    one hit those), while the outputs stay what they are without the cache."""
    prompt = [*SHARED, 9]
    with Engine(BASE, shared_model_factory(model64("ouro-tiny"))) as eng:
        hits = []
        for salt in ("tenant-a", "tenant-b", "", "tenant-a"):
            before = eng.sched_stats.prefix_hits
            eng.generate([prompt], [replace(params(False, 0), cache_salt=salt)])
            hits.append(eng.sched_stats.prefix_hits - before)
    assert hits == [0, 0, 0, len(SHARED)]


def test_requests_that_arrive_together_share_the_prefix_the_first_one_writes() -> None:
    """The choices of one ``n > 1`` body (one prompt, several seeds) arrive together: the first prefills the prompt,
    the others wait for its blocks and reuse them, and every output is the one without the cache."""
    prompt = [*SHARED, 21, 22]
    plist = [params(True, i) for i in range(4)]
    outs, hits = {}, {}
    for caching in (True, False):
        with Engine(replace(BASE, enable_prefix_caching=caching), shared_model_factory(model64("ouro-tiny"))) as eng:
            outs[caching] = [(o.token_ids, o.depths) for o in eng.generate([prompt] * 4, plist)]
            hits[caching] = eng.sched_stats.prefix_hits
            eng.scheduler.check_invariants()
    assert outs[True] == outs[False]
    assert hits == {True: 3 * len(SHARED), False: 0}
