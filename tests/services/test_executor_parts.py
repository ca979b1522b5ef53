"""The executor's small parts on their own: the measurement probe (the default measures nothing and only sends;
``OpTimes`` times each op for an observer; ``HopLog`` stamps the hand-overs) and the result queue's straight lane
(a result the poller's own read releases comes back at once, never ahead of one queued before it)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from cdb_scheduler.plan import Stage, StageLoss, StageOp, StageResult
from services.telemetry.probe import NO_PROBE, HopLog, OpTimes
from services.transport.results import ResultQueue
from tests.services.test_stage_protocol import loop_op

pytestmark = pytest.mark.timeout(30)

LOOP = Stage.LOOP


class Observer:
    def __init__(self) -> None:
        self.done: list[tuple[int, str | None, bool]] = []

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str]:
        return {rid: "ctx" for rid in op.rids}

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        self.done.append((op.seq, result.error, sent_ns <= done_ns))


def refuse(wire: str) -> None:
    raise ValueError("too large")


def test_the_default_probe_only_sends() -> None:
    sent: list[str] = []
    assert NO_PROBE.contexts_for_op(loop_op(0, (1,))) is None
    NO_PROBE.send(sent.append, "wire", loop_op(0, (1,)))
    NO_PROBE.polled(StageResult(LOOP, 0, 0.0))
    assert sent == ["wire"]


def test_op_times_report_each_polled_op_once_and_nothing_void_or_unsent() -> None:
    observer = Observer()
    times = OpTimes(observer)
    assert times.contexts_for_op(loop_op(0, (3,))) == {3: "ctx"}
    sent: list[str] = []
    times.send(sent.append, "wire", loop_op(0, (3,)))
    times.queued(loop_op(1, (3,)))  # waits for the stages: timed from now
    with pytest.raises(ValueError):
        times.send(refuse, "wire", loop_op(2, (3,)))
    for seq in (0, 1, 2, 0):
        times.polled(StageResult(LOOP, seq, 0.0, error="too large" if seq == 2 else None))
    assert observer.done == [(0, None, True), (1, None, True)]  # op 2 never went out; op 0 is told once
    times.send(sent.append, "wire", loop_op(3, (3,)))
    times.lost()
    times.polled(StageResult(LOOP, 3, 0.0))
    assert len(observer.done) == 2 and sent == ["wire", "wire"]


def test_the_hop_log_stamps_sends_and_polled_replies() -> None:
    hops = HopLog(size=4)
    hops.send(lambda wire: None, b"", loop_op(7, (1,)))
    ((stage, seq, written, cpu),) = hops.sent
    assert (stage, seq) == (LOOP, 7) and written > 0 and cpu >= 0
    hops.read(LOOP, 7, (10, 20))
    hops.polled(StageResult(LOOP, 8, 0.0))  # never read from a ring: no line
    hops.polled(StageResult(LOOP, 7, 0.0))
    (line,) = hops.replies
    assert line[:4] == (LOOP, 7, 10, 20) and line[4] > 20


class Bell:
    """A doorbell that never sleeps (``ResultQueue`` reads its word, waits on it, rings it)."""

    name = "bell"

    def __init__(self) -> None:
        self.rings = 0

    def word(self) -> int:
        return self.rings

    def wait(self, word: int, timeout_s: float) -> None:
        pass

    def ring(self) -> None:
        self.rings += 1

    def close(self) -> None:
        pass


def result(seq: int) -> StageResult:
    return StageResult(LOOP, seq, 0.0)


def test_a_result_released_by_the_pollers_read_comes_straight_back() -> None:
    bell = Bell()
    results = ResultQueue(bell)  # type: ignore[arg-type]
    replies = [[result(0), result(1)]]

    def read() -> int:
        if not replies:
            return 0
        results.release(replies.pop(), poller=True)
        return 2

    assert results.next(0.1, read) == result(0)
    assert results.next(0.1, read) == result(1)
    assert results.next(0.0, read) is None and bell.rings == 0  # nothing posted: no ring


def test_the_straight_lane_never_overtakes_what_was_queued_before() -> None:
    bell = Bell()
    results = ResultQueue(bell)  # type: ignore[arg-type]
    loss = StageLoss("gone")
    results.post(loss)
    results.release([result(0)], poller=True)  # queued before: behind the loss
    results.release([result(1)], poller=False)  # another thread's read: queued, and the poller woken
    assert bell.rings == 2
    assert [results.next(0.0, lambda: 0) for _ in range(4)] == [loss, result(0), result(1), None]
    results.release([result(2)], poller=True)  # the queue is empty now: straight
    results.post(loss)
    results.release([result(3)], poller=True)  # the lane holds a result: behind it, ahead of the loss
    assert [results.next(0.0, lambda: 0) for _ in range(3)] == [result(2), result(3), loss]


def test_without_a_doorbell_results_wait_in_the_queue() -> None:
    results = ResultQueue(None)
    results.release([result(0)], poller=False)
    results.post(StageLoss("gone"))
    assert results.next(0.1, lambda: 0) == result(0)
    assert isinstance(results.next(0.1, lambda: 0), StageLoss)
    assert results.next(0.0, lambda: 0) is None
