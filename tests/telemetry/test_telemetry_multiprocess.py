"""Trace context crossing real process boundaries: this process plays the scheduler, three child processes
play the stages; every process exports to one OTLP receiver. One request's trace must cover every stage hop
with the right parentage, and each stage's batch spans must link to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace

from services import telemetry
from services.telemetry.otlp_receiver import (
    OtlpReceiver,
    check_request_trace,
    format_trace,
    linked_to,
    one,
    otel_env,
    trace_of,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STAGES = ("prelude", "loop", "head")


@pytest.mark.slow
def test_request_trace_across_processes(tracing: OtlpReceiver) -> None:
    procs = {}
    for stage in STAGES:
        env = {**os.environ, **otel_env(tracing.endpoint, f"cdb-{stage}"), "PYTHONPATH": str(ROOT)}
        procs[stage] = subprocess.Popen(
            [sys.executable, str(HERE / "fake_stage.py"), stage],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=ROOT,
        )
    try:
        traces = telemetry.RequestTraces(detail_tokens=2)
        client = telemetry.get_tracer().start_span("client")
        md = telemetry.inject_metadata(context=trace.set_span_in_context(client))
        spans_by_rid = {}
        for rid in (1, 2):
            span = telemetry.start_request_span(model="ouro-tiny", max_tokens=8, metadata=md, request_id=rid)
            traces.register(rid, span)
            span.enqueued()
            spans_by_rid[rid] = span
        seq = dict.fromkeys(STAGES, 0)

        def op(stage: str, rids: list[int], steps: int = 1) -> None:
            start = telemetry.now_ns()
            msg = {
                "contexts": traces.contexts_for(stage, rids),
                "released": [],
                "seq": seq[stage],
                "rids": rids,
                "start_ns": start,
                "end_ns": start + 1000,
                "compute_s": 1e-6,
            }
            proc = procs[stage]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            traces.on_hop(stage, seq[stage], rids, start, telemetry.now_ns(), 1e-6, steps)
            seq[stage] += 1

        op("prelude", [1, 2]), op("loop", [1, 1, 2, 2], steps=4), op("head", [1, 2])
        for span in spans_by_rid.values():
            span.first_token()
        for _ in range(2):
            op("prelude", [1, 2]), op("loop", [1, 2]), op("loop", [1, 2]), op("head", [1, 2])
        for span in spans_by_rid.values():
            span.finish("length", output_tokens=3, depths=[4, 2, 2])
        client.end()
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
        codes = [proc.wait(timeout=60) for proc in procs.values()]
    assert codes == [0, 0, 0]
    telemetry.force_flush()
    spans = tracing.wait_for(lambda s: sum(x.name.startswith("batch") for x in s) == 11)
    client_span = one(spans, "client")
    requests = [s for s in spans if s.name == "text_completion ouro-tiny"]
    assert len(requests) == 2
    for req in requests:
        assert req.parent_span_id == client_span.span_id
        check_request_trace(spans, req, STAGES, {s: f"cdb-{s}" for s in STAGES})
        assert len(linked_to(spans, req)) == 11  # every op served both requests
    print(format_trace(trace_of(spans, requests[0].trace_id), requests[0]))
