"""``cdb trace``: a local OTLP/gRPC receiver that prints each finished request's trace, for users without Jaeger.

    cdb trace [--host 127.0.0.1] [--port 4317] [--request-id ID] [--json] [--settle SECONDS]

It prints the endpoint to export to (``OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=<endpoint>`` in the
environment of ``cdb serve``, which passes it to the stage processes), then every request as its trace settles:
the scheduler's request span with its attributes, its ``validate`` / ``queue`` / ``prefill`` / ``decode`` children
holding the stage hops, each with its duration, and the stage batch spans that link to it (process, op sequence
number, batch size, compute time). A request is printed once neither its trace nor a batch span linked to it got
a new span for ``--settle`` seconds (processes export in batches every ``OTEL_BSP_SCHEDULE_DELAY`` ms, 5000 by
default: set it to e.g. 200 for prompt output). ``--request-id ID``: only the request of that ``cdb.request_id``,
then exit. ``--json``: one JSON object per request and line on stdout (the endpoint line goes to stderr).
Ctrl-C (SIGINT) or SIGTERM stops, printing the requests still settling first.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

from services.net import ListenError
from services.telemetry.otlp_receiver import (
    KIND_SERVER,
    CollectedSpan,
    OtlpReceiver,
    children,
    descendants,
    format_request,
    linked_to,
)

_POLL_S = 0.2  # how often the loop looks at the stop flag while no span arrives


def is_request_span(span: CollectedSpan) -> bool:
    """A cdb request span: the scheduler's SERVER span with the ``gen_ai`` attributes."""
    return span.kind == KIND_SERVER and "gen_ai.operation.name" in span.attributes


def _node(spans: list[CollectedSpan], span: CollectedSpan) -> dict[str, Any]:
    return {
        "name": span.name,
        "service": span.service,
        "span_id": span.span_id,
        "start_ns": span.start_ns,
        "duration_ms": round(span.duration_ms, 6),
        "status": {"code": span.status_code, "message": span.status_message},
        "attributes": span.attributes,
        "events": [{"name": name, "attributes": attrs} for name, attrs in span.events],
        "children": [_node(spans, c) for c in children(spans, span)],
    }


def request_json(spans: Iterable[CollectedSpan], request: CollectedSpan) -> dict[str, Any]:
    """One request's trace as plain data: the span tree under ``request`` and the batch spans linked to it."""
    spans = list(spans)
    batches = sorted(linked_to(spans, request), key=lambda s: s.start_ns)
    return {
        "trace_id": request.trace_id,
        "request_id": request.attributes.get("cdb.request_id"),
        "request": _node(spans, request),
        "batches": [
            {k: v for k, v in _node(spans, b).items() if k != "children"} | {"trace_id": b.trace_id} for b in batches
        ],
    }


