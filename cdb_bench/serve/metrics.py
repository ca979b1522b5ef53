"""Per-request latencies and per-run summaries of a serving run (all times in seconds).

Every time is measured on the client from the request's *scheduled* arrival (the run's start + its arrival
offset), not from when the client got round to sending it, so a late client cannot hide queueing; the client's
own lag (send time - scheduled time) is reported beside the figures to show it stayed negligible.

- TTFT: first token - arrival. E2E: finish - arrival. TPOT: (E2E - TTFT) / (n - 1), None for n = 1.
- ITL: the gaps between consecutive tokens of a request. Normalized latency (NL): E2E / n.
- n: the server's own count of generated tokens when it reported one (an OpenAI ``usage`` object: a server that
  streams several tokens in one chunk), else the tokens the client saw; ITLs are then the gaps between chunks.
- Run duration: from the first arrival (0) to the last finish. Throughputs divide by it; goodput counts the
  requests that met both SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot).
- Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cdb_bench.stats import percentile


@dataclass(frozen=True, slots=True)
class Usage:
    """A server's own token counts of one request (an OpenAI ``usage`` object)."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are seconds after the run's start."""

    index: int
    scheduled_s: float
    prompt_tokens: int = 0  # the server's count when it reported usage, else the client's
    sent_s: float | None = None
    token_s: list[float] = field(default_factory=list)  # arrival of each token (of each chunk, see ``Usage``)
    depths: list[int] = field(default_factory=list)  # served depth of each token, where the server reports it
    finished_s: float | None = None
    error: str | None = None
    ended_s: float | None = None  # the request left the client (finished or failed): in flight from ``sent_s``
    reported_tokens: int | None = None  # generated tokens by the server's usage; None: not reported

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None and bool(self.token_s)

    @property
    def output_tokens(self) -> int:
        return self.reported_tokens if self.reported_tokens is not None else len(self.token_s)

    def add_usage(self, usage: Usage) -> None:
        self.prompt_tokens = usage.prompt_tokens
        self.reported_tokens = usage.completion_tokens


@dataclass(frozen=True, slots=True)
class RequestTimes:
    ttft: float
    tpot: float | None
    itl: tuple[float, ...]
    e2e: float
    normalized: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, t: RequestTimes) -> bool:
        return t.ttft <= self.ttft_s and (t.tpot is None or t.tpot <= self.tpot_s)


def request_times(rec: RequestRecord) -> RequestTimes:
    """The latencies of one finished request (``rec.ok`` must hold)."""
    assert rec.ok and rec.finished_s is not None, f"request {rec.index} did not finish: {rec.error}"
    n = max(1, rec.output_tokens)
    ttft = rec.token_s[0] - rec.scheduled_s
    e2e = rec.finished_s - rec.scheduled_s
    itl = tuple(b - a for a, b in zip(rec.token_s, rec.token_s[1:]))
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return RequestTimes(ttft, tpot, itl, e2e, e2e / n, n)


def describe(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (None for no values)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def lag_stats(lags: Sequence[float]) -> dict[str, float | None]:
    """The client's lag (send - scheduled): mean, p99, max."""
    if not lags:
        return {"mean_s": None, "p99_s": None, "max_s": None}
    return {"mean_s": sum(lags) / len(lags), "p99_s": percentile(lags, 99), "max_s": max(lags)}


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once on the client, each from ``sent_s`` to ``ended_s`` (a request sent at
    the moment another ended does not overlap it)."""
    spans = [(r.sent_s, r.ended_s) for r in records if r.sent_s is not None and r.ended_s is not None]
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])  # ends first on a tie
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def queue_summary(samples: Sequence[tuple[float, int, int]], interval_s: float) -> dict[str, Any]:
    """Queue length over time: ``samples`` are (t, waiting, running)."""
    waiting = [w for _, w, _ in samples]
    running = [r for _, _, r in samples]
    return {
        "interval_s": interval_s,
        "samples": [[round(t, 4), w, r] for t, w, r in samples],
        "mean_waiting": sum(waiting) / len(waiting) if waiting else None,
        "max_waiting": max(waiting, default=None),
        "mean_running": sum(running) / len(running) if running else None,
        "max_running": max(running, default=None),
    }


def summarize_run(records: Sequence[RequestRecord], rate: float, slo: Slo) -> dict[str, Any]:
    """A run's figures: throughputs, goodput, latency distributions, client lag and per-request values."""
    done = [r for r in records if r.ok]
    times = [request_times(r) for r in done]
    duration = max((r.finished_s or 0.0 for r in done), default=0.0)
    tokens = sum(t.output_tokens for t in times)
    good = sum(slo.met(t) for t in times)
    depths = [d for r in done for d in r.depths]
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "rate": rate,
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "output_throughput": per_second(tokens),
        "request_throughput": per_second(len(done)),
        "goodput": per_second(good),
        "slo_attainment": good / len(records) if records else 0.0,
        "mean_depth": sum(depths) / len(depths) if depths else None,
        "depth_histogram": {str(d): depths.count(d) for d in sorted(set(depths))},  # served depth -> tokens
        "ttft_s": describe([t.ttft for t in times]),
        "tpot_s": describe([t.tpot for t in times if t.tpot is not None]),
        "itl_s": describe([x for t in times for x in t.itl]),
        "e2e_s": describe([t.e2e for t in times]),
        "normalized_latency_s": describe([t.normalized for t in times]),
        "client_lag": lag_stats([r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]),
        "per_request": _per_request(records),
    }


