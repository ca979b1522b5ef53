"""The one settings source: flags > ``CDB_*`` variables > the config file > defaults, for engine and service fields
alike; a TOML or YAML file feeding ``EngineConfig`` and ``Settings``; one-line errors naming the variable or key;
the launcher's children running the parent's config; and (slow) a launched tree configured by one file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from cdb.processes import process_config, scheduler_main, stage_main
from cdb.serve import serve_parser
from cdb_engine.config import DType, EngineConfig
from cdb_engine.options import add_engine_args, engine_config_from_args, engine_config_to_argv
from cdb_model.kv import KVPolicy
from cdb_scheduler.config import Mode
from services.settings import SettingsError, load_configuration, load_settings

pytestmark = pytest.mark.timeout(60)

STAGE_ARGV = ["--role", "loop", "--listen", "127.0.0.1:0"]


def _file(tmp_path: Path, text: str, name: str = "cdb.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_an_engine_field_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _file(tmp_path, "max_num_seqs = 8\n")
    other = _file(tmp_path, "max_num_seqs = 12\n", "other.toml")
    assert process_config("scheduler", [], {}).max_num_seqs == 32
    assert process_config("scheduler", [], {"CDB_CONFIG": path}).max_num_seqs == 8
    assert process_config("scheduler", ["--config", other], {"CDB_CONFIG": path}).max_num_seqs == 12
    env = {"CDB_CONFIG": path, "CDB_MAX_NUM_SEQS": "16"}
    assert process_config("scheduler", [], env).max_num_seqs == 16
    assert process_config("scheduler", ["--max-num-seqs", "24"], env).max_num_seqs == 24


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
    assert process_config("stage", STAGE_ARGV, {"CDB_CONFIG": conf.config_file or ""}).dtype is DType.FLOAT64


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
    parser = argparse.ArgumentParser()
    add_engine_args(parser, {})
    args = parser.parse_args(["--max-depth", "auto", "--exit-threshold", "0.5", "--dtype", "auto", "--device", "cuda"])
    assert engine_config_from_args(args) == EngineConfig(exit_threshold=0.5, device="cuda")
    assert engine_config_from_args(args).dtype is DType.BFLOAT16, "auto resolves on the device"
    for bad in (["--dtype", "f32"], ["--max-depth", "deep"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    err = capsys.readouterr().err
    assert "invalid choice: 'f32' (choose from 'float32', 'float64', 'bfloat16', 'float16', 'auto')" in err
    assert "invalid int value: 'deep'" in err


def test_the_launchers_options_win_over_the_childs_environment(tmp_path: Path) -> None:
    """A child inherits the environment and the file; the options the launcher passes still give the parent's
    config, also where the parent's value is the built-in default (a flag over the file) or auto."""
    path = _file(tmp_path, "max_num_seqs = 8\nmax_depth = 2\n")
    env = {"CDB_CONFIG": path, "CDB_DTYPE": "float64"}
    parent = EngineConfig(model="ouro-tiny", max_num_seqs=32, dtype="float32")  # e.g. flags over the file and env
    argv = engine_config_to_argv(parent, env)
    assert {"--max-num-seqs", "--max-depth", "--dtype"} <= set(argv) and argv[argv.index("--max-depth") + 1] == "auto"
    assert process_config("scheduler", argv, env) == parent
    assert engine_config_to_argv(parent, {}) == [], "nothing to override: only what differs from the defaults"


def test_the_source_is_read_once(tmp_path: Path) -> None:
    path = tmp_path / "cdb.toml"
    path.write_text("max_num_seqs = 8\n")
    env = {"CDB_CONFIG": str(path), "CDB_DRAIN_TIMEOUT_S": "3"}
    first = load_configuration(env)
    assert load_configuration(dict(env)) is first, "the same environment and file: the result of the first read"
    path.write_text("max_num_seqs = 9\n")  # another file (size or mtime changes): read anew
    os.utime(path, ns=(1, 1))
    assert load_configuration(env).engine["max_num_seqs"] == 9


# --- a launched tree ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_launched_tree_runs_one_config_from_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cdb serve --config FILE --max-num-seqs 32`` as the launcher runs it: the four children inherit
    ``CDB_CONFIG`` and get the same effective config (the scheduler's ``Info``; the stages accepted its
    ``Configure``, so model and dtype agree), the flag's value winning over the file's."""
    from clients.sync_client import Client
    from tests.services.tree import process_tree

    path = _file(tmp_path, 'model = "ouro-tiny"\ndtype = "float64"\nmax_num_seqs = 5\nmax_waiting = 9\n')
    monkeypatch.setenv("CDB_CONFIG", path)  # what cdb serve --config FILE does before it starts the tree
    config = load_configuration().engine_config(max_num_seqs=32)
    assert (config.dtype, config.max_num_seqs, config.max_waiting) == (DType.FLOAT64, 32, 9)
    with process_tree(config) as handle, Client(handle.address, timeout=60) as client:
        info = client.info()
        assert (info.model, info.dtype) == ("ouro-tiny", "float64")
        assert (info.limits["max_num_seqs"], info.limits["max_waiting"]) == (32, 9), "the flag over the file"
        assert client.generate([1, 2, 3], max_tokens=3).finish.finish_reason in ("stop", "length")
        for proc in handle.processes():
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert f"CDB_CONFIG={path}".encode() in environ, "every child reads the same file"
