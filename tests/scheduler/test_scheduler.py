"""Scheduler core against a fake executor: decisions, queue discipline, resources, preemption."""

from __future__ import annotations

import random

import pytest

from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import FixedDepth, Horizon, OuroHazard
from cdb_scheduler.plan import LoopOp, Stage, StageOp
from cdb_scheduler.request import Finished, FinishReason, Request, TokenOut
from cdb_scheduler.scheduler import Scheduler
from tests.scheduler.fake import STOP_ID, FakeExecutor, expected, score

MAX_DEPTH = 4


def make_requests(rng: random.Random, n: int, horizon: Horizon, q: float = 0.5) -> list[Request]:
    reqs = []
    for rid in range(1, n + 1):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        reqs.append(
            Request(
                rid=rid,
                prompt=prompt,
                max_tokens=rng.randint(1, 12),
                policy=OuroHazard(q, MAX_DEPTH, 1, horizon),
                stop_token_ids=frozenset({STOP_ID}),
            )
        )
    return reqs


def drive(sched: Scheduler, ex: FakeExecutor, reqs: list[Request], arrivals: int = 1) -> dict[int, list]:
    """Run to completion, adding ``arrivals`` requests per round; checks invariants after every step."""
    events: dict[int, list] = {r.rid: [] for r in reqs}
    pending = list(reqs)
    for _ in range(100_000):
        for _ in range(arrivals):
            if pending:
                sched.add(pending.pop(0))
        for op in sched.schedule():
            ex.submit(op)
        sched.check_invariants()
        res = ex.poll(0)
        if res is None:
            if not pending and not sched.has_work():
                return events
            assert pending or sched.in_flight(), "scheduler stalled with work left"
            continue
        for ev in sched.on_result(res):
            events[ev.rid].append(ev)
        sched.check_invariants()
    raise AssertionError("did not drain")


def tokens_by_request(events: dict[int, list]) -> dict[int, list[tuple[int, int]]]:
    return {rid: [(e.token_id, e.depth) for e in evs if isinstance(e, TokenOut)] for rid, evs in events.items()}


def config(**kw) -> SchedulerConfig:
    base = dict(
        max_depth=MAX_DEPTH,
        max_num_seqs=8,
        num_kv_blocks=256,
        kv_block_size=4,
        prefill_chunk_size=16,
        prefill_token_budget=32,
        copy_on_exit=True,
    )
    base.update(kw)
    return SchedulerConfig(**base)


def check_against_expected(reqs: list[Request], events: dict[int, list]) -> None:
    for r in reqs:
        toks = [e for e in events[r.rid] if isinstance(e, TokenOut)]
        fin = [e for e in events[r.rid] if isinstance(e, Finished)]
        assert len(fin) == 1 and fin[0].reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert [e.index for e in toks] == list(range(len(toks))), "tokens must leave in order"
        want_tokens, want_depths = expected(r.rid, r.prompt_len, r.max_tokens, r.policy)
        assert [e.token_id for e in toks] == want_tokens
        assert [e.depth for e in toks] == want_depths


@pytest.mark.parametrize("mode", [Mode.CDB, Mode.NO_REFILL])
@pytest.mark.parametrize("horizon", [Horizon.ONE_AHEAD, Horizon.SAME_STEP])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_and_depths_equal_sequential_semantics(mode: Mode, horizon: Horizon, seed: int) -> None:
    rng = random.Random(seed)
    reqs = make_requests(rng, 30, horizon)
    sched, ex = Scheduler(config(mode=mode)), FakeExecutor()
    events = drive(sched, ex, reqs, arrivals=rng.randint(1, 4))
    check_against_expected(reqs, events)
    assert sched.rows.num_used == 0 and sched.blocks.num_used == 0, "resources leaked after drain"


def test_full_depth_mode_serves_every_token_at_max_depth() -> None:
    reqs = make_requests(random.Random(3), 12, Horizon.ONE_AHEAD)
    sched, ex = Scheduler(config(mode=Mode.FULL_DEPTH)), FakeExecutor()
    events = drive(sched, ex, reqs)
    depths = {e.depth for evs in events.values() for e in evs if isinstance(e, TokenOut)}
    assert depths == {MAX_DEPTH}


def test_one_ahead_keeps_two_loop_ops_in_flight() -> None:
    reqs = make_requests(random.Random(4), 16, Horizon.ONE_AHEAD)
    ex = FakeExecutor()
    drive(Scheduler(config()), ex, reqs, arrivals=16)
    assert ex.max_loop_in_flight == 2


