"""The routing study's requests: the serving benchmark's seeded request set, with a fraction marked deep.

Lengths, prompts, replayed per-token depths and Poisson arrivals come from ``cdb_bench.serve.requests`` (ShareGPT-
like lengths scaled, depths lo + Binomial with the given mean). A seeded ``deep_fraction`` of the requests is
marked *deep*: it carries ``exit_threshold`` 1.0 (a request's threshold q: lower exits earlier, so q = 1 serves
every token at full depth) and every one of its tokens replays the max depth. A router sees what a client knows
of a request before sending it: its prompt length, ``max_tokens`` and ``exit_threshold`` (``RequestView``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from cdb_bench.routing.costs import StepCosts
from cdb_bench.serve.arrivals import Arrival, arrival_times
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.requests import ServeRequest, make_requests
from cdb_bench.stats import percentile

DEEP_THRESHOLD = 1.0  # the exit threshold deep requests carry


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a client-side router knows of a request."""

    prompt_tokens: int
    max_tokens: int
    exit_threshold: float | None  # None: the server's


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    serve: ServeRequest  # arrival, prompt, max_tokens, replay_depths (never None here)
    deep: bool

    @property
    def view(self) -> RequestView:
        return RequestView(self.serve.prompt_len, self.serve.max_tokens, DEEP_THRESHOLD if self.deep else None)

    @property
    def depths(self) -> tuple[int, ...]:
        """Loop steps of generated tokens 1 .. n-1 (token 0 comes from the prefill)."""
        assert self.serve.replay_depths is not None
        return self.serve.replay_depths

    def work_s(self, costs: StepCosts, width: int, mean_depth: float) -> float:
        """Replica time the request takes at full width: its prefill plus its share of full decode steps."""
        exiting = max(1, round(width / mean_depth))
        return costs.prefill_s(self.serve.prompt_len) + sum(self.depths) * costs.decode_step_s(width, exiting) / width


@dataclass(frozen=True, slots=True)
class Workload:
    """``requests`` at unit rate; ``at(rate)`` rescales the arrivals (the same requests at every rate)."""

    requests: tuple[RoutedRequest, ...]
    unit_gaps: tuple[float, ...]
    description: dict[str, object]

    def at(self, rate: float) -> list[RoutedRequest]:
        times = arrival_times(list(self.unit_gaps), rate)
        return [replace(r, serve=replace(r.serve, arrival_s=t)) for r, t in zip(self.requests, times)]

    def capacity(self, costs: StepCosts, replicas: int, width: int) -> float:
        """Requests/s that ``replicas`` replicas of ``width`` slots could serve if kept full (the load unit)."""
        depths = [d for r in self.requests for d in r.depths]
        mean_depth = sum(depths) / len(depths)
        work = sum(r.work_s(costs, width, mean_depth) for r in self.requests) / len(self.requests)
        return replicas / work

    def long_cut(self, quantile: float) -> int:
        """The ``max_tokens`` at ``quantile`` (0-100) of the requests: at or above it, a request is long."""
        return max(2, round(percentile([r.serve.max_tokens for r in self.requests], quantile)))


def make_workload(
    n: int,
    *,
    dataset: str = "sharegpt",
    scale: float = 0.1,
    depth: tuple[float, int, int] = (2.5, 2, 4),
    deep_fraction: float = 0.2,
    vocab: int = 1024,
    max_input: int = 512,
    max_total: int = 1024,
    seed: int = 0,
) -> Workload:
    """``n`` seeded requests, Poisson arrivals; ``depth = (mean, min, max)``, max = the model's max depth."""
    if not 0 <= deep_fraction <= 1:
        raise ValueError(f"deep_fraction: 0 to 1, got {deep_fraction}")
    if dataset not in DATASETS:
        raise ValueError(f"dataset: one of {', '.join(DATASETS)}, got {dataset!r}")
    base = make_requests(
        DATASETS[dataset],
        n,
        vocab=vocab,
        scale=scale,
        max_input=max_input,
        max_total=max_total,
        depth=depth,
        arrival=Arrival.POISSON,
        cv=1.0,
        seed=seed,
    )
    rng = random.Random(seed + 2)
    deep = set(rng.sample(range(n), round(deep_fraction * n)))
    reqs = []
    for r in base.requests:
        if r.index in deep:
            r = replace(r, replay_depths=(depth[2],) * (r.max_tokens - 1))
        reqs.append(RoutedRequest(r, r.index in deep))
    description: dict[str, object] = {
        "dataset": dataset,
        "scale": scale,
        "requests": n,
        "mean_prompt_tokens": sum(r.serve.prompt_len for r in reqs) / n,
        "mean_output_tokens": sum(r.serve.max_tokens for r in reqs) / n,
        "depth": {"mean": depth[0], "min": depth[1], "max": depth[2]},
        "deep_fraction": deep_fraction,
        "deep_exit_threshold": DEEP_THRESHOLD,
        "arrival": "poisson",
        "seed": seed,
    }
    return Workload(tuple(reqs), base.unit_gaps, description)
