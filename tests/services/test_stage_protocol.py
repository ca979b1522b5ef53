"""The stage protocol with stage servers in this process: fences, errors, broken streams, configuration, and
the engine over gRPC executors producing exactly the in-process engine's tokens."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
import torch

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.memory import stage_weights
from cdb_model.loader import load_config, load_model
from cdb_scheduler.plan import Fence, HeadOp, LoopOp, PreludeOp, Stage, StageLoss, StageOp, StageResult
from cdb_scheduler.sampling import SamplingParams
from services.net import require_loopback
from services.stage_secret import call_metadata
from services.transport import stage_probe
from services.transport.executor import GrpcExecutor, GrpcExecutorFactory
from tests.services.stage_harness import (
    FAST,
    TEST_SECRET,
    FakeWorker,
    fake_model,
    fake_setup,
    restart_stage,
    stage_servers,
)

pytestmark = pytest.mark.timeout(90)
AUTH = call_metadata(TEST_SECRET)


def loop_op(seq: int, rows: tuple[int, ...], fences: tuple[Fence, ...] = ()) -> LoopOp:
    n = len(rows)
    return LoopOp(seq, fences, (), (), rids=rows, positions=(0,) * n, rows=rows, steps=(0,) * n)


def head_op(seq: int, rows: tuple[int, ...], fences: tuple[Fence, ...] = ()) -> HeadOp:
    n = len(rows)
    return HeadOp(
        seq,
        fences,
        (),
        (),
        rids=rows,
        positions=(0,) * n,
        rows=rows,
        sample=(True,) * n,
        sampling=(SamplingParams(),) * n,
        token_index=(0,) * n,
    )


def poll_all(ex: GrpcExecutor, n: int, timeout: float = 10.0) -> list[StageResult]:
    out: list[StageResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        res = ex.poll(deadline - time.monotonic())
        if res is not None:
            out.append(res)
    return out


@pytest.fixture(params=["rings", "streams"])
def fake_stages(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[dict, GrpcExecutor]]:
    """Three fake stages and an executor over them; ops and replies on the shared-memory rings (the default) or
    on the gRPC streams (``CDB_STAGE_RINGS=false``)."""
    FakeWorker.reset()
    settings = replace(FAST, stage_rings=request.param == "rings")
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=settings) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, settings)
        assert all(link.max_message is not None for link in ex._links.values()) == (request.param == "rings")
        assert all(link.op_records for link in ex._links.values()) == (request.param == "rings")  # records on rings
        try:
            yield running, ex
        finally:
            for gate in FakeWorker.gates.values():
                gate.set()
            ex.close()


def test_fences_order_stages_and_results_arrive_in_order(fake_stages: tuple[dict, GrpcExecutor]) -> None:
    _, ex = fake_stages
    gate = FakeWorker.gates[(Stage.LOOP, 1)] = threading.Event()
    ex.submit(loop_op(0, (1, 2)))
    ex.submit(loop_op(1, (1, 2)))
    ex.submit(head_op(0, (1, 2), fences=(Fence(Stage.LOOP, 1),)))  # must wait for the gated loop op
    ex.submit(PreludeOp(0, (), (), (), rids=(3,), token_ids=(5,), positions=(0,), rows=(3,), init_seeds=(-1,)))
    first = poll_all(ex, 2)  # loop 0 and the prelude op; the head op waits on its fence
    assert {(r.stage, r.seq) for r in first} == {(Stage.LOOP, 0), (Stage.PRELUDE, 0)}
    gate.set()
    rest = poll_all(ex, 2)  # the head's reply may overtake the loop's; the executor restores causal order
    assert [(r.stage, r.seq) for r in rest] == [(Stage.LOOP, 1), (Stage.HEAD, 0)]
    assert rest[1].token_ids == (2, 2)  # the head saw both loop steps through the shared bank
    assert FakeWorker.log.index((Stage.LOOP, 1)) < FakeWorker.log.index((Stage.HEAD, 0))
    assert ex.ping(Stage.LOOP) > 0 and ex.counters[Stage.LOOP].ops == 2


def test_failed_op_replies_error_and_the_stage_keeps_serving(fake_stages: tuple[dict, GrpcExecutor]) -> None:
    _, ex = fake_stages
    FakeWorker.fail_seqs.add((Stage.LOOP, 0))
    ex.submit(loop_op(0, (0,)))
    ex.submit(loop_op(1, (0,)))
    a, b = poll_all(ex, 2)
    assert a.seq == 0 and a.error is not None and "injected failure" in a.error
    assert b.seq == 1 and b.error is None and b.signals == (0.5,)
    assert ex.broken is None


def test_fence_timeout_fails_the_op_not_the_stage(tmp_path: Path) -> None:
    FakeWorker.reset()
    short = replace(FAST, fence_timeout_s=0.2)
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=short) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, short)
        try:
            ex.submit(head_op(0, (0,), fences=(Fence(Stage.LOOP, 5),)))  # never satisfied
            ex.submit(head_op(1, (0,)))
            a, b = poll_all(ex, 2)
            assert a.error is not None and "not satisfied" in a.error
            assert b.error is None
        finally:
            ex.close()


def poll_loss(ex: GrpcExecutor, timeout: float = 10.0) -> tuple[StageLoss | None, list[StageResult]]:
    """Poll until a StageLoss (returned with the results seen before it)."""
    seen: list[StageResult] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = ex.poll(deadline - time.monotonic())
        if isinstance(res, StageLoss):
            return res, seen
        if res is not None:
            seen.append(res)
    return None, seen


def test_stage_death_voids_outstanding_ops_and_the_stages_are_reattached(
    fake_stages: tuple[dict, GrpcExecutor],
) -> None:
    running, ex = fake_stages
    started = FakeWorker.started[(Stage.LOOP, 0)] = threading.Event()
    FakeWorker.gates[(Stage.LOOP, 0)] = threading.Event()  # the loop stage hangs in op 0
    for seq in range(3):
        ex.submit(loop_op(seq, (seq,)))
    ex.submit(head_op(0, (0,), fences=(Fence(Stage.LOOP, 2),)))  # the head waits on the loop
    assert started.wait(10)
    old_board = ex.fences
    t0 = time.monotonic()
    running[Stage.LOOP].server.stop(0)  # the loop stage goes away
    loss, before = poll_loss(ex)
    assert loss is not None and "loop stage failed" in loss.reason and time.monotonic() - t0 < 5
    assert before == []  # no result of a void op, not even an error
    assert old_board.aborted and ex.outage is not None and ex.broken is None
    # After the loss was polled, ops wait for the stages; fences on void ops hold at once.
    ex.submit(loop_op(3, (0,), fences=(Fence(Stage.HEAD, 0),)))
    ex.submit(head_op(1, (0,), fences=(Fence(Stage.LOOP, 3),)))
    assert ex.poll(0.2) is None
    FakeWorker.gates[(Stage.LOOP, 0)].set()  # the dead stage's last op ends (its session closes after it)
    restart_stage(running, Stage.LOOP)
    results = poll_all(ex, 2)
    assert [(r.stage, r.seq, r.error) for r in results] == [(Stage.LOOP, 3, None), (Stage.HEAD, 1, None)]
    assert ex.bank.tensor is not None
    assert results[1].token_ids == (int(ex.bank.tensor[0, 0]),)  # the head ran after the new loop op
    assert ex.outage is None and ex.recoveries == 1 and ex.recovery_s[0] < 10
    assert ex.fences is not old_board and ex.fences.completed(Stage.PRELUDE) == -1
    assert ex.fences.completed(Stage.LOOP) == 3


def test_stages_down_past_the_limit_fail_every_op_and_break_the_executor(tmp_path: Path) -> None:
    FakeWorker.reset()
    short = replace(FAST, stage_down_limit_s=0.5)
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=short) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, short)
        try:
            running[Stage.HEAD].server.stop(0).wait()
            loss, _ = poll_loss(ex)
            assert loss is not None
            ex.submit(loop_op(0, (0,)))  # waits in the backlog, then fails when the executor gives up
            (res,) = poll_all(ex, 1)
            assert res.seq == 0 and res.error is not None and "no complete set of stages back" in res.error
            assert ex.broken == res.error
            ex.submit(loop_op(1, (0,)))  # later ops fail at once
            late = ex.poll(1.0)
            assert isinstance(late, StageResult) and late.seq == 1 and late.error == ex.broken
        finally:
            ex.close()


class Recorder:
    """Both observer protocols: what the executor sends and what a stage sees."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def contexts_for_op(self, op: StageOp) -> dict[int, str]:
        return {rid: f"00-{rid:032x}-{op.seq + 1:016x}-01" for rid in op.rids}

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        self.calls.append(("done", op.stage, op.seq, result.error, sent_ns <= done_ns))

    def update(self, contexts: dict[int, str], released: tuple[int, ...] = ()) -> None:
        self.calls.append(("update", dict(contexts), tuple(released)))

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        self.calls.append(("record", op.stage, op.seq, start_ns <= end_ns, error))


