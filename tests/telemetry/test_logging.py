"""Logs: the level and the JSON format of every process, the opt-in request line (never the prompt), the periodic
throughput line, the flags, and a real tree whose four processes all log alike."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from cdb.processes import scheduler_parser, stage_parser
from cdb.serve import serve_parser
from cdb_engine.config import EngineConfig
from cdb_engine.events import FinishEvent, TokenEvent
from cdb_scheduler.request import FinishReason
from clients.sync_client import Client
from services import telemetry
from services.settings.checks import SettingsError
from services.settings.knobs import Settings
from services.settings.source import load_configuration, load_settings
from services.telemetry.logs import REQUEST_LOG, ThroughputLog, configure_logging
from services.telemetry.metrics import Metrics
from services.telemetry.request_observer import ObservedRequest
from tests.services.tree import process_tree

pytestmark = pytest.mark.timeout(60)
REQUEST_FIELDS = {
    "request_id",
    "caller",
    "prompt_tokens",
    "generated_tokens",
    "mean_depth",
    "finish_reason",
    "latency_s",
}


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """configure_logging changes this process's root logger: put it back after each test."""
    root = logging.getLogger()
    handlers, level, request_level = list(root.handlers), root.level, REQUEST_LOG.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    REQUEST_LOG.setLevel(request_level)
    logging.captureWarnings(False)


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_format_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("loop", Settings(log_format="json"))
    logging.getLogger("cdb.test").info("hello %s", "there", extra={"answer": 42})
    logging.getLogger("cdb.test").debug("not at info")
    (line,) = _json_lines(capsys.readouterr().err)
    assert line["message"] == "hello there" and line["level"] == "INFO" and line["logger"] == "cdb.test"
    assert line["role"] == "loop" and line["answer"] == 42 and "time" in line


def test_text_format_and_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("head", Settings(log_level="warning"))
    log = logging.getLogger("cdb.test")
    log.info("quiet")
    log.warning("loud")
    err = capsys.readouterr().err
    assert "quiet" not in err and " head WARNING loud" in err
    configure_logging("head", Settings(log_level="warning"), level="debug")  # the flag over the setting
    log.debug("detail")
    err = capsys.readouterr().err
    assert " head DEBUG detail" in err and len(logging.getLogger().handlers) == len(set(logging.getLogger().handlers))


def test_a_text_line_cannot_be_forged_from_a_logged_value(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings())
    logging.getLogger("cdb.test").warning("request %s failed", "r1\r\n2026-01-01 scheduler ERROR forged\x1b[2J")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "ERROR forged" in lines[0]
    assert lines[0].endswith("request r1\\r\\n2026-01-01 scheduler ERROR forged\\x1b[2J failed")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("cdb.test").exception("caf\u00e9 crashed")
    err = capsys.readouterr().err
    assert " scheduler ERROR café crashed\nTraceback" in err, "printable text as is, the traceback below"


def test_a_second_setup_replaces_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings())
    configure_logging("scheduler", Settings(log_format="json"))
    logging.getLogger("cdb.test").warning("once")
    assert len(_json_lines(capsys.readouterr().err)) == 1  # JSON only: the text handler is gone