def test_emit_hands_out_each_op_in_issue_order_and_a_loop_op_before_the_rest_of_its_round() -> None:
    reqs = make_requests(random.Random(5), 24, Horizon.ONE_AHEAD)
    sched, ex = Scheduler(config()), FakeExecutor()  # (the engine's tests cover it with the fused head)
    pending, emitted, formed_after = list(reqs), [], 0
    events: dict[int, list] = {r.rid: [] for r in reqs}

    def emit(op: StageOp) -> None:  # with the next seq of every stage when it left: what was planned by then
        emitted.append((op, [sched.ops.next_seq(stage) for stage in Stage]))
        ex.submit(op)

    while pending or sched.has_work():
        if pending:
            sched.add(pending.pop(0))
        before = len(emitted)
        ops = sched.schedule(emit)
        assert [op for op, _ in emitted[before:]] == ops  # every op, once, in issue order
        left: list[int] | None = None  # the stages' next seqs when this round's last decode loop op left
        for op, next_seqs in emitted[before:]:
            if left is not None:
                assert op.seq >= left[op.stage]  # formed after the loop op had left
                formed_after += 1
            if isinstance(op, LoopOp) and not op.prefill:  # (a prefill chain's loop op is formed with its chain)
                left = next_seqs
        sched.check_invariants()
        res = ex.poll(0)
        for ev in sched.on_result(res) if res is not None else ():
            events[ev.rid].append(ev)
    assert formed_after > 0  # (rounds that plan more after their loop op are exercised)
    check_against_expected(reqs, events)


def test_same_step_exits_one_step_earlier_than_one_ahead() -> None:
    for horizon, shift in [(Horizon.SAME_STEP, 0), (Horizon.ONE_AHEAD, 1)]:
        reqs = make_requests(random.Random(5), 6, horizon)
        events = drive(Scheduler(config()), FakeExecutor(), reqs)
        for r in reqs:
            same = OuroHazard(0.5, MAX_DEPTH, 1, Horizon.SAME_STEP)
            _, base = expected(r.rid, r.prompt_len, r.max_tokens, same)
            got = [e.depth for e in events[r.rid] if isinstance(e, TokenOut)]
            assert got[1:] == [min(d + shift, MAX_DEPTH) for d in base[1 : len(got)]]


def test_refill_joins_running_loop_in_cdb_but_waits_for_the_wave_in_no_refill() -> None:
    for mode in (Mode.CDB, Mode.NO_REFILL):
        reqs = make_requests(random.Random(6), 16, Horizon.ONE_AHEAD)
        sched, ex = Scheduler(config(mode=mode)), FakeExecutor()
        drive(sched, ex, reqs, arrivals=16)
        loops = [op for op in ex.submitted if isinstance(op, LoopOp) and not op.prefill]
        mixed = sum(1 for op in loops if 0 in op.steps and any(s > 0 for s in op.steps))
        if mode is Mode.CDB:
            assert mixed > 0 and sched.stats.refill_events > 0
        else:
            assert mixed == 0, "no-refill must not mix a new token into a running wave"


def test_tiny_kv_pool_forces_preemption_and_results_are_unchanged() -> None:
    rng = random.Random(7)
    reqs = make_requests(rng, 20, Horizon.ONE_AHEAD)
    for r in reqs:
        r.max_tokens = 12
    sched = Scheduler(config(num_kv_blocks=24, kv_block_size=4, kv_margin=0.0))
    events = drive(sched, FakeExecutor(), reqs, arrivals=20)
    assert sched.stats.preemptions > 0
    check_against_expected(reqs, events)


@pytest.mark.parametrize("blocks", [256, 24])  # 24: preemptions recompute requests mid-prefill and after it
def test_scored_prompts_report_each_prompt_logprob_once_and_max_tokens_zero_ends_after_prefill(blocks: int) -> None:
    rng = random.Random(11)
    reqs = make_requests(rng, 24, Horizon.ONE_AHEAD)
    for r in reqs:
        r.score_prompt = r.rid % 3 != 0
        r.max_tokens = 0 if r.rid % 4 == 0 else 12
    sched = Scheduler(config(num_kv_blocks=blocks, kv_margin=0.0))
    events = drive(sched, FakeExecutor(), reqs, arrivals=24)
    assert blocks > 24 or sched.stats.preemptions > 0
    for r in reqs:
        want = [score(r.rid, p, r.prompt[p + 1]) for p in range(r.prompt_len - 1)] if r.score_prompt else []
        assert r.prompt_logprobs == want, r.rid
        if r.max_tokens == 0:
            assert [(type(e), e.reason) for e in events[r.rid]] == [(Finished, FinishReason.LENGTH)]  # type: ignore[union-attr]
    check_against_expected([r for r in reqs if r.max_tokens > 0], events)
    assert sched.rows.num_used == 0 and sched.blocks.num_used == 0, "resources leaked after drain"


