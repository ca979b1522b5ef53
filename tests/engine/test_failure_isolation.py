"""A failure stays with its request: an op that cannot be sent fails the requests in it and nothing else
(``cdb_engine.isolation``), and an engine loop that cannot go on fails every live request and then tells its owner
(``Engine(on_fatal=...)``), which in a server ends the process."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.errors import EngineStopped
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_engine.inprocess import InProcessExecutor
from cdb_engine.isolation import IsolatingExecutor, isolating, stand_in
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Fence, HeadOp, KVUpdate, LoopOp, Stage, StageLoss, StageOp, StageResult
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams
from cdb_scheduler.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)

CFG = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=128, kv_block_size=8, num_threads=1)
MARK = 424242  # a top_k that no real request here uses: the flaky executor refuses ops carrying it


class FakeExecutor:
    """Completes every submitted op in order; ``submit`` raises for the seqs in ``refuse``."""

    concurrent_stages = False

    def __init__(self, refuse: Callable[[StageOp], bool]) -> None:
        self.refuse = refuse
        self.submitted: list[StageOp] = []
        self.results: queue.SimpleQueue[StageResult | StageLoss] = queue.SimpleQueue()

    def submit(self, op: StageOp) -> None:
        if self.refuse(op):
            raise ValueError("Value out of range")
        self.submitted.append(op)
        self.results.put(StageResult(op.stage, op.seq, 0.001))

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def head_op(seq: int, top_k: int) -> HeadOp:
    return HeadOp(
        seq=seq,
        fences=(Fence(Stage.LOOP, seq),),
        kv_updates=(KVUpdate(7, (3,)),),
        released=(5,),
        rids=(7, 8),
        positions=(4, 9),
        rows=(0, 1),
        sample=(True, True),
        sampling=(SamplingParams(top_k=top_k), SamplingParams()),
        token_index=(0, 3),
    )


def test_an_op_that_cannot_be_sent_fails_alone_and_a_stand_in_keeps_its_seq() -> None:
    inner = FakeExecutor(lambda op: isinstance(op, HeadOp) and any(s.top_k == MARK for s in op.sampling))
    ex = IsolatingExecutor(inner)
    for op in (head_op(1, 0), head_op(2, MARK), head_op(3, 0)):
        ex.submit(op)  # never raises
    got = [ex.poll(0) for _ in range(3)]
    assert [(r.seq, r.error is None) for r in got if isinstance(r, StageResult)] == [(1, True), (2, False), (3, True)]
    failed = got[1]
    assert isinstance(failed, StageResult) and "head op 2 could not be sent: ValueError" in (failed.error or "")
    sent = inner.submitted[1]
    assert isinstance(sent, HeadOp) and sent.seq == 2 and sent.rows == () and sent.sampling == ()
    assert (sent.fences, sent.kv_updates, sent.released) == (
        (Fence(Stage.LOOP, 2),),
        (KVUpdate(7, (3,)),),
        (5,),
    )


def test_when_the_stand_in_cannot_be_sent_either_the_failure_is_delivered_directly() -> None:
    ex = IsolatingExecutor(FakeExecutor(lambda op: op.seq == 2))
    ex.submit(head_op(1, 0))
    ex.submit(head_op(2, 0))
    first, second = ex.poll(0), ex.poll(0)
    assert isinstance(first, StageResult) and first.seq == 2 and first.error
    assert isinstance(second, StageResult) and second.seq == 1 and second.error is None


def test_a_stand_in_carries_every_stage_kind_without_tokens() -> None:
    loop = LoopOp(1, (), (), (), rids=(1,), positions=(2,), rows=(0,), steps=(0,), prefill=True, num_steps=4)
    empty = stand_in(loop)
    assert isinstance(empty, LoopOp) and empty.rows == () and empty.prefill and empty.num_steps == 4


def run(engine: Engine, ids: list[int], params: RequestParams) -> tuple[list[TokenEvent], FinishEvent]:
    """Submit and wait for the request's finish (events arrive on the engine thread)."""
    tokens: list[TokenEvent] = []
    done: queue.SimpleQueue[FinishEvent] = queue.SimpleQueue()

    def sink(ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            tokens.append(ev)
        else:
            done.put(ev)

    engine.submit(ids, params, sink)
    return tokens, done.get(timeout=60)


def test_a_request_whose_op_cannot_be_sent_fails_and_the_others_are_untouched() -> None:
    long = RequestParams(max_tokens=24, ignore_eos=True)
    marked = RequestParams(max_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_k=MARK))
    with Engine(CFG) as clean:
        expected, _ = run(clean, [10, 11, 12], long)

    def flaky(setup: StageSetup) -> InProcessExecutor:
        class Flaky(InProcessExecutor):
            def submit(self, op: StageOp) -> None:
                if isinstance(op, HeadOp) and any(s.top_k == MARK for s in op.sampling):
                    raise ValueError("Value out of range")
                super().submit(op)

        return Flaky(setup, num_threads=1)

    with Engine(CFG, executor_factory=isolating(flaky)) as engine:
        other_tokens: list[TokenEvent] = []
        other_done: queue.SimpleQueue[FinishEvent] = queue.SimpleQueue()
        started = threading.Event()

        def sink(ev: Event) -> None:
            if isinstance(ev, TokenEvent):
                other_tokens.append(ev)
                started.set()
            else:
                other_done.put(ev)

        engine.submit([10, 11, 12], long, sink)
        assert started.wait(60)  # the other request is decoding: the marked one is prefilled on its own
        _, failed = run(engine, [20, 21], marked)
        assert failed.finish_reason is FinishReason.ERROR and "could not be sent" in (failed.error or "")
        finish = other_done.get(timeout=60)
        assert finish.finish_reason is FinishReason.LENGTH
        assert [t.token_id for t in other_tokens] == [t.token_id for t in expected]
        assert engine.stats().healthy
        after, done = run(engine, [10, 11, 12], long)
        assert done.finish_reason is FinishReason.LENGTH and [t.token_id for t in after] == [
            t.token_id for t in expected
        ]


class _FailsOnceRunning:
    """A scheduler whose planning raises once a request runs; everything else is the wrapped one's."""

    def __init__(self, inner: Scheduler) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def schedule(self, emit: Callable[[StageOp], None] | None = None) -> list[StageOp]:
        if self._inner.running:
            raise RuntimeError("injected scheduler failure")
        return self._inner.schedule(emit)


def test_an_engine_loop_that_fails_fails_every_live_request_then_calls_on_fatal() -> None:
    order: list[str] = []
    fatal = threading.Event()

    def on_fatal(error: str) -> None:
        order.append(f"fatal: {error}")
        fatal.set()

    engine = Engine(CFG, on_fatal=on_fatal)
    engine.scheduler = cast(Scheduler, _FailsOnceRunning(engine.scheduler))  # (a compiled class takes no patch)
    engine.start()
    try:

        def sink(ev: Event) -> None:  # on the engine thread, like on_fatal: the order is the engine's
            if isinstance(ev, FinishEvent):
                order.append(f"request: {ev.finish_reason}")

        engine.submit([10, 11, 12], RequestParams(max_tokens=8), sink)
        assert fatal.wait(30)
        assert order == [
            "request: error",
            "fatal: engine loop failed: RuntimeError: injected scheduler failure",
        ]
        assert not engine.stats().healthy
        with pytest.raises(EngineStopped):
            engine.submit([1, 2], RequestParams(), lambda ev: None)
    finally:
        engine.shutdown()
