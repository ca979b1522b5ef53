"""The capacity knee of a mode: the highest request rate whose mean normalized latency stays under a bound.

From the swept rates: the highest passing rate (mean NL < bound) and the lowest failing rate above it bracket
the knee; ``steps`` bisections of that bracket (each measures the midpoint) narrow it, and the knee is the highest
passing rate found. No failing rate above the highest passing one: the knee is at least the highest swept rate
(``censored``). No passing rate: the knee lies below the lowest swept rate (``rate`` None).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Knee:
    rate: float | None  # highest passing rate measured (None: none passed)
    failing: float | None  # lowest failing rate above it (None: none failed above it)
    censored: bool  # the knee lies at or beyond the highest swept rate
    bisect_steps: int
    bound: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def passes(nl: float | None, bound: float) -> bool:
    return nl is not None and nl < bound


def find_knee(
    measured: Mapping[float, float | None], bound: float, steps: int, measure: Callable[[float], float | None]
) -> Knee:
    """The knee from ``measured`` (rate -> mean NL of the sweep), bisected ``steps`` times with ``measure``."""
    passing = [r for r, nl in measured.items() if passes(nl, bound)]
    if not passing:
        return Knee(None, min(measured, default=None), False, 0, bound)
    lo = max(passing)
    above = [r for r, nl in measured.items() if r > lo and not passes(nl, bound)]
    if not above:
        return Knee(lo, None, True, 0, bound)
    hi = min(above)
    for _ in range(steps):
        mid = (lo + hi) / 2
        if passes(measure(mid), bound):
            lo = mid
        else:
            hi = mid
    return Knee(lo, hi, False, steps, bound)


def knee_ratio(knees: Mapping[str, Knee], num: str = "cdb", den: str = "full-depth") -> float | None:
    """knee(num) / knee(den) where both are known."""
    a, b = knees.get(num), knees.get(den)
    if a is None or b is None or a.rate is None or not b.rate:
        return None
    return a.rate / b.rate


def latency_cut(nl_mode: float | None, nl_reference: float | None) -> float | None:
    """1 - NL_mode / NL_reference (the fraction of the reference's normalized latency saved)."""
    if nl_mode is None or not nl_reference:
        return None
    return 1.0 - nl_mode / nl_reference
