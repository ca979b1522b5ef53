"""Warm standby stages (``CDB_STANDBY_STAGES``): each role has a second stage process, model loaded and idle, and a
lost stage is replaced by it at once, without waiting for a process start. Proven with supervision off, so a
killed stage never comes back: each role in turn is killed while 8 streams run, every request still completes
with the tokens of a fault-free run, and the tree serves again on the standbys."""

from __future__ import annotations

import os
import signal

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.sync_client import Client
from services.launcher import serve_all
from tests.services.test_healing import tokens, workload
from tests.services.tree import IDLE, TEST_ENV, StreamRun, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=4, num_kv_blocks=512, max_waiting=64)


def run_all(client: Client, tag: str) -> list[StreamRun]:
    """8 of the healing test's requests: a full batch streaming and as many queued behind it."""
    return [StreamRun(client, prompt, options).start() for prompt, options in workload(tag)[:8]]


def test_a_killed_stage_is_replaced_by_its_standby_without_a_restart() -> None:
    env = {**os.environ, **TEST_ENV, "CDB_STANDBY_STAGES": "true"}
    tree = serve_all(CONFIG, "127.0.0.1:0", env=env)
    try:
        assert set(tree.standbys) == set(Stage) and set(tree.standby_addrs) == set(Stage)
        with Client(tree.address, timeout=120) as client:
            reference = run_all(client, "ref")
            for run in reference:
                assert run.done.wait(120) and run.error is None, run.error
            want = tokens(reference)
            tree.unsupervise()  # a killed stage stays dead: only its standby can serve its role
            for role in (Stage.LOOP, Stage.HEAD):  # (the prelude: the same path)
                runs = run_all(client, role.role)
                for run in runs[: CONFIG.max_num_seqs]:
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
            assert info.counters["recoveries"] == 2 and len(info.recovery_seconds) == 2
        assert "takes over" in tree.log("scheduler")
    finally:
        tree.stop(drain_timeout=5.0)
