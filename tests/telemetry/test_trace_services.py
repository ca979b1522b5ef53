"""Real spans from the real process tree: scheduler + three stage servers export to an OTLP receiver in the test
process (the session's shared tree, tests/conftest.py); one request's trace must cover every stage hop with the
right parentage, and every stage's batch spans must link to it. ``-s`` prints the request's trace (span names and
durations). The same tree serves its Prometheus metrics (``--metrics-listen``), scraped before and after requests.

Wiring contract this test checks: the scheduler calls ``init_tracing("cdb-scheduler")`` and each stage server
``init_tracing(f"cdb-{role}")`` at start, ``shutdown_tracing()`` at exit; the request span is the child of the
caller's context from the gRPC metadata; the executor sends ``contexts_for_op`` in stage messages and reports
``on_op_done``; stage servers call ``StageTracer.update`` and ``record_op`` per batch.
"""

from __future__ import annotations

import io
import re
import urllib.request
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from services import telemetry
from services.telemetry.otlp_receiver import (
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    CollectedSpan,
    OtlpReceiver,
    check_request_trace,
    descendants,
    format_trace,
    linked_to,
    one,
)
from services.telemetry.trace_cli import TraceWatcher
from tests.services.tree import SHARED_CONFIG, SharedTree

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("prelude", "loop", "head")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Tree(NamedTuple):
    receiver: OtlpReceiver
    address: str
    metrics_url: str


@pytest.fixture
def traced_tree(ouro_tiny_tree: SharedTree) -> Tree:
    """The shared tree, which exports to its receiver; spans of earlier tests are dropped first (the checks below
    look for one request's spans, so stragglers of earlier requests do not matter)."""
    ouro_tiny_tree.receiver.clear()
    return Tree(ouro_tiny_tree.receiver, ouro_tiny_tree.address, ouro_tiny_tree.metrics_url)


def _request_spans(spans: list[CollectedSpan], request_id: str) -> list[CollectedSpan]:
    return [s for s in spans if s.kind == KIND_SERVER and s.attributes.get("cdb.request_id") == request_id]


def _trace_complete(spans: list[CollectedSpan], request_id: str) -> bool:
    """The request span, its ``decode`` child (recorded last, on the lean path, which exports in order) and a
    batch span of every stage linked to it have arrived (three processes and two export threads here)."""
    reqs = _request_spans(spans, request_id)
    return (
        bool(reqs)
        and any(s.name == "decode" for s in descendants(spans, reqs[0]))
        and all(any(b.name == f"batch {st}" for b in linked_to(spans, reqs[0])) for st in STAGES)
    )


def _has_queue(spans: list[CollectedSpan], request_id: str) -> bool:
    return any(s.name == "queue" for req in _request_spans(spans, request_id) for s in descendants(spans, req))


