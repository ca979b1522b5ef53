"""Serving metrics kept in-process and exposed in the Prometheus text format (version 0.0.4).

``Metrics`` is the typed API the scheduler server and the engine call (see each method for when);
``serve_metrics`` starts a tiny stdlib HTTP server thread answering ``GET /metrics``. No dependency beyond the
standard library. Every call is a lock, a bisect and an add (well under 1 µs), so metrics are always on.
Names follow Prometheus conventions (base units: seconds; ``_total`` for counters).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (s): 1 ms to 60 s, dense where tiny models on CPU and GPUs live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
OCCUPANCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
STAGES = ("prelude", "loop", "head")


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    esc = [(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in pairs]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}" if esc else ""


class _Metric:
    """One metric family: name, help, type, and one value per label tuple."""

    def __init__(self, name: str, help_: str, kind: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help, self.kind, self.label_names = name, help_, kind, tuple(label_names)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        """Sample lines of this family."""
        raise NotImplementedError


class Counter(_Metric):
    """Monotonic count, per label values."""

    def __init__(self, name: str, help_: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_, "counter", label_names)
        self._values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(zip(self.label_names, k))} {_num(v)}" for k, v in items]


class Gauge(Counter):
    """Value that goes up and down (``set``), per label values."""

    def __init__(self, name: str, help_: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_, label_names)
        self.kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = float(value)


class Histogram(_Metric):
    """Cumulative-bucket histogram (upper bounds inclusive, as Prometheus' ``le``), per label values."""

    def __init__(self, name: str, help_: str, buckets: Sequence[float], label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_, "histogram", label_names)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._series: dict[tuple[str, ...], list[float]] = {}  # counts per bucket + [+Inf, sum, count]

    def observe(self, value: float, *labels: str) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            s = self._series.get(labels)
            if s is None:
                s = self._series[labels] = [0.0] * (len(self.bounds) + 3)
            s[i] += 1
            s[-2] += value
            s[-1] += 1

    def count(self, *labels: str) -> int:
        s = self._series.get(labels)
        return int(s[-1]) if s else 0

    def sum(self, *labels: str) -> float:
        s = self._series.get(labels)
        return s[-2] if s else 0.0

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        lines = []
        for key, s in items:
            pairs = list(zip(self.label_names, key))
            cumulative = 0.0
            for bound, n in zip((*self.bounds, math.inf), s[:-2]):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels([*pairs, ('le', _num(bound))])} {_num(cumulative)}")
            lines.append(f"{self.name}_sum{_labels(pairs)} {_num(s[-2])}")
            lines.append(f"{self.name}_count{_labels(pairs)} {_num(s[-1])}")
        return lines


