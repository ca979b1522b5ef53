"""The one settings source: flags > ``CDB_*`` variables > the config file > defaults, for engine and service fields
alike; a TOML or YAML file feeding ``EngineConfig`` and ``Settings``; one-line errors naming the variable or key;
a launcher's child running the document it was handed; and (slow) ``cdb serve``'s tree, every process reporting the
one resolved configuration."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cdb.processes import process_resolution, scheduler_main, stage_main
from cdb.serve import serve_parser
from cdb_engine.config import DType, EngineConfig
from cdb_model.kv import KVPolicy
from cdb_scheduler.config import Mode
from services.settings.checks import SettingsError
from services.settings.source import load_configuration, load_settings

pytestmark = pytest.mark.timeout(60)

STAGE_ARGV = ["--role", "loop", "--listen", "127.0.0.1:0"]
ROOT = Path(__file__).resolve().parents[2]


def _file(tmp_path: Path, text: str, name: str = "cdb.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_an_engine_field_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _file(tmp_path, "max_num_seqs = 8\n")
    other = _file(tmp_path, "max_num_seqs = 12\n", "other.toml")

    def width(argv: list[str], env: dict[str, str]) -> int:
        return process_resolution("scheduler", argv, env).engine.max_num_seqs

    assert width([], {}) == 32
    assert width([], {"CDB_CONFIG": path}) == 8
    assert width(["--config", other], {"CDB_CONFIG": path}) == 12
    env = {"CDB_CONFIG": path, "CDB_MAX_NUM_SEQS": "16"}
    assert width([], env) == 16
    assert width(["--max-num-seqs", "24"], env) == 24


def test_a_service_field_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _file(tmp_path, 'http_addr = "127.0.0.1:8001"\ndrain_timeout_s = 5\n')

    def http(argv: list[str], env: dict[str, str]) -> str:
        return str(serve_parser(load_configuration(env, None)).parse_args(argv).http)

    assert http([], {}) == "127.0.0.1:8000" and load_settings({}).drain_timeout_s == 30.0  # cdb serve's own default
    assert http([], {"CDB_HTTP_ADDR": ""}) == "", "set empty: no HTTP API"
    assert http([], {"CDB_CONFIG": path}) == "127.0.0.1:8001"
    assert load_settings({"CDB_CONFIG": path}).drain_timeout_s == 5.0
    env = {"CDB_CONFIG": path, "CDB_HTTP_ADDR": "127.0.0.1:8002", "CDB_DRAIN_TIMEOUT_S": "7"}
    assert http([], env) == "127.0.0.1:8002" and load_settings(env).drain_timeout_s == 7.0
    assert http(["--http", "127.0.0.1:8003"], env) == "127.0.0.1:8003"
    assert http(["--config", path], {"CDB_HTTP_ADDR": "127.0.0.1:8002"}) == "127.0.0.1:8002", "env over --config"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "cdb.toml",
            'model = "huginn-tiny"\ndtype = "float64"\nmax-num-seqs = 5\nkv_policy = "single"\nexit_threshold = 0.25\n'
            'max_depth = "auto"\nearly_exit = false\nmode = "no-refill"\nstage_threads = 2\nuvloop = false\n'
            'metrics_addr = ":9464"\n',
        ),
        (
            "cdb.yaml",
            "model: huginn-tiny\ndtype: float64\nmax_num_seqs: 5\nkv_policy: single\nexit_threshold: 0.25\n"
            "max_depth: auto\nearly_exit: false\nmode: no-refill\nstage_threads: 2\nuvloop: off\n"
            "metrics_addr: ':9464'\n",
        ),
    ],
)
def test_a_config_file_feeds_the_engine_config_and_the_settings(tmp_path: Path, name: str, text: str) -> None:
    conf = load_configuration({"CDB_CONFIG": _file(tmp_path, text, name)})
    want = EngineConfig(
        model="huginn-tiny",
        dtype="float64",
        max_num_seqs=5,
        kv_policy="single",
        exit_threshold=0.25,
        early_exit=False,
        mode="no-refill",
    )
    assert conf.engine_config() == want
    assert conf.engine["dtype"] is DType.FLOAT64 and conf.engine["kv_policy"] is KVPolicy.SINGLE
    assert conf.engine["mode"] is Mode.NO_REFILL and conf.engine["max_depth"] is None, "typed values, auto = None"
    settings = conf.settings
    assert (settings.stage_threads, settings.uvloop, settings.metrics_addr) == (2, False, ":9464")
    assert conf.origins["max_num_seqs"].endswith(f"{name}: max_num_seqs")
    stage = process_resolution("stage", STAGE_ARGV, {"CDB_CONFIG": conf.config_file or ""})
    assert stage.engine == want and stage.settings == settings, "a stage resolves every field, not only its flags'"


BAD_ENV = [
    ({"CDB_MAX_NUM_SEQS": "lots"}, "CDB_MAX_NUM_SEQS='lots': not an integer"),
    ({"CDB_MAX_NUM_SEQS": "0"}, "CDB_MAX_NUM_SEQS='0': must be >= 1"),
    ({"CDB_DTYPE": "f32"}, "CDB_DTYPE='f32': must be one of float32, float64, bfloat16, float16, auto"),
    ({"CDB_KV_POLICY": "lru"}, "CDB_KV_POLICY='lru': must be one of depth_indexed, last_exited, single"),
    ({"CDB_EARLY_EXIT": "maybe"}, "CDB_EARLY_EXIT='maybe': not a boolean"),
    ({"CDB_EXIT_THRESHOLD": "high"}, "CDB_EXIT_THRESHOLD='high': not a number"),
    ({"CDB_DRAIN_TIMEOUT_S": "0"}, "CDB_DRAIN_TIMEOUT_S='0': must be positive"),
    ({"CDB_HTTP_ADDR": "8000"}, "CDB_HTTP_ADDR='8000': must be HOST:PORT"),
    ({"CDB_CPUS": "coda:1"}, "CDB_CPUS='coda:1': must be ROLE:CPU"),
    ({"CDB_FORWARDED_ALLOW_IPS": "proxy.local"}, "CDB_FORWARDED_ALLOW_IPS='proxy.local': must be IPs or CIDRs"),
    ({"CDB_CONFIG": "/nonexistent/cdb.toml"}, "CDB_CONFIG='/nonexistent/cdb.toml': no such file"),
]
BAD_FILE = [
    ("max_num_seqs = 0\n", "max_num_seqs = 0: must be >= 1"),
    ("max_num_seqs = 2.5\n", "max_num_seqs = 2.5: not an integer"),
    ('horizon = "later"\n', "horizon = 'later': must be one of same-step, one-ahead"),
    ("drain_timeout_s = -1\n", "drain_timeout_s = -1: must be positive"),
    ('metrics_addr = "9464"\n', "metrics_addr = '9464': must be HOST:PORT"),
    ("max_num_seq = 8\n", "unknown key 'max_num_seq'; did you mean max_num_seqs?"),
    ("max_num_seqs = \n", "not a valid TOML file"),
    ("[engine]\nmax_num_seqs = 8\n", "unknown key 'engine'"),
]


@pytest.mark.parametrize(("env", "message"), BAD_ENV)
def test_a_bad_variable_is_one_line_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_configuration(env)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("text", "message"), BAD_FILE)
def test_a_bad_file_key_is_one_line_naming_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_configuration({"CDB_CONFIG": path})
    assert str(caught.value).startswith(f"{path}: {message}") and "\n" not in str(caught.value)


def test_the_variable_wins_over_a_bad_file_value_and_names_what_it_checks(tmp_path: Path) -> None:
    path = _file(tmp_path, "max_num_seqs = 0\n")
    assert load_configuration({"CDB_CONFIG": path, "CDB_MAX_NUM_SEQS": "4"}).engine["max_num_seqs"] == 4
    with pytest.raises(SettingsError, match=r"^CDB_MAX_NUM_SEQS='x': not an integer$"):
        load_configuration({"CDB_CONFIG": path, "CDB_MAX_NUM_SEQS": "x"})


@pytest.mark.parametrize("main", [scheduler_main, stage_main])
def test_the_commands_fail_in_one_line_on_a_bad_source(
    main: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CDB_DTYPE", "f32")
    assert callable(main)
    assert main(["--in-process"] if main is scheduler_main else STAGE_ARGV) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "CDB_DTYPE='f32': must be one of float32" in err


def test_flags_take_auto_and_refuse_what_is_not_a_choice(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"CDB_MAX_DEPTH": "3", "CDB_EXIT_THRESHOLD": "0.2"}
    argv = ["--max-depth", "auto", "--exit-threshold", "0.5", "--dtype", "auto", "--device", "cuda"]
    config = process_resolution("scheduler", argv, env).engine
    assert config == EngineConfig(exit_threshold=0.5, device="cuda"), "auto given as a flag wins over the variable"
    assert config.dtype is DType.BFLOAT16, "auto resolves on the device"
    for bad in (["--dtype", "f32"], ["--max-depth", "deep"]):
        with pytest.raises(SystemExit):
            process_resolution("scheduler", bad, {})
    err = capsys.readouterr().err
    assert "invalid choice: 'f32' (choose from 'float32', 'float64', 'bfloat16', 'float16', 'auto')" in err
    assert "invalid int value: 'deep'" in err


def test_a_handed_document_is_the_whole_source_under_the_flags(tmp_path: Path) -> None:
    """A launcher's child reads the document it was handed, not its environment or a config file (it inherits
    both); its own flags would still win."""
    path = _file(tmp_path, "max_num_seqs = 8\nmax_depth = 2\n")
    env = {"CDB_CONFIG": path, "CDB_DTYPE": "float64", "CDB_DRAIN_TIMEOUT_S": "3"}
    parent = process_resolution("scheduler", ["--max-num-seqs", "32", "--max-depth", "auto"], env)
    assert (parent.engine.max_num_seqs, parent.engine.max_depth, parent.settings.drain_timeout_s) == (32, None, 3.0)
    document = str(tmp_path / "config.json")
    parent.write(document)
    for command in ("scheduler", "stage"):
        argv = [*(STAGE_ARGV if command == "stage" else []), "--resolved-config", document]
        assert process_resolution(command, argv, {"CDB_MAX_NUM_SEQS": "4", "CDB_CONFIG": path}) == parent
    flagged = process_resolution("scheduler", ["--resolved-config", document, "--max-num-seqs", "6"], {})
    assert flagged.engine.max_num_seqs == 6
    with pytest.raises(SystemExit):  # one source or the other
        process_resolution("scheduler", ["--resolved-config", document, "--config", path], {})


def test_the_source_is_read_once(tmp_path: Path) -> None:
    path = tmp_path / "cdb.toml"
    path.write_text("max_num_seqs = 8\n")
    env = {"CDB_CONFIG": str(path), "CDB_DRAIN_TIMEOUT_S": "3"}
    first = load_configuration(env)
    assert load_configuration(dict(env)) is first, "the same environment and file: the result of the first read"
    path.write_text("max_num_seqs = 9\n")  # another file (size or mtime changes): read anew
    os.utime(path, ns=(1, 1))
    assert load_configuration(env).engine["max_num_seqs"] == 9


# --- a served tree ----------------------------------------------------------------------------------------------


def _served_address(proc: subprocess.Popen[str]) -> str:
    """The address ``cdb serve`` prints once its tree is ready (``cdb serving MODEL on ADDR ...``)."""
    assert proc.stdout is not None
    seen = []
    while line := proc.stdout.readline():
        seen.append(line)
        if line.startswith("cdb serving "):
            return line.split(" on ", 1)[1].split()[0]
    raise AssertionError(f"cdb serve exited with {proc.wait()} before serving:\n{''.join(seen)}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_process_of_a_served_tree_runs_the_one_resolved_configuration(tmp_path: Path) -> None:
    """``cdb serve`` with values in every layer, resolved once (flags > ``CDB_*`` > config file > defaults): the
    scheduler's Info shows them and the engine runs them, and every stage process reports the same digest (each
    was handed the launcher's document: nothing re-serialised into its argv, its environment not re-read)."""
    from clients.sync_client import Client

    text = "max_num_seqs = 5\nnum_kv_blocks = 100\nkv_block_size = 8\nhealth_interval_s = 0.3\ndrain_timeout_s = 5\n"
    path = _file(tmp_path, text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDB_")} | {"OTEL_TRACES_EXPORTER": "none"}
    env |= {
        "CDB_MAX_NUM_SEQS": "7",
        "CDB_NUM_KV_BLOCKS": "300",
        "CDB_HEALTH_INTERVAL_S": "0.1",
        "CDB_LOG_LEVEL": "info",
    }
    argv = [sys.executable, "-m", "cdb", "serve", "ouro-tiny", "--listen", "127.0.0.1:0", "--no-http"]
    argv += ["--config", path, "--max-num-seqs", "6", "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with Client(_served_address(proc), timeout=60) as client:
            info = client.info()
        cmdlines = {
            role: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for role, pid in info.stage_pids.items()
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    engine, settings = info.config["engine"], info.config["settings"]
    assert engine["max_num_seqs"] == info.limits["max_num_seqs"] == 6, "the flag over the variable over the file"
    assert engine["num_kv_blocks"] == 300 and settings["health_interval_s"] == 0.1, "the variable over the file"
    assert engine["kv_block_size"] == info.kv_block_size == 8 and settings["drain_timeout_s"] == 5, "the file"
    assert engine["max_head_wait_steps"] == 4 and settings["stall_timeout_s"] == 15, "the defaults"
    assert settings["log_level"] == "warning" and settings["http_addr"] == "", "service flags (--no-http)"
    assert info.config_digest == hashlib.sha256(json.dumps(info.config, sort_keys=True).encode()).hexdigest()
    assert info.stage_config_digests == dict.fromkeys(("prelude", "loop", "head"), info.config_digest)
    for role, cmdline in cmdlines.items():
        assert b"--resolved-config" in cmdline, (role, cmdline)
        assert not any(a.startswith((b"--max-num-seqs", b"--model", b"--config")) for a in cmdline), (role, cmdline)


def test_the_stage_spin_is_auto_by_core_count_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CDB_FENCE_SPIN_S`` auto: a stage spins only on a host with cores to spare (on fewer, the spin takes the
    core the scheduler needs); a value given is used as given, 0 included."""
    from services.settings.knobs import SPIN_MIN_CPUS, Settings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(SPIN_MIN_CPUS)))
    assert Settings().fence_spin_s is None and Settings().spin_s == 2e-4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(SPIN_MIN_CPUS - 1)))
    assert Settings().spin_s == 0.0
    assert Settings(fence_spin_s=5e-5).spin_s == 5e-5 and Settings(fence_spin_s=0.0).spin_s == 0.0
    assert load_settings(environ={"CDB_FENCE_SPIN_S": "auto"}).fence_spin_s is None
    assert load_settings(environ={"CDB_FENCE_SPIN_S": "1e-4"}).spin_s == 1e-4
    with pytest.raises(SettingsError, match="CDB_FENCE_SPIN_S='-1': must be >= 0"):
        load_settings(environ={"CDB_FENCE_SPIN_S": "-1"})


def test_the_front_ends_are_auto_by_core_count_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CDB_FRONTENDS`` auto (the default): where the stages compute on the host's cores, no front-end process
    below ``FRONTENDS_MIN_CPUS`` (the scheduler serves the ports); where they compute on a device, one from two
    cores; then one per ``FRONTEND_CPUS`` cores beyond four, at most ``MAX_AUTO_FRONTENDS``; a count given is used
    as given, 0 included."""
    from services.settings.knobs import FRONTEND_CPUS, FRONTENDS_MIN_CPUS, MAX_AUTO_FRONTENDS, Settings

    def cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    cores(2)
    assert Settings().frontends is None and Settings().front_ends() == 0 and Settings().front_ends(True) == 1
    cores(1)
    assert Settings().front_ends(True) == 0
    cores(FRONTENDS_MIN_CPUS - 1)
    assert Settings().front_ends() == 0 and Settings().front_ends(True) == 1
    cores(FRONTENDS_MIN_CPUS)
    assert Settings().front_ends() == 1
    cores(4 + 3 * FRONTEND_CPUS)
    assert Settings().front_ends() == Settings().front_ends(True) == 3
    cores(256)
    assert Settings().front_ends() == MAX_AUTO_FRONTENDS
    assert Settings(frontends=0).front_ends(True) == 0 and Settings(frontends=2).front_ends() == 2
    assert load_settings(environ={"CDB_FRONTENDS": "auto"}).frontends is None
    assert load_settings(environ={"CDB_FRONTENDS": "1"}).front_ends() == 1
    with pytest.raises(SettingsError, match="CDB_FRONTENDS='-1': must be >= 0"):
        load_settings(environ={"CDB_FRONTENDS": "-1"})
