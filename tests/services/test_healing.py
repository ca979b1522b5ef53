"""A stage that dies costs latency, not requests: ``kill -9`` of each stage in turn while 16 streams run, on a
real process tree. Every request completes with exactly the tokens of a fault-free run (greedy and seeded
sampling), health goes NOT_SERVING then SERVING, and nothing is held afterwards. A stage that stays down past
the limit: UNAVAILABLE and a non-zero scheduler exit."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.messages import GenerateOptions
from clients.sync_client import Client
from services.launcher.tree import serve_all
from tests.services.tree import IDLE, TEST_ENV, StreamRun, free_port, process_tree, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)
STREAMS = 16


def workload(tag: str) -> list[tuple[str, GenerateOptions]]:
    """16 requests, half greedy, half seeded sampling, of different lengths (some still queued at the kill)."""
    out = []
    for i in range(STREAMS):
        options = GenerateOptions(max_tokens=12 + (i % 5) * 4, ignore_eos=True, request_id=f"{tag}-{i}")
        if i % 2:
            options["temperature"], options["top_p"], options["seed"] = 0.9, 0.95, 1000 + i
        out.append((f"request {i}: the loop runs again and again", options))
    return out


def run_all(client: Client, tag: str) -> list[StreamRun]:
    return [StreamRun(client, prompt, options).start() for prompt, options in workload(tag)]


def tokens(runs: list[StreamRun]) -> list[list[tuple[int, int]]]:
    return [[(t.id, t.depth) for t in run.tokens] for run in runs]


def test_kill_9_of_each_stage_in_turn_loses_no_request_and_changes_no_token() -> None:
    with process_tree(CONFIG) as tree, Client(tree.address, timeout=120) as client:
        reference = run_all(client, "ref")
        for run in reference:
            assert run.done.wait(120) and run.error is None, run.error
        want = tokens(reference)
        for role in Stage:
            runs = run_all(client, role.role)
            for run in runs[: CONFIG.max_num_seqs]:
                assert run.first.wait(60)  # a full batch is streaming (the rest queue behind it)
            pid = tree.stages[role].pid
            os.kill(pid, signal.SIGKILL)
            client.wait_for_status("NOT_SERVING", timeout=15)
            prompt, options = workload(f"{role.role}-late")[1]  # arrives during the outage: waits, then runs
            late = StreamRun(client, prompt, options).start()
            client.wait_for_status("SERVING", timeout=90)
            assert tree.stages[role].pid != pid  # restarted by the tree's supervisor
            for run in runs:
                assert run.done.wait(120) and run.error is None, (role, run.error)
                assert run.finish is not None and run.finish.finish_reason == "length"
            got = tokens(runs)
            assert got == want, f"{role.role}: {sum(a != b for a, b in zip(got, want))} requests differ"
            assert late.done.wait(120) and late.error is None and tokens([late]) == [want[1]]
            wait_for_counters(client, lambda c: all(c[k] == v for k, v in IDLE.items()), "nothing held", 30)
        info = client.info()
        assert info.healthy and info.counters["recoveries"] == len(Stage)


def test_a_stage_down_past_the_limit_fails_its_requests_and_the_scheduler_exits_1() -> None:
    with process_tree(CONFIG, CDB_STAGE_DOWN_LIMIT_S="2") as tree, Client(tree.address, timeout=60) as client:
        runs = [
            StreamRun(
                client, f"prompt {i}", GenerateOptions(max_tokens=3000, ignore_eos=True), resume_attempts=0
            ).start()
            for i in range(4)
        ]
        for run in runs:
            assert run.first.wait(60)
        tree.unsupervise()  # the stage is not coming back
        os.kill(tree.stages[Stage.LOOP].pid, signal.SIGKILL)
        t0 = time.monotonic()
        for run in runs:
            assert run.done.wait(30) and run.code == grpc.StatusCode.UNAVAILABLE, (run.code, run.finish)
            assert "no complete set of stages back" in run.error.details()  # type: ignore[union-attr]
        assert tree.scheduler is not None
        assert tree.scheduler.wait(timeout=60) == 1
        assert time.monotonic() - t0 < 45


def test_a_restarted_scheduler_works_with_the_same_stages() -> None:
    address = f"127.0.0.1:{free_port()}"  # a fixed port: the supervisor restarts the scheduler on it
    tree = serve_all(CONFIG, address, env={**os.environ, **TEST_ENV})
    try:
        with Client(tree.address, timeout=60) as client:
            before = client.generate("the same prompt", max_tokens=8, ignore_eos=True)
            assert tree.scheduler is not None
            stage_pids = {s: p.pid for s, p in tree.stages.items()}
            old = tree.scheduler.pid
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while tree.scheduler.pid == old and time.monotonic() < deadline:
                threading.Event().wait(0.05)  # the supervisor restarts it on its own thread
            client.wait_for_status("SERVING", timeout=90)
            after = client.generate("the same prompt", max_tokens=8, ignore_eos=True)
            assert [t.id for t in after.tokens] == [t.id for t in before.tokens]
            assert {s: p.pid for s, p in tree.stages.items()} == stage_pids  # the stages were not restarted
    finally:
        tree.stop(drain_timeout=5.0)