def test_abort_frees_row_and_blocks_at_once() -> None:
    reqs = make_requests(random.Random(8), 4, Horizon.ONE_AHEAD)
    for r in reqs:
        r.max_tokens = 50
        r.stop_token_ids = frozenset()
    sched, ex = Scheduler(config()), FakeExecutor()
    for r in reqs:
        sched.add(r)
    for _ in range(40):
        for op in sched.schedule():
            ex.submit(op)
        res = ex.poll(0)
        if res is not None:
            sched.on_result(res)
    assert len(sched.running) == 4
    for r in reqs:
        (ev,) = sched.abort(r.rid)
        assert isinstance(ev, Finished) and ev.reason is FinishReason.CANCELLED
        sched.check_invariants()
    assert sched.rows.num_used == 0 and sched.blocks.num_used == 0
    while (res := ex.poll(0)) is not None:  # late results of aborted requests are dropped
        assert sched.on_result(res) == []
    assert sched.schedule() == []


def test_fences_order_head_after_the_loop_op_that_wrote_the_row() -> None:
    reqs = make_requests(random.Random(9), 5, Horizon.ONE_AHEAD)
    ex = FakeExecutor()
    drive(Scheduler(config()), ex, reqs)
    heads = [op for op in ex.submitted if op.stage is Stage.HEAD]
    assert heads and all(any(f.stage is Stage.LOOP for f in op.fences) for op in heads)


def test_fixed_depth_tokens_may_run_in_consecutive_ops_without_waiting() -> None:
    reqs = make_requests(random.Random(10), 3, Horizon.ONE_AHEAD)
    for r in reqs:
        r.policy = FixedDepth(MAX_DEPTH, MAX_DEPTH)
    ex = FakeExecutor()
    drive(Scheduler(config()), ex, reqs, arrivals=3)
    assert ex.max_loop_in_flight == 2


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_concurrent_stages_deliver_results_out_of_submission_order(seed: int) -> None:
    """Stages as separate processes: results of different stages overtake each other; nothing changes."""
    for mode in (Mode.CDB, Mode.NO_REFILL):
        runs = {}
        for concurrent in (False, True):
            reqs = make_requests(random.Random(seed), 24, Horizon.ONE_AHEAD)
            sched = Scheduler(config(mode=mode, num_kv_blocks=40, kv_margin=0.0))
            ex = FakeExecutor(random.Random(seed) if concurrent else None)
            if concurrent:  # (as the engine sets it for such an executor)
                sched.stage_progress = ex.done.__getitem__
            events = drive(sched, ex, reqs, arrivals=3)
            check_against_expected(reqs, events)
            runs[concurrent] = ex.overtakes(), tokens_by_request(events)
        (in_order, want), (overtakes, got) = runs[False], runs[True]
        assert in_order == [], "one stream in submission order delivers nothing early"
        assert overtakes, "no result overtook an earlier submitted op"
        assert all(later.stage != earlier.stage for later, earlier in overtakes), "a stage ran its ops out of order"
        assert got == want


class _WaitRecorder(FakeExecutor):
    """Concurrent stages that record, for each decode loop op as it is submitted, how many of its rows wait for a
    prelude or head op submitted since the loop op before it and still running (such an op waits for that loop op:
    the loop stage would idle through the whole chain), and how many rows it has."""

    def __init__(self, rng: random.Random, times: tuple[float, float, float]) -> None:
        super().__init__(rng, times)
        self.waits: list[tuple[int, int]] = []

    def submit(self, op: StageOp) -> None:
        if isinstance(op, LoopOp) and not op.prefill:
            since = max((i for i, o in enumerate(self.submitted) if o.stage is Stage.LOOP), default=-1)
            # (a stage runs its ops in order: a fence on op f waits for every op of that stage up to f)
            upto = {f.stage: f.seq for f in op.fences if f.stage is not Stage.LOOP}
            pending = [o for o in self.submitted[since + 1 :] if self.done[o.stage] < o.seq <= upto.get(o.stage, -1)]
            written = {row for o in pending for row in o.rows}
            self.waits.append((len(written & set(op.rows)), len(op.rows)))
        super().submit(op)


