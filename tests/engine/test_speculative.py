"""Self-speculative decoding (``cdb_scheduler.speculation``) changes no result: every request's tokens and served
depths equal the sequential reference's, greedy and sampled alike, whatever the drafts were; and it shortens a
lone stream's chain of loop ops."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import random
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import cdb_engine.engine
import cdb_scheduler
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine, FinishEvent
from cdb_engine.inprocess import shared_model_factory
from cdb_scheduler.loop_cost import MIN_VERDICTS
from cdb_scheduler.plan import Stage
from cdb_scheduler.request import Item
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams
from cdb_scheduler.scheduler import Scheduler
from tests.engine.test_equivalence import Case, case_config, model64, run_engine, run_reference, workload

# Ouro (the fused loop head) under the KV policies that allow speculation, both horizons, cdb and full depth; the
# shipped trained model (whose shallow drafts are often right) and the random tiny one (often wrong).
CASES = [
    Case(m, q, kv, hz, mode)
    for m, q in [("ouro-tiny", 0.5), ("ouro-kjv", None)]
    for kv, hz, mode in [
        ("last_exited", "one-ahead", "cdb"),
        ("last_exited", "same-step", "cdb"),
        ("last_exited", "one-ahead", "full-depth"),
        ("depth_indexed", "one-ahead", "full-depth"),
    ]
]


def kjv_on(**fields: Any) -> EngineConfig:
    """The shipped model in float64, speculating on every request, drafts up to the whole width."""
    return EngineConfig(
        model="ouro-kjv", dtype="float64", kv_block_size=4, speculative="on", speculative_max_occupancy=1, **fields
    )


@functools.cache
def interpreted_scheduler() -> type[Scheduler]:
    """The ``Scheduler`` class run from its source by the interpreter, even where the compiled build is imported
    (``cdb_scheduler._native``): a compiled class's methods cannot be wrapped."""
    name = "cdb_scheduler._interpreted_scheduler"
    spec = importlib.util.spec_from_file_location(name, Path(cdb_scheduler.__file__).parent / "scheduler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    cls: type[Scheduler] = module.Scheduler
    return cls


@contextlib.contextmanager
def watching_drafts(seen: Callable[[Scheduler, list[Item], list[Item]], None]) -> Iterator[None]:
    """Call ``seen(scheduler, items, drafts)`` whenever the scheduler forms a loop op's drafts (engines made meanwhile
    run the interpreted scheduler, whose ``_draft`` is wrapped)."""
    cls = interpreted_scheduler()
    original = cls._draft

    def record(self: Scheduler, items: list[Item], width: int) -> list[Item]:
        drafts = original(self, items, width)
        seen(self, items, drafts)
        return drafts

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "_draft", record)
        mp.setattr(cdb_engine.engine, "Scheduler", cls)
        yield


_REFERENCES: dict[Case, list] = {}  # the sequential reference of each case's workload


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in vars(c).values()))
def test_speculation_changes_no_token_and_no_depth(case: Case, depth: int) -> None:
    rng = random.Random(zlib.crc32(repr(case).encode()))  # both draft depths serve one workload (one reference)
    model = model64(case.model)
    cfg = replace(
        case_config(case, rng), max_num_seqs=8, speculative="on", speculative_depth=depth, speculative_max_occupancy=1
    )
    work = [(p, replace(r, max_tokens=r.max_tokens + 8)) for p, r in workload(rng, 6)]  # greedy and sampled
    got, eng = run_engine(model, cfg, work)
    if case not in _REFERENCES:
        _REFERENCES[case] = run_reference(model, eng, work, cfg)
    want = _REFERENCES[case]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"request {i}: tokens differ"
        assert g[1] == w[1], f"request {i}: depths differ"
    stats = eng.sched_stats
    assert stats.spec_drafts > 0 and stats.spec_accepted + stats.spec_rejected > 0, "the workload should speculate"


def test_right_and_wrong_drafts_both_leave_exact_results_and_free_everything() -> None:
    """The shipped model at draft depth 1: some drafts are right (their work kept), some wrong (dropped, the
    successor restarted from the real token); either way the results are the reference's, and no row or KV block
    is held afterwards (``run_engine`` checks the invariants and the drained resources)."""
    model = model64("ouro-kjv")
    cfg = kjv_on(max_num_seqs=8, speculative_depth=1)
    rng = random.Random(4)
    work = [(p, replace(r, max_tokens=24)) for p, r in workload(rng, 4)]
    got, eng = run_engine(model, cfg, work)
    assert got == run_reference(model, eng, work, cfg)
    stats = eng.sched_stats
    assert stats.spec_accepted > 0 and stats.spec_rejected > 0 and stats.spec_wasted_steps > 0


