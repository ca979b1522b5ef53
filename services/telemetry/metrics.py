"""Serving metrics, kept and exposed by ``prometheus_client``.

``Metrics`` is the typed API the scheduler server and the engine call (see each method for when). Each ``Metrics``
owns a ``CollectorRegistry`` (never the library's global one, so that several engines in one process do not clash)
holding the cdb metrics and the library's process, platform and GC collectors (``process_*``, ``python_info``,
``python_gc_*``). ``exposition(accept)`` encodes them in the format the scrape's ``Accept`` header asks for
(``prometheus_client.exposition.choose_encoder``: OpenMetrics 1.0.0 on ``application/openmetrics-text``, else the
Prometheus text format 0.0.4); ``render()`` is the text format. ``serve_metrics`` answers ``GET /metrics`` from a
daemon thread with the library's WSGI app (format negotiation, gzip, ``?name[]=`` filters).

Names follow Prometheus conventions (base units: seconds; ``_total`` for counters). Counters and histograms also
carry the library's ``_created`` series; ``le`` bucket labels are written as floats (``le="2.0"``). The request
series (latencies, per-request token counts, finished and rejected requests) carry a ``model_name`` label, the
served model, as vLLM's do: a dashboard or a gateway over several deployments tells them apart; ``Metrics`` fills
it in (callers pass only the other labels). Latency buckets reach 2 h for TTFT, end-to-end and queue time (a long
answer on a GPU, or a deep queue, takes minutes), 60 s for the per-token ones; ``CDB_REQUEST_LATENCY_BUCKETS`` and
``CDB_TOKEN_LATENCY_BUCKETS`` replace them (``Metrics.from_settings``).

Cost per call (best of ``timeit`` repeats, Python 3.11 on a shared 2-vCPU box): a histogram observation ≈0.65 µs,
a labelled counter increment ≈0.33 µs; the hand-written exposition this replaced took ≈0.36 / ≈0.28 µs. That is
≈2 µs per generated token and ≈1.5 µs per stage op, far below a loop step, so metrics stay always on. Label
children are cached here: ``prometheus_client``'s own ``labels()`` lookup would add ≈0.6 µs per call.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client as prom
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest, make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # services.settings imports the engine's config (torch): only where settings are read
    from services.settings import Settings

log = logging.getLogger(__name__)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what ``render`` returns: "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (s): 1 ms to 60 s, dense where tiny models on CPU and GPUs live (inter-token, per output token).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
# Per request (TTFT, end-to-end, queue): on to 2 h, as thousands of tokens on a loaded GPU take minutes.
REQUEST_LATENCY_BUCKETS = (*LATENCY_BUCKETS, 120, 300, 600, 1200, 1800, 3600, 7200)
# Tokens per request (prompt, generated): 1-2-5 steps to 200k.
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
MODEL_LABEL = "model_name"
COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
OCCUPANCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
STAGES = ("prelude", "loop", "head")


class _Family:
    """One ``prometheus_client`` metric, label values passed positionally, children cached per label tuple.

    ``fixed``: the values of the last label names, the same for every series (the served model), appended to the
    labels callers pass."""

    def __init__(self, metric: Any, name: str, label_names: Sequence[str], fixed: Sequence[str] = ()) -> None:
        self.metric, self.name, self.label_names, self.fixed = metric, name, tuple(label_names), tuple(fixed)
        self._children: dict[tuple[str, ...], Any] = {} if label_names else {(): metric}

    def child(self, labels: tuple[str, ...]) -> Any:
        """The series of ``labels`` (``labels()`` raises ValueError naming the label names on a wrong count)."""
        found = self._children.get(labels)
        if found is None:  # labels() is thread-safe and returns one child per tuple: a race stores the same one
            found = self._children.setdefault(labels, self.metric.labels(*labels, *self.fixed))
        return found

    def _sample(self, sample_name: str, labels: tuple[str, ...]) -> float:
        """The current value of one sample (reads and tests; not for the hot path)."""
        want = dict(zip(self.label_names, (*labels, *self.fixed)))
        for family in self.metric.collect():
            for s in family.samples:
                if s.name == sample_name and s.labels == want:
                    return float(s.value)
        return 0.0


class Counter(_Family):
    """Monotonic count, per label values. ``name`` ends in ``_total``, as exposed."""

    def __init__(
        self,
        name: str,
        help_: str,
        label_names: Sequence[str] = (),
        *,
        registry: prom.CollectorRegistry,
        fixed: Sequence[str] = (),
    ) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter names end in _total: {name!r}")
        super().__init__(prom.Counter(name, help_, label_names, registry=registry), name, label_names, fixed)

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.child(labels).inc(amount)

    def value(self, *labels: str) -> float:
        return self._sample(self.name, labels)


class Gauge(_Family):
    """Value that goes up and down (``set``), per label values."""

    def __init__(
        self, name: str, help_: str, label_names: Sequence[str] = (), *, registry: prom.CollectorRegistry
    ) -> None:
        super().__init__(prom.Gauge(name, help_, label_names, registry=registry), name, label_names)

    def set(self, value: float, *labels: str) -> None:
        self.child(labels).set(value)

    def remove(self, *labels: str) -> None:
        """Drop the series of ``labels`` (no-op when it does not exist)."""
        if self._children.pop(labels, None) is not None:
            self.metric.remove(*labels)

    def value(self, *labels: str) -> float:
        return self._sample(self.name, labels)


class OptionalGauge:
    """An unlabelled gauge exported only once ``set`` (where a 0 before then would read as a real value)."""

    def __init__(self, name: str, help_: str, *, registry: prom.CollectorRegistry) -> None:
        self.name, self.help = name, help_
        self._value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self._value = float(value)

    def value(self) -> float | None:
        return self._value

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.help)]

    def collect(self) -> list[Metric]:
        value = self._value
        return [] if value is None else [GaugeMetricFamily(self.name, self.help, value=value)]


class Histogram(_Family):
    """Cumulative-bucket histogram (upper bounds inclusive, Prometheus' ``le``), per label values."""

    def __init__(
        self,
        name: str,
        help_: str,
        buckets: Iterable[float],
        label_names: Sequence[str] = (),
        *,
        registry: prom.CollectorRegistry,
        fixed: Sequence[str] = (),
    ) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets))
        metric = prom.Histogram(name, help_, label_names, registry=registry, buckets=self.bounds)
        super().__init__(metric, name, label_names, fixed)

    def observe(self, value: float, *labels: str) -> None:
        self.child(labels).observe(value)

    def observe_many(self, values: Sequence[float], *labels: str) -> None:
        """``observe`` of every value, one bucket update per bucket hit (a front end's batch of observations; the
        sum is added once, so it may differ from one-by-one addition in the last bits). Reaches into
        ``prometheus_client``'s histogram child (its bounds, buckets and sum; the version is pinned and
        ``tests/telemetry/test_bulk_observations.py`` compares this with ``observe``)."""
        if not values:
            return
        child = self.child(labels)
        bounds = child._upper_bounds
        for index, n in collections.Counter(bisect.bisect_left(bounds, v) for v in values).items():
            child._buckets[index].inc(n)
        child._sum.inc(sum(values))

    def count(self, *labels: str) -> int:
        return int(self._sample(self.name + "_count", labels))

    def sum(self, *labels: str) -> float:
        return self._sample(self.name + "_sum", labels)


