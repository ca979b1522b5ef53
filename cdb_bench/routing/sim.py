"""A discrete-event simulation of K replicas, each running continuous depth batching, behind one router.

Each replica has ``width`` slots (its ``max_num_seqs``) and runs one op at a time, back to back while it has work:

- a **prefill** op admits the oldest waiting request when a slot is free: its prompt runs at full depth and its
  first token is out when the op ends (the TTFT); it then holds a slot until it finishes;
- a **decode step** is one loop op: every active request's current token advances one loop step; a token whose
  replayed depth is reached leaves for the head when the op ends (it is streamed then) and its successor takes
  the slot at once, at step 0, in the next op (the refill); the request's last token frees the slot.

A replica alternates the two while both have work (at most one prefill in flight, decode ops interleave with it,
as the scheduler does), so a long queue of prompts does not stall decoding. Op durations come from
``cdb_bench.routing.costs.StepCosts`` (measured, linear in the op's tokens). Arrivals are the workload's Poisson
times; the router picks a replica at arrival (``cdb_bench.routing.policies``), from the client's own counts of
outstanding requests per replica. Nothing here depends on wall time: the same inputs give the same outcomes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cdb_bench.routing.costs import StepCosts
from cdb_bench.routing.policies import Policy
from cdb_bench.routing.workload import RequestView, RoutedRequest
from cdb_bench.serve.metrics import describe


@dataclass(slots=True)
class Outcome:
    """One request's fate; times in seconds from the run's start."""

    index: int
    arrival_s: float
    view: RequestView
    replica: int = -1
    first_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0

    @property
    def ttft_s(self) -> float:
        assert self.first_s is not None
        return self.first_s - self.arrival_s

    @property
    def normalized_s(self) -> float:
        assert self.finish_s is not None and self.tokens > 0
        return (self.finish_s - self.arrival_s) / self.tokens


@dataclass(slots=True)
class _Slot:
    req: int
    token: int  # the generated token being computed (1 .. n-1)
    remaining: int  # loop steps it still needs


@dataclass(slots=True)
class _Replica:
    waiting: deque[int] = field(default_factory=deque)
    active: list[_Slot] = field(default_factory=list)
    outstanding: int = 0
    busy: bool = False
    last_was_prefill: bool = False
    on_done: Callable[[float], None] | None = None


class _Simulation:
    """One run of ``simulate``: the outcomes so far, the replicas, and the event queue."""

    def __init__(
        self, requests: Sequence[RoutedRequest], policy: Policy, costs: StepCosts, replicas: int, width: int
    ) -> None:
        self.requests, self.policy, self.costs, self.width = requests, policy, costs, width
        self.out = [Outcome(i, r.serve.arrival_s, r.view) for i, r in enumerate(requests)]
        self.reps = [_Replica() for _ in range(replicas)]
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, arg): kind 0 = arrival, 1 = op done
        self.seq = 0
        for i, r in enumerate(requests):
            self.events.append((r.serve.arrival_s, self.seq, 0, i))
            self.seq += 1
        heapq.heapify(self.events)

    def run(self) -> list[Outcome]:
        while self.events:
            now, _, kind, arg = heapq.heappop(self.events)
            if kind == 0:
                k = self.policy.pick(self.out[arg].view, [r.outstanding for r in self.reps])
                rep = self.reps[k]
                self.out[arg].replica = k
                rep.outstanding += 1
                rep.waiting.append(arg)
                if not rep.busy:
                    self._start(k, now)
            else:
                rep = self.reps[arg]
                assert rep.on_done is not None
                rep.on_done(now)
                rep.on_done, rep.busy = None, False
                self._start(arg, now)
        assert all(o.finish_s is not None for o in self.out), "a request did not finish"
        return self.out

    def _finish(self, rep: _Replica, i: int, now: float) -> None:
        self.out[i].finish_s = now
        rep.outstanding -= 1

    def _prefill(self, rep: _Replica) -> float:
        i = rep.waiting.popleft()
        req = self.requests[i]

        def done(end: float) -> None:
            self.out[i].first_s, self.out[i].tokens = end, 1
            if req.serve.max_tokens == 1:
                self._finish(rep, i, end)
            else:
                rep.active.append(_Slot(i, 1, req.depths[0]))

        rep.on_done, rep.last_was_prefill = done, True
        return self.costs.prefill_s(req.serve.prompt_len)

    def _decode(self, rep: _Replica) -> float:
        for s in rep.active:
            s.remaining -= 1
        exiting = [s for s in rep.active if s.remaining == 0]

        def done(end: float) -> None:
            for s in exiting:
                o, req = self.out[s.req], self.requests[s.req]
                o.tokens += 1
                s.token += 1
                if s.token == req.serve.max_tokens:
                    rep.active.remove(s)
                    self._finish(rep, s.req, end)
                else:
                    s.remaining = req.depths[s.token - 1]

        rep.on_done, rep.last_was_prefill = done, False
        return self.costs.decode_step_s(len(rep.active), len(exiting))

    def _start(self, k: int, now: float) -> None:
        rep = self.reps[k]
        can_prefill = bool(rep.waiting) and len(rep.active) < self.width
        if can_prefill and not (rep.active and rep.last_was_prefill):
            duration = self._prefill(rep)
        elif rep.active:
            duration = self._decode(rep)
        else:
            return
        rep.busy = True
        heapq.heappush(self.events, (now + duration, self.seq, 1, k))
        self.seq += 1


def simulate(
    requests: Sequence[RoutedRequest], policy: Policy, costs: StepCosts, *, replicas: int, width: int
) -> list[Outcome]:
    """Serve ``requests`` (by their ``arrival_s``) on ``replicas`` replicas of ``width`` slots; every request
    finishes (the run drains)."""
    if replicas < 1 or width < 1:
        raise ValueError(f"replicas and width: >= 1, got {replicas} and {width}")
    return _Simulation(requests, policy, costs, replicas, width).run()


def summarize(
    outcomes: Sequence[Outcome], *, replicas: int, heavy: Callable[[RequestView], bool] | None = None
) -> dict[str, Any]:
    """Mean / p50 / p90 / p99 of normalized latency (E2E / output tokens), TTFT and E2E; requests per replica;
    with ``heavy``, the normalized latency and TTFT of the heavy and the light requests apart."""
    nl = [o.normalized_s for o in outcomes]
    ttft = [o.ttft_s for o in outcomes]
    e2e = [o.finish_s - o.arrival_s for o in outcomes if o.finish_s is not None]
    per_replica = [sum(o.replica == k for o in outcomes) for k in range(replicas)]
    result: dict[str, Any] = {
        "requests": len(outcomes),
        "normalized_latency_s": describe(nl),
        "ttft_s": describe(ttft),
        "e2e_s": describe(e2e),
        "per_replica_requests": per_replica,
    }
    if heavy is not None:
        for name, want in (("heavy", True), ("light", False)):
            group = [o for o in outcomes if heavy(o.view) is want]
            result[name] = {
                "requests": len(group),
                "normalized_latency_s": describe([o.normalized_s for o in group]),
                "ttft_s": describe([o.ttft_s for o in group]),
            }
    return result
