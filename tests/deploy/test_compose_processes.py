"""Every service command of docker-compose.yml, started directly as child processes on loopback (Docker does
not run here), must reach ready through the same grpc health probe the compose healthchecks run.

The commands are taken from the compose file with its variables substituted and moved onto this machine by
``Remap``: published and internal ports onto free loopback ports (consistently across commands and probes), the
scheduler's 0.0.0.0 onto 127.0.0.1, the stage-secret volume onto a temporary folder. The one-shot
``stage-secret`` service runs first, as ``depends_on: service_completed_successfully`` orders it. Each process
gets its service's compose environment, except that traces are not exported (there is no collector here).
"""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.compose_file import (
    CDB_SERVICES,
    FRONTEND_SERVICE,
    FRONTENDS_OVERRIDE,
    LINK_DIR,
    SECRET_SERVICE,
    command_argv,
    interpolate,
    load,
    merge,
)
from tests.deploy.process_tree import ProcessSpec, ProcessTree, Remap, run_once

pytestmark = pytest.mark.slow
READY_WAIT_S = 240
SECRET_DIR = "/var/lib/cdb/secret"  # the stage-secret volume's mount point in every cdb service


class ComposeTree(ProcessTree):
    """The compose services as local processes (with ``override`` merged: its services too, a service with
    ``deploy.replicas`` as that many processes ``NAME-1``...); ``secret_file`` is where the init service wrote the
    secret."""

    def __init__(self, workdir: Path, override: Path | None = None) -> None:
        doc = load()
        if override is not None:
            doc = merge(doc, load(override))
        services = interpolate(doc, {})["services"]
        (workdir / "secret").mkdir()
        (workdir / "link").mkdir(mode=0o700)
        paths = {SECRET_DIR: workdir / "secret", LINK_DIR: workdir / "link"}
        self.remap = Remap.free((50051, 50061, 50062, 50063, 8000, 9464), paths)
        init = [self.remap(a) for a in command_argv(services[SECRET_SERVICE])]
        done = run_once(init, dict(os.environ))
        assert done.returncode == 0, f"{SECRET_SERVICE}: {done.stdout}{done.stderr}"
        self.secret_file = Path(self.remap(f"{SECRET_DIR}/stage-secret"))
        specs = []
        for name in [*CDB_SERVICES, *([FRONTEND_SERVICE] if FRONTEND_SERVICE in services else [])]:
            svc = services[name]
            env = {**os.environ, **{k: self.remap(str(v)) for k, v in svc["environment"].items()}}
            argv = [self.remap(a) for a in command_argv(svc)]
            replicas = int(svc.get("deploy", {}).get("replicas", 0))
            for process in [f"{name}-{i + 1}" for i in range(replicas)] or [name]:
                specs.append(ProcessSpec(process, argv, env, self.remap(svc["healthcheck"]["test"][4])))
        super().__init__(specs, workdir)
        self.metrics_port = self.remap.ports[9464]
        self.http_port = self.remap.ports[8000]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeTree]:
    t = ComposeTree(tmp_path_factory.mktemp("compose"))
    try:
        yield t
    finally:
        t.stop()


def test_the_init_service_wrote_a_private_secret_once(tree: ComposeTree) -> None:
    mode = tree.secret_file.stat().st_mode
    assert stat.S_IMODE(mode) == 0o600, oct(mode)
    secret = tree.secret_file.read_text()
    assert len(secret.strip()) >= 16
    init = interpolate(load(), {})["services"][SECRET_SERVICE]
    again = run_once([tree.remap(a) for a in command_argv(init)], dict(os.environ))  # an `up` after a restart
    assert again.returncode == 0, again.stderr
    assert tree.secret_file.read_text() == secret, "an existing secret is kept"


@pytest.mark.timeout(READY_WAIT_S + 120)
def test_every_service_reaches_ready(tree: ComposeTree) -> None:
    for name in ("prelude", "loop", "head", "scheduler"):  # the scheduler is ready only once its stages are
        run = tree.probe(name, READY_WAIT_S)
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}\n--- log:\n{tree.tail(name)}"
        assert run.stdout.strip().endswith("SERVING")
        assert tree.procs[name].poll() is None, f"{name} exited:\n{tree.tail(name)}"


@pytest.mark.timeout(120)
def test_the_tree_serves_a_generation(tree: ComposeTree) -> None:
    from clients.sync_client import Client

    assert tree.probe("scheduler", READY_WAIT_S).returncode == 0
    with Client(tree.addr["scheduler"], timeout=60) as client:
        result = client.generate([1, 2, 3], max_tokens=4)
    assert result.finish.finish_reason in ("stop", "length") and 1 <= len(result.token_ids) <= 4


@pytest.mark.timeout(60)
def test_the_scheduler_serves_metrics(tree: ComposeTree) -> None:
    assert tree.probe("scheduler", READY_WAIT_S).returncode == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{tree.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "# TYPE cdb_time_to_first_token_seconds histogram" in text


# ---------------------------------------------------------------------- deploy/docker-compose.frontends.yml


@pytest.fixture(scope="module")
def front_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeTree]:
    t = ComposeTree(tmp_path_factory.mktemp("compose-frontends"), FRONTENDS_OVERRIDE)
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.timeout(READY_WAIT_S + 120)
def test_with_front_ends_every_process_reaches_ready_and_the_public_port_streams(front_tree: ComposeTree) -> None:
    """The override's tree: the stages, the scheduler (its port a Unix socket in the link volume) and two front
    ends sharing the public gRPC and HTTP ports; a generation over gRPC and one over HTTP through them, and the
    scheduler's metrics count the tokens the front ends streamed."""
    from clients.sync_client import Client

    names = ("prelude", "loop", "head", "scheduler", f"{FRONTEND_SERVICE}-1", f"{FRONTEND_SERVICE}-2")
    assert set(front_tree.procs) == set(names)
    assert front_tree.addr["scheduler"].startswith("unix:")
    for name in names:
        run = front_tree.probe(name, READY_WAIT_S)
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}\n--- log:\n{front_tree.tail(name)}"
        assert front_tree.procs[name].poll() is None, f"{name} exited:\n{front_tree.tail(name)}"
    with Client(front_tree.addr[f"{FRONTEND_SERVICE}-1"], timeout=60) as client:
        result = client.generate([1, 2, 3], max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4
    body = json.dumps({"model": "ouro-kjv", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{front_tree.http_port}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 30
    while True:  # the front ends relay their request metrics every 50 ms
        with urllib.request.urlopen(f"http://127.0.0.1:{front_tree.metrics_port}/metrics", timeout=10) as resp:
            counted = [ln for ln in resp.read().decode().splitlines() if ln.startswith("cdb_generation_tokens_total{")]
        if (counted and float(counted[0].split()[1]) >= 7) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counted and float(counted[0].split()[1]) == 7