def test_a_lone_stream_runs_fewer_loop_ops_per_token() -> None:
    """Light load: a successor that starts from a right draft runs while its predecessor still loops, so one
    request's tokens need far fewer loop ops than its loop steps (the latency of the chain)."""
    model = model64("ouro-kjv")
    work = [([random.Random(3).randrange(3, 259) for _ in range(12)], RequestParams(max_tokens=40, ignore_eos=True))]
    ops = {}
    outs = {}
    for spec in ("off", "on"):
        cfg = EngineConfig(model="ouro-kjv", dtype="float64", max_num_seqs=8, kv_block_size=4, speculative=spec)
        outs[spec], eng = run_engine(model, cfg, work)
        ops[spec] = eng.sched_stats.loop_steps
    assert outs["on"] == outs["off"]
    assert ops["on"] < 0.8 * ops["off"], ops


@pytest.mark.parametrize("kv_policy", ["single", "first_then_shared"])
def test_policies_whose_steps_read_the_final_kv_do_not_speculate(kv_policy: str) -> None:
    """``single`` (and ``first_then_shared`` past its private slots) reads a predecessor's final KV at every step:
    nothing can start early, so auto does not draft and on is refused at start, naming why."""
    model = model64("ouro-tiny")
    cfg = EngineConfig(model="ouro-tiny", dtype="float64", kv_policy=kv_policy, min_depth=2, kv_block_size=4)
    _, eng = run_engine(model, cfg, workload(random.Random(2), 3))
    assert eng.sched_stats.spec_drafts == 0
    with pytest.raises(ValueError, match="kv_policy"):
        Engine(replace(cfg, speculative="on"), shared_model_factory(model))


def test_huginn_does_not_speculate_and_on_is_refused() -> None:
    model = model64("huginn-tiny")
    cfg = EngineConfig(model="huginn-tiny", dtype="float64", kv_block_size=4)
    _, eng = run_engine(model, cfg, workload(random.Random(2), 3))
    assert eng.sched_stats.spec_drafts == 0
    with pytest.raises(ValueError, match="fused loop head"):
        Engine(replace(cfg, speculative="on"), shared_model_factory(model))


def test_requests_that_opt_out_or_count_their_tokens_do_not_speculate() -> None:
    """Per request: ``speculative=False`` opts out; penalized sampling (the stage counts every sampled token of
    the row) never drafts. The others do."""
    model = model64("ouro-kjv")
    cfg = kjv_on(max_num_seqs=8)
    prompt = [random.Random(1).randrange(3, 259) for _ in range(8)]
    penalized = SamplingParams(processing=LogitsProcessing(frequency_penalty=0.5))
    drafted: dict[int, int] = {}

    def count(sched: Scheduler, items: list[Item], drafts: list[Item]) -> None:
        for d in drafts:
            drafted[d.req.rid] = drafted.get(d.req.rid, 0) + 1

    params = [
        RequestParams(max_tokens=16, ignore_eos=True, speculative=False),
        RequestParams(max_tokens=16, ignore_eos=True, sampling=penalized),
        RequestParams(max_tokens=16, ignore_eos=True),
    ]
    with watching_drafts(count), Engine(cfg, shared_model_factory(model)) as eng:
        outs = eng.generate([prompt] * 3, params)
    rids = {o.request_id: int(o.request_id.split("-")[1]) for o in outs}
    assert drafted.get(rids[outs[0].request_id], 0) == 0
    assert drafted.get(rids[outs[1].request_id], 0) == 0
    assert drafted.get(rids[outs[2].request_id], 0) > 0
    assert outs[0].token_ids == outs[2].token_ids  # the same greedy request, with and without speculation


def test_no_draft_is_made_while_a_request_waits_for_admission() -> None:
    """Drafts take rows and loop width that admissions need: while any request waits, none is made."""
    model = model64("ouro-kjv")
    cfg = kjv_on(max_num_seqs=3)
    waiting_at_draft: list[int] = []

    def waiting(sched: Scheduler, items: list[Item], drafts: list[Item]) -> None:
        if drafts:
            waiting_at_draft.append(len(sched.waiting))

    work = [(p, replace(r, max_tokens=12)) for p, r in workload(random.Random(6), 8)]
    with watching_drafts(waiting):
        got, eng = run_engine(model, cfg, work)
    assert waiting_at_draft and set(waiting_at_draft) == {0}
    assert got == run_reference(model, eng, work, cfg)


def test_a_tiny_pool_preempts_speculating_requests_and_results_are_unchanged() -> None:
    model = model64("ouro-kjv")
    cfg = kjv_on(max_num_seqs=8, num_kv_blocks=20, prefill_chunk_size=16, prefill_token_budget=32)
    rng = random.Random(12)
    work = [
        ([rng.randrange(3, 259) for _ in range(rng.randint(10, 30))], RequestParams(max_tokens=12, ignore_eos=True))
        for _ in range(10)
    ]
    got, eng = run_engine(model, cfg, work)
    assert eng.sched_stats.preemptions > 0 and eng.sched_stats.spec_drafts > 0
    assert got == run_reference(model, eng, work, cfg)