class TraceWatcher:
    """Groups arriving spans per request and prints each request once it settled (see the module docstring).

    ``add`` new spans, then ``emit_due``; ``flush`` prints what is still settling. Spans that belong to no pending
    request are forgotten ``keep_s`` seconds after their trace last grew. Single-threaded."""

    def __init__(
        self,
        out: TextIO,
        *,
        request_id: str | None = None,
        as_json: bool = False,
        settle_s: float = 1.0,
        keep_s: float = 30.0,
    ) -> None:
        self.out, self.request_id, self.as_json = out, request_id, as_json
        self.settle_s, self.keep_s = settle_s, max(keep_s, 2 * settle_s)
        self.printed = 0
        self._pruned_at = 0.0
        self._traces: dict[str, list[CollectedSpan]] = {}  # trace id -> its spans
        self._touched: dict[str, float] = {}  # trace id -> when its last span arrived
        self._batches: dict[tuple[str, str], list[CollectedSpan]] = {}  # (trace id, span id) -> batch spans linking
        self._linked_at: dict[tuple[str, str], float] = {}  # ... and when the last of them arrived
        self._pending: dict[tuple[str, str], CollectedSpan] = {}  # request spans not printed yet

    @property
    def done(self) -> bool:
        """True once the one request asked for (``request_id``) was printed."""
        return self.request_id is not None and self.printed > 0

    def add(self, spans: Iterable[CollectedSpan], now: float) -> None:
        """Spans that arrived at ``now`` (``time.monotonic()``)."""
        for s in spans:
            self._traces.setdefault(s.trace_id, []).append(s)
            self._touched[s.trace_id] = now
            for link in dict.fromkeys(s.links):
                self._batches.setdefault(link, []).append(s)
                self._linked_at[link] = now
            if is_request_span(s) and (
                self.request_id is None or s.attributes.get("cdb.request_id") == self.request_id
            ):
                self._pending[(s.trace_id, s.span_id)] = s

    def _last_activity(self, key: tuple[str, str]) -> float:
        return max(self._touched.get(key[0], 0.0), self._linked_at.get(key, 0.0))

    def next_due(self) -> float | None:
        """When the next pending request settles (monotonic seconds), None when none is pending."""
        if not self._pending:
            return None
        return min(self._last_activity(k) for k in self._pending) + self.settle_s

    def emit_due(self, now: float) -> None:
        """Print every pending request that settled by ``now``; forget what is older than ``keep_s``."""
        due = [k for k in self._pending if now - self._last_activity(k) >= self.settle_s]
        for key in sorted(due, key=lambda k: self._pending[k].start_ns):
            self._emit(self._pending.pop(key))
        self._prune(now)

    def flush(self) -> None:
        """Print every pending request as it stands (at exit)."""
        for key in sorted(self._pending, key=lambda k: self._pending[k].start_ns):
            self._emit(self._pending[key])
        self._pending.clear()

    def _emit(self, request: CollectedSpan) -> None:
        if self.done:
            return
        spans = descendants(self._traces.get(request.trace_id, [request]), request)
        spans += self._batches.get((request.trace_id, request.span_id), [])
        if self.as_json:
            self.out.write(json.dumps(request_json(spans, request), default=list) + "\n")
        else:
            self.out.write(format_request(spans, request) + "\n\n")
        self.out.flush()
        self.printed += 1

    def _prune(self, now: float) -> None:
        if now - self._pruned_at < 1.0:
            return
        self._pruned_at = now
        live = {k[0] for k in self._pending}
        for trace_id, t in list(self._touched.items()):
            if now - t > self.keep_s and trace_id not in live:
                del self._touched[trace_id], self._traces[trace_id]
        for key, t in list(self._linked_at.items()):
            if now - t > self.keep_s and key not in self._pending:
                del self._linked_at[key], self._batches[key]


def watch(receiver: OtlpReceiver, watcher: TraceWatcher, stop: threading.Event) -> None:
    """Feed ``watcher`` from ``receiver`` until ``stop`` is set or the watcher is done; then flush it."""
    while not stop.is_set() and not watcher.done:
        due = watcher.next_due()
        wait = _POLL_S if due is None else min(_POLL_S, max(0.0, due - time.monotonic()))
        got = receiver.drain(wait)
        now = time.monotonic()
        watcher.add(got, now)
        watcher.emit_due(now)
    watcher.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cdb trace", description="Receive OTLP spans and print each request's trace (Ctrl-C stops)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=4317, help="port (default 4317, the OTLP/gRPC one; 0: any free)")
    parser.add_argument("--request-id", help="print only this request (its cdb.request_id), then exit")
    parser.add_argument("--json", action="store_true", help="one JSON object per request and line")
    parser.add_argument(
        "--settle", type=float, default=1.0, metavar="SECONDS", help="quiet time before a request is printed (1.0)"
    )
    args = parser.parse_args(argv)
    if args.settle < 0:
        parser.error(f"--settle must be >= 0, got {args.settle}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be within 0-65535, got {args.port}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the endpoint line: a caller may signal right after it
        signal.signal(sig, lambda *_: stop.set())
    try:
        receiver = OtlpReceiver(args.port, host=args.host).start()
    except ListenError as exc:
        print(f"cdb trace: {exc}; --port 0 picks a free port", file=sys.stderr)
        return 1
    info = sys.stderr if args.json else sys.stdout
    print(
        f"OTLP receiver on {receiver.endpoint}; export to it with\n"
        f"  OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint} OTEL_BSP_SCHEDULE_DELAY=200\n"
        "Ctrl-C to stop.",
        file=info,
        flush=True,
    )
    watcher = TraceWatcher(sys.stdout, request_id=args.request_id, as_json=args.json, settle_s=args.settle)
    try:
        watch(receiver, watcher, stop)
    finally:
        receiver.stop()
    if args.request_id is not None and not watcher.done:
        print(f"cdb trace: no request {args.request_id!r} arrived", file=sys.stderr)
        return 1
    print(f"cdb trace: {watcher.printed} request(s) printed", file=info, flush=True)
    return 0
