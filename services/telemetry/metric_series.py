"""Every series of the scheduler's metrics (``Metrics``), declared per concern on one registry, and their buckets.

Names follow Prometheus conventions (base units: seconds; ``_total`` for counters). Every series carries a
``model_name`` label, the served model, as vLLM's do: a dashboard, an autoscaler or a gateway over several
deployments tells them apart; the families fill it in (callers pass only the other labels), and a family with no
other label exports its one series from the start. The declaration order is the exposition order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import prometheus_client as prom

from services.telemetry.metric_families import Counter, Family, Gauge, Histogram, OptionalGauge

# Latency buckets (s): 1 ms to 60 s, dense where tiny models on CPU and GPUs live (inter-token, per output token).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)
# Per request (TTFT, end-to-end, queue): on to 2 h, as thousands of tokens on a loaded GPU take minutes.
REQUEST_LATENCY_BUCKETS = (*LATENCY_BUCKETS, 120, 300, 600, 1200, 1800, 3600, 7200)
# Tokens per request (prompt, generated): 1-2-5 steps to 200k.
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
MODEL_LABEL = "model_name"
_F = TypeVar("_F", bound=Family)
COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
OCCUPANCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Declare:
    """Makes the families of one registry, each ending in the served model's label."""

    def __init__(self, registry: prom.CollectorRegistry, model: str) -> None:
        self.registry, self.model = registry, model
        self.per_model: list[Family] = []  # series without labels of their own: exported from the start

    def _made(self, family: _F, labels: Sequence[str]) -> _F:
        if not labels:
            self.per_model.append(family)
        return family

    def histogram(self, name: str, help_: str, buckets: Iterable[float], labels: Sequence[str] = ()) -> Histogram:
        family = Histogram(name, help_, buckets, (*labels, MODEL_LABEL), registry=self.registry, fixed=(self.model,))
        return self._made(family, labels)

    def gauge(self, name: str, help_: str, labels: Sequence[str] = ()) -> Gauge:
        family = Gauge(name, help_, (*labels, MODEL_LABEL), registry=self.registry, fixed=(self.model,))
        return self._made(family, labels)

    def counter(self, name: str, help_: str, labels: Sequence[str] = ()) -> Counter:
        family = Counter(name, help_, (*labels, MODEL_LABEL), registry=self.registry, fixed=(self.model,))
        return self._made(family, labels)


