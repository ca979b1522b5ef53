"""Every service command of docker-compose.yml, started directly as child processes on loopback (Docker does
not run here), must reach ready through the same grpc health probe the compose healthchecks run.

The commands are taken from the compose file with its variables substituted; the published and internal ports
are remapped to free loopback ports (consistently across commands and probes) and the scheduler listens on
127.0.0.1 instead of 0.0.0.0. Each process gets its service's compose environment, except that traces are not
exported (there is no collector here).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.compose_file import CDB_SERVICES, ROOT, command_argv, interpolate, load

pytestmark = pytest.mark.slow
READY_WAIT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _remap(text: str, ports: dict[int, int]) -> str:
    text = text.replace("0.0.0.0:", "127.0.0.1:")
    return re.sub(r"(?<=:)(\d{4,5})\b", lambda m: str(ports.get(int(m[1]), m[1])), text)


class Tree:
    """The compose services as local processes; ``addr[name]`` is where each one's health is probed."""

    def __init__(self, workdir: Path) -> None:
        services = interpolate(load(), {})["services"]
        self.ports = {p: _free_port() for p in (50051, 50061, 50062, 50063, 9464)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = {name: workdir / f"{name}.log" for name in CDB_SERVICES}
        self.addr: dict[str, str] = {}
        self.metrics_port = self.ports[9464]
        for name in CDB_SERVICES:
            svc: dict[str, Any] = services[name]
            argv = [_remap(a, self.ports) for a in command_argv(svc)]
            assert argv[0] == "python"
            env = {**os.environ, **{k: _remap(str(v), self.ports) for k, v in svc["environment"].items()}}
            env.update(OTEL_TRACES_EXPORTER="none", PYTHONPATH=str(ROOT))
            self.addr[name] = _remap(svc["healthcheck"]["test"][4], self.ports)
            with open(self.logs[name], "wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, *argv[1:]], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )

    def probe(self, name: str, wait: float) -> subprocess.CompletedProcess[str]:
        """The compose healthcheck command of ``name``, repeated (``--wait 5`` each) until SERVING, the process
        exits, or ``wait`` seconds pass."""
        cmd = [sys.executable, "-m", "services.healthcheck", self.addr[name], "--wait", "5"]
        deadline = time.monotonic() + wait
        while True:
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
            if run.returncode == 0 or self.procs[name].poll() is not None or time.monotonic() > deadline:
                return run

    def tail(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    t = Tree(tmp_path_factory.mktemp("compose"))
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.timeout(READY_WAIT_S + 120)
def test_every_service_reaches_ready(tree: Tree) -> None:
    for name in ("prelude", "loop", "head", "scheduler"):  # the scheduler is ready only once its stages are
        run = tree.probe(name, READY_WAIT_S)
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}\n--- log:\n{tree.tail(name)}"
        assert run.stdout.strip().endswith("SERVING")
        assert tree.procs[name].poll() is None, f"{name} exited:\n{tree.tail(name)}"


@pytest.mark.timeout(120)
def test_the_tree_serves_a_generation(tree: Tree) -> None:
    from clients.sync_client import Client

    assert tree.probe("scheduler", READY_WAIT_S).returncode == 0
    with Client(tree.addr["scheduler"], timeout=60) as client:
        result = client.generate([1, 2, 3], max_tokens=4)
    assert result.finish.finish_reason in ("stop", "length") and 1 <= len(result.token_ids) <= 4


@pytest.mark.timeout(60)
def test_the_scheduler_serves_metrics(tree: Tree) -> None:
    assert tree.probe("scheduler", READY_WAIT_S).returncode == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{tree.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "# TYPE cdb_time_to_first_token_seconds histogram" in text
