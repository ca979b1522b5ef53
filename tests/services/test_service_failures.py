"""Overload, SIGTERM drain and ``kill -9`` of each stage, each on its own real process tree."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.messages import GenerateOptions
from clients.sync_client import Client
from tests.services.tree import StreamRun, process_tree, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LONG = GenerateOptions(max_tokens=3000, ignore_eos=True)


def test_overload_is_resource_exhausted_at_once() -> None:
    config = EngineConfig(model="ouro-tiny", max_num_seqs=2, max_waiting=2, num_kv_blocks=512)
    # one caller may hold the whole server here (by default: half of it)
    with process_tree(config, CDB_MAX_REQUESTS_PER_CALLER="8") as tree, Client(tree.address, timeout=60) as client:
        runs = [StreamRun(client, "busy", GenerateOptions(LONG, request_id=f"r{i}")).start() for i in range(4)]
        wait_for_counters(client, lambda c: c["running"] + c["waiting"] >= 4, "all four admitted or queued", 30)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("one too many", max_tokens=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 2.0
        for i in range(4):
            assert client.abort(f"r{i}")
        for run in runs:
            assert run.done.wait(30) and run.finish is not None and run.finish.finish_reason == "cancelled"
        assert client.generate("fits again", max_tokens=2).finish.generated_tokens == 2


def test_sigterm_stops_serving_drains_in_flight_streams_and_exits() -> None:
    config = EngineConfig(model="ouro-tiny", max_num_seqs=8, num_kv_blocks=512)
    with process_tree(config, CDB_DRAIN_TIMEOUT_S="4") as tree, Client(tree.address, timeout=60) as client:
        short = [
            StreamRun(client, f"short {i}", GenerateOptions(max_tokens=40, ignore_eos=True)).start() for i in range(3)
        ]
        long = [StreamRun(client, f"long {i}", LONG, resume_attempts=0).start() for i in range(2)]  # no replica
        for run in short + long:
            assert run.first.wait(30)
        assert tree.scheduler is not None
        tree.scheduler.send_signal(signal.SIGTERM)
        client.wait_for_status("NOT_SERVING", timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("too late", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for run in short:  # in-flight streams finish normally
            assert run.done.wait(30) and run.error is None
            assert run.finish is not None and run.finish.finish_reason == "length" and len(run.tokens) == 40
        for run in long:  # cut at the drain deadline
            assert run.done.wait(30) and run.code == grpc.StatusCode.UNAVAILABLE
        assert tree.scheduler.wait(timeout=30) == 0


def test_idle_streams_survive_keepalive_and_a_frozen_stage_is_detected_and_healed() -> None:
    config = EngineConfig(model="ouro-tiny", max_num_seqs=8, num_kv_blocks=512)
    with process_tree(config, CDB_STAGE_KEEPALIVE_S="0.5") as tree, Client(tree.address, timeout=60) as client:
        assert client.generate("warm", max_tokens=2).finish.generated_tokens == 2
        time.sleep(3.0)  # the scenario, not a synchronisation: idle Run streams under frequent keepalive pings
        assert client.health() == "SERVING"
        assert client.generate("still connected", max_tokens=2).finish.generated_tokens == 2
        runs = [
            StreamRun(client, f"prompt {i}", GenerateOptions(max_tokens=200, ignore_eos=True)).start() for i in range(3)
        ]
        for run in runs:
            assert run.first.wait(30)
        loop_pid = tree.stages[Stage.LOOP].pid
        os.kill(loop_pid, signal.SIGSTOP)  # frozen, not dead: the scheduler's watchdog kills it, it is restarted
        try:
            client.wait_for_status("NOT_SERVING", timeout=15)
            assert "loop" in client.info().error
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed and reaped already
                os.kill(loop_pid, signal.SIGCONT)
        client.wait_for_status("SERVING", timeout=60)
        for run in runs:
            assert run.done.wait(120) and run.error is None, run.error
            assert run.finish is not None and len(run.tokens) == 200
