"""Causal order of stage results on its own (no process, no thread): a reply waits for the results of the ops it
was fenced on and for the earlier ops of its stage, goes straight through when nothing is held, and a loss or a
give-up leaves the book as the executor's outage handling reads it. Random interleavings of the stages' replies
(each stage answers in seq order, as its stream does) check the order against the rule itself."""

from __future__ import annotations

import random

import pytest

from cdb_scheduler.plan import Fence, Stage, StageResult
from services.transport.ordering import CausalOrder, Pending
from services.transport.watchdog import OldestOp

pytestmark = pytest.mark.timeout(30)

PRELUDE, LOOP, HEAD = Stage.PRELUDE, Stage.LOOP, Stage.HEAD


def send(order: CausalOrder, stage: Stage, seq: int, *fences: Fence, budget: float = 1.0) -> None:
    order.sent(stage, seq, Pending(tuple(fences), units=1, budget=budget))


def reply(order: CausalOrder, stage: Stage, seq: int, error: str | None = None) -> list[tuple[Stage, int]]:
    pending, released = order.replied(StageResult(stage, seq, 0.0, error=error))
    assert pending is not None
    return [(r.stage, r.seq) for r in released]


def test_a_reply_with_nothing_held_goes_straight_through() -> None:
    order = CausalOrder()
    send(order, LOOP, 0)
    send(order, HEAD, 0, Fence(LOOP, 0))
    assert reply(order, LOOP, 0) == [(LOOP, 0)]
    assert reply(order, HEAD, 0) == [(HEAD, 0)]


def test_a_reply_overtaking_its_fence_waits_for_it() -> None:
    order = CausalOrder()
    send(order, LOOP, 0)
    send(order, HEAD, 0, Fence(LOOP, 0))
    assert reply(order, HEAD, 0) == []  # the head op's reply came first: held
    assert reply(order, LOOP, 0) == [(LOOP, 0), (HEAD, 0)]


def test_a_stage_delivers_in_seq_order_and_a_failed_op_waits_only_for_its_stage() -> None:
    order = CausalOrder()
    send(order, LOOP, 0)
    send(order, HEAD, 0, Fence(LOOP, 0))
    send(order, HEAD, 1, Fence(LOOP, 0))
    assert reply(order, HEAD, 0) == []
    assert reply(order, HEAD, 1, error="boom") == []  # behind head op 0 of its own stage
    assert reply(order, LOOP, 0) == [(LOOP, 0), (HEAD, 0), (HEAD, 1)]
    send(order, LOOP, 1)
    send(order, HEAD, 2, Fence(LOOP, 1))
    assert reply(order, HEAD, 2, error="boom") == [(HEAD, 2)]  # its requests fail either way: not held


def test_a_reply_to_an_op_not_outstanding_is_void() -> None:
    order = CausalOrder()
    assert order.replied(StageResult(LOOP, 5, 0.0)) == (None, ())
    send(order, LOOP, 0)
    order.unsent(LOOP, 0)
    assert order.replied(StageResult(LOOP, 0, 0.0)) == (None, ())


def test_the_oldest_op_is_runnable_once_its_fences_are_delivered() -> None:
    order = CausalOrder()
    assert order.oldest(HEAD) is None
    send(order, LOOP, 0, budget=2.0)
    send(order, HEAD, 0, Fence(LOOP, 0), budget=3.0)
    assert order.budgets() == 5.0
    assert order.oldest(HEAD) == OldestOp(0, 1, runnable=False)
    reply(order, LOOP, 0)
    assert order.oldest(HEAD) == OldestOp(0, 1, runnable=True)


def test_a_loss_voids_every_op_and_counts_them_delivered() -> None:
    order = CausalOrder()
    send(order, LOOP, 0)
    send(order, LOOP, 1)
    send(order, HEAD, 0, Fence(LOOP, 1))
    assert reply(order, HEAD, 0) == []
    order.lose()
    assert order.void == {PRELUDE: -1, LOOP: 1, HEAD: 0}
    assert all(order.oldest(s) is None for s in Stage) and order.budgets() == 0
    order.voided(LOOP, 2)  # issued before the engine saw the loss
    assert order.void[LOOP] == 2
    send(order, HEAD, 1, Fence(LOOP, 2))  # fenced on a void op: runnable, delivered at once
    assert order.oldest(HEAD) == OldestOp(1, 1, runnable=True)
    assert reply(order, HEAD, 1) == [(HEAD, 1)]


def test_giving_up_returns_every_outstanding_op_per_stage() -> None:
    order = CausalOrder()
    for seq in (2, 0, 1):
        send(order, LOOP, seq)
    send(order, HEAD, 0)
    assert order.fail() == [(PRELUDE, []), (LOOP, [0, 1, 2]), (HEAD, [0])]
    assert order.oldest(LOOP) is None


@pytest.mark.parametrize("seed", range(20))
def test_random_replies_come_out_in_causal_order(seed: int) -> None:
    rng = random.Random(seed)
    order = CausalOrder()
    fences: dict[tuple[Stage, int], tuple[Fence, ...]] = {}
    next_seq = dict.fromkeys(Stage, 0)
    for _ in range(40):  # each op fenced on a random earlier op of another stage
        stage = rng.choice(list(Stage))
        others = [(s, n - 1) for s, n in next_seq.items() if s is not stage and n > 0]
        own = tuple(Fence(*rng.choice(others)) for _ in range(rng.randint(0, 1)) if others)
        fences[(stage, next_seq[stage])] = own
        send(order, stage, next_seq[stage], *own)
        next_seq[stage] += 1
    out: list[tuple[Stage, int]] = []
    replied = dict.fromkeys(Stage, 0)
    while left := [s for s in Stage if replied[s] < next_seq[s]]:  # each stage replies in seq order (its stream)
        stage = rng.choice(left)
        out += reply(order, stage, replied[stage])
        replied[stage] += 1
    assert sorted(out) == sorted(fences)  # every result delivered once
    position = {key: i for i, key in enumerate(out)}
    for (stage, seq), own in fences.items():
        assert seq == 0 or position[(stage, seq - 1)] < position[(stage, seq)]
        assert all(position[(f.stage, f.seq)] < position[(stage, seq)] for f in own)
