"""Scheduler counters: what the benchmarks and metrics report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    loop_steps: int = 0  # decode loop ops issued
    loop_tokens: int = 0  # sum of their batch sizes
    loop_capacity: int = 0  # sum of max_num_seqs over them (occupancy denominator)
    refill_events: int = 0  # a step-0 item joined a non-empty ready queue
    prefill_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens of requests admitted with prefix caching (vLLM's prefix_cache_queries)
    prefix_hits: int = 0  # of those, the tokens a cached prefix served (vLLM's prefix_cache_hits)
    preemptions: int = 0
    recoveries: int = 0  # stage losses recovered from (every running request recomputed)
    recomputed: int = 0  # requests re-queued for recomputation by those recoveries
    tokens: int = 0  # generated tokens reported
    depth_hist: dict[int, int] = field(default_factory=dict)  # served depth -> tokens
    compute_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # per stage, from results
    ops: list[int] = field(default_factory=lambda: [0, 0, 0])  # results consumed, per stage
    loop_decode_compute_s: float = 0.0  # the loop stage's compute in decode ops (prefill loop ops excluded)
    sched_cpu_s: float = 0.0  # scheduler thread CPU time in schedule() and on_result(), emit excluded
    emit_cpu_s: float = 0.0  # its CPU time in schedule()'s ``emit`` (handing the ops to the executor)
    spec_drafts: int = 0  # successors started from a draft (self-speculative decoding)
    spec_accepted: int = 0  # drafts verified equal to the real token (their work kept)
    spec_rejected: int = 0  # drafts that differed (their work dropped)
    spec_wasted_steps: int = 0  # loop steps run by dropped speculative items
    spec_draft_depth_sum: int = 0  # sum of the depths the drafts were read at

    @property
    def spec_acceptance(self) -> float:
        """Accepted drafts over verified ones (0 before any)."""
        n = self.spec_accepted + self.spec_rejected
        return self.spec_accepted / n if n else 0.0

    def on_loop_issue(self, batch: int, width: int) -> None:
        self.loop_steps += 1
        self.loop_tokens += batch
        self.loop_capacity += width

    def on_token(self, depth: int) -> None:
        self.tokens += 1
        self.depth_hist[depth] = self.depth_hist.get(depth, 0) + 1

    @property
    def occupancy(self) -> float:
        """Mean loop-batch occupancy (tokens per loop step over the width)."""
        return self.loop_tokens / self.loop_capacity if self.loop_capacity else 0.0

    @property
    def mean_depth(self) -> float:
        n = sum(self.depth_hist.values())
        return sum(d * c for d, c in self.depth_hist.items()) / n if n else 0.0