def test_trace_contexts_travel_with_batches_to_observers(tmp_path: Path) -> None:
    FakeWorker.reset()
    stage_side, engine_side = Recorder(), Recorder()
    with stage_servers(
        tmp_path,
        lambda s: fake_model(),
        worker_factory=FakeWorker,
        observer_for=lambda s: stage_side if s is Stage.LOOP else None,
    ) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST, observer=engine_side)
        try:
            ex.submit(replace(loop_op(0, (3, 4)), released=(9,)))
            assert ex.poll(10) is not None
        finally:
            ex.close()
    contexts = {3: f"00-{3:032x}-{1:016x}-01", 4: f"00-{4:032x}-{1:016x}-01"}
    assert stage_side.calls == [("update", contexts, (9,)), ("record", Stage.LOOP, 0, True, None)]
    assert engine_side.calls == [("done", Stage.LOOP, 0, None, True)]


def test_configure_is_checked_and_run_needs_it(tmp_path: Path) -> None:
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker) as running:
        channel = grpc.insecure_channel(running[Stage.HEAD].address)
        stub = stage_pb2_grpc.StageStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Run(iter([pb.StageBatch(seq=0, ping=pb.Ping())]), metadata=AUTH)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        bad = [
            pb.ConfigureRequest(role=pb.STAGE_ROLE_LOOP, model="ouro-tiny", dtype="float64"),
            pb.ConfigureRequest(role=pb.STAGE_ROLE_HEAD, model="other", dtype="float64"),
            pb.ConfigureRequest(role=pb.STAGE_ROLE_HEAD, model="ouro-tiny", dtype="float32"),
            pb.ConfigureRequest(role=pb.STAGE_ROLE_HEAD, model="ouro-tiny", dtype="float64", device="cuda:0"),
            pb.ConfigureRequest(role=pb.STAGE_ROLE_HEAD, model="ouro-tiny", dtype="float64", bank=pb.BankSpec(width=3)),
        ]
        for request, what in zip(
            bad, ["role", "model", "dtype", "device: caller wants cuda:0, stage has cpu", "bank width"]
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Configure(request, timeout=5, metadata=AUTH)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and what in err.value.details()
        channel.close()


@pytest.mark.parametrize(
    "listen,ok",
    [
        ("127.0.0.1:0", True),
        ("[::1]:50061", True),
        ("localhost:5", True),
        ("unix:///tmp/x.sock", True),
        ("0.0.0.0:50061", False),
        ("10.1.2.3:80", False),
        ("example.com:80", False),
        ("127.0.0.1", False),
    ],
)
def test_stage_servers_listen_on_loopback_only(listen: str, ok: bool) -> None:
    if ok:
        assert require_loopback(listen) == listen
    else:
        with pytest.raises(ValueError):
            require_loopback(listen)


@pytest.mark.parametrize(("model", "rings"), [("ouro-tiny", True), ("huginn-tiny", True), ("ouro-tiny", False)])
def test_engine_over_grpc_stages_equals_in_process_engine(tmp_path: Path, model: str, rings: bool) -> None:
    cfg = EngineConfig(model=model, dtype="float64", max_num_seqs=4, num_kv_blocks=128, init_seed=7)
    prompts: list[str | list[int]] = ["hello", [5, 6, 7, 8, 9, 10], "the loop", [300] * 20, "x", "abc def"]
    params = [
        RequestParams(max_tokens=12, ignore_eos=True),
        RequestParams(max_tokens=9, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=3, logprobs=2)),
        RequestParams(max_tokens=7, sampling=SamplingParams(temperature=1.2, top_k=20, seed=11), ignore_eos=True),
    ] * 2
    with Engine(cfg) as local:
        expected = local.generate(prompts, params)
    weights = {s: load_model(model, dtype=torch.float64, stages=stage_weights(s, load_config(model))) for s in Stage}
    settings = replace(FAST, stage_rings=rings)
    with stage_servers(tmp_path, weights.__getitem__, model_name=model, settings=settings) as running:
        factory = GrpcExecutorFactory({s: r.address for s, r in running.items()}, settings)
        with Engine(cfg, executor_factory=factory) as remote:
            got = remote.generate(prompts, params)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.depths, g.finish_reason) == (e.token_ids, e.depths, e.finish_reason)
        assert g.logprobs == e.logprobs


