"""Processes that die lose no request, on one real process tree with warm standby stages (``CDB_STANDBY_STAGES``):

1. ``kill -9`` of the scheduler while 16 streams run: its supervisor restarts it on the same port, and the
   project's client resumes every broken stream there (``GenerateRequest.resume``): each request ends with exactly
   the tokens and depths of a fault-free run, under one request id, no token delivered twice, nothing held after.
2. Each role has a second stage process, model loaded and idle, and a lost stage is replaced by it at once, without
   waiting for a process start. Proven with supervision off, so a killed stage never comes back: each role in turn
   is killed while a full batch streams, every request still completes with the tokens of a fault-free run, and the
   tree serves again on the standbys. (Supervision stays off afterwards: this test runs last.)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from services.launcher.tree import serve_all
from tests.services.test_healing import run_all, tokens, workload
from tests.services.tree import IDLE, TEST_ENV, StreamRun, free_port, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)


@pytest.fixture(scope="module")
def tree() -> Iterator[ServeHandle]:
    address = f"127.0.0.1:{free_port()}"  # a fixed port: a restarted scheduler listens where the clients point
    handle = serve_all(CONFIG, address, env={**os.environ, **TEST_ENV, "CDB_STANDBY_STAGES": "true"})
    try:
        yield handle
    finally:
        handle.stop(drain_timeout=5.0)


def test_kill_9_of_the_scheduler_loses_no_request_and_changes_no_token(tree: ServeHandle) -> None:
    with Client(tree.address, timeout=120) as client:
        reference = run_all(client, "ref")
        for run in reference:
            assert run.done.wait(120) and run.error is None, run.error
        want = tokens(reference)
        runs = run_all(client, "kill")
        for run in runs[: CONFIG.max_num_seqs]:
            assert run.first.wait(60)  # a full batch is streaming (the rest queue behind it)
        assert tree.scheduler is not None
        pid = tree.scheduler.pid
        os.kill(pid, signal.SIGKILL)
        for run in runs:
            assert run.done.wait(120) and run.error is None, run.error
            assert run.finish is not None and run.finish.finish_reason == "length"
            assert {t.request_id for t in run.tokens} == {run.finish.request_id} == {run.options["request_id"]}
        assert tree.scheduler.pid != pid  # restarted by the tree's supervisor
        got = tokens(runs)
        assert got == want, f"{sum(a != b for a, b in zip(got, want))} requests differ"
        for run, ref in zip(runs, reference):  # usage counts the whole request, as without the fault
            assert run.finish is not None and ref.finish is not None
            assert (run.finish.generated_tokens, run.finish.total_loop_steps) == (
                ref.finish.generated_tokens,
                ref.finish.total_loop_steps,
            )
            assert "".join(t.text for t in run.tokens) == "".join(t.text for t in ref.tokens)
        wait_for_counters(client, lambda c: all(c[k] == v for k, v in IDLE.items()), "nothing held", 30)


def full_batch(client: Client, tag: str) -> list[StreamRun]:
    """A full batch of the healing test's requests, streaming."""
    return [StreamRun(client, prompt, options).start() for prompt, options in workload(tag)[: CONFIG.max_num_seqs]]


def test_a_killed_stage_is_replaced_by_its_standby_without_a_restart(tree: ServeHandle) -> None:
    assert set(tree.standbys) == set(Stage) and set(tree.standby_addrs) == set(Stage)
    with Client(tree.address, timeout=120) as client:
        client.wait_for_status("SERVING", timeout=60)
        reference = full_batch(client, "ref")
        for run in reference:
            assert run.done.wait(120) and run.error is None, run.error
        want = tokens(reference)
        recoveries = client.info().counters["recoveries"]
        tree.unsupervise()  # a killed stage stays dead: only its standby can serve its role
        for role in (Stage.LOOP, Stage.HEAD):  # (the prelude: the same path)
            runs = full_batch(client, role.role)
            for run in runs:
                assert run.first.wait(60)
            victim = tree.stages[role]
            assert client.info().stage_pids[role.role] == victim.pid
            os.kill(victim.pid, signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
            for run in runs:
                assert run.done.wait(120) and run.error is None, (role, run.error)
            assert tokens(runs) == want, role.role
            assert victim.poll() is not None and tree.stages[role] is victim  # not restarted: the standby served
            assert client.info().stage_pids[role.role] == tree.standbys[role].pid
            client.wait_for_status("SERVING", timeout=30)
            wait_for_counters(client, lambda c: all(c[k] == v for k, v in IDLE.items()), "nothing held", 30)
        info = client.info()
        assert info.counters["recoveries"] == recoveries + 2 and len(info.recovery_seconds) == recoveries + 2
    assert "takes over" in tree.log("scheduler")