def test_the_apis_carry_the_choice_and_info_reports_what_speculation_did() -> None:
    """gRPC ``GenerateRequest.speculative`` and the HTTP body's ``speculative`` reach the engine; a server that
    cannot speculate refuses ``true`` naming the field; ``Info`` reports the mode and the drafts' outcomes."""
    from cdb_api.v1 import generation_pb2 as pb
    from cdb_engine.errors import InvalidRequest
    from clients.messages import ServerInfo
    from services.api.messages import info_to_pb, request_to_engine
    from services.http.schemas import CompletionRequest

    _, on = request_to_engine(pb.GenerateRequest(text="x", speculative=True))
    _, unset = request_to_engine(pb.GenerateRequest(text="x"))
    assert (on.speculative, unset.speculative) == (True, None)
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": False})
    assert body.params(4, None).speculative is False

    model = model64("ouro-kjv")
    cfg = EngineConfig(model="ouro-kjv", dtype="float64", max_num_seqs=8, kv_block_size=4)
    finished: list[FinishEvent] = []
    done = threading.Event()

    def sink(ev: object) -> None:
        if isinstance(ev, FinishEvent):
            finished.append(ev)
            done.set()

    with Engine(cfg, shared_model_factory(model)) as eng:
        eng.submit([5, 6, 7, 8], RequestParams(max_tokens=24, ignore_eos=True), sink)
        assert done.wait(60)
        response = info_to_pb(eng, "in_process", 1)
        info = response.speculation
    assert ServerInfo.from_pb(response).speculation["accepted"] == info.accepted  # the clients' view
    (fin,) = finished  # the request's own counts (its span's cdb.speculative.* attributes)
    assert (fin.spec_drafts, fin.spec_accepted, fin.spec_rejected) == (info.drafts, info.accepted, info.rejected)
    assert (info.mode, info.unsupported, info.max_tokens, info.draft_depth) == ("auto", "", 4, 1)
    assert info.drafts > 0 and info.accepted + info.rejected > 0 and info.mean_draft_depth >= 1
    assert info.acceptance == pytest.approx(info.accepted / (info.accepted + info.rejected))

    single = EngineConfig(model="ouro-tiny", dtype="float64", kv_policy="single")
    with Engine(single, shared_model_factory(model64("ouro-tiny"))) as eng:
        with pytest.raises(InvalidRequest, match="kv_policy") as err:
            eng.validate([5, 6], RequestParams(speculative=True))
        assert err.value.field == "speculative"
        assert "kv_policy" in info_to_pb(eng, "in_process", 1).speculation.unsupported


def test_drafts_never_fill_a_loop_op_past_the_occupancy_bound() -> None:
    """``speculative_max_occupancy``: a loop op holds at most that fraction of the width once its drafts are in
    (a host path's cost per op grows with its tokens: drafts must not slow the other requests down)."""
    model = model64("ouro-kjv")
    cfg = EngineConfig(
        model="ouro-kjv", dtype="float64", max_num_seqs=8, kv_block_size=4, speculative_max_occupancy=0.5
    )
    widths: list[int] = []

    def width(sched: Scheduler, items: list[Item], drafts: list[Item]) -> None:
        if drafts:
            widths.append(len(items) + len(drafts))

    work = [(p, replace(r, max_tokens=16)) for p, r in workload(random.Random(8), 3)]
    with watching_drafts(width):
        got, eng = run_engine(model, cfg, work)
    assert widths and max(widths) <= 4
    assert got == run_reference(model, eng, work, cfg)


@pytest.mark.parametrize(("loop_cost", "pays"), [("loop=0:2000:0", False), ("loop=2000:0:0", True)])
def test_auto_drafts_only_where_a_loop_op_costs_about_the_same_at_any_width(loop_cost: str, pays: bool) -> None:
    """``speculative auto`` fits the loop op's cost against its width: on stages whose op costs per token (a CPU)
    a lone stream drafts only while it explores (until the first fit and a few verdicts), on stages whose op costs
    the same at any width (a GPU) it drafts and runs fewer loop ops; either way the tokens and depths are those
    without drafts."""
    cost = f"{loop_cost},head=20:0:0"
    outs, stats = {}, {}
    for spec in ("off", "auto"):
        cfg = EngineConfig(model="ouro-tiny", synthetic_cost=cost, synthetic_depths="3:2", speculative=spec)
        with Engine(cfg) as engine:
            [out] = engine.generate([[5, 6, 7]], RequestParams(max_tokens=48, ignore_eos=True))
            outs[spec], stats[spec] = (out.token_ids, out.depths), engine.sched_stats
    assert outs["auto"] == outs["off"]
    if pays:
        assert stats["auto"].spec_drafts > 20 and stats["auto"].ops[Stage.LOOP] < 0.8 * stats["off"].ops[Stage.LOOP]
    else:
        assert stats["auto"].spec_drafts <= MIN_VERDICTS + 1, "only the drafts that explored (cost, acceptance)"