def _per_request(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """Per-request values in request order (None where a request failed)."""
    times = [request_times(r) if r.ok else None for r in records]

    def col(get: Any) -> list[Any]:
        return [None if t is None else _r(get(t)) for t in times]

    return {
        "arrival_s": [_r(r.scheduled_s) for r in records],
        "client_lag_s": [None if r.sent_s is None else _r(r.sent_s - r.scheduled_s) for r in records],
        "prompt_tokens": [r.prompt_tokens for r in records],
        "output_tokens": col(lambda t: t.output_tokens),
        "ttft_s": col(lambda t: t.ttft),
        "tpot_s": col(lambda t: t.tpot),
        "e2e_s": col(lambda t: t.e2e),
        "normalized_latency_s": col(lambda t: t.normalized),
    }


def itl_lists(records: Sequence[RequestRecord]) -> list[list[float]]:
    """Every request's inter-token latencies (empty for a failed request)."""
    return [[round(x, 6) for x in request_times(r).itl] if r.ok else [] for r in records]


def _r(x: float | int | None) -> float | int | None:
    return round(x, 6) if isinstance(x, float) else x


@dataclass(frozen=True, slots=True)
class OpCounters:
    """Cumulative op counters of a target; ``delta`` of two snapshots is what one run cost."""

    ops: dict[str, int] = field(default_factory=dict)  # stage role -> ops completed
    compute_s: dict[str, float] = field(default_factory=dict)  # stage role -> the stage's own compute seconds
    loop_ops: int = 0  # decode loop ops
    loop_tokens: int = 0  # tokens in them
    loop_decode_s: float = 0.0  # the loop stage's compute in them

    def delta(self, before: OpCounters) -> OpCounters:
        return OpCounters(
            {k: v - before.ops.get(k, 0) for k, v in self.ops.items()},
            {k: v - before.compute_s.get(k, 0.0) for k, v in self.compute_s.items()},
            self.loop_ops - before.loop_ops,
            self.loop_tokens - before.loop_tokens,
            self.loop_decode_s - before.loop_decode_s,
        )


def op_summary(cost: OpCounters, output_tokens: int, wall_s: float) -> dict[str, Any]:
    """What a run cost op by op: per stage its ops, compute seconds, mean compute per op and busy fraction (its
    compute over the run's wall time); the loop stage's decode ops apart (count, mean tokens, mean compute) from its
    prefill ops (which run every step over a prompt chunk); generated tokens per head op (each token is sampled by
    exactly one head op)."""
    stages = {
        role: {
            "ops": n,
            "compute_s": cost.compute_s.get(role, 0.0),
            "mean_op_ms": 1e3 * cost.compute_s.get(role, 0.0) / n if n else None,
            "busy": cost.compute_s.get(role, 0.0) / wall_s if wall_s > 0 else None,
        }
        for role, n in cost.ops.items()
    }
    head = cost.ops.get("head", 0)
    prefill_ops = cost.ops.get("loop", 0) - cost.loop_ops
    prefill_s = cost.compute_s.get("loop", 0.0) - cost.loop_decode_s
    return {
        "wall_s": wall_s,
        "stages": stages,
        "loop_decode_ops": cost.loop_ops,
        "tokens_per_loop_op": cost.loop_tokens / cost.loop_ops if cost.loop_ops else None,
        "loop_decode_op_ms": 1e3 * cost.loop_decode_s / cost.loop_ops if cost.loop_ops else None,
        "loop_prefill_ops": prefill_ops,
        "loop_prefill_op_ms": 1e3 * prefill_s / prefill_ops if prefill_ops > 0 else None,
        "tokens_per_head_op": output_tokens / head if head else None,
    }
