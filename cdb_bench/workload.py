"""Seeded offline workloads: random prompts, output lengths and (optionally) replayed per-token depths."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from cdb_engine.config import RequestParams
from cdb_scheduler.plan import SamplingParams


@dataclass(frozen=True, slots=True)
class Workload:
    """A seeded offline workload: prompts (random token ids), output lengths, replayed depths."""

    prompts: list[list[int]]
    params: list[RequestParams]

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def depth_sampler(rng: random.Random, mean: float, lo: int, hi: int) -> Callable[[], int]:
    """Depths in [lo, hi] with the given mean: lo + Binomial(hi - lo, p)."""
    if not lo <= mean <= hi:
        raise ValueError(f"mean depth {mean} outside [{lo}, {hi}]")
    n = hi - lo
    p = (mean - lo) / n if n else 0.0
    return lambda: lo + sum(rng.random() < p for _ in range(n))


def make_workload(
    *,
    vocab: int,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    depth: tuple[float, int, int] | None,
    seed: int = 0,
) -> Workload:
    """``depth = (mean, min, max)`` replays per-token depths; None lets the live exit rule decide."""
    rng = random.Random(seed)
    draw = depth_sampler(rng, *depth) if depth else None
    prompts, params = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        n = rng.randint(*output_len)
        replay = tuple(draw() for _ in range(n - 1)) if draw else None
        params.append(RequestParams(max_tokens=n, sampling=SamplingParams(), ignore_eos=True, replay_depths=replay))
    return Workload(prompts, params)
