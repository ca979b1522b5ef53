"""Real spans from the real process tree: scheduler + three stage servers export to an OTLP receiver started by
the test; one request's trace must cover every stage hop with the right parentage, and every stage's batch spans
must link to it. ``-s`` prints the request's trace (span names and durations).

Wiring contract this test checks: the scheduler calls ``init_tracing("cdb-scheduler")`` and each stage server
``init_tracing(f"cdb-{role}")`` at start, ``shutdown_tracing()`` at exit; the request span is the child of the
caller's context from the gRPC metadata; the executor sends ``contexts_for_op`` in stage messages and reports
``on_op_done``; stage servers call ``StageTracer.update`` and ``record_op`` per batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import telemetry
from tests.telemetry.otlp_receiver import (
    KIND_SERVER,
    STATUS_UNSET,
    CollectedSpan,
    OtlpReceiver,
    by_name,
    check_request_trace,
    descendants,
    format_trace,
    one,
)

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("prelude", "loop", "head")
_WIRED = all(
    (ROOT / "services" / f).exists() and "telemetry" in (ROOT / "services" / f).read_text()
    for f in ("scheduler_server.py", "stage_server.py")
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not _WIRED, reason="the scheduler and stage servers do not call services.telemetry yet"),
]


@pytest.fixture(scope="module")
def traced_tree() -> Iterator[tuple[OtlpReceiver, str]]:
    from cdb_engine.config import EngineConfig
    from services.launcher import serve_all

    config = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=256)
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        handle = serve_all(config, "127.0.0.1:0", env=env)
        try:
            yield receiver, handle.address
        finally:
            handle.stop(drain_timeout=5.0)


def _request_spans(spans: list[CollectedSpan], request_id: str) -> list[CollectedSpan]:
    return [s for s in spans if s.kind == KIND_SERVER and s.attributes.get("cdb.request_id") == request_id]


def test_one_request_trace_covers_every_stage(tracing: OtlpReceiver, traced_tree: tuple[OtlpReceiver, str]) -> None:
    from clients.sync_client import Client

    receiver, address = traced_tree
    # the metadata is evaluated once the client span is current, so it carries that span's context
    with (
        telemetry.get_tracer().start_as_current_span("client generate") as client_span,
        Client(address, timeout=60, metadata=telemetry.inject_metadata()) as client,
    ):
        result = client.generate([5, 6, 7, 8], max_tokens=4)
    rid = result.request_id
    spans = receiver.wait_for(
        lambda s: any(_request_spans(s, rid)) and all(by_name(s, f"batch {st}") for st in STAGES), timeout=30
    )
    (req,) = _request_spans(spans, rid)
    ctx = client_span.get_span_context()
    assert (req.trace_id, req.parent_span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert req.service == "cdb-scheduler"
    assert req.attributes["gen_ai.usage.input_tokens"] == 4
    assert req.attributes["gen_ai.usage.output_tokens"] == len(result.tokens)
    assert req.attributes["gen_ai.response.finish_reasons"] == (result.finish.finish_reason,)
    assert req.attributes["cdb.loop_steps"] >= len(result.tokens)
    check_request_trace(spans, req, STAGES, {s: f"cdb-{s}" for s in STAGES})
    print("\n" + format_trace(descendants(spans, req), req))


def test_cancelled_stream_is_recorded(traced_tree: tuple[OtlpReceiver, str]) -> None:
    from clients.sync_client import Client

    receiver, address = traced_tree
    with Client(address, timeout=60) as client:
        stream = client.stream([5, 6, 7, 8], max_tokens=200)
        first = next(iter(stream))
        rid = first.request_id
        stream.close()  # leaving the stream cancels the call
    spans = receiver.wait_for(lambda s: any(_request_spans(s, rid)), timeout=30)
    (req,) = _request_spans(spans, rid)
    assert req.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert "cancelled" in [name for name, _ in req.events]
    assert req.status_code == STATUS_UNSET, "a client's cancel is not a server error"
    assert one([s for s in descendants(spans, req) if s.name == "queue"], "queue")
