"""The main series again under vLLM's names (opt-in: ``CDB_METRICS_VLLM_NAMES``), for what reads vLLM's metrics
as they are: a vLLM Grafana dashboard, an autoscaler rule, the Gateway API Inference Extension's endpoint picker
(which reads ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``).

``VllmNames`` is a ``prometheus_client`` collector over a ``MetricSeries``: each scrape copies the samples of the
mapped families (``NAMES``: cdb attribute -> vLLM's names) under vLLM's names, labels (``model_name`` included) and
values unchanged. ``docs/coming-from-vllm.md`` has the same map as a table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

NAMES: Mapping[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # (the latter: before vLLM v1)
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generated_tokens": ("vllm:generation_tokens",),
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "preemptions": ("vllm:num_preemptions",),
    "finished": ("vllm:request_success",),
}


def _renamed(metric: Metric, name: str) -> Metric:
    out = Metric(name, metric.documentation, metric.type, metric.unit)
    out.samples = [
        Sample(name + s.name[len(metric.name) :], s.labels, s.value, s.timestamp, s.exemplar)
        for s in metric.samples
        if not s.name.endswith("_created")
    ]
    return out


class VllmNames:
    """A collector of ``series``' mapped families under vLLM's names (module docstring)."""

    def __init__(self, series: Any) -> None:
        self.families = [(getattr(series, attr).metric, names) for attr, names in NAMES.items()]

    def describe(self) -> Iterable[Metric]:
        for metric, names in self.families:
            for family in metric.describe():
                yield from (Metric(n, family.documentation, family.type) for n in names)

    def collect(self) -> Iterable[Metric]:
        for metric, names in self.families:
            for family in metric.collect():
                yield from (_renamed(family, n) for n in names)