class LaunchingWorker(FakeWorker):
    """A worker with ``launch``: the op's work is done at launch, its finish blocks on ``finish_gates[seq]``; the
    log records ("launch" | "finish", stage, seq)."""

    events: ClassVar[list[tuple[str, Stage, int]]] = []
    finish_gates: ClassVar[dict[tuple[Stage, int], threading.Event]] = {}

    def launch(self, op: StageOp) -> Callable[[], StageResult]:
        LaunchingWorker.events.append(("launch", op.stage, op.seq))
        result = self.execute(op)
        gate = LaunchingWorker.finish_gates.get((op.stage, op.seq))

        def finish() -> StageResult:
            if gate is not None:
                gate.wait(30)
            LaunchingWorker.events.append(("finish", op.stage, op.seq))
            return result

        # A gated op is not done for a while: the stage takes the next message off the wire meanwhile.
        finish.ready_at = time.perf_counter() + (30.0 if gate is not None else 0.0)  # type: ignore[attr-defined]
        return finish


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)  # polling a condition with a deadline, not a synchronising sleep
    return cond()


def test_the_next_op_is_launched_before_the_running_one_is_waited_for(tmp_path: Path) -> None:
    FakeWorker.reset()
    LaunchingWorker.events, LaunchingWorker.finish_gates = [], {}
    gate = LaunchingWorker.finish_gates[(Stage.LOOP, 0)] = threading.Event()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=LaunchingWorker) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            ex.submit(loop_op(0, (1,)))
            ex.submit(loop_op(1, (2,)))
            # Op 1 arrived while op 0 runs and needs no other stage: it is launched before op 0 is waited for.
            assert _wait_for(lambda: ("launch", Stage.LOOP, 1) in LaunchingWorker.events)
            assert ("finish", Stage.LOOP, 0) not in LaunchingWorker.events
            gate.set()
            assert [(r.stage, r.seq, r.error) for r in poll_all(ex, 2)] == [
                (Stage.LOOP, 0, None),
                (Stage.LOOP, 1, None),
            ]
            finishes = [e for e in LaunchingWorker.events if e[0] == "finish"]
            assert finishes == [("finish", Stage.LOOP, 0), ("finish", Stage.LOOP, 1)]  # replies stay in order
        finally:
            gate.set()
            ex.close()


