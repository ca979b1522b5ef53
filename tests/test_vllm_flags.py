"""``cdb serve`` takes vLLM's spellings of its options (``docs/coming-from-vllm.md``), and no option is ever read
as an abbreviation of another."""

from __future__ import annotations

import pytest

from cdb.resolution import resolve_command
from cdb.serve import serve_parser


def resolved(*argv: str):  # type: ignore[no-untyped-def]
    return resolve_command(["ouro-tiny", *argv], "cdb serve", serve_parser).resolved


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error of a command line the parser refuses (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        resolved(*argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_host_and_port_set_the_http_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert resolved().settings.http_addr == "127.0.0.1:8000"
    assert resolved("--port", "9001").settings.http_addr == "127.0.0.1:9001"
    assert resolved("--host", "0.0.0.0", "--port", "9002").settings.http_addr == "0.0.0.0:9002"
    assert resolved("--http", "127.0.0.1:7000", "--host", "localhost").settings.http_addr == "localhost:7000"
    assert "--host/--port: the HTTP API is off" in refused(capsys, "--no-http", "--port", "9003")


def test_api_key_is_repeatable_and_never_an_abbreviation_of_the_keys_file(capsys: pytest.CaptureFixture[str]) -> None:
    settings = resolved("--api-key", "sk-1", "--api-key", "sk-2").settings
    assert settings.api_keys == "sk-1,sk-2" and not settings.api_keys_file
    assert "--api-key: a key must be non-empty" in refused(capsys, "--api-key", "a,b")
    assert "unrecognized arguments: --api-keys" in refused(capsys, "--api-keys", "sk-1")  # not --api-keys-file


def test_enforce_eager_max_model_len_and_memory_share_reach_the_configuration() -> None:
    r = resolved("--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.5")
    assert r.settings.cuda_graphs is False and resolved().settings.cuda_graphs is True
    assert r.engine.max_total_tokens == 1024 and r.engine.gpu_memory_utilization == 0.5


def test_tokenizer_names_another_tokenizer_and_a_folder_without_one_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cdb_engine.config import EngineConfig
    from cdb_engine.preflight import ConfigError, check_config
    from cdb_engine.prepare import RequestPreparer
    from cdb_model.loader import DEFAULT_MODEL, _folder

    shipped = str(_folder(DEFAULT_MODEL))
    prep = RequestPreparer.of(EngineConfig(model=shipped, tokenizer=shipped))
    assert prep.tokenizer.encode("And God said") == RequestPreparer.of(EngineConfig(model=shipped)).tokenizer.encode(
        "And God said"
    )
    assert resolved("--tokenizer", shipped).engine.tokenizer == shipped
    with pytest.raises(ConfigError, match="--tokenizer"):
        check_config(EngineConfig(model="ouro-tiny", tokenizer=str(tmp_path)))