class MetricSeries:
    """The families of the scheduler's metrics over their own ``registry`` (never the library's global one, so that
    several engines in one process do not clash), with the library's process, platform and GC collectors.
    ``max_depth`` sizes the served-depth histogram (one bucket per depth); ``request_buckets`` (TTFT, end-to-end,
    queue time) and ``token_buckets`` (inter-token latency, time per output token) replace the default latency
    buckets when given."""

    def __init__(
        self, model: str, max_depth: int, request_buckets: Sequence[float], token_buckets: Sequence[float]
    ) -> None:
        self.registry = prom.CollectorRegistry()
        self.model = model
        declare = _Declare(self.registry, model)
        self._declare_request_series(
            declare, tuple(request_buckets) or REQUEST_LATENCY_BUCKETS, tuple(token_buckets) or LATENCY_BUCKETS
        )
        self._declare_batch_series(declare, max_depth)
        self._declare_speculation_series(declare)
        self._declare_stage_series(declare)
        self._declare_memory_series(declare)
        self._declare_outcome_series(declare)
        self._declare_engine_series(declare)
        self.info.set(1, model)
        prom.ProcessCollector(registry=self.registry)
        prom.PlatformCollector(registry=self.registry)
        prom.GCCollector(registry=self.registry)
        for family in declare.per_model:
            family.child(())  # the model's series exist (at zero) before the first request

    def _declare_request_series(
        self, d: _Declare, request_buckets: Sequence[float], token_buckets: Sequence[float]
    ) -> None:
        """Per request: its latencies and token counts."""
        self.ttft = d.histogram(
            "cdb_time_to_first_token_seconds", "Request arrival to first token streamed.", request_buckets
        )
        self.itl = d.histogram(
            "cdb_inter_token_latency_seconds", "Gap between consecutive streamed tokens.", token_buckets
        )
        self.e2e = d.histogram(
            "cdb_e2e_request_latency_seconds", "Request arrival to its final message.", request_buckets
        )
        self.queue = d.histogram(
            "cdb_request_queue_time_seconds", "Admission to the first stage op serving it.", request_buckets
        )
        self.tpot = d.histogram(
            "cdb_request_time_per_output_token_seconds",
            "Per request of two tokens or more: first token to last token / (generated tokens - 1).",
            token_buckets,
        )
        self.request_prompt_tokens = d.histogram(
            "cdb_request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = d.histogram(
            "cdb_request_generation_tokens", "Tokens generated per finished request.", TOKEN_COUNT_BUCKETS
        )

    def _declare_batch_series(self, d: _Declare, max_depth: int) -> None:
        """The queues, the loop batches and the depths they serve."""
        self.waiting = d.gauge("cdb_requests_waiting", "Requests admitted but not yet scheduled.")
        self.running = d.gauge("cdb_requests_running", "Requests holding a slot (prefill or decode).")
        self.occupancy = d.histogram(
            "cdb_loop_batch_occupancy", "Loop batch tokens / loop batch capacity, per op.", OCCUPANCY_BUCKETS
        )
        self.batch_size = d.histogram("cdb_loop_batch_size", "Tokens per loop-stage op.", BATCH_SIZE_BUCKETS)
        self.depth = d.histogram(
            "cdb_served_depth", "Loop depth each generated token was served at.", range(1, max_depth + 1)
        )
        self.mean_depth = d.gauge("cdb_served_depth_mean", "Mean loop depth of the tokens generated since start.")
        self.exit_threshold = d.gauge(
            "cdb_exit_threshold",
            "The engine's exit threshold q in effect (requests may override it), by exit rule and its source.",
            ["rule", "source"],
        )
        self.refills = d.counter("cdb_refill_events_total", "Loop slots refilled by a waiting token after an exit.")

    def _declare_speculation_series(self, d: _Declare) -> None:
        """Self-speculative decoding: drafts, their verdicts and the work dropped."""
        self.spec_drafts = d.counter(
            "cdb_spec_drafts_total",
            "Self-speculative decoding: successors started from a draft read at a shallow depth.",
        )
        self.spec_verified = d.counter(
            "cdb_spec_verified_total",
            "Drafts verified against the real token, by outcome (accepted: the successor's early work kept).",
            ["outcome"],
        )
        self.spec_wasted = d.counter(
            "cdb_spec_wasted_loop_steps_total", "Loop steps run by speculative work that was dropped."
        )

    def _declare_stage_series(self, d: _Declare) -> None:
        """The stages: their compute, their attachment and the recoveries from their loss."""
        self.loop_decode_compute = d.counter(
            "cdb_loop_decode_compute_seconds_total", "The loop stage's own compute in decode ops (not prefill ops)."
        )
        self.compute = d.histogram(
            "cdb_stage_compute_seconds", "A stage's own compute time per op.", COMPUTE_BUCKETS, ["stage"]
        )
        self.stages_attached = OptionalGauge(
            "cdb_stages_attached",
            "1 while every stage server is attached; 0 during an outage or once given up (absent in-process).",
            registry=self.registry,
            labels={MODEL_LABEL: d.model},
        )
        self.recoveries = d.counter(
            "cdb_stage_recoveries_total", "Stage losses recovered from (running requests recomputed)."
        )
        self.recomputed = d.counter(
            "cdb_recomputed_requests_total", "Requests re-queued for recomputation by recoveries."
        )

    def _declare_memory_series(self, d: _Declare) -> None:
        """The KV cache and the hidden-state bank."""
        self.kv_used = d.gauge("cdb_kv_blocks_used", "KV cache blocks held by live requests.")
        self.kv_total = d.gauge("cdb_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_usage = d.gauge(
            "cdb_kv_cache_usage_perc", "KV cache usage, 0 to 1: blocks held by live requests / blocks in the pool."
        )
        self.preemptions = d.counter(
            "cdb_num_preemptions_total", "Requests preempted (KV blocks released, recomputed later) to free KV blocks."
        )
        self.prefix_queries = d.counter(
            "cdb_prefix_cache_queries_total", "Prompt tokens of requests admitted with prefix caching (vLLM's)."
        )
        self.prefix_hits = d.counter(
            "cdb_prefix_cache_hits_total", "Prompt tokens a cached prefix served, of those queried (vLLM's)."
        )
        self.prefix_blocks = d.gauge("cdb_prefix_cache_blocks", "KV blocks holding a cached prompt prefix.")
        self.bank_used = d.gauge("cdb_bank_rows_used", "Hidden-state bank rows held by live requests.")
        self.bank_total = d.gauge("cdb_bank_rows_total", "Hidden-state bank rows in total.")

    def _declare_outcome_series(self, d: _Declare) -> None:
        """How requests ended, and the tokens and loop steps served since start."""
        self.finished = d.counter("cdb_requests_finished_total", "Requests ended, by finish reason.", ["finish_reason"])
        self.rejected = d.counter(
            "cdb_requests_rejected_total", "Requests refused at admission, by gRPC code.", ["code"]
        )
        self.prompt_tokens = d.counter("cdb_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generated_tokens = d.counter("cdb_generation_tokens_total", "Tokens generated.")
        self.loop_steps = d.counter("cdb_loop_steps_total", "Loop-block applications to generated tokens.")

    def _declare_engine_series(self, d: _Declare) -> None:
        """The engine thread's CPU, synthetic stages and the served model."""
        self.engine_cpu = d.counter(
            "cdb_engine_thread_cpu_seconds_total",
            "CPU of the engine (scheduler) thread by part: plan (schedule, on_result), submit (ops to the stages), "
            "dispatch (tokens to their requests), other (commands, polling).",
            ["part"],
        )
        self.synthetic = d.gauge(
            "cdb_synthetic_stages",
            "1 when the stages model device time instead of running the model (its tokens mean nothing), by cost.",
            ["cost"],
        )
        self.info = d.gauge("cdb_model_info", "The served model (value always 1).", ["model"])