def test_one_request_trace_covers_every_stage(tracing: OtlpReceiver, traced_tree: Tree) -> None:
    from clients.sync_client import Client

    receiver, address, _ = traced_tree
    # the metadata is evaluated once the client span is current, so it carries that span's context
    with (
        telemetry.get_tracer().start_as_current_span("client generate") as client_span,
        Client(address, timeout=60, metadata=telemetry.inject_metadata()) as client,
    ):
        result = client.generate([5, 6, 7, 8], max_tokens=4)
    rid = result.request_id
    spans = receiver.wait_for(lambda s: _trace_complete(s, rid), timeout=30)
    (req,) = _request_spans(spans, rid)
    ctx = client_span.get_span_context()
    assert (req.trace_id, req.parent_span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert req.service == "cdb-scheduler"
    assert req.attributes["gen_ai.usage.input_tokens"] == 4
    assert req.attributes["gen_ai.usage.output_tokens"] == len(result.tokens)
    assert req.attributes["gen_ai.response.finish_reasons"] == (result.finish.finish_reason,)
    assert req.attributes["cdb.loop_steps"] >= len(result.tokens)
    assert req.attributes["gen_ai.provider.name"] == "cdb" and req.attributes["gen_ai.response.id"] == rid
    assert req.attributes["gen_ai.request.model"] == req.attributes["gen_ai.response.model"] == "ouro-tiny"
    check_request_trace(spans, req, STAGES, {s: f"cdb-{s}" for s in STAGES})
    print("\n" + format_trace(descendants(spans, req), req))


def test_cdb_trace_prints_a_real_request(traced_tree: Tree) -> None:
    """``cdb trace``'s watcher on the spans of the real tree: the request tree, then batch spans of every stage
    process."""
    from clients.sync_client import Client

    receiver, address, _ = traced_tree
    with Client(address, timeout=60) as client:
        rid = client.generate([5, 6, 7, 8], max_tokens=3).request_id
    spans = receiver.wait_for(lambda s: _trace_complete(s, rid), timeout=30)
    out = io.StringIO()
    watcher = TraceWatcher(out, request_id=rid, settle_s=0.0)
    watcher.add(spans, now=0.0)
    watcher.emit_due(now=0.0)
    text = out.getvalue()
    assert watcher.done and text.startswith("[cdb-scheduler] trace "), text
    assert re.search(r"^text_completion ouro-tiny +\d+\.\d{3} ms$", text, re.M), text
    for phase in ("validate", "queue", "prefill", "decode"):
        assert re.search(rf"^  {phase} +\d+\.\d{{3}} ms$", text, re.M), text
    for stage in STAGES:
        assert re.search(rf"^    hop {stage} +\d+\.\d{{3}} ms  seq=\d+", text, re.M), text
        assert re.search(rf"^  \[cdb-{stage}\] +batch {stage} +\d+\.\d{{3}} ms  seq=\d+ tokens=\d+", text, re.M), text
    print("\n" + text)


def test_cancelled_stream_is_recorded(traced_tree: Tree) -> None:
    from clients.sync_client import Client

    receiver, address, _ = traced_tree
    with Client(address, timeout=60) as client:
        stream = client.stream([5, 6, 7, 8], max_tokens=200)
        first = next(iter(stream))
        rid = first.request_id
        stream.close()  # leaving the stream cancels the call
    # the request span (SDK) and its children (lean path) are exported by different threads: wait for both
    spans = receiver.wait_for(lambda s: any(_request_spans(s, rid)) and _has_queue(s, rid), timeout=30)
    (req,) = _request_spans(spans, rid)
    assert req.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert "cancelled" in [name for name, _ in req.events]
    assert req.status_code == STATUS_UNSET, "a client's cancel is not a server error"
    assert one([s for s in descendants(spans, req) if s.name == "queue"], "queue")


def test_rejected_request_is_an_error_span(traced_tree: Tree) -> None:
    from clients.sync_client import Client

    receiver, address, _ = traced_tree
    with Client(address, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("hi", max_tokens=0, request_id="rejected-1")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(lambda s: any(_request_spans(s, "rejected-1")), timeout=30)
    (req,) = _request_spans(spans, "rejected-1")
    assert req.status_code == STATUS_ERROR and req.attributes["error.type"] == "INVALID_ARGUMENT"
    assert req.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert "exception" in [name for name, _ in req.events]


def test_abort_is_recorded_as_a_cancel(traced_tree: Tree) -> None:
    from clients.messages import GenerateOptions
    from clients.sync_client import Client
    from tests.services.tree import StreamRun

    receiver, address, _ = traced_tree
    with Client(address, timeout=60) as client:
        options = GenerateOptions(max_tokens=300, ignore_eos=True, request_id="aborted-1")
        run = StreamRun(client, [5, 6, 7], options).start()
        assert run.first.wait(30)
        assert client.abort("aborted-1")
        assert run.done.wait(30) and run.finish is not None and run.finish.finish_reason == "cancelled"
    spans = receiver.wait_for(lambda s: any(_request_spans(s, "aborted-1")), timeout=30)
    (req,) = _request_spans(spans, "aborted-1")
    assert ("cancelled", {"cdb.cancel.reason": "Abort"}) in req.events
    assert req.status_code == STATUS_UNSET
    assert req.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)


def _scrape(url: str) -> dict[str, float]:
    from tests.telemetry.test_metrics_endpoint import parse

    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse(resp.read().decode())[1]


def test_scheduler_serves_metrics_of_real_requests(traced_tree: Tree) -> None:
    from clients.sync_client import Client

    _, address, url = traced_tree
    before = _scrape(url)
    with Client(address, timeout=60) as client:
        result = client.generate([5, 6, 7, 8], max_tokens=4, ignore_eos=True)
        with pytest.raises(grpc.RpcError):
            client.generate("hi", max_tokens=0)
    after = _scrape(url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert len(result.tokens) == 4
    model = 'model_name="ouro-tiny"'  # the request series' label
    assert delta(f'cdb_requests_rejected_total{{code="INVALID_ARGUMENT",{model}}}') == 1
    assert delta("cdb_prompt_tokens_total") == 4
    assert delta("cdb_generation_tokens_total") == 4 and delta("cdb_served_depth_count") == 4
    assert delta("cdb_loop_steps_total") == sum(t.depth for t in result.tokens)
    assert delta(f"cdb_time_to_first_token_seconds_count{{{model}}}") == 1
    assert delta(f"cdb_inter_token_latency_seconds_count{{{model}}}") == 3
    assert delta(f"cdb_request_queue_time_seconds_count{{{model}}}") == 1
    assert delta(f"cdb_e2e_request_latency_seconds_count{{{model}}}") == 1
    assert delta(f'cdb_requests_finished_total{{finish_reason="length",{model}}}') == 1
    for stage in STAGES:
        assert delta(f'cdb_stage_compute_seconds_count{{stage="{stage}"}}') >= 1, stage
    assert delta("cdb_loop_batch_size_count") >= 3 and delta("cdb_loop_batch_occupancy_count") >= 3
    assert after["cdb_kv_blocks_total"] == SHARED_CONFIG.num_kv_blocks and after["cdb_bank_rows_total"] > 4
    assert after["cdb_requests_waiting"] == 0 and after["cdb_requests_running"] == 0
    assert after['cdb_model_info{model="ouro-tiny"}'] == 1
    assert after["cdb_served_depth_mean"] >= 1
    (threshold,) = [k for k in after if k.startswith("cdb_exit_threshold{") and "model_name" in k]
    assert 'rule="hazard"' in threshold and 0 < after[threshold] <= 1, threshold
    assert delta("cdb_stage_recoveries_total") == 0 and delta("cdb_recomputed_requests_total") == 0
    assert after.get("cdb_stages_attached", 1) == 1  # exported when the server passes its stage plane
    assert after["process_resident_memory_bytes"] > 0
