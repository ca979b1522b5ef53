"""The request list of a serving run: drawn once from the seed, the same for every mode.

Prompts (random token ids, or a data set file's prompts: ``requests_from``), output lengths and replayed
per-token depths do not depend on the rate either: a run at rate r serves the same requests with the seed's
unit-rate arrival pattern divided by r (``cdb_bench.serve.arrivals``). Separate generators (seed, seed + 1) keep
the lengths independent of the number of arrival gaps drawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cdb_bench.serve.arrivals import Arrival, arrival_times, unit_gaps
from cdb_bench.serve.lengths import DatasetFit, draw_lengths
from cdb_bench.workload import depth_sampler


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One request: when it arrives (seconds after the run's start), what it sends, how deep each token goes."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...] | str  # token ids, or text (a data set file's prompt)
    max_tokens: int
    replay_depths: tuple[int, ...] | None  # depth of generated token k at [k-1]; None: the model's gate decides
    text_tokens: int = 0  # a text prompt's tokens by the client's tokenizer (0: unknown, the server will say)

    @property
    def prompt_len(self) -> int:
        return self.text_tokens if isinstance(self.prompt, str) else len(self.prompt)

    def prompt_arg(self) -> str | list[int]:
        """The prompt as the clients take it: text as it is (the server's tokenizer encodes it), ids as a list."""
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)


@dataclass(frozen=True, slots=True)
class RequestSet:
    """The requests at unit rate (``arrival_s`` from the unit gaps); ``at(rate)`` rescales the arrivals."""

    requests: tuple[ServeRequest, ...]
    unit_gaps: tuple[float, ...]

    def at(self, rate: float) -> list[ServeRequest]:
        times = arrival_times(list(self.unit_gaps), rate)
        return [replace(r, arrival_s=t) for r, t in zip(self.requests, times)]

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def make_requests(
    fit: DatasetFit,
    n: int,
    *,
    vocab: int,
    scale: float,
    max_input: int,
    max_total: int,
    depth: tuple[float, int, int] | None,
    arrival: Arrival,
    cv: float,
    seed: int,
) -> RequestSet:
    """``n`` requests; ``depth = (mean, min, max)`` replays depths (``workload.depth_sampler``), None: live."""
    rng = random.Random(seed)
    lengths = draw_lengths(fit, n, scale=scale, max_input=max_input, max_total=max_total, rng=rng)
    draw = depth_sampler(rng, *depth) if depth is not None else None
    reqs = []
    for i, (p, o) in enumerate(lengths):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(p))
        replay = tuple(draw() for _ in range(o - 1)) if draw is not None else None
        reqs.append(ServeRequest(i, 0.0, prompt, o, replay))
    gaps = unit_gaps(arrival, n, cv=cv, seed=seed + 1)
    return RequestSet(tuple(reqs), tuple(gaps))


def requests_from(
    prompts: Sequence[tuple[tuple[int, ...] | str, int, int]],
    *,
    depth: tuple[float, int, int] | None,
    arrival: Arrival,
    cv: float,
    seed: int,
) -> RequestSet:
    """Requests for given (prompt, prompt tokens, output tokens), e.g. a data set file's (``datasets``): the same
    arrivals (seed + 1) and replayed depths (seed) as ``make_requests`` draws."""
    rng = random.Random(seed)
    draw = depth_sampler(rng, *depth) if depth is not None else None
    reqs = []
    for i, (prompt, tokens, out) in enumerate(prompts):
        replay = tuple(draw() for _ in range(out - 1)) if draw is not None else None
        text_tokens = tokens if isinstance(prompt, str) else 0
        reqs.append(ServeRequest(i, 0.0, prompt, out, replay, text_tokens))
    gaps = unit_gaps(arrival, len(reqs), cv=cv, seed=seed + 1)
    return RequestSet(tuple(reqs), tuple(gaps))


def warmup_requests(requests: RequestSet, k: int, max_tokens: int = 8) -> list[ServeRequest]:
    """The first ``k`` requests, all arriving at once, cut to at most ``max_tokens`` outputs."""
    out = []
    for r in requests.requests[:k]:
        m = min(r.max_tokens, max_tokens)
        depths = r.replay_depths[: m - 1] if r.replay_depths is not None else None
        out.append(replace(r, arrival_s=0.0, max_tokens=m, replay_depths=depths))
    return out
