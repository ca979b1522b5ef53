"""``cdb trace``: the watcher's settling and output on hand-made spans, the loop on a live receiver fed by this
process's tracing, and the command itself as a process (endpoint line, tree, ``--json``, ``--request-id``,
Ctrl-C)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import telemetry
from services.telemetry.otlp_receiver import (
    KIND_CONSUMER,
    KIND_INTERNAL,
    KIND_SERVER,
    CollectedSpan,
    OtlpReceiver,
    otel_env,
)
from services.telemetry.trace_cli import TraceWatcher, watch
from tests.telemetry.test_telemetry_spans import MS, _drive_request

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)
STAGES = ("prelude", "loop", "head")


def _span(
    name: str, trace: str, span_id: str, parent: str = "", kind: int = KIND_INTERNAL, **kw: object
) -> CollectedSpan:
    fields: dict[str, object] = dict(
        service="cdb-scheduler",
        name=name,
        trace_id=trace,
        span_id=span_id,
        parent_span_id=parent,
        kind=kind,
        start_ns=0,
        end_ns=2 * MS,
        attributes={},
        events=[],
        links=[],
        status_code=0,
        status_message="",
    )
    fields.update(kw)
    return CollectedSpan(**fields)  # type: ignore[arg-type]


def _request(trace: str, span_id: str, request_id: str) -> CollectedSpan:
    attrs = {"gen_ai.operation.name": "text_completion", "cdb.request_id": request_id}
    return _span("text_completion m", trace, span_id, kind=KIND_SERVER, attributes=attrs, end_ns=5 * MS)


def _batch(trace: str, linked: tuple[str, str], seq: int = 0) -> CollectedSpan:
    attrs = {"cdb.stage": "loop", "cdb.op.seq": seq, "cdb.batch.size": 2, "cdb.batch.requests": 1}
    return _span(
        "batch loop", trace, "b" * 16, kind=KIND_CONSUMER, service="cdb-loop", attributes=attrs, links=[linked]
    )


def test_a_request_is_printed_once_its_trace_and_linked_batches_settle() -> None:
    out = io.StringIO()
    w = TraceWatcher(out, settle_s=1.0, keep_s=10.0)
    req = _request("t1", "r1", "a")
    w.add([req, _span("queue", "t1", "q1", "r1")], now=0.0)
    assert w.next_due() == 1.0
    w.add([_batch("t9", ("t1", "r1"))], now=0.8)  # a stage's batch span arrives later: the request waits for it
    w.emit_due(1.5)
    assert out.getvalue() == "" and w.next_due() == 1.8
    w.emit_due(1.9)
    text = out.getvalue()
    assert text.splitlines()[:2] == [
        "[cdb-scheduler] trace t1",
        "  cdb.request_id=a, gen_ai.operation.name=text_completion",
    ]
    assert re.search(r"^text_completion m +5\.000 ms\n  queue +2\.000 ms$", text, re.M), text
    assert "linked from 1 batch spans" in text and re.search(
        r"\[cdb-loop\] +batch loop +2\.000 ms +seq=0 tokens=2", text
    )
    assert w.printed == 1 and w.next_due() is None
    w.emit_due(100.0)  # forgotten once older than keep_s
    assert not w._traces and not w._batches


def test_request_id_filter_json_and_flush() -> None:
    out = io.StringIO()
    w = TraceWatcher(out, request_id="b", as_json=True, settle_s=5.0)
    w.add([_request("t1", "r1", "a"), _request("t2", "r2", "b"), _span("decode", "t2", "d2", "r2")], now=0.0)
    w.add([_batch("t9", ("t2", "r2"), seq=3)], now=0.1)
    assert not w.done
    w.flush()  # Ctrl-C before it settled: printed as it stands
    (line,) = out.getvalue().splitlines()
    doc = json.loads(line)
    assert (doc["trace_id"], doc["request_id"]) == ("t2", "b") and w.done
    assert doc["request"]["name"] == "text_completion m" and doc["request"]["duration_ms"] == 5.0
    assert [c["name"] for c in doc["request"]["children"]] == ["decode"]
    (batch,) = doc["batches"]
    assert (batch["name"], batch["service"], batch["trace_id"], batch["attributes"]["cdb.op.seq"]) == (
        "batch loop",
        "cdb-loop",
        "t9",
        3,
    )


class _Lines(io.StringIO):
    """Output that signals every write (the test waits on it, not on time)."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Condition()

    def write(self, s: str) -> int:
        with self.wrote:
            n = super().write(s)
            self.wrote.notify_all()
            return n

    def wait_for(self, text: str, timeout: float = 20.0) -> str:
        with self.wrote:
            assert self.wrote.wait_for(lambda: text in self.getvalue(), timeout), self.getvalue()
            return self.getvalue()


