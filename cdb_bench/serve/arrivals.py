"""Open-loop arrival processes: seeded inter-arrival gaps, Poisson or a bursty gamma renewal process.

A gamma renewal process with coefficient of variation ``cv`` has gaps ~ Gamma(shape k = 1/cv², scale 1/(rate·k)):
mean gap 1/rate, standard deviation cv/rate. ``cv = 1`` is the Poisson process (exponential gaps); ``cv > 1`` is
burstier than Poisson (vLLM's ``--burstiness`` is k). Gaps are drawn once at unit rate and divided by the rate, so
the same seed gives the same arrival pattern, compressed or stretched, at every rate.
"""

from __future__ import annotations

import enum
import itertools
import random


class Arrival(enum.StrEnum):
    POISSON = "poisson"
    GAMMA = "gamma"


def unit_gaps(process: Arrival, n: int, *, cv: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` inter-arrival gaps at rate 1 (mean 1). ``cv`` is used by the gamma process only."""
    rng = random.Random(seed)
    if process is Arrival.POISSON:
        return [rng.expovariate(1.0) for _ in range(n)]
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    return [rng.gammavariate(shape, 1.0 / shape) for _ in range(n)]


def arrival_times(gaps: list[float], rate: float) -> list[float]:
    """Arrival offsets (seconds) at ``rate`` requests/s: the first request at 0, then the cumulated gaps."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return [0.0, *itertools.accumulate(g / rate for g in gaps[: max(0, len(gaps) - 1)])][: len(gaps)]
