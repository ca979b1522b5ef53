"""The stage plane admits only its own: the deployment's secret on every Stage RPC, one session holder at a time,
a bad Configure harms nothing, fence counters only move forward, no reflection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_scheduler.plan import Fence, Stage, StageResult
from services.settings.checks import SettingsError
from services.settings.knobs import Settings
from services.stage_secret import call_metadata, create_secret_file, load_stage_secret, secret_matches
from services.transport.convert import bank_spec_to_pb, role_to_pb
from services.transport.executor import GrpcExecutor
from services.transport.fences import FenceBoard
from tests.services.stage_harness import FAST, TEST_SECRET, FakeWorker, fake_model, fake_setup, stage_servers
from tests.services.test_stage_protocol import head_op, loop_op, poll_all

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[dict, GrpcExecutor]]:
    """Three fake stages serving a live executor session (rows 0..3 hold known values)."""
    FakeWorker.reset()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            assert ex.bank.tensor is not None
            ex.bank.tensor[:4] = torch.arange(4, dtype=ex.bank.tensor.dtype)[:, None]
            yield running, ex
        finally:
            ex.close()


def still_serving(ex: GrpcExecutor, seq: int) -> StageResult:
    """The live session still works: a loop op on row 0 then a head op reading it."""
    ex.submit(loop_op(seq, (0,)))
    ex.submit(head_op(seq, (0,), fences=(Fence(Stage.LOOP, seq),)))
    loop, head = sorted(poll_all(ex, 2), key=lambda r: r.stage)
    assert loop.error is None and head.error is None
    return head


def configure_request(ex: GrpcExecutor, stage: Stage, holder: str, bank_name: str | None = None) -> pb.ConfigureRequest:
    bank = bank_spec_to_pb(ex.bank.spec)
    if bank_name is not None:
        bank.name = bank_name
    return pb.ConfigureRequest(
        role=role_to_pb(stage),
        model="ouro-tiny",
        dtype="float64",
        bank=bank,
        token_bank=bank_spec_to_pb(ex.tokens.spec),
        fences=pb.FenceBoardSpec(name=ex.fences.name),
        kv=pb.KVSpec(policy="last_exited", max_depth=2, shared_after=4, num_blocks=64, block_size=16),
        holder=holder,
    )


@pytest.mark.parametrize("metadata", [(), call_metadata("a-wrong-secret-of-enough-length")], ids=["none", "wrong"])
def test_foreign_callers_are_refused_every_stage_rpc_and_change_nothing(
    live: tuple[dict, GrpcExecutor], metadata: tuple
) -> None:
    running, ex = live
    assert ex.bank.tensor is not None
    checksum = ex.bank.tensor[:4].clone()
    loop_counter = ex.fences.completed(Stage.LOOP)
    for stage in Stage:
        with grpc.insecure_channel(running[stage].address) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Configure(configure_request(ex, stage, "intruder", "made-up-bank"), timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            foreign = [pb.StageBatch(seq=10**6, loop=pb.LoopBatch(rows=[0], rids=[0], positions=[0], steps=[0]))]
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Run(iter(foreign), timeout=5, metadata=metadata))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert torch.equal(ex.bank.tensor[:4], checksum)  # no foreign batch ran on a live row
    assert ex.fences.completed(Stage.LOOP) == loop_counter
    assert still_serving(ex, 0).token_ids == (1,)  # row 0 held 0: the session is intact


def test_health_is_open_and_no_reflection_is_served(live: tuple[dict, GrpcExecutor]) -> None:
    running, _ = live
    with grpc.insecure_channel(running[Stage.LOOP].address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_another_holder_cannot_configure_a_live_session(live: tuple[dict, GrpcExecutor]) -> None:
    running, ex = live
    with grpc.insecure_channel(running[Stage.HEAD].address) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Configure(configure_request(ex, Stage.HEAD, "another-scheduler"), timeout=5, metadata=ex._metadata)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "live session" in err.value.details()
    assert still_serving(ex, 0).error is None


def test_a_bad_configure_from_the_holder_keeps_the_live_session(live: tuple[dict, GrpcExecutor]) -> None:
    running, ex = live
    with grpc.insecure_channel(running[Stage.HEAD].address) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            request = configure_request(ex, Stage.HEAD, ex.holder, bank_name="cdb-no-such-bank")
            stub.Configure(request, timeout=5, metadata=ex._metadata)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "shared memory" in err.value.details()
    assert still_serving(ex, 0).token_ids == (1,)


def test_a_stage_drops_the_session_of_a_scheduler_that_went_away(tmp_path: Path) -> None:
    FakeWorker.reset()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker) as running:
        addrs = {s: r.address for s, r in running.items()}
        first = GrpcExecutor(fake_setup(), addrs, FAST)
        first.close()  # its streams end: the stages drop its session
        deadline = time.monotonic() + 10
        while any(r.service._session is not None for r in running.values()) and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # the stages drop the session on their own threads
        assert all(r.service._session is None for r in running.values()), "a stage kept a dead scheduler's session"
        second = GrpcExecutor(fake_setup(), addrs, FAST)  # another holder: admitted
        try:
            assert still_serving(second, 0).error is None
        finally:
            second.close()


def test_fence_counters_only_move_forward() -> None:
    board = FenceBoard.create({Stage.LOOP: 7})
    try:
        assert board.completed(Stage.LOOP) == 7 and board.completed(Stage.HEAD) == -1
        board.complete(Stage.LOOP, 3)  # a stale completion
        assert board.completed(Stage.LOOP) == 7
        board.complete(Stage.LOOP, 9)
        assert board.completed(Stage.LOOP) == 9
    finally:
        board.close()


def test_the_secret_file_is_made_once_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "s" / "stage.secret"
    assert create_secret_file(path) and not create_secret_file(path)  # an existing one is kept
    assert path.stat().st_mode & 0o777 == 0o600
    secret = load_stage_secret(Settings(stage_secret_file=str(path)))
    assert len(secret) >= 32 and secret_matches(secret, call_metadata(secret))
    assert not secret_matches(secret, call_metadata(secret[:-1] + "x")) and not secret_matches(secret, ())
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="readable by others"):
        load_stage_secret(Settings(stage_secret_file=str(path)))
    with pytest.raises(SettingsError, match="no stage secret"):
        load_stage_secret(Settings())
    with pytest.raises(SettingsError, match="CDB_STAGE_SECRET_FILE"):
        load_stage_secret(Settings(stage_secret_file=str(tmp_path / "missing")))
    assert load_stage_secret(Settings(stage_secret=TEST_SECRET)) == TEST_SECRET