def test_an_op_whose_fence_is_not_met_is_not_launched_early(tmp_path: Path) -> None:
    FakeWorker.reset()
    LaunchingWorker.events, LaunchingWorker.finish_gates = [], {}
    head_gate = FakeWorker.gates[(Stage.HEAD, 0)] = threading.Event()
    loop_gate = LaunchingWorker.finish_gates[(Stage.LOOP, 0)] = threading.Event()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=LaunchingWorker) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            ex.submit(head_op(0, (3,)))
            ex.submit(loop_op(0, (1,)))
            ex.submit(loop_op(1, (3,), fences=(Fence(Stage.HEAD, 0),)))  # reads what the gated head op writes
            assert _wait_for(lambda: ("launch", Stage.LOOP, 0) in LaunchingWorker.events)
            loop_gate.set()  # op 0 finishes while the head op still blocks: op 1 must not have been launched
            assert [(r.stage, r.seq) for r in poll_all(ex, 1)] == [(Stage.LOOP, 0)]
            assert ("launch", Stage.LOOP, 1) not in LaunchingWorker.events
            head_gate.set()
            rest = poll_all(ex, 2)
            assert {(r.stage, r.seq, r.error) for r in rest} == {(Stage.HEAD, 0, None), (Stage.LOOP, 1, None)}
        finally:
            head_gate.set()
            loop_gate.set()
            ex.close()


def test_a_stage_closing_waits_for_the_op_log_of_a_session_whose_stream_just_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's end closes its session on the executor thread; a stage stopping meanwhile (SIGTERM) must wait
    for that close, or the process exits with half an op log written."""
    FakeWorker.reset()
    writing, proceed = threading.Event(), threading.Event()
    write = stage_probe.write_op_log

    def slow_write(*args: Any) -> str:
        writing.set()
        proceed.wait(30)
        return write(*args)

    monkeypatch.setattr(stage_probe, "write_op_log", slow_write)
    logged = replace(FAST, stage_op_log=str(tmp_path / "ops"))
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=logged) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, logged)
        ex.submit(loop_op(0, (1,)))
        assert [r.error for r in poll_all(ex, 1)] == [None]
        ex.close()  # the stream ends: the loop stage's executor thread closes the session and writes its log
        assert writing.wait(30)
        closer = threading.Thread(target=running[Stage.LOOP].service.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive()  # still waiting for the write in progress
        proceed.set()
        closer.join(30)
        assert not closer.is_alive()
        (log,) = (tmp_path / "ops").glob("loop-*.json")
        assert json.loads(log.read_text())["ops"][0][0] == 0
