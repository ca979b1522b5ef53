"""Routing policies: which of K replicas a client sends the next request to.

Each sees only what a client knows: the request (``RequestView``: prompt length, ``max_tokens``,
``exit_threshold``) and its own count of outstanding requests per replica (sent, not yet finished). The same
objects route the simulation (``cdb_bench.routing.sim``) and the real run's client-side picker
(``cdb_bench.routing.live``).

- ``round-robin``: replica 0, 1, ..., K-1, 0, ... (what gRPC's ``round_robin`` does over READY backends);
- ``least-outstanding``: the replica with the fewest outstanding requests; ties go to the next in rotation;
- ``segregation``: *heavy* requests (``max_tokens`` >= ``long_tokens``, or deep: ``exit_threshold`` >=
  ``deep_threshold``) go to the first ``heavy_replicas`` replicas, the rest to the others; least-outstanding
  within each group. ``balanced_split`` sizes the groups and the cut so that each group's share of the work
  matches its share of the replicas (else one group saturates long before the other).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cdb_bench.routing.workload import RequestView

POLICIES = ("round-robin", "least-outstanding", "segregation")


class Policy(Protocol):
    name: str

    def pick(self, req: RequestView, outstanding: Sequence[int]) -> int:
        """The replica (index into ``outstanding``) for ``req``."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, req: RequestView, outstanding: Sequence[int]) -> int:
        i = self._next % len(outstanding)
        self._next = i + 1
        return i


class LeastOutstanding:
    name = "least-outstanding"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, req: RequestView, outstanding: Sequence[int]) -> int:
        return self.pick_among(range(len(outstanding)), outstanding)

    def pick_among(self, group: Sequence[int], outstanding: Sequence[int]) -> int:
        """The least-outstanding replica of ``group``, the first one at or after the rotation on ties."""
        k = len(group)
        start = self._next % k
        order = [group[(start + j) % k] for j in range(k)]
        best = min(order, key=lambda i: outstanding[i])
        self._next = start + 1
        return best


class Segregation:
    name = "segregation"

    def __init__(self, replicas: int, heavy_replicas: int, long_tokens: int, deep_threshold: float = 0.9) -> None:
        if not 1 <= heavy_replicas < replicas:
            raise ValueError(f"heavy_replicas: 1 to {replicas - 1} of {replicas} replicas, got {heavy_replicas}")
        if long_tokens < 1:
            raise ValueError(f"long_tokens: >= 1, got {long_tokens}")
        self.heavy = tuple(range(heavy_replicas))
        self.light = tuple(range(heavy_replicas, replicas))
        self.long_tokens = long_tokens
        self.deep_threshold = deep_threshold
        self._within = (LeastOutstanding(), LeastOutstanding())

    def is_heavy(self, req: RequestView) -> bool:
        deep = req.exit_threshold is not None and req.exit_threshold >= self.deep_threshold
        return deep or req.max_tokens >= self.long_tokens

    def pick(self, req: RequestView, outstanding: Sequence[int]) -> int:
        if len(outstanding) != len(self.heavy) + len(self.light):
            raise ValueError(f"segregation was sized for {len(self.heavy) + len(self.light)} replicas")
        heavy = self.is_heavy(req)
        return self._within[heavy].pick_among(self.heavy if heavy else self.light, outstanding)


def balanced_split(
    views: Sequence[RequestView], work: Sequence[float], replicas: int, deep_threshold: float = 0.9
) -> tuple[int, int, float]:
    """Size segregation to a workload: the (heavy replicas h, long-token cut) whose heavy share of the work is
    closest to h / K, over every h in 1 .. K-1 and every cut among the requests' ``max_tokens`` (deep requests
    are heavy whatever the cut). Returns (h, cut, heavy share)."""
    if replicas < 2:
        raise ValueError(f"segregation needs two or more replicas, got {replicas}")
    total = sum(work)
    cuts = sorted({v.max_tokens for v in views} | {max(v.max_tokens for v in views) + 1})
    best: tuple[float, int, int, float] | None = None
    for cut in cuts:
        probe = Segregation(replicas, 1, cut, deep_threshold)
        share = sum(w for v, w in zip(views, work) if probe.is_heavy(v)) / total
        for h in range(1, replicas):
            gap = abs(share - h / replicas)
            if best is None or gap < best[0]:
                best = (gap, h, cut, share)
    assert best is not None
    return best[1], best[2], best[3]


def make_policy(name: str, replicas: int, *, heavy_replicas: int = 1, long_tokens: int = 64) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-outstanding":
        return LeastOutstanding()
    if name == "segregation":
        return Segregation(replicas, heavy_replicas, long_tokens)
    raise ValueError(f"policy: one of {', '.join(POLICIES)}, got {name!r}")
