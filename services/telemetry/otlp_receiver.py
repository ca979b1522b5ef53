"""A real OTLP/gRPC trace receiver (tests, the tracing-cost benchmark, ``cdb trace``), and helpers to read spans.

``OtlpReceiver`` implements ``opentelemetry.proto.collector.trace.v1.TraceService`` on a loopback port; point a
process at it with ``otel_env(receiver.endpoint, service_name)``. Spans arrive as ``CollectedSpan`` (ids in hex,
attributes as plain Python values). ``check_request_trace`` asserts the layout of one request's trace (parentage
of phases and stage hops, batch spans linked from the stage processes); ``format_trace`` prints a trace as an
indented tree with durations, for notes and failure messages.

``python -m services.telemetry.otlp_receiver [--port 4317]`` runs a sink that only counts spans (no decoding), as
the endpoint of the tracing-on throughput benchmark; with ``--dump N`` it keeps the spans and, when stopped
(Ctrl-C / SIGTERM), prints the last N request traces to start (``format_request``: the tree with durations, and
the stage batch spans linked to the request).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from services.net import NO_REUSEPORT, listen_on

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT, KIND_PRODUCER, KIND_CONSUMER = 1, 2, 3, 4, 5
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class CollectedSpan:
    """One received span. Ids are lowercase hex; ``parent_span_id`` is "" for a root span."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace_id, span_id)
    status_code: int
    status_message: str
    flags: int = 0
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class OtlpReceiver(pb_grpc.TraceServiceServicer):
    """Collects every exported span in memory. Use as a context manager, or ``start()``/``stop()``.

    Listens on ``host:port`` alone (a busy port is a ``ListenError``, never a shared one; port 0: any free one)."""

    def __init__(self, port: int = 0, count_only: bool = False, host: str = "127.0.0.1") -> None:
        self.count_only, self.count = count_only, 0
        self._spans: list[CollectedSpan] = []
        self._cond = threading.Condition()
        self.requests = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=NO_REUSEPORT)
        pb_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.host = host
        self.port = listen_on(self._server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def endpoint(self) -> str:
        """OTLP endpoint URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (plain http scheme: no TLS); loopback when the
        receiver listens on every interface."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def Export(self, request: pb.ExportTraceServiceRequest, context: Any) -> pb.ExportTraceServiceResponse:
        if self.count_only:
            with self._cond:
                self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                self.requests += 1
            return pb.ExportTraceServiceResponse()
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        CollectedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=int(s.kind),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            events=[(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in s.events],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            status_code=int(s.status.code),
                            status_message=s.status.message,
                            flags=s.flags,
                            resource=resource,
                        )
                    )
        with self._cond:
            self._spans.extend(got)
            self.requests += 1
            self._cond.notify_all()
        return pb.ExportTraceServiceResponse()

    def spans(self) -> list[CollectedSpan]:
        """Everything received so far."""
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def drain(self, timeout: float) -> list[CollectedSpan]:
        """The spans received since the last ``drain`` (or ``clear``), forgotten here; waits up to ``timeout``
        seconds for some when there are none yet."""
        with self._cond:
            if not self._spans:
                self._cond.wait(timeout)
            got, self._spans = self._spans, []
            return got

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], timeout: float = 10.0) -> list[CollectedSpan]:
        """Block until ``predicate(spans)`` holds; return the spans. Raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; received:\n{format_spans(self._spans)}")
                self._cond.wait(left)
            return list(self._spans)


def otel_env(endpoint: str, service_name: str, **extra: str) -> dict[str, str]:
    """Environment that makes a cdb process export its spans to ``endpoint`` quickly."""
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": service_name,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    env.update(extra)
    return env


def by_name(spans: Iterable[CollectedSpan], name: str) -> list[CollectedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: Iterable[CollectedSpan], name: str) -> CollectedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, f"expected one span {name!r}, got {len(found)}:\n{format_spans(spans)}"
    return found[0]


def trace_of(spans: Iterable[CollectedSpan], trace_id: str) -> list[CollectedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def children(spans: Iterable[CollectedSpan], parent: CollectedSpan) -> list[CollectedSpan]:
    return sorted((s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)


def linked_to(spans: Iterable[CollectedSpan], target: CollectedSpan) -> list[CollectedSpan]:
    """Spans (of any trace) that link to ``target``."""
    return [s for s in spans if (target.trace_id, target.span_id) in s.links]


def descendants(spans: Iterable[CollectedSpan], root: CollectedSpan) -> list[CollectedSpan]:
    """``root`` and every span below it (a trace may hold several requests, e.g. under one client span)."""
    same = trace_of(spans, root.trace_id)
    found, frontier = [root], [root]
    while frontier:
        frontier = [s for p in frontier for s in children(same, p)]
        found.extend(frontier)
    return found


def format_spans(spans: Iterable[CollectedSpan]) -> str:
    return "\n".join(f"  [{s.service}] {s.name} {s.duration_ms:.3f} ms parent={s.parent_span_id}" for s in spans)


def format_trace(spans: Iterable[CollectedSpan], root: CollectedSpan) -> str:
    """``root`` and its descendants as an indented tree with durations (ms)."""
    spans = list(spans)
    lines: list[str] = []

    def walk(span: CollectedSpan, depth: int) -> None:
        extra = ""
        if span.name.startswith("hop"):
            a = span.attributes
            extra = f"  seq={a.get('cdb.op.seq')} compute={a.get('cdb.stage.compute_s', 0.0) * 1e3:.3f} ms"
            if "cdb.loop.steps" in a:
                extra += f" steps={a['cdb.loop.steps']}"
        lines.append(f"{'  ' * depth}{span.name:<{34 - 2 * depth}} {span.duration_ms:9.3f} ms{extra}")
        for child in children(spans, span):
            walk(child, depth + 1)

    walk(root, 0)
    return "\n".join(lines)


def format_request(spans: Iterable[CollectedSpan], request: CollectedSpan, max_links: int = 6) -> str:
    """``format_trace`` of one request span (with its attributes), then the batch spans of other traces that link
    to it (stage process, op sequence number, batch size, compute time), at most ``max_links`` per stage."""
    spans = list(spans)
    attrs = ", ".join(f"{k}={v}" for k, v in sorted(request.attributes.items()))
    lines = [f"[{request.service}] trace {request.trace_id}", f"  {attrs}", format_trace(spans, request)]
    linked = sorted(linked_to(spans, request), key=lambda s: s.start_ns)
    if linked:
        lines.append(f"linked from {len(linked)} batch spans (root spans of their own traces in the stage processes):")
    shown: dict[str, int] = {}
    for b in linked:
        shown[b.name] = shown.get(b.name, 0) + 1
        if shown[b.name] > max_links:
            continue
        a = b.attributes
        lines.append(
            f"  {'[' + b.service + ']':<15} {b.name:<14} {b.duration_ms:9.3f} ms  seq={a.get('cdb.op.seq')} "
            f"tokens={a.get('cdb.batch.size')} requests={a.get('cdb.batch.requests')} "
            f"compute={a.get('cdb.stage.compute_s', 0.0) * 1e3:.3f} ms"
        )
    hidden = {name: n - max_links for name, n in shown.items() if n > max_links}
    if hidden:
        lines.append("  ... and " + ", ".join(f"{n} more {name}" for name, n in sorted(hidden.items())))
    return "\n".join(lines)


def check_request_trace(
    spans: list[CollectedSpan],
    request: CollectedSpan,
    stages: Iterable[str] = ("prelude", "loop", "head"),
    stage_services: dict[str, str] | None = None,
) -> None:
    """Assert one request's trace: the SERVER span is a request root (or a child of the client's span) with the
    gen_ai attributes; queue, prefill and decode are its children; every stage has at least one ``hop`` span
    under prefill or decode; and every stage has a ``batch <stage>`` root span, in another trace (from
    ``stage_services[stage]`` when given), linked to the request span."""
    assert request.kind == KIND_SERVER, request
    for key in (
        "gen_ai.provider.name",
        "gen_ai.operation.name",
        "gen_ai.request.model",
        "gen_ai.request.max_tokens",
        "gen_ai.response.model",
        "gen_ai.response.finish_reasons",
        "gen_ai.usage.output_tokens",
    ):
        assert key in request.attributes, (key, request.attributes)
    mine = descendants(spans, request)
    phases = {s.name: s for s in children(mine, request)}
    for name in ("queue", "prefill"):
        assert name in phases, f"no {name} span under the request:\n{format_trace(mine, request)}"
    parents = {phases[n].span_id for n in ("prefill", "decode") if n in phases}
    hops = [s for s in mine if s.name.startswith("hop ")]
    assert hops and all(h.parent_span_id in parents for h in hops), format_trace(mine, request)
    for stage in stages:
        assert any(h.name == f"hop {stage}" for h in hops), f"no hop {stage}:\n{format_trace(mine, request)}"
        batches = [b for b in linked_to(spans, request) if b.name == f"batch {stage}"]
        assert batches, f"no batch {stage} span links to the request"
        for b in batches:
            assert b.parent_span_id == "" and b.trace_id != request.trace_id, b
            assert b.kind == KIND_CONSUMER and b.attributes.get("cdb.stage") == stage, b
            if stage_services:
                assert b.service == stage_services[stage], b


def main() -> None:
    parser = argparse.ArgumentParser(description="OTLP/gRPC trace sink on loopback that counts spans.")
    parser.add_argument("--port", type=int, default=4317, help="0: any free port (printed)")
    parser.add_argument(
        "--dump", type=int, default=0, metavar="N", help="keep the spans; on exit print the last N request traces"
    )
    args = parser.parse_args()
    receiver = OtlpReceiver(args.port, count_only=args.dump <= 0).start()
    print(f"OTLP sink on {receiver.endpoint}; Ctrl-C to stop", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    receiver.stop()
    spans = receiver.spans()
    count = receiver.count if args.dump <= 0 else len(spans)
    if args.dump > 0:
        requests = sorted((s for s in spans if s.kind == KIND_SERVER), key=lambda s: s.start_ns)
        for request in requests[-args.dump :]:
            print(format_request(spans, request), flush=True)
    print(f"received {count} spans in {receiver.requests} export requests", flush=True)


if __name__ == "__main__":
    main()