def _run_refills(fuse_refill_embed: bool, times: tuple[float, float, float], concurrent: bool) -> _WaitRecorder:
    reqs = make_requests(random.Random(11), 40, Horizon.ONE_AHEAD)
    sched = Scheduler(config(fuse_refill_embed=fuse_refill_embed))
    ex = _WaitRecorder(random.Random(11), times)
    if concurrent:  # (as the engine sets it for an executor whose stages run concurrently)
        sched.stage_progress = ex.done.__getitem__
    check_against_expected(reqs, drive(sched, ex, reqs, arrivals=8))
    return ex


# (prelude, loop, head) compute seconds: refills through prelude ops after the head, or embedded by a slow head
@pytest.mark.parametrize(("fuse_refill_embed", "times"), [(False, (0.001, 0.002, 0.001)), (True, (0.0, 0.002, 0.003))])
def test_with_concurrent_stages_ready_tokens_do_not_wait_behind_a_refills_long_chain(
    fuse_refill_embed: bool, times: tuple[float, float, float]
) -> None:
    """A refill's prelude (or the head op embedding it) waits for the loop op its predecessor left: the loop op
    formed right after would idle the loop stage through that chain. Where the chain takes as long as a loop op,
    tokens ready to run never wait for it (the refills join the next op), unless nothing else is ready; results
    are unchanged."""
    held = _run_refills(fuse_refill_embed, times, concurrent=False).waits
    assert any(0 < w < n for w, n in held), "no loop op held ready tokens behind a refill (the case is not exercised)"
    waits = _run_refills(fuse_refill_embed, times, concurrent=True).waits
    assert all(w in (0, n) for w, n in waits), "ready tokens waited behind a refill's chain"
    assert any(w > 0 for w, _ in waits), "refills never ran fenced, even with nothing else to run"


def test_with_concurrent_stages_a_short_chain_changes_no_op() -> None:
    """Where a refill's writer is short against a loop op (Ouro's head: final norm and LM head), waiting for it costs
    less than leaving the refill out for an op: every op is formed as with an in-order executor."""
    times = (0.0, 0.002, 0.0001)
    ops = [_run_refills(True, times, concurrent).submitted for concurrent in (False, True)]
    formed = [[(o.stage, o.seq, sorted(o.rows), o.fences) for o in run] for run in ops]  # (rows in any order)
    assert formed[0] == formed[1]


@pytest.mark.parametrize("mode", [Mode.CDB, Mode.NO_REFILL])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovery_from_stage_losses_gives_the_sequential_tokens_once_and_frees_everything(
    mode: Mode, seed: int
) -> None:
    """Stage losses at random points (every op in flight void, as after a stage died): each running request is
    recomputed, and every request still streams exactly its sequential tokens and depths, in order, once."""
    rng = random.Random(100 + seed)
    reqs = make_requests(rng, 30, Horizon.ONE_AHEAD)
    sched, ex = Scheduler(config(mode=mode)), FakeExecutor(rng)
    events: dict[int, list] = {r.rid: [] for r in reqs}
    pending, losses = list(reqs), 0
    for _ in range(200_000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        for op in sched.schedule():
            ex.submit(op)
        if sched.running and rng.random() < 0.03:  # a stage dies: nothing in flight comes back
            for op in ex.queue:
                ex.done[op.stage] = max(ex.done[op.stage], op.seq)
            ex.queue.clear()
            assert sched.recover() == []
            losses += 1
            sched.check_invariants()
            assert sched.rows.num_used == 0 and sched.blocks.num_used == 0 and sched.in_flight() == 0
            continue
        res = ex.poll(0)
        if res is None:
            if not pending and not sched.has_work():
                break
            continue
        for ev in sched.on_result(res):
            events[ev.rid].append(ev)
        sched.check_invariants()
    else:
        raise AssertionError("did not drain")
    assert losses >= 2 and sched.stats.recoveries == losses and sched.stats.recomputed > 0
    check_against_expected(reqs, events)
    assert sched.rows.num_used == 0 and sched.blocks.num_used == 0
