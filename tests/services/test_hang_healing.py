"""A stage that hangs without dying costs latency, not requests: the loop stage SIGSTOPped mid-generation on a real
process tree is judged hung by the scheduler's watchdog, killed and restarted by the tree's supervisor; every
request completes with exactly the tokens of a fault-free run, and the scheduler is the same process. A stage
stopped while idle (no op to time: lost to keepalive) is killed when the stages are re-attached."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.messages import GenerateOptions
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from tests.services.tree import IDLE, StreamRun, process_tree, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)


def greedy_runs(client: Client, tag: str, n: int = 8) -> list[StreamRun]:
    return [
        StreamRun(
            client,
            f"request {i}: the loop stops and starts again",
            GenerateOptions(max_tokens=12 + 4 * (i % 3), ignore_eos=True, request_id=f"{tag}-{i}"),
        ).start()
        for i in range(n)
    ]


def tokens(runs: list[StreamRun]) -> list[list[tuple[int, int]]]:
    return [[(t.id, t.depth) for t in run.tokens] for run in runs]


def test_a_stopped_stage_is_killed_and_replaced_and_its_requests_complete_unchanged() -> None:
    with process_tree(CONFIG, CDB_STAGE_KEEPALIVE_S="0.5") as tree, Client(tree.address, timeout=120) as client:
        reference = greedy_runs(client, "ref")
        for run in reference:
            assert run.done.wait(120) and run.error is None, run.error
        assert tree.scheduler is not None
        scheduler_pid, stopped_pid = tree.scheduler.pid, tree.stages[Stage.LOOP].pid

        runs = greedy_runs(client, "stopped")
        for run in runs:
            assert run.first.wait(60)  # a full batch is streaming
        os.kill(stopped_pid, signal.SIGSTOP)  # frozen mid-generation: not dead, its sockets stay open
        t0 = time.monotonic()
        deadline = t0 + 60
        wait_replaced(tree, Stage.LOOP, stopped_pid, deadline)  # the watchdog kills it, the supervisor restarts it
        replaced_after = time.monotonic() - t0
        for run in runs:
            assert run.done.wait(120) and run.error is None, run.error
            assert run.finish is not None and run.finish.finish_reason == "length"
        assert tokens(runs) == tokens(reference)
        healed_after = time.monotonic() - t0

        with pytest.raises(ProcessLookupError):
            os.kill(stopped_pid, 0)  # gone (and reaped)
        assert tree.scheduler.pid == scheduler_pid and tree.scheduler.poll() is None
        assert [r.name for r in tree.restarts] == ["loop"] and tree.restarts[0].code == -signal.SIGKILL
        assert replaced_after < 10 and healed_after < 60, (replaced_after, healed_after)
        info = client.info()
        assert info.healthy and info.counters["recoveries"] == 1
        wait_for_counters(client, lambda c: all(c[k] == v for k, v in IDLE.items()), "nothing held", 30)
        assert "loop stage hung: its process is stopped" in tree.log("scheduler")

        idle_pid = tree.stages[Stage.HEAD].pid
        os.kill(idle_pid, signal.SIGSTOP)  # holds no op: keepalive notices, re-attaching kills it
        wait_replaced(tree, Stage.HEAD, idle_pid, time.monotonic() + 60)
        client.wait_for_status("SERVING", timeout=60)
        (again,) = greedy_runs(client, "after", 1)
        assert again.done.wait(60) and again.error is None and tokens([again]) == tokens(reference)[:1]
        assert tree.scheduler.pid == scheduler_pid and [r.name for r in tree.restarts] == ["loop", "head"]
        assert f"head stage process {idle_pid} is stopped: killed" in tree.log("scheduler")


def wait_replaced(tree: ServeHandle, stage: Stage, pid: int, deadline: float) -> None:
    while tree.stages[stage].pid == pid:
        assert time.monotonic() < deadline, f"the stopped {stage.role} stage was not replaced"
        time.sleep(0.05)  # the poll interval
