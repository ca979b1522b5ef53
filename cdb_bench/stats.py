"""Percentiles, medians and ranges: how every benchmark here summarises a sample, in one place."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def order_statistic(values: Iterable[float], fraction: float, rounding: Callable[[float], int] = round) -> float:
    """The sample value at rank ``fraction`` (0..1) of the sorted values, no interpolation: the rank
    ``fraction * (n - 1)`` taken by ``rounding`` (``round``: the nearest, ``math.floor``: the lower,
    ``math.ceil``: the upper)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("order statistic of no values")
    return xs[min(len(xs) - 1, rounding(fraction * (len(xs) - 1)))]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the known values (None marks an unknown one); None when none is known."""
    known = [x for x in values if x is not None]
    return statistics.median(known) if known else None


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    """The median, the lowest and the highest value of a sample (not empty)."""
    return statistics.median(values), min(values), max(values)


def median_range(values: Iterable[float | None]) -> dict[str, float | None]:
    """``{"median", "min", "max"}`` of the known values (None marks an unknown one); each None when none is known."""
    known = [x for x in values if x is not None]
    return {"median": median(known), "min": min(known, default=None), "max": max(known, default=None)}


def middle(items: Sequence[T], key: Callable[[T], float]) -> T:
    """The item of median rank by ``key`` (of an even count, the upper of the two middle ones): a whole run to
    report, where the median of each figure apart would mix figures of different runs."""
    return sorted(items, key=key)[len(items) // 2]


def error_bars(samples: Sequence[Sequence[float]]) -> list[list[float]]:
    """Matplotlib's ``yerr`` for bars from each sample's median down to its lowest and up to its highest value."""
    mid = [statistics.median(v) for v in samples]
    return [[m - min(v) for m, v in zip(mid, samples)], [max(v) - m for m, v in zip(mid, samples)]]