class Metrics:
    """The scheduler's metrics. ``max_depth`` sizes the served-depth histogram (one bucket per depth)."""

    def __init__(self, model: str = "", max_depth: int = 4) -> None:
        h, g, c = Histogram, Gauge, Counter
        self.ttft = h("cdb_time_to_first_token_seconds", "Request arrival to first token streamed.", LATENCY_BUCKETS)
        self.itl = h("cdb_inter_token_latency_seconds", "Gap between consecutive streamed tokens.", LATENCY_BUCKETS)
        self.e2e = h("cdb_e2e_request_latency_seconds", "Request arrival to its final message.", LATENCY_BUCKETS)
        self.queue = h("cdb_request_queue_time_seconds", "Admission to the first stage op serving it.", LATENCY_BUCKETS)
        self.waiting = g("cdb_requests_waiting", "Requests admitted but not yet scheduled.")
        self.running = g("cdb_requests_running", "Requests holding a slot (prefill or decode).")
        self.occupancy = h(
            "cdb_loop_batch_occupancy", "Loop batch tokens / loop batch capacity, per op.", OCCUPANCY_BUCKETS
        )
        self.batch_size = h("cdb_loop_batch_size", "Tokens per loop-stage op.", (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.depth = h("cdb_served_depth", "Loop depth each generated token was served at.", range(1, max_depth + 1))
        self.refills = c("cdb_refill_events_total", "Loop slots refilled by a waiting token after an exit.")
        self.compute = h("cdb_stage_compute_seconds", "A stage's own compute time per op.", COMPUTE_BUCKETS, ["stage"])
        self.kv_used = g("cdb_kv_blocks_used", "KV cache blocks held by live requests.")
        self.kv_total = g("cdb_kv_blocks_total", "KV cache blocks in the pool.")
        self.bank_used = g("cdb_bank_rows_used", "Hidden-state bank rows held by live requests.")
        self.bank_total = g("cdb_bank_rows_total", "Hidden-state bank rows in total.")
        self.finished = c("cdb_requests_finished_total", "Requests ended, by finish reason.", ["finish_reason"])
        self.rejected = c("cdb_requests_rejected_total", "Requests refused at admission, by gRPC code.", ["code"])
        self.prompt_tokens = c("cdb_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generated_tokens = c("cdb_generation_tokens_total", "Tokens generated.")
        self.loop_steps = c("cdb_loop_steps_total", "Loop-block applications to generated tokens.")
        self.info = g("cdb_model_info", "The served model (value always 1).", ["model"])
        self.info.set(1, model)
        self.families = [v for v in vars(self).values() if isinstance(v, _Metric)]
        self._collectors: list[Callable[[Metrics], None]] = []

    def add_collector(self, collect: Callable[[Metrics], None]) -> None:
        """Run ``collect(self)`` before every ``render`` (each scrape): sample gauges and counters that other
        components keep (queue sizes, KV and bank usage, refill counters) off the serving hot path."""
        self._collectors.append(collect)

    # --- per request (scheduler server) -------------------------------------------------------------------
    def observe_queue_time(self, seconds: float) -> None:
        """When a request's first stage op is sent: time since it was admitted to the waiting queue."""
        self.queue.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        """When a request's first token is streamed: time since the RPC arrived."""
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        """When each later token is streamed: time since the previous token of the same request."""
        self.itl.observe(seconds)

    def observe_token_depth(self, depth: int) -> None:
        """Per generated token: the loop depth it was served at (counts its loop steps too)."""
        self.depth.observe(depth)
        self.generated_tokens.inc(1)
        self.loop_steps.inc(depth)

    def observe_request_end(self, seconds: float, finish_reason: str) -> None:
        """When the final message is sent (stop, length, cancelled, error): time since the RPC arrived."""
        self.e2e.observe(seconds)
        self.finished.inc(1, finish_reason)

    def observe_admitted(self, prompt_tokens: int) -> None:
        """When a request passes validation and enters the waiting queue."""
        self.prompt_tokens.inc(prompt_tokens)

    def observe_rejected(self, code: str) -> None:
        """When a request is refused (``INVALID_ARGUMENT``, ``RESOURCE_EXHAUSTED``, ...)."""
        self.rejected.inc(1, code)

    # --- per engine step (scheduler loop / executor) ------------------------------------------------------
    def observe_loop_batch(self, size: int, capacity: int) -> None:
        """Per loop-stage decode op: tokens in it and the loop batch capacity (``max_num_seqs``)."""
        self.batch_size.observe(size)
        self.occupancy.observe(size / capacity if capacity else 0.0)

    def observe_stage_compute(self, stage: str, seconds: float) -> None:
        """Per stage result: the stage's own compute time (``StageResult.compute_s``)."""
        self.compute.observe(seconds, stage)

    def inc_refills(self, n: int = 1) -> None:
        """When exited tokens' loop slots are refilled by waiting tokens (count the refilled slots)."""
        self.refills.inc(n)

    def set_queue_sizes(self, waiting: int, running: int) -> None:
        """After each scheduling decision: waiting and running request counts."""
        self.waiting.set(waiting)
        self.running.set(running)

    def set_kv_blocks(self, used: int, total: int) -> None:
        """After allocations/frees: KV blocks held and in the pool."""
        self.kv_used.set(used)
        self.kv_total.set(total)

    def set_bank_rows(self, used: int, total: int) -> None:
        """After allocations/frees: hidden-state bank rows held and in total."""
        self.bank_used.set(used)
        self.bank_total.set(total)

    def render(self) -> str:
        """The Prometheus text exposition of every metric (after running the collectors)."""
        for collect in self._collectors:
            try:
                collect(self)
            except Exception:  # a failing collector leaves its metrics stale; the scrape still answers
                log.exception("metrics collector failed")
        lines: list[str] = []
        for family in self.families:
            lines += family.header() + family.render()
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    metrics: Metrics

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype, code = self.metrics.render().encode(), CONTENT_TYPE, 200
        elif path in ("/", "/healthz"):
            body, ctype, code = b"cdb metrics: see /metrics\n", "text/plain; charset=utf-8", 200
        else:
            body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line
        pass


class MetricsServer:
    """``GET /metrics`` on a daemon thread. ``port`` is the bound port (useful with port 0)."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 9464) -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="cdb-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(metrics: Metrics, address: str) -> MetricsServer:
    """Serve ``metrics`` on ``address`` = ``"host:port"`` (``":9464"`` means all interfaces)."""
    host, _, port = address.rpartition(":")
    return MetricsServer(metrics, host or "0.0.0.0", int(port))


def metrics_address_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``CDB_METRICS_ADDR`` (e.g. ``0.0.0.0:9464``) as read by ``services.settings``; None when unset or empty (no
    endpoint). Raises ``SettingsError`` when it is not ``HOST:PORT``."""
    from services.settings import load_settings

    env = os.environ if environ is None else environ
    return load_settings({k: v for k, v in env.items() if k == "CDB_METRICS_ADDR"}).metrics_addr or None
