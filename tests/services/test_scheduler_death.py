"""A scheduler that dies loses no request: ``kill -9`` of the scheduler process while 16 streams run on a real
process tree. Its supervisor restarts it on the same port, and the project's client resumes every broken stream
there (``GenerateRequest.resume``): each request ends with exactly the tokens and depths of a fault-free run, under
one request id, no token delivered twice, and nothing is held afterwards."""

from __future__ import annotations

import os
import signal

import pytest

from cdb_engine.config import EngineConfig
from clients.sync_client import Client
from services.launcher import serve_all
from tests.services.test_healing import run_all, tokens
from tests.services.tree import IDLE, TEST_ENV, free_port, wait_for_counters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=512, max_waiting=64)


def test_kill_9_of_the_scheduler_loses_no_request_and_changes_no_token() -> None:
    address = f"127.0.0.1:{free_port()}"  # a fixed port: the restarted scheduler listens where the clients point
    tree = serve_all(CONFIG, address, env={**os.environ, **TEST_ENV})
    try:
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
    finally:
        tree.stop(drain_timeout=5.0)