def test_log_settings_are_validated() -> None:
    assert load_settings({"CDB_LOG_LEVEL": "debug", "CDB_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(SettingsError, match="CDB_LOG_LEVEL"):
        load_settings({"CDB_LOG_LEVEL": "verbose"})
    with pytest.raises(SettingsError, match="CDB_LOG_FORMAT"):
        load_settings({"CDB_LOG_FORMAT": "xml"})
    with pytest.raises(SettingsError, match="CDB_THROUGHPUT_LOG_INTERVAL_S"):
        load_settings({"CDB_THROUGHPUT_LOG_INTERVAL_S": "-1"})
    assert load_settings({"CDB_THROUGHPUT_LOG_INTERVAL_S": "0"}).throughput_log_interval_s == 0


# --- the request line -------------------------------------------------------------------------------------------


def _serve_one_request(prompt_text: str) -> None:
    clock = iter((10.0, 10.5, 10.75, 11.0))  # arrival, two tokens, the finish
    observer = ObservedRequest(
        Metrics(model="m"),
        None,
        telemetry.NOOP_REQUEST_SPAN,
        status_name=lambda e: "INTERNAL",
        deadline_passed=lambda: False,
        cut=lambda: False,
        request_id="req-7",
        caller="key-0123456789ab",
        clock=lambda: next(clock),
    )
    observer.validated(5)
    observer.admitted(5)
    observer.event(TokenEvent("req-7", 0, 11, prompt_text, 4, None))
    observer.event(TokenEvent("req-7", 1, 12, prompt_text, 2, None))
    observer.event(FinishEvent("req-7", FinishReason.LENGTH, 5, 2, 6))


def test_the_request_line_is_opt_in(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings(log_format="json", log_level="debug"))
    _serve_one_request("secret words")
    assert not any("request_id" in x for x in _json_lines(capsys.readouterr().err))  # off even at debug


def test_the_request_line_names_the_request_never_its_text(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings(log_format="json", log_level="warning", request_log=True))
    _serve_one_request("secret words")
    err = capsys.readouterr().err
    (line,) = _json_lines(err)  # on at level warning too: the opt-in is the request logger's own
    assert {k: line[k] for k in REQUEST_FIELDS} == {
        "request_id": "req-7",
        "caller": "key-0123456789ab",
        "prompt_tokens": 5,
        "generated_tokens": 2,
        "mean_depth": 3.0,
        "finish_reason": "length",
        "latency_s": 1.0,
    }
    assert line["logger"] == "cdb.requests" and "secret" not in err
    configure_logging("scheduler", Settings(request_log=True))
    _serve_one_request("secret words")
    text = capsys.readouterr().err
    assert "request req-7 finished: caller=key-0123456789ab prompt_tokens=5 generated_tokens=2" in text
    assert "mean_depth=3.00 finish_reason=length latency=1.000s" in text


# --- the throughput line ----------------------------------------------------------------------------------------


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_throughput_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings(log_format="json"))
    m, clock = Metrics(), _Clock()
    report = ThroughputLog(m, 10.0, clock=clock)
    clock.t = 10.0
    assert report.report() is None  # idle: no line
    for depth in (4, 2, 3, 3):
        m.observe_token_depth(depth)
    m.observe_admitted(40)
    m.observe_loop_batch(size=3, capacity=4)
    m.observe_loop_batch(size=1, capacity=4)
    m.add_collector(lambda mm: (mm.set_queue_sizes(waiting=1, running=2), mm.set_kv_blocks(used=5, total=20)))
    clock.t = 12.0
    t = report.report()
    assert t is not None
    assert (t.interval_s, t.generation_tokens_per_s, t.prompt_tokens_per_s) == (2.0, 2.0, 20.0)
    assert (t.mean_depth, t.occupancy, t.running, t.waiting, t.kv_usage) == (3.0, 0.5, 2, 1, 0.25)
    (line,) = _json_lines(capsys.readouterr().err)
    assert line["logger"] == "cdb.throughput" and line["generation_tokens_per_s"] == 2.0 and line["occupancy"] == 0.5
    assert line["message"].startswith("throughput: 2.0 tokens/s generated, 20.0 tokens/s prompt, mean depth 3.00")
    m.observe_token_depth(1)
    clock.t = 13.0
    t = report.report()  # only the new interval counts
    assert t is not None and (t.generation_tokens_per_s, t.mean_depth, t.occupancy) == (1.0, 1.0, 0.0)


def test_the_throughput_thread_logs_its_last_interval_at_close(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("scheduler", Settings())
    m = Metrics()
    report = ThroughputLog(m, 3600.0).start()
    m.observe_token_depth(2)
    report.close()
    assert "throughput: " in capsys.readouterr().err
    assert ThroughputLog(m, 0.0).start()._thread is None  # interval 0: off


# --- the flags --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [serve_parser, scheduler_parser, stage_parser])
def test_log_level_flag(build: Any) -> None:
    conf = load_configuration({"CDB_LOG_LEVEL": "warning"})
    base = ["--role", "loop", "--listen", "unix:/tmp/x"] if build is stage_parser else []
    assert build(conf).parse_args(base).log_level == "warning"
    assert build(conf).parse_args([*base, "--log-level", "debug"]).log_level == "debug"
    with pytest.raises(SystemExit):
        build(conf).parse_args([*base, "--log-level", "loud"])


def test_serve_hands_its_log_flags_to_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cdb serve --log-level debug --request-log``: both in the configuration it hands the tree."""
    import cdb.serve

    for var in ("CDB_LOG_LEVEL", "CDB_REQUEST_LOG"):
        monkeypatch.delenv(var, raising=False)
    seen: list[Any] = []

    def serve_forever(resolved: Any, listen: str) -> int:
        seen.append(resolved.settings)
        return 0

    monkeypatch.setattr(cdb.serve, "serve_forever", serve_forever)
    argv = ["--listen", "127.0.0.1:0", "--model", "ouro-tiny", "--http", "", "--log-level", "debug", "--request-log"]
    assert cdb.serve.serve_main(argv) == 0
    assert (seen[0].log_level, seen[0].request_log) == ("debug", True)
    assert logging.getLogger().level == logging.DEBUG  # the launcher's own logs too


# --- a real tree ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_process_of_a_tree_logs_json_and_the_scheduler_logs_requests() -> None:
    config = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=128, max_total_tokens=256)
    env = {"CDB_LOG_FORMAT": "json", "CDB_REQUEST_LOG": "true", "CDB_THROUGHPUT_LOG_INTERVAL_S": "3600"}
    with process_tree(config, **env) as handle:
        with Client(handle.address, timeout=60) as client:
            result = client.generate("In the beginning", max_tokens=3, ignore_eos=True, request_id="logged-1")
        handle.unsupervise()  # stop the scheduler ourselves (its last throughput line) and read its log
        assert handle.scheduler is not None
        handle.scheduler.send_signal(signal.SIGTERM)
        handle.scheduler.wait(timeout=30)
        logs = {name: handle.log(name) for name in ("scheduler", "prelude", "loop", "head")}
    for name, text in logs.items():
        lines = _json_lines(text)  # raises on a line that is not JSON
        assert lines and {x["role"] for x in lines} == {name}, name
    scheduler = _json_lines(logs["scheduler"])
    (request,) = [x for x in scheduler if x["logger"] == "cdb.requests"]
    assert request["request_id"] == "logged-1" and request["caller"] == "anon"
    assert (request["prompt_tokens"], request["generated_tokens"]) == (result.finish.prompt_tokens, 3)
    assert request["mean_depth"] == pytest.approx(sum(t.depth for t in result.tokens) / 3, abs=1e-3)
    assert request["finish_reason"] == "length" and "In the beginning" not in logs["scheduler"]
    (throughput,) = [x for x in scheduler if x["logger"] == "cdb.throughput"]
    assert throughput["generation_tokens_per_s"] > 0 and throughput["mean_depth"] >= 1
