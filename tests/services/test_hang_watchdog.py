"""The hang watchdog: its rule on a made-up clock, the process identity it kills by, and the executor declaring a
stage stuck inside an op (while its gRPC server answers) lost, with fence waits bounded by the batch's own limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cdb_scheduler.plan import Fence, LoopHead, Stage, StageLoss, StageResult
from cdb_scheduler.sampling import SamplingParams
from services.transport.executor import GrpcExecutor
from services.transport.watchdog import (
    HangWatch,
    OldestOp,
    ProcessId,
    is_stopped,
    kill,
    op_units,
    process,
    this_process,
)
from tests.services.stage_harness import FAST, FakeWorker, fake_model, fake_setup, stage_servers
from tests.services.test_stage_protocol import head_op, loop_op, poll_all, poll_loss

pytestmark = pytest.mark.timeout(60)

LOOP, HEAD = Stage.LOOP, Stage.HEAD


def only(stage: Stage, op: OldestOp | None) -> dict[Stage, OldestOp | None]:
    return {s: (op if s is stage else None) for s in Stage}


def test_an_op_past_max_floor_and_factor_times_pace_times_units_hangs_its_stage() -> None:
    watch = HangWatch(floor_s=1.0, factor=10.0)
    op = OldestOp(seq=0, units=8, runnable=True)
    assert watch.check(0.0, only(LOOP, op)) is None  # first seen runnable: its clock starts
    assert watch.check(0.99, only(LOOP, op)) is None
    hang = watch.check(1.01, only(LOOP, op))  # no reply yet: the floor alone
    assert hang is not None and hang.stage is LOOP and "op 0 has run 1.0s" in hang.why

    watch = HangWatch(floor_s=1.0, factor=10.0)
    watch.on_reply(LOOP, units=4, compute_s=0.4)  # 0.1 s per unit
    watch.on_reply(LOOP, units=100, compute_s=0.1)  # faster; the slowest recent pace counts
    assert watch.budget(LOOP, 8) == pytest.approx(8.0)  # 10 x 0.1 x 8
    assert watch.budget(LOOP, 1) == 1.0 and watch.budget(HEAD, 1000) == 1.0  # the floor; another stage's pace
    assert watch.check(10.0, only(LOOP, op)) is None
    assert watch.check(17.9, only(LOOP, op)) is None
    assert watch.check(18.1, only(LOOP, op)) is not None
    assert watch.budget(LOOP, 8) == pytest.approx(16.0)  # a verdict doubles the stage's budget


def test_only_a_runnable_op_is_timed_and_a_reply_restarts_the_clock() -> None:
    watch = HangWatch(floor_s=1.0, factor=10.0)
    waiting = OldestOp(seq=3, units=1, runnable=False)  # fenced on another stage's op: not this stage's doing
    for t in (0.0, 5.0, 50.0):
        assert watch.check(t, only(HEAD, waiting)) is None
    assert watch.check(50.5, only(HEAD, replace(waiting, runnable=True))) is None  # runnable from now
    assert watch.check(51.4, only(HEAD, replace(waiting, runnable=True))) is None
    assert watch.check(51.6, only(HEAD, replace(waiting, runnable=True))) is not None
    watch = HangWatch(floor_s=1.0, factor=10.0)
    for i in range(20):  # progress: each check finds a newer oldest op
        assert watch.check(i * 0.9, only(LOOP, OldestOp(seq=i, units=1, runnable=True))) is None
    assert watch.check(100.0, only(LOOP, None)) is None  # nothing outstanding


def test_a_stopped_process_holding_ops_hangs_its_stage_on_the_second_check() -> None:
    watch = HangWatch(floor_s=30.0, factor=10.0)
    op = OldestOp(seq=7, units=1, runnable=False)
    assert watch.check(0.0, only(LOOP, None), {LOOP: True}) is None  # stopped, but holds nothing
    assert watch.check(0.1, only(LOOP, op), {LOOP: True}) is None  # once: maybe a moment's stop
    assert watch.check(0.2, only(LOOP, op), {LOOP: False}) is None  # it went on
    assert watch.check(0.3, only(LOOP, op), {LOOP: True}) is None
    hang = watch.check(0.4, only(LOOP, op), {LOOP: True})
    assert hang is not None and hang.stage is LOOP and "stopped" in hang.why
    assert watch.budget(LOOP, 1) == 30.0  # a stop says nothing of its pace: the budget is not doubled
    assert watch.tick_s == 0.1 and HangWatch(0.2, 1.0).tick_s == 0.05


def test_op_units_count_token_steps() -> None:
    n = 3
    decode = loop_op(0, (0, 1, 2))
    assert op_units(decode) == 3 and op_units(head_op(0, (4,))) == 1
    assert op_units(replace(decode, prefill=True, num_steps=4)) == 12
    fused = LoopHead((9,), (0,), (9,), (SamplingParams(),), (0,), (-1,))
    assert op_units(replace(decode, head=fused)) == n + 1
    assert op_units(loop_op(0, ())) == 1


def test_process_identity_kills_only_the_same_live_process() -> None:
    me = this_process()
    assert me.namespace and not me.local and not kill(me)  # never itself
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = process(child.pid)
        assert proc is not None and proc.local and not is_stopped(proc)
        assert not kill(replace(proc, start_ticks=proc.start_ticks + 1))  # a reused pid is another process
        assert not kill(replace(proc, namespace="another-host/pid:[1]"))
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not is_stopped(proc):
            assert time.monotonic() < deadline, "the child never showed as stopped"
            time.sleep(0.01)  # the poll interval
        assert kill(proc)
        assert child.wait(10) == -signal.SIGKILL
        assert not kill(proc) and not is_stopped(proc)  # gone
    finally:
        child.kill()
        child.wait()
    assert process(child.pid) is None or process(child.pid) != proc
    assert ProcessId(1, "", 0).local is False


def test_a_stage_stuck_in_an_op_while_its_server_answers_is_lost_and_reattached(tmp_path: Path) -> None:
    FakeWorker.reset()
    quick = replace(FAST, stage_hang_floor_s=0.3)
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=quick) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, quick)
        gate = FakeWorker.gates[(LOOP, 1)] = threading.Event()
        try:
            ex.submit(loop_op(0, (0,)))
            (first,) = poll_all(ex, 1)  # a reply: the loop stage has a pace
            assert first.error is None
            ex.submit(loop_op(1, (0,)))  # stuck inside the op; gRPC and keepalive still answer
            ex.submit(head_op(0, (0,), fences=(Fence(LOOP, 1),)))  # waits on it: not the head stage's doing
            t0 = time.monotonic()
            loss, before = poll_loss(ex)
            assert isinstance(loss, StageLoss) and before == []
            assert loss.reason.startswith("loop stage hung: op 1 has run"), loss.reason
            assert "not a process to kill here" in loss.reason  # an in-process stage: this very process
            assert time.monotonic() - t0 < 5
            gate.set()  # the stuck op ends, its session closes, the re-Configure goes through
            ex.submit(loop_op(2, (0,)))
            (after,) = poll_all(ex, 1)
            assert (after.seq, after.error) == (2, None) and ex.recoveries == 1
        finally:
            gate.set()
            ex.close()


def test_a_batch_waits_on_its_fences_no_longer_than_the_limit_it_carries(tmp_path: Path) -> None:
    FakeWorker.reset()
    stage_side = replace(FAST, fence_timeout_s=600.0)  # the stage's own limit: far away
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=stage_side) as running:
        ex = GrpcExecutor(
            fake_setup(), {s: r.address for s, r in running.items()}, replace(FAST, stage_hang_floor_s=0.1)
        )
        try:
            t0 = time.monotonic()
            ex.submit(head_op(0, (0,), fences=(Fence(LOOP, 5),)))  # never met: a scheduler bug, not a hang
            (res,) = poll_all(ex, 1)
            assert isinstance(res, StageResult) and res.error is not None and "not satisfied" in res.error
            assert time.monotonic() - t0 < 5 and ex.outage is None  # 2 x (floor + nothing outstanding) = 0.2 s
        finally:
            ex.close()
