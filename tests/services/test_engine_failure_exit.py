"""A scheduler whose engine loop cannot go on exits non-zero (so that it is restarted) instead of staying up and
refusing everything: ``services.api.fatal.ExitOnEngineFailure`` on its own, and a real ``cdb scheduler``
process whose scheduler core is made to fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from services.api.fatal import ExitOnEngineFailure
from tests.http.harness import wait_until
from tests.services.tree import free_port

pytestmark = pytest.mark.timeout(180)


def test_the_engine_failure_stops_the_process_then_forces_exit_1_after_the_grace() -> None:
    stopped, exited = threading.Event(), threading.Event()
    codes: list[int] = []

    def hard_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    fail = ExitOnEngineFailure(0.05, stop=stopped.set, hard_exit=hard_exit)
    assert fail.error is None
    fail("engine loop failed: RuntimeError: boom")
    assert stopped.is_set() and fail.error == "engine loop failed: RuntimeError: boom"
    assert exited.wait(10) and codes == [1]
    fail("a second failure")  # reported once
    assert fail.error == "engine loop failed: RuntimeError: boom" and codes == [1]


# A ``cdb scheduler`` whose scheduler core raises once a request runs: the engine loop dies on its first request.
_FAILING_SCHEDULER = textwrap.dedent(
    """
    import sys

    from cdb_scheduler.scheduler import Scheduler

    original = Scheduler.schedule

    def schedule(self, emit=None):
        if self.running:
            raise RuntimeError("injected scheduler failure")
        return original(self, emit)

    Scheduler.schedule = schedule

    from cdb.processes import scheduler_main

    sys.exit(scheduler_main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_a_scheduler_process_whose_engine_loop_dies_exits_1(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-c", _FAILING_SCHEDULER, "--in-process", "--listen", address, "--ready-file", str(ready)]
    argv += ["--model", "ouro-tiny", "--max-num-seqs", "4", "--num-kv-blocks", "64", "--num-threads", "1"]
    # (the failure replaces a method of the scheduler's class: the interpreted one, whose methods can be replaced)
    env = {**os.environ, "CDB_HEALTH_INTERVAL_S": "0.1", "CDB_DRAIN_TIMEOUT_S": "5", "CDB_NATIVE": "off"}
    log_file = tmp_path / "scheduler.log"
    with log_file.open("w") as stderr:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, "the scheduler to be ready", timeout=120)
        assert proc.poll() is None, log_file.read_text()
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(pb.GenerateRequest(text="hello", max_tokens=4), timeout=60)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert proc.wait(timeout=60) == 1
        log = log_file.read_text()
        assert "engine loop failed: RuntimeError: injected scheduler failure" in log
        assert "the scheduler exits 1 so that it is restarted" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
