"""``Residency``: which requests wait, which hold resources, and the ends of a request's stay.

It owns the waiting queue, the running table and both allocators (bank rows, KV blocks): a request holds a row
and its blocks exactly while it is running; ``release`` frees both at once, whatever ends the stay (finish,
abort, failure or preemption). ``releases`` counts them: a queued item can only go stale (its request finished
or recomputed) through a release, so the scheduler rescans its queues for stale items only after one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cdb_scheduler.allocators import BlockAllocator, RowAllocator
from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.prefix_cache import release_blocks
from cdb_scheduler.request import Event, Finished, FinishReason, Request, Status
from cdb_scheduler.stats import SchedulerStats


class Residency:
    def __init__(self, config: SchedulerConfig, ops: OpBuilder, stats: SchedulerStats) -> None:
        self.blocks = BlockAllocator(config.num_kv_blocks, config.kv_block_size)
        self.rows = RowAllocator(config.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._ops = ops
        self._stats = stats
        self.releases = 0  # stays ended so far (finish, abort, failure, preemption, recovery)

    def abort(self, rid: int, reason: FinishReason) -> list[Event]:
        """End request ``rid`` (waiting or running) now; [] if it is not live."""
        req = self.running.get(rid)
        if req is None:
            queued = next((r for r in self.waiting if r.rid == rid), None)
            if queued is None:
                return []
            self.waiting.remove(queued)
            req = queued
        return [self.finish(req, reason)]

    def release(self, req: Request) -> None:
        self.releases += 1
        self.running.pop(req.rid, None)
        if req.row >= 0:
            self.rows.free(req.rid, [req.row, *req.spec_rows])
            req.row = -1
            req.spec_rows = []
        release_blocks(self.blocks, req)
        self._ops.forget(req)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> Finished:
        self.release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        return Finished(req.rid, reason, len(req.output), req.loop_steps, error)

    def fail(self, reqs: Iterable[Request], error: str, events: list[Event]) -> None:
        for req in list(reqs):
            if req.alive:
                events.append(self.finish(req, FinishReason.ERROR, error))

    def enqueue(self, req: Request, ahead: bool = False) -> None:
        """Queue ``req`` in priority order (lower value first): behind every waiting request of its priority or a
        more urgent one; ``ahead``: before those of its own priority (a recomputation, older than them)."""
        waiting, p = self.waiting, req.priority
        last = waiting[-1].priority if waiting else p - 1
        if last < p or (last == p and not ahead):
            waiting.append(req)  # (every request of one priority: always here unless ``ahead``)
            return
        i = len(waiting)
        while i > 0 and (waiting[i - 1].priority > p or (ahead and waiting[i - 1].priority == p)):
            i -= 1
        waiting.insert(i, req)

    def preempt_one(self) -> bool:
        """Nothing can run and a token waits for KV: recompute a request of the least urgent priority, among them
        the one with the fewest computed tokens (it goes back to the waiting queue ahead of its priority and
        replays its tokens at their recorded depths)."""
        return self._preempt([r for r in self.running.values() if r.alive])

    def preempt_for_urgent(self, min_free: int) -> int:
        """Priority preemption (vLLM's priority policy): while fewer than ``min_free`` rows are free and a waiting
        request is more urgent than a running one, recompute the least urgent running request (among those, the one
        with the fewest computed tokens), one per such waiting request. Returns how many were preempted."""
        waiting, n = self.waiting, 0
        while n < len(waiting) and self.rows.num_free < min_free:
            urgent = waiting[n].priority
            if not self._preempt([r for r in self.running.values() if r.alive and r.priority > urgent]):
                break
            n += 1
        return n

    def _preempt(self, victims: list[Request]) -> bool:
        """Recompute the least urgent of ``victims``, among those the one with the fewest computed tokens (back to
        the waiting queue ahead of its priority); False if there is none."""
        if not victims:
            return False
        victim = min(victims, key=lambda r: (-r.priority, r.computed_tokens, -r.rid))
        self.requeue(victim)
        self._stats.preemptions += 1
        self.enqueue(victim, ahead=True)
        return True

    def requeue(self, req: Request) -> None:
        """Free ``req``'s row and blocks and make it a recomputation: its items so far are stale, its prompt is
        prefilled again and its tokens replayed at their recorded depths (the caller queues it)."""
        self.release(req)
        req.status = Status.WAITING
        req.prefilled = 0
        req.epoch += 1
        req.num_preemptions += 1

    def requeue_all(self) -> int:
        """Every running request becomes a recomputation, ahead of the waiting ones of its priority, in arrival
        order."""
        victims = sorted((r for r in self.running.values() if r.alive), key=lambda r: r.rid)
        for req in victims:
            self.requeue(req)
        waiting = self.waiting
        waiting.extendleft(reversed(victims))
        if any(r.priority for r in waiting):  # (a stable sort: each priority's recomputations stay first)
            ordered = sorted(waiting, key=lambda r: r.priority)
            waiting.clear()
            waiting.extend(ordered)
        return len(victims)