def _export_request(rid: int, request_id: str = "") -> None:
    """One request through every stage, with a batch span per stage linked to it (this process's tracing)."""
    traces = telemetry.RequestTraces()
    span, t = _drive_request(traces, rid=rid, t0=telemetry.now_ns())
    if request_id:
        span.set_attribute("cdb.request_id", request_id)
    for stage in STAGES:
        tracer = telemetry.StageTracer(stage)
        tracer.update(traces.contexts_for(stage, [rid]))
        tracer.record(0, [rid, rid], t, t + MS, 0.0005)
    span.finish("length", output_tokens=3, depths=[4, 3, 3], t_ns=t)
    telemetry.force_flush()


def test_watch_prints_the_tree_of_exported_spans(tracing: OtlpReceiver) -> None:
    out, stop = _Lines(), threading.Event()
    loop = threading.Thread(target=watch, args=(tracing, TraceWatcher(out, settle_s=0.05), stop), daemon=True)
    loop.start()
    _export_request(rid=5)
    text = out.wait_for("linked from 3 batch spans")
    text = out.wait_for("batch head")
    stop.set()
    loop.join(10)
    assert not loop.is_alive()
    tree = [m.group(1) for line in text.splitlines() if (m := re.match(r"^( *\S.*?) +\d+\.\d{3} ms", line))]
    assert tree[:14] == [
        "text_completion ouro-tiny",
        "  validate",
        "  queue",
        "  prefill",
        "    hop prelude",
        "    hop loop",
        "    hop head",
        "  decode",
        *["    hop prelude", "    hop loop", "    hop head"] * 2,  # 2 decode tokens, 3 loop steps merged in each
    ], text
    assert re.search(r"^  validate +1\.000 ms$", text, re.M) and re.search(r"^    hop loop .* steps=4$", text, re.M)
    for stage in STAGES:
        assert re.search(rf"\[cdb-test\] +batch {stage} +1\.000 ms +seq=0 tokens=2 requests=1", text), text


def _cdb_trace(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "cdb", "trace", "--port", "0", "--settle", "0.1", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _endpoint(stream: io.TextIOBase | None) -> str:
    assert stream is not None
    line = stream.readline()
    found = re.search(r"OTLP receiver on (http://127\.0\.0\.1:\d+);", line)
    assert found, line
    return found.group(1)


@pytest.fixture
def trace_process() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _trace_to(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in otel_env(endpoint, "cdb-test").items():
        monkeypatch.setenv(key, value)
    telemetry.init_tracing("cdb-test")


def test_cdb_trace_prints_requests_until_ctrl_c(
    trace_process: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _cdb_trace()
    trace_process.append(proc)
    _trace_to(_endpoint(proc.stdout), monkeypatch)
    assert proc.stdout is not None and "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:" in proc.stdout.readline()
    _export_request(rid=1, request_id="r-cli")
    lines = iter(proc.stdout.readline, "")
    seen = [next(lines) for _ in range(3)]
    while not seen[-1].startswith("text_completion"):
        seen.append(next(lines))
    assert any("cdb.request_id=r-cli" in line for line in seen)
    tree = [next(lines) for _ in range(11)]
    assert tree[0].startswith("  validate") and tree[2].startswith("  prefill") and "hop head" in tree[5]
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()  # not communicate(): it would skip what readline() buffered already
    assert proc.wait(20) == 0, proc.stderr.read() if proc.stderr else ""
    assert re.search(r"^linked from 3 batch spans", rest, re.M) and "batch loop" in rest, rest
    assert rest.endswith("cdb trace: 1 request(s) printed\n")


def test_cdb_trace_json_for_one_request_id(
    trace_process: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _cdb_trace("--json", "--request-id", "r-json")
    trace_process.append(proc)
    _trace_to(_endpoint(proc.stderr), monkeypatch)  # --json: the endpoint line goes to stderr
    _export_request(rid=1, request_id="r-other")
    _export_request(rid=2, request_id="r-json")
    out, err = proc.communicate(timeout=30)  # it exits by itself once that request is printed
    assert proc.returncode == 0, err
    (line,) = out.splitlines()
    doc = json.loads(line)
    assert doc["request_id"] == "r-json" and doc["request"]["attributes"]["gen_ai.provider.name"] == "cdb"
    assert [c["name"] for c in doc["request"]["children"]] == ["validate", "queue", "prefill", "decode"]
    assert sorted(b["name"] for b in doc["batches"]) == ["batch head", "batch loop", "batch prelude"]


def test_cdb_trace_reports_a_request_id_that_never_came(trace_process: list[subprocess.Popen[str]]) -> None:
    proc = _cdb_trace("--request-id", "nope")
    trace_process.append(proc)
    _endpoint(proc.stdout)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and "no request 'nope' arrived" in err


def test_cdb_trace_refuses_a_busy_port() -> None:
    with OtlpReceiver() as busy:
        run = subprocess.run(
            [sys.executable, "-m", "cdb", "trace", "--port", str(busy.port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert run.returncode == 1 and "address already in use" in run.stderr and "--port 0" in run.stderr
