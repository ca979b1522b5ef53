"""A run's figures under the names ``vllm bench serve`` writes in its result JSON, so that what reads those files
(scripts, dashboards, comparison tables) reads ours too. They sit beside this benchmark's own figures in every run.

Two of vLLM's conventions differ from this benchmark's own figures, and are kept here:

- latencies count from when the client *sent* the request (vLLM's clock starts inside its request function), not
  from the scheduled arrival; under ``--max-concurrency`` the wait for a free slot is therefore not in them (it is
  in ``ttft_s`` / ``e2e_s`` and in ``client_lag``);
- milliseconds, 0 where there is no value (vLLM's ``np.mean(x or 0)``), the population standard deviation.

Names: ``duration``, ``completed``, ``failed``, ``num_prompts``, ``request_rate`` (``"inf"``: every request at
once), ``burstiness`` (the gamma shape 1/cv²; 1 is Poisson), ``max_concurrency`` (None: no cap),
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``, ``request_goodput`` (requests/s meeting
the SLOs), ``output_throughput``, ``total_token_throughput``, ``max_concurrent_requests`` (the peak of requests in
flight, measured on the client), and for each of ``ttft``, ``tpot``, ``itl`` and ``e2el``: ``mean_X_ms``,
``median_X_ms``, ``std_X_ms`` and ``pNN_X_ms`` for every NN of ``--percentiles`` (``p99``, ``p99.9``).
Token counts are the server's own (its ``usage``) when it reports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from cdb_bench.serve.metrics import RequestRecord, Slo, peak_in_flight, queue_summary, summarize_run
from cdb_bench.stats import percentile

METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_key(p: float) -> str:
    """``p99`` for 99, ``p99.9`` for 99.9 (vLLM's spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def _latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, measured from each request's send: per request TTFT, TPOT (n > 1) and E2E; every ITL."""
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for r in records:
        if not r.ok or r.sent_s is None or r.finished_s is None:
            continue
        ttft, e2el, n = r.token_s[0] - r.sent_s, r.finished_s - r.sent_s, r.output_tokens
        out["ttft"].append(ttft)
        out["e2el"].append(e2el)
        if n > 1:
            out["tpot"].append((e2el - ttft) / (n - 1))
        out["itl"].extend(b - a for a, b in zip(r.token_s, r.token_s[1:]))
    return out


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [1e3 * v for v in values]
    mean = sum(ms) / len(ms) if ms else 0.0
    out = {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(ms, 50) if ms else 0.0,
        f"std_{name}_ms": math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)) if ms else 0.0,
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = percentile(ms, p) if ms else 0.0
    return out


def vllm_fields(
    records: Sequence[RequestRecord],
    *,
    duration: float,
    rate: float,
    goodput: float,
    percentiles: Sequence[float] = (50, 90, 99),
    max_concurrency: int | None = None,
    burstiness: float = 1.0,
) -> dict[str, Any]:
    """The vLLM-named figures of one run (``duration``: the run's, from the first arrival to the last finish)."""
    done = [r for r in records if r.ok]
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "num_prompts": len(records),
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": per_second(len(done)),
        "request_goodput": goodput,
        "output_throughput": per_second(outputs),
        "total_token_throughput": per_second(inputs + outputs),
        "max_concurrent_requests": peak_in_flight(records),
    }
    for name, values in _latencies(records).items():
        out |= _stats(name, values, percentiles)
    return out


def field_names(percentiles: Sequence[float]) -> list[str]:
    """The names ``vllm_fields`` gives for these percentiles."""
    return list(vllm_fields([], duration=0.0, rate=1.0, goodput=0.0, percentiles=percentiles))


class RunOptions(Protocol):
    """What a run's figures depend on (``SweepConfig``, ``RemoteConfig``)."""

    @property
    def slo(self) -> Slo: ...
    @property
    def sample_interval(self) -> float: ...
    @property
    def percentiles(self) -> tuple[float, ...]: ...
    @property
    def max_concurrency(self) -> int | None: ...
    @property
    def burstiness(self) -> float: ...


def run_figures(
    records: Sequence[RequestRecord], samples: Sequence[Any], rate: float, opts: RunOptions
) -> dict[str, Any]:
    """One run's figures: ``summarize_run``, its ``queue`` samples, and the vLLM-named ones."""
    run = summarize_run(records, rate, opts.slo)
    run["queue"] = queue_summary(samples, opts.sample_interval)
    return run | vllm_fields(
        records,
        duration=run["duration_s"],
        rate=rate,
        goodput=run["goodput"],
        percentiles=opts.percentiles,
        max_concurrency=opts.max_concurrency,
        burstiness=opts.burstiness,
    )
