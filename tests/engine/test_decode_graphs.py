"""Decode loop ops through ``DecodeGraphs`` (padded to width and context buckets, static buffers; captured on CUDA,
run eagerly here) change no result: the engine's tokens and depths equal the sequential reference's, for every KV
policy and both model families, and the padding never touches another request's KV or bank row."""

from __future__ import annotations

import functools
import random
import zlib

import pytest

from cdb_engine.decode_graphs import width_buckets
from cdb_engine.engine import Engine
from cdb_engine.inprocess import InProcessExecutor
from cdb_engine.setup import StageSetup
from cdb_engine.stage_worker import StageWorker
from cdb_scheduler.plan import Stage
from tests.engine.test_equivalence import Case, case_config, model64, run_reference, workload

pytestmark = pytest.mark.timeout(600)


def test_width_buckets_cover_every_width_up_to_the_bank() -> None:
    assert width_buckets(1) == (1,)
    assert width_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert width_buckets(130)[-3:] == (96, 128, 130)
    for top in (3, 17, 64, 100):
        buckets = width_buckets(top)
        assert all(any(b >= w for b in buckets) for w in range(1, top + 1)) and buckets[-1] == top


@pytest.mark.parametrize(
    "case",
    [
        Case("ouro-tiny", 0.5, "last_exited", "one-ahead", "cdb"),
        Case("ouro-tiny", 0.2, "single", "same-step", "cdb"),
        Case("huginn-tiny", None, "single", "one-ahead", "cdb", 7),
        Case("huginn-tiny", None, "first_then_shared", "one-ahead", "no-refill", min_depth=2),
    ],
    ids=str,
)
def test_padded_decode_graphs_reproduce_the_reference(case: Case) -> None:
    model = model64(case.model)
    rng = random.Random(zlib.crc32(repr(case).encode()))
    cfg = case_config(case, rng)
    work = workload(rng, 10)
    graphs = functools.partial(StageWorker, decode_graphs=True)
    made: list[InProcessExecutor] = []

    def factory(setup: StageSetup) -> InProcessExecutor:
        made.append(InProcessExecutor(setup, model=model, worker_factory=graphs))
        return made[-1]

    with Engine(cfg, factory) as eng:
        outs = eng.generate([p for p, _ in work], [r for _, r in work])
        loop = made[-1].workers[Stage.LOOP]
        assert isinstance(loop, StageWorker) and loop.graphs is not None and loop.graphs._graphs, "graphs unused"
        got = [(o.token_ids, o.depths) for o in outs]
        assert got == run_reference(model, eng, work, cfg)
