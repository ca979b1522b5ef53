"""Request priorities (vLLM's meaning: lower first): the waiting queue is ordered by priority, then arrival; a
preemption takes the least urgent running request; a recovery's recomputations stay first within their priority.
The tokens of every request are what they are without priorities."""

from __future__ import annotations

import random

from cdb_scheduler.exit_policy import Horizon
from cdb_scheduler.request import Request, Status
from cdb_scheduler.scheduler import Scheduler
from tests.scheduler.fake import FakeExecutor
from tests.scheduler.test_scheduler import check_against_expected, config, drive, make_requests


def _requests(priorities: list[int], seed: int = 5) -> list[Request]:
    reqs = make_requests(random.Random(seed), len(priorities), Horizon.ONE_AHEAD)
    for req, priority in zip(reqs, priorities, strict=True):
        req.priority = priority
    return reqs


def test_the_waiting_queue_is_ordered_by_priority_then_arrival_and_admits_in_that_order() -> None:
    priorities = [0, 5, -1, 5, 0, -1]
    queued = Scheduler(config(max_num_seqs=1))
    for req in _requests(priorities):
        queued.add(req)
    assert [r.rid for r in queued.waiting] == [3, 6, 1, 5, 2, 4]
    reqs = _requests(priorities)
    sched = Scheduler(config(max_num_seqs=1))
    events = drive(sched, FakeExecutor(), reqs, arrivals=len(reqs))  # (all queued before the first plan)
    check_against_expected(reqs, events)
    first = sorted(reqs, key=lambda r: r.admitted)  # one row: each request runs alone, in queue order
    assert [r.rid for r in first] == [3, 6, 1, 5, 2, 4]


def _run_until(sched: Scheduler, ex: FakeExecutor, done: object) -> None:
    for _ in range(10_000):
        if done():  # type: ignore[operator]
            return
        for op in sched.schedule():
            ex.submit(op)
        res = ex.poll(0)
        if res is not None:
            sched.on_result(res)
    raise AssertionError("not reached")


def test_a_preemption_takes_the_least_urgent_running_request_and_requeues_it_ahead_of_its_priority() -> None:
    urgent, relaxed, waiting_same = _requests([0, 2, 2])
    for req in (urgent, relaxed, waiting_same):
        req.max_tokens = 12
    urgent.prompt, relaxed.prompt = [7, 8], list(range(1, 31))  # the urgent one has the fewest tokens computed
    sched, ex = Scheduler(config(max_num_seqs=2)), FakeExecutor()
    sched.add(urgent)
    sched.add(relaxed)
    _run_until(sched, ex, lambda: len(sched.running) == 2 and all(r.output for r in sched.running.values()))
    sched.add(waiting_same)
    assert sched.residency.preempt_one()
    assert (urgent.num_preemptions, relaxed.num_preemptions) == (0, 1), "the less urgent one, not the fewest tokens"
    assert [r.rid for r in sched.waiting] == [relaxed.rid, waiting_same.rid], "ahead of its priority's arrivals"
    sched.check_invariants()


def test_an_urgent_arrival_takes_the_row_of_the_least_urgent_running_request_at_once() -> None:
    """All rows held by requests of priority 2 and 1: one of priority 2 (no more urgent than any) waits; one of
    priority 0 is admitted in the next round, the least urgent running one recomputed later (ahead of its
    priority)."""
    low, mid, same, urgent = _requests([2, 1, 2, 0])
    for req in (low, mid, same, urgent):
        req.max_tokens = 40
        req.stop_token_ids = frozenset()
    sched, ex = Scheduler(config(max_num_seqs=2)), FakeExecutor()
    sched.add(low)
    sched.add(mid)
    _run_until(sched, ex, lambda: len(sched.running) == 2 and all(r.output for r in sched.running.values()))
    sched.add(same)
    for op in sched.schedule():
        ex.submit(op)
    assert same.status is Status.WAITING and sched.stats.preemptions == 0, "no more urgent: it waits for a row"
    sched.add(urgent)
    for op in sched.schedule():
        ex.submit(op)
    assert urgent.status is Status.RUNNING and low.status is Status.WAITING and mid.status is Status.RUNNING
    assert [r.rid for r in sched.waiting] == [low.rid, same.rid] and sched.stats.preemptions == 1
    sched.check_invariants()
    _run_until(sched, ex, lambda: not sched.has_work())
    sched.check_invariants()


def test_a_recovery_keeps_the_priority_order_with_recomputations_first_within_theirs() -> None:
    a, b, c, d = _requests([1, 0, 1, 0])
    sched, ex = Scheduler(config(max_num_seqs=2)), FakeExecutor()
    sched.add(a)
    sched.add(c)
    _run_until(sched, ex, lambda: len(sched.running) == 2)
    sched.add(b)
    sched.add(d)
    sched.recover()
    assert [r.rid for r in sched.waiting] == [b.rid, d.rid, a.rid, c.rid]
    assert all(r.status is Status.WAITING for r in (a, b, c, d))


def test_priorities_change_no_token_and_a_tiny_pool_preempts_the_least_urgent_first() -> None:
    rng = random.Random(7)
    reqs = make_requests(rng, 20, Horizon.ONE_AHEAD)
    for r in reqs:
        r.max_tokens, r.priority = 12, r.rid % 2
    sched = Scheduler(config(num_kv_blocks=24, kv_block_size=4, kv_margin=0.0))
    events = drive(sched, FakeExecutor(), reqs, arrivals=20)
    check_against_expected(reqs, events)
    preempted = {p: sum(r.num_preemptions for r in reqs if r.priority == p) for p in (0, 1)}
    assert preempted[1] > 0 and preempted[1] >= preempted[0], preempted
