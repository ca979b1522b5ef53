"""Request lengths shaped like real data sets, from stated fits (nothing is downloaded).

Provenance of the targets: the mean lengths the vLLM paper reports for the two data sets it serves (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Fig. 11):

| data set | mean prompt tokens | mean output tokens |
|---|---|---|
| ShareGPT | 161.31 | 337.99 |
| Alpaca | 19.31 | 58.45 |

The fits: each length is a lognormal draw, rounded and clipped to ``[lo, hi]``. The spreads (sigma) are our
choice of a plausible shape, not a fit to the raw data: ShareGPT is long-tailed (prompt sigma 1.2, output 1.0),
Alpaca narrower (0.6, 0.9). The clip follows the common practice of dropping ShareGPT conversations with prompts
over 1024 tokens and very short turns (< 4 tokens). Each mu is then solved so that the mean of the *clipped*
lognormal equals the published mean (``clipped_mean``; the test checks the sampled means at scale 1).

``--scale s`` multiplies every length by s (rounded, at least 1 prompt token and 2 output tokens) to make a CPU
run affordable; the result is then clipped to the model's limits (max input tokens, max total tokens).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

MIN_PROMPT = 1
MIN_OUTPUT = 2  # a TPOT needs two tokens; a replayed request needs one depth after its first token


@dataclass(frozen=True, slots=True)
class LogNormalFit:
    """round(exp(N(mu, sigma²))) clipped to ``[lo, hi]``; ``target_mean`` is the published mean it matches."""

    mu: float
    sigma: float
    lo: int
    hi: int
    target_mean: float

    def draw(self, rng: random.Random) -> int:
        return min(self.hi, max(self.lo, round(rng.lognormvariate(self.mu, self.sigma))))


@dataclass(frozen=True, slots=True)
class DatasetFit:
    name: str
    prompt: LogNormalFit
    output: LogNormalFit
    source: str


DATASETS: dict[str, DatasetFit] = {
    "sharegpt": DatasetFit(
        "sharegpt",
        prompt=LogNormalFit(mu=4.4465, sigma=1.2, lo=4, hi=1024, target_mean=161.31),
        output=LogNormalFit(mu=5.4661, sigma=1.0, lo=4, hi=1024, target_mean=337.99),
        source="ShareGPT means from Kwon et al. (SOSP 2023), Fig. 11; lognormal spread assumed",
    ),
    "alpaca": DatasetFit(
        "alpaca",
        prompt=LogNormalFit(mu=2.7803, sigma=0.6, lo=4, hi=256, target_mean=19.31),
        output=LogNormalFit(mu=3.6697, sigma=0.9, lo=4, hi=512, target_mean=58.45),
        source="Alpaca means from Kwon et al. (SOSP 2023), Fig. 11; lognormal spread assumed",
    ),
}


def clipped_mean(fit: LogNormalFit) -> float:
    """E[clip(X, lo, hi)] for X ~ LogNormal(mu, sigma²) (before rounding), in closed form."""
    nd, mu, s = NormalDist(), fit.mu, fit.sigma
    a, b = math.log(fit.lo), math.log(fit.hi)
    below, above = nd.cdf((a - mu) / s), 1.0 - nd.cdf((b - mu) / s)
    inside = math.exp(mu + s * s / 2) * (nd.cdf((b - mu - s * s) / s) - nd.cdf((a - mu - s * s) / s))
    return fit.lo * below + fit.hi * above + inside


def scaled(n: int, scale: float, lo: int) -> int:
    """A length multiplied by ``scale``, rounded, at least ``lo``."""
    return max(lo, round(n * scale))


def draw_lengths(
    fit: DatasetFit, n: int, *, scale: float, max_input: int, max_total: int, rng: random.Random
) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths: drawn from the fit, scaled, clipped to the model's limits."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if max_total < MIN_PROMPT + MIN_OUTPUT:
        raise ValueError(f"max_total_tokens {max_total} leaves no room for a request")
    out = []
    for _ in range(n):
        p = min(scaled(fit.prompt.draw(rng), scale, MIN_PROMPT), max_input, max_total - MIN_OUTPUT)
        o = min(scaled(fit.output.draw(rng), scale, MIN_OUTPUT), max_total - p)
        out.append((p, o))
    return out
