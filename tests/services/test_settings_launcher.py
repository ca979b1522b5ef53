"""Settings from ``CDB_*`` variables and the launcher's configuration plumbing: the resolved configuration's
document, stage addresses, ready files; (slow) children die with their launcher."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from services.net import parse_stage_addrs, wait_ready_file, write_ready_file
from services.settings.checks import SettingsError
from services.settings.knobs import Settings
from services.settings.resolved import Resolved
from services.settings.source import load_settings

pytestmark = pytest.mark.timeout(30)


def test_settings_defaults_and_overrides() -> None:
    assert load_settings({}) == Settings()
    s = load_settings({"CDB_DRAIN_TIMEOUT_S": "2.5", "CDB_STAGE_THREADS": "2", "CDB_UVLOOP": "off", "OTHER": "x"})
    assert (s.drain_timeout_s, s.stage_threads, s.uvloop) == (2.5, 2, False)


def test_metrics_address_setting() -> None:
    from services.telemetry.metrics_endpoint import metrics_address_from_env

    assert load_settings({}).metrics_addr == "" and metrics_address_from_env({"CDB_STAGE_THREADS": "x"}) is None
    assert load_settings({"CDB_METRICS_ADDR": " 0.0.0.0:9464 "}).metrics_addr == "0.0.0.0:9464"
    assert metrics_address_from_env({"CDB_METRICS_ADDR": ":9464"}) == ":9464"


@pytest.mark.parametrize(
    "env,match",
    [
        ({"CDB_STAGE_THREADS": "two"}, "CDB_STAGE_THREADS"),
        ({"CDB_UVLOOP": "maybe"}, "CDB_UVLOOP"),
        ({"CDB_DRAIN_TIMEOUT_S": "0"}, "CDB_DRAIN_TIMEOUT_S"),
        ({"CDB_MAX_CONCURRENT_RPCS": "-1"}, "MAX_CONCURRENT"),
        ({"CDB_METRICS_ADDR": "9464"}, "CDB_METRICS_ADDR"),
        ({"CDB_METRICS_ADDR": "host:port"}, "CDB_METRICS_ADDR"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        load_settings(env)


def test_the_resolved_configuration_round_trips_through_its_document(tmp_path: Path) -> None:
    """What the launcher hands its children: every field, typed again on the way back (enums, auto = None)."""
    config = EngineConfig(
        model="huginn-tiny",
        dtype="float64",
        max_num_seqs=5,
        kv_policy="single",
        exit_threshold=0.25,
        max_input_tokens=100,
        init_seed=3,
        early_exit=False,
    )
    resolved = Resolved(Settings(fence_spin_s=1e-4, stage_secret="s3cret-value", log_level="debug"), config)
    path = str(tmp_path / "config.json")
    resolved.write(path)
    assert Resolved.read(path) == resolved and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "s3cret-value" not in resolved.shown() and json.loads(resolved.shown())["settings"]["stage_secret"]
    assert resolved.digest() == hashlib.sha256(resolved.shown().encode()).hexdigest()
    assert Resolved(Settings(), config).digest() != resolved.digest()
    for bad in ("{", '{"engine": {}}', '{"engine": {"max_num_seqs": 0}, "settings": {}}'):
        with pytest.raises(SettingsError, match="not a resolved configuration"):
            Resolved.from_json(bad)


def test_stage_addresses() -> None:
    addrs = parse_stage_addrs(["prelude=unix:///a", "loop=127.0.0.1:1", "head=127.0.0.1:2"])
    assert addrs == {Stage.PRELUDE: "unix:///a", Stage.LOOP: "127.0.0.1:1", Stage.HEAD: "127.0.0.1:2"}
    with pytest.raises(ValueError, match="missing --stage for head"):
        parse_stage_addrs(["prelude=a:1", "loop=b:2"])
    with pytest.raises(ValueError, match="ROLE=ADDRESS"):
        parse_stage_addrs(["coda=a:1"])


def test_ready_files(tmp_path: Path) -> None:
    path = str(tmp_path / "x.ready")
    write_ready_file(path, "127.0.0.1:5")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_ready_file(path, alive, 5, "x") == "127.0.0.1:5"
    finally:
        alive.kill()
        alive.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3"):
        wait_ready_file(str(tmp_path / "never"), dead, 20, "child")


def test_metrics_listen_option() -> None:
    from cdb.processes import scheduler_main
    from cdb.serve import serve_main

    with pytest.raises(SystemExit):
        scheduler_main(["--in-process", "--metrics-listen", "nowhere"])
    with pytest.raises(SystemExit):
        serve_main(["--metrics-listen", "nowhere"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """kill -9 of the process that started the tree: every child gets SIGTERM (PR_SET_PDEATHSIG, set by the child
    itself) and exits; none is left serving."""
    script = (
        "import sys, time\n"
        "from cdb_engine.config import EngineConfig\n"
        "from services.launcher.tree import serve_all\n"
        "h = serve_all(EngineConfig(model='ouro-tiny'), '127.0.0.1:0')\n"
        "print(' '.join(str(p.pid) for p in h.processes()), flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert launcher.stdout is not None
    pids = [int(p) for p in launcher.stdout.readline().split()]
    assert len(pids) == 4
    launcher.kill()
    launcher.wait()
    for pid in pids:  # each child exits on its own; wait for it to be gone (reaped by init)
        deadline = time.monotonic() + 60
        while _alive(pid):
            assert time.monotonic() < deadline, f"child {pid} outlived its launcher"
            time.sleep(0.05)  # polling /proc: a foreign process offers no wait primitive


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cpu_pinning_setting_parses_and_names_bad_parts() -> None:
    from services.settings.checks import cpu_map

    assert cpu_map("loop:1, head:0+1,scheduler:0") == {"loop": {1}, "head": {0, 1}, "scheduler": {0}}
    assert load_settings({"CDB_CPUS": "prelude:0"}).cpus == "prelude:0"
    for bad in ("loop", "coda:1", "loop:x"):
        with pytest.raises(SettingsError, match="CDB_CPUS"):
            load_settings({"CDB_CPUS": bad})
