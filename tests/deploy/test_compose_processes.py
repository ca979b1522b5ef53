"""Every service command of docker-compose.yml, started directly as child processes on loopback (Docker does
not run here), must reach ready through the same grpc health probe the compose healthchecks run.

The commands are taken from the compose file with its variables substituted and moved onto this machine by
``Remap``: published and internal ports onto free loopback ports (consistently across commands and probes), the
scheduler's 0.0.0.0 onto 127.0.0.1, the stage-secret volume onto a temporary folder. The one-shot
``stage-secret`` service runs first, as ``depends_on: service_completed_successfully`` orders it. Each process
gets its service's compose environment, except that traces are not exported (there is no collector here).
"""

from __future__ import annotations

import os
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.compose_file import CDB_SERVICES, SECRET_SERVICE, command_argv, interpolate, load
from tests.deploy.process_tree import ProcessSpec, ProcessTree, Remap, run_once

pytestmark = pytest.mark.slow
READY_WAIT_S = 240
SECRET_DIR = "/var/lib/cdb/secret"  # the stage-secret volume's mount point in every cdb service


class ComposeTree(ProcessTree):
    """The compose services as local processes; ``secret_file`` is where the init service wrote the secret."""

    def __init__(self, workdir: Path) -> None:
        services = interpolate(load(), {})["services"]
        (workdir / "secret").mkdir()
        self.remap = Remap.free((50051, 50061, 50062, 50063, 8000, 9464), {SECRET_DIR: workdir / "secret"})
        init = [self.remap(a) for a in command_argv(services[SECRET_SERVICE])]
        done = run_once(init, dict(os.environ))
        assert done.returncode == 0, f"{SECRET_SERVICE}: {done.stdout}{done.stderr}"
        self.secret_file = Path(self.remap(f"{SECRET_DIR}/stage-secret"))
        specs = []
        for name in CDB_SERVICES:
            svc = services[name]
            env = {**os.environ, **{k: self.remap(str(v)) for k, v in svc["environment"].items()}}
            argv = [self.remap(a) for a in command_argv(svc)]
            specs.append(ProcessSpec(name, argv, env, self.remap(svc["healthcheck"]["test"][4])))
        super().__init__(specs, workdir)
        self.metrics_port = self.remap.ports[9464]


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