class _Sampled:
    """A ``prometheus_client`` collector: run the ``Metrics`` samplers, then yield ``source``'s metrics."""

    def __init__(self, sample: Callable[[], None], source: Collector) -> None:
        self._sample, self._source = sample, source

    def collect(self) -> Iterable[Metric]:
        self._sample()
        return self._source.collect()


class Metrics:
    """The scheduler's metrics. ``max_depth`` sizes the served-depth histogram (one bucket per depth);
    ``request_buckets`` (TTFT, end-to-end, queue time) and ``token_buckets`` (inter-token latency, time per output
    token) replace the default latency buckets.

    A ``prometheus_client`` collector itself (``collect``), over its own ``registry``."""

    def __init__(
        self,
        model: str = "",
        max_depth: int = 4,
        *,
        request_buckets: Sequence[float] = (),
        token_buckets: Sequence[float] = (),
    ) -> None:
        self.registry = prom.CollectorRegistry()
        self.model = model
        r = self.registry
        per_model: list[_Family] = []  # request series without labels of their own: exported from the start

        def h(name: str, help_: str, buckets: Iterable[float], labels: Sequence[str] = ()) -> Histogram:
            return Histogram(name, help_, buckets, labels, registry=r)

        def rh(name: str, help_: str, buckets: Iterable[float]) -> Histogram:
            family = Histogram(name, help_, buckets, (MODEL_LABEL,), registry=r, fixed=(model,))
            per_model.append(family)
            return family

        def g(name: str, help_: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(name, help_, labels, registry=r)

        def c(name: str, help_: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, help_, labels, registry=r)

        def rc(name: str, help_: str, labels: Sequence[str]) -> Counter:
            return Counter(name, help_, (*labels, MODEL_LABEL), registry=r, fixed=(model,))

        request_buckets = tuple(request_buckets) or REQUEST_LATENCY_BUCKETS
        token_buckets = tuple(token_buckets) or LATENCY_BUCKETS
        self.ttft = rh("cdb_time_to_first_token_seconds", "Request arrival to first token streamed.", request_buckets)
        self.itl = rh("cdb_inter_token_latency_seconds", "Gap between consecutive streamed tokens.", token_buckets)
        self.e2e = rh("cdb_e2e_request_latency_seconds", "Request arrival to its final message.", request_buckets)
        self.queue = rh(
            "cdb_request_queue_time_seconds", "Admission to the first stage op serving it.", request_buckets
        )
        self.tpot = rh(
            "cdb_request_time_per_output_token_seconds",
            "Per request of two tokens or more: first token to last token / (generated tokens - 1).",
            token_buckets,
        )
        self.request_prompt_tokens = rh(
            "cdb_request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = rh(
            "cdb_request_generation_tokens", "Tokens generated per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.waiting = g("cdb_requests_waiting", "Requests admitted but not yet scheduled.")
        self.running = g("cdb_requests_running", "Requests holding a slot (prefill or decode).")
        self.occupancy = h(
            "cdb_loop_batch_occupancy", "Loop batch tokens / loop batch capacity, per op.", OCCUPANCY_BUCKETS
        )
        self.batch_size = h("cdb_loop_batch_size", "Tokens per loop-stage op.", (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.depth = h("cdb_served_depth", "Loop depth each generated token was served at.", range(1, max_depth + 1))
        self.mean_depth = g("cdb_served_depth_mean", "Mean loop depth of the tokens generated since start.")
        self.exit_threshold = g(
            "cdb_exit_threshold",
            "The engine's exit threshold q in effect (requests may override it), by exit rule and its source.",
            ["rule", "source"],
        )
        self.refills = c("cdb_refill_events_total", "Loop slots refilled by a waiting token after an exit.")
        self.spec_drafts = c(
            "cdb_spec_drafts_total",
            "Self-speculative decoding: successors started from a draft read at a shallow depth.",
        )
        self.spec_verified = rc(
            "cdb_spec_verified_total",
            "Drafts verified against the real token, by outcome (accepted: the successor's early work kept).",
            ["outcome"],
        )
        self.spec_wasted = c("cdb_spec_wasted_loop_steps_total", "Loop steps run by speculative work that was dropped.")
        self.loop_decode_compute = c(
            "cdb_loop_decode_compute_seconds_total", "The loop stage's own compute in decode ops (not prefill ops)."
        )
        self.compute = h("cdb_stage_compute_seconds", "A stage's own compute time per op.", COMPUTE_BUCKETS, ["stage"])
        self.stages_attached = OptionalGauge(
            "cdb_stages_attached",
            "1 while every stage server is attached; 0 during an outage or once given up (absent in-process).",
            registry=r,
        )
        self.recoveries = c("cdb_stage_recoveries_total", "Stage losses recovered from (running requests recomputed).")
        self.recomputed = c("cdb_recomputed_requests_total", "Requests re-queued for recomputation by recoveries.")
        self.kv_used = g("cdb_kv_blocks_used", "KV cache blocks held by live requests.")
        self.kv_total = g("cdb_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_usage = g(
            "cdb_kv_cache_usage_perc", "KV cache usage, 0 to 1: blocks held by live requests / blocks in the pool."
        )
        self.preemptions = c(
            "cdb_num_preemptions_total", "Requests preempted (KV blocks released, recomputed later) to free KV blocks."
        )
        self.bank_used = g("cdb_bank_rows_used", "Hidden-state bank rows held by live requests.")
        self.bank_total = g("cdb_bank_rows_total", "Hidden-state bank rows in total.")
        self.finished = rc("cdb_requests_finished_total", "Requests ended, by finish reason.", ["finish_reason"])
        self.rejected = rc("cdb_requests_rejected_total", "Requests refused at admission, by gRPC code.", ["code"])
        self.prompt_tokens = c("cdb_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generated_tokens = c("cdb_generation_tokens_total", "Tokens generated.")
        self.loop_steps = c("cdb_loop_steps_total", "Loop-block applications to generated tokens.")
        self.engine_cpu = c(
            "cdb_engine_thread_cpu_seconds_total",
            "CPU of the engine (scheduler) thread by part: plan (schedule, on_result), submit (ops to the stages), "
            "dispatch (tokens to their requests), other (commands, polling).",
            ["part"],
        )
        self.synthetic = g(
            "cdb_synthetic_stages",
            "1 when the stages model device time instead of running the model (its tokens mean nothing), by cost.",
            ["cost"],
        )
        self.info = g("cdb_model_info", "The served model (value always 1).", ["model"])
        self.info.set(1, model)
        prom.ProcessCollector(registry=r)
        prom.PlatformCollector(registry=r)
        prom.GCCollector(registry=r)
        for family in per_model:
            family.child(())  # the model's series exist (at zero) before the first request
        self._collectors: list[Callable[[Metrics], None]] = []
        self._threshold_labels: tuple[str, str] | None = None
        self._scrape = _Sampled(self._run_collectors, r)

    @classmethod
    def from_settings(cls, model: str, max_depth: int, settings: Settings) -> Metrics:
        """The metrics of a scheduler serving ``model``, with the latency buckets ``settings`` give."""
        from services.settings import parse_buckets

        return cls(
            model,
            max_depth,
            request_buckets=parse_buckets(settings.request_latency_buckets),
            token_buckets=parse_buckets(settings.token_latency_buckets),
        )

    def add_collector(self, collect: Callable[[Metrics], None]) -> None:
        """Run ``collect(self)`` before every scrape (``collect``, ``render``, ``exposition``): sample gauges and
        counters that other components keep (queue sizes, KV and bank usage, refill counters) off the hot path."""
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

    def observe_itls(self, seconds: Sequence[float]) -> None:
        """``observe_itl`` of many tokens at once (what a front-end process streamed since its last batch)."""
        self.itl.observe_many(seconds)

    def observe_token_depths(self, depths: Sequence[int]) -> None:
        """``observe_token_depth`` of many tokens at once (a front-end process's batch)."""
        if depths:
            self.depth.observe_many(depths)
            self.generated_tokens.inc(len(depths))
            self.loop_steps.inc(sum(depths))

    def observe_request_end(self, seconds: float, finish_reason: str) -> None:
        """When the final message is sent (stop, length, cancelled, error): time since the RPC arrived."""
        self.e2e.observe(seconds)
        self.finished.inc(1, finish_reason)

    def observe_request_tokens(self, prompt_tokens: int, generated_tokens: int, tpot_s: float | None) -> None:
        """When a request that was admitted ends (any reason): its prompt and generated token counts and, with two
        tokens or more, its time per output token (first to last token over the tokens after the first)."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def observe_admitted(self, prompt_tokens: int) -> None:
        """When a request passes validation and enters the waiting queue."""
        self.prompt_tokens.inc(prompt_tokens)

    def observe_rejected(self, code: str) -> None:
        """When a request is refused (``INVALID_ARGUMENT``, ``RESOURCE_EXHAUSTED``, ...)."""
        self.rejected.inc(1, code)

    # --- per engine step (scheduler loop / executor) ------------------------------------------------------
    def observe_loop_batch(self, size: int, capacity: int, compute_s: float = 0.0) -> None:
        """Per loop-stage decode op: tokens in it, the loop batch capacity (``max_num_seqs``), its compute time."""
        self.batch_size.observe(size)
        self.occupancy.observe(size / capacity if capacity else 0.0)
        if compute_s > 0:
            self.loop_decode_compute.inc(compute_s)

    def observe_stage_compute(self, stage: str, seconds: float) -> None:
        """Per stage result: the stage's own compute time (``StageResult.compute_s``)."""
        self.compute.observe(seconds, stage)

    def inc_refills(self, n: int = 1) -> None:
        """When exited tokens' loop slots are refilled by waiting tokens (count the refilled slots)."""
        self.refills.inc(n)

    def inc_speculation(self, drafts: int, accepted: int, rejected: int, wasted_steps: int) -> None:
        """Self-speculative decoding since last time: drafts made, verdicts, loop steps of dropped work."""
        if drafts:
            self.spec_drafts.inc(drafts)
        if accepted:
            self.spec_verified.inc(accepted, "accepted")
        if rejected:
            self.spec_verified.inc(rejected, "rejected")
        if wasted_steps:
            self.spec_wasted.inc(wasted_steps)

    def inc_recoveries(self, recoveries: int, recomputed: int = 0) -> None:
        """When stage losses were healed: ``recoveries`` of them, which re-queued ``recomputed`` requests."""
        if recoveries:
            self.recoveries.inc(recoveries)
        if recomputed:
            self.recomputed.inc(recomputed)

    # --- sampled at scrape time (collectors) --------------------------------------------------------------
    def set_queue_sizes(self, waiting: int, running: int) -> None:
        """After each scheduling decision: waiting and running request counts."""
        self.waiting.set(waiting)
        self.running.set(running)

    def set_kv_blocks(self, used: int, total: int) -> None:
        """After allocations/frees: KV blocks held and in the pool."""
        self.kv_used.set(used)
        self.kv_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)

    def inc_preemptions(self, n: int) -> None:
        """When requests were preempted to free KV blocks (the scheduler's count since last time)."""
        if n > 0:
            self.preemptions.inc(n)

    def set_bank_rows(self, used: int, total: int) -> None:
        """After allocations/frees: hidden-state bank rows held and in total."""
        self.bank_used.set(used)
        self.bank_total.set(total)

    def set_mean_depth(self, mean: float) -> None:
        """The mean served depth of every token generated so far (0 before the first)."""
        self.mean_depth.set(mean)

    def set_exit_threshold(self, threshold: float, rule: str, source: str) -> None:
        """The engine's exit threshold, its exit rule and where it came from (``cdb_engine.limits``); one series
        (a change of rule or source replaces the previous one)."""
        labels = (rule, source)
        previous, self._threshold_labels = self._threshold_labels, labels
        if previous is not None and previous != labels:
            self.exit_threshold.remove(*previous)
        self.exit_threshold.set(threshold, *labels)

    def inc_engine_cpu(self, part: str, seconds: float) -> None:
        """CPU seconds the engine thread spent in ``part`` (plan | submit | dispatch | other) since last time."""
        if seconds > 0:
            self.engine_cpu.inc(seconds, part)

    def set_synthetic(self, cost: str) -> None:
        """The stages are synthetic with this cost SPEC (``cdb_engine.synthetic``)."""
        self.synthetic.set(1, cost)

    def set_stages_attached(self, attached: bool) -> None:
        """Whether every stage server is attached (the gRPC executor is neither in an outage nor broken)."""
        self.stages_attached.set(1 if attached else 0)

    # --- exposition -----------------------------------------------------------------------------------------
    def sample(self) -> None:
        """Run the collectors now (the throughput log reads the gauges they set between scrapes)."""
        self._run_collectors()

    def _run_collectors(self) -> None:
        for collect in self._collectors:
            try:
                collect(self)
            except Exception:  # a failing collector leaves its metrics stale; the scrape still answers
                log.exception("metrics collector failed")

    def collect(self) -> Iterable[Metric]:
        """``prometheus_client`` collector protocol: run the collectors, then every metric of the registry."""
        return self._scrape.collect()

    def restricted_registry(self, names: Iterable[str]) -> Collector:
        """The collector of only the series named (``/metrics?name[]=...``), sampled first."""
        return _Sampled(self._run_collectors, self.registry.restricted_registry(names))

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type) of a scrape whose ``Accept`` header is ``accept``: OpenMetrics when it asks for
        ``application/openmetrics-text``, else the Prometheus text format (0.0.4, or 1.0.0 when asked)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self._scrape), content_type

    def render(self) -> str:
        """The Prometheus text exposition (0.0.4, ``CONTENT_TYPE``) of every metric, after running the collectors."""
        return generate_latest(self._scrape).decode()


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line
        pass


def metrics_app(metrics: Metrics) -> Callable[..., Iterable[bytes]]:
    """WSGI app: ``/metrics`` is ``prometheus_client``'s app over ``metrics``; ``/`` and ``/healthz`` a short
    text; anything else 404."""
    exposition = make_wsgi_app(metrics)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return exposition(environ, start_response)
        ok = path in ("/", "/healthz")
        body = b"cdb metrics: see /metrics\n" if ok else b"not found\n"
        status = "200 OK" if ok else "404 Not Found"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    """``GET /metrics`` on a daemon thread. ``port`` is the bound port (useful with port 0)."""

    def __init__(self, metrics: Metrics, host: str = "0.0.0.0", port: int = 9464) -> None:
        self._server = make_server(
            host, port, metrics_app(metrics), server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self.host, self.port = host, int(self._server.server_port)
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
