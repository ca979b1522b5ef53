"""Serving metrics, kept and exposed by ``prometheus_client``.

``Metrics`` is the typed API the scheduler server and the engine call (see each method for when), over the series
``services.telemetry.metric_series`` declares. It is a ``prometheus_client`` collector itself: ``exposition(accept)``
encodes its registry (the cdb series and the library's ``process_*``, ``python_info``, ``python_gc_*``) in the
format the scrape's ``Accept`` header asks for (``prometheus_client.exposition.choose_encoder``: OpenMetrics 1.0.0
on ``application/openmetrics-text``, else the Prometheus text format 0.0.4); ``render()`` is the text format.
``services.telemetry.metrics_endpoint`` answers ``GET /metrics``.

Counters and histograms also carry the library's ``_created`` series; ``le`` bucket labels are written as floats
(``le="2.0"``). Latency buckets reach 2 h for TTFT, end-to-end and queue time (a long answer on a GPU, or a deep
queue, takes minutes), 60 s for the per-token ones; ``CDB_REQUEST_LATENCY_BUCKETS`` and
``CDB_TOKEN_LATENCY_BUCKETS`` replace them (``Metrics.from_settings``).

Cost per call (best of ``timeit`` repeats, Python 3.11 on a shared 2-vCPU box): a histogram observation ≈0.65 µs,
a labelled counter increment ≈0.33 µs; the hand-written exposition this replaced took ≈0.36 / ≈0.28 µs. That is
≈2 µs per generated token and ≈1.5 µs per stage op, far below a loop step, so metrics stay always on. A streaming
server's per-token observations are tallied per event-loop iteration (``Metrics.observe_itl``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.telemetry.metric_series import MetricSeries
from services.telemetry.metrics_endpoint import MetricsServer as MetricsServer  # (re-exported for its importers)
from services.telemetry.metrics_endpoint import serve_metrics as serve_metrics
from services.telemetry.vllm_names import VllmNames

if TYPE_CHECKING:  # services.settings imports the engine's config (torch): only where settings are read
    from services.settings.knobs import Settings

log = logging.getLogger(__name__)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what ``render`` returns: "text/plain; version=0.0.4; charset=utf-8"


class _Sampled:
    """A ``prometheus_client`` collector: run the ``Metrics`` samplers, then yield ``source``'s metrics."""

    def __init__(self, sample: Callable[[], None], source: Collector) -> None:
        self._sample, self._source = sample, source

    def collect(self) -> Iterable[Metric]:
        self._sample()
        return self._source.collect()


class Metrics(MetricSeries):
    """The scheduler's metrics: ``MetricSeries`` (``max_depth``, ``request_buckets``, ``token_buckets``: see there)
    fed through the methods below. A ``prometheus_client`` collector itself (``collect``), over its own
    ``registry``."""

    def __init__(
        self,
        model: str = "",
        max_depth: int = 4,
        *,
        request_buckets: Sequence[float] = (),
        token_buckets: Sequence[float] = (),
        cache_s: float = 0.0,
    ) -> None:
        """``cache_s``: a scrape within this long of the last one of the same format gets its body again
        (``exposition``; ``CDB_METRICS_CACHE_S``)."""
        super().__init__(model, max_depth, request_buckets, token_buckets)
        self.cache_s = cache_s
        self._cached: dict[str, tuple[float, bytes]] = {}  # content type -> (when, body)
        self._collectors: list[Callable[[Metrics], None]] = []
        self._threshold_labels: tuple[str, str] | None = None
        self._scrape = _Sampled(self._run_collectors, self.registry)
        self._itls: list[float] = []  # this loop iteration's tokens (``_tallying``)
        self._depths: list[int] = []
        self._tally_loop: asyncio.AbstractEventLoop | None = None  # armed: ``_tally`` is due on this loop
        self._tally_thread: int | None = None

    @classmethod
    def from_settings(cls, model: str, max_depth: int, settings: Settings) -> Metrics:
        """The metrics of a scheduler serving ``model``, with the latency buckets ``settings`` give."""
        from services.settings.checks import parse_buckets

        metrics = cls(
            model,
            max_depth,
            request_buckets=parse_buckets(settings.request_latency_buckets),
            token_buckets=parse_buckets(settings.token_latency_buckets),
            cache_s=settings.metrics_cache_s,
        )
        if settings.metrics_vllm_names:
            metrics.registry.register(VllmNames(metrics))
        return metrics

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
        """When each later token is streamed: time since the previous token of the same request. On an event loop,
        tallied with the iteration's other tokens (``_tally``)."""
        if self._tallying():
            self._itls.append(seconds)
        else:
            self.itl.observe(seconds)

    def observe_token_depth(self, depth: int) -> None:
        """Per generated token: the loop depth it was served at (counts its loop steps too); tallied as
        ``observe_itl``."""
        if self._tallying():
            self._depths.append(depth)
        else:
            self.observe_token_depths((depth,))

    def _tallying(self) -> bool:
        """Whether this token's observations wait for the end of the event-loop iteration (a streaming server's
        loop hands out the tokens of many requests in one iteration: one bucket update per bucket hit instead of
        per token). Off a loop, or on another thread than the first loop's, they are observed at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if loop is self._tally_loop:
            return True
        if self._tally_thread is None:
            self._tally_thread = threading.get_ident()
        elif self._tally_thread != threading.get_ident():
            return False
        self._tally()  # (what a loop that stopped before its tally left)
        self._tally_loop = loop
        loop.call_soon(self._tally)
        return True

    def _tally(self) -> None:
        self._tally_loop = None
        itls, self._itls = self._itls, []
        depths, self._depths = self._depths, []
        self.observe_itls(itls)
        self.observe_token_depths(depths)

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

    def record_prefix_cache(self, queries: int, hits: int, blocks: int) -> None:
        """Prefix caching: tokens queried and hit since last time, and the blocks cached now."""
        if queries > 0:
            self.prefix_queries.inc(queries)
        if hits > 0:
            self.prefix_hits.inc(hits)
        self.prefix_blocks.set(blocks)

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
        now = time.monotonic()
        cached = self._cached.get(content_type)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1], content_type
        body = encoder(self._scrape)
        self._cached[content_type] = (now, body)
        return body, content_type

    def render(self) -> str:
        """The Prometheus text exposition (0.0.4, ``CONTENT_TYPE``) of every metric, after running the collectors."""
        return generate_latest(self._scrape).decode()
