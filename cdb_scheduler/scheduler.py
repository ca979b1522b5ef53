"""The continuous-depth-batching scheduler: requests and stage results in, stage ops out.

``schedule()`` is called whenever something changed; it issues every op that may run now, in the tick order of
the method (coda, preludes of refills, prefill, loop steps, undersized coda) and never waits for an op it has
issued. ``on_result()`` consumes one stage result. Exit decisions are taken as early as the decision horizon
allows: with one-ahead decisions the survivors of loop op k are known before k returns, so op k+1 is issued
while k runs (``loop_pipeline_depth`` ops in flight).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from cdb_scheduler.allocators import BlockAllocator, RowAllocator
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import FixedDepth, Horizon
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import KVCopy, Stage, StageOp, StageResult, TokenLogprobs
from cdb_scheduler.prefill import PrefillFlight, grow_blocks, pick_chunks, prefill_chain
from cdb_scheduler.request import Event, Finished, FinishReason, Item, Request, Status, TokenOut
from cdb_scheduler.stats import SchedulerStats


@dataclass(slots=True)
class _LoopFlight:
    items: list[Item]
    steps: list[int]


class Scheduler:
    """Decides what every stage runs. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.cfg = config
        self.blocks = BlockAllocator(config.num_kv_blocks, config.kv_block_size)
        self.rows = RowAllocator(config.max_num_seqs)
        self.ops = OpBuilder()
        self.stats = SchedulerStats()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.ready: deque[Item] = deque()  # loop work, head = next to run
        self.coda: deque[Item] = deque()  # exited tokens waiting for the head
        self.refills: deque[Item] = deque()  # successors waiting for their prelude
        self.stalled: deque[Item] = deque()  # successors waiting for a KV block
        self.wave_next: list[Item] = []  # no-refill: items waiting for the next wave
        self._loop: dict[int, _LoopFlight] = {}
        self._head: dict[int, list[Item]] = {}
        self._prelude: dict[int, list[Item]] = {}
        self._prefill: PrefillFlight | None = None
        self._prefill_starved = False

    # ----------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        """Queue a request for prefill. The engine has validated it against the limits."""
        if self.cfg.mode is Mode.FULL_DEPTH:
            req.policy = FixedDepth(self.cfg.max_depth, self.cfg.max_depth)
            req.replay_depths = None
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, request_id: int, reason: FinishReason = FinishReason.CANCELLED) -> list[Event]:
        """End a request now; its row and blocks are free at once (ops already issued stay ordered by fences
        and stage order; their results for it are dropped)."""
        req = self.running.get(request_id)
        if req is None:
            for queued in self.waiting:
                if queued.id == request_id:
                    self.waiting.remove(queued)
                    return [self._finish(queued, reason)]
            return []
        return [self._finish(req, reason)]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_flight(self) -> int:
        return len(self._loop) + len(self._head) + len(self._prelude) + (self._prefill is not None)

    # ----------------------------------------------------------------- planning
    def schedule(self) -> list[StageOp]:
        t0 = time.thread_time()
        ops: list[StageOp] = []
        while True:
            self._prefill_starved = False
            self._retry_stalled()
            self._drop_stale(self.ready)
            self._issue_codas(ops, flush=False)
            self._issue_refills(ops)
            self._issue_prefill(ops)
            self._start_wave()
            if self.ready and len(self._loop) < self.cfg.loop_pipeline_depth:
                # One loop op per round: tokens it lets exit go to the head (and their successors to the
                # prelude) before the next loop op is formed, so that op already includes the refills.
                ops.append(self._issue_loop())
                continue
            if not self.ready:
                self._issue_codas(ops, flush=True)
                self._issue_refills(ops)
                if self.ready and len(self._loop) < self.cfg.loop_pipeline_depth:
                    continue
            starved = bool(self.stalled) or self._prefill_starved
            if ops or self.in_flight() or not starved or not self._preempt_one():
                break
        self.stats.sched_cpu_s += time.thread_time() - t0
        return ops

    def _issue_codas(self, ops: list[StageOp], *, flush: bool) -> None:
        self._drop_stale(self.coda)
        if self.cfg.mode is Mode.NO_REFILL:
            if not (self.coda and not self.ready and not self._loop and not self._head):
                return  # the wave's coda runs once, when its last token has left the loop
            flush = True
        need = 1 if flush else self.cfg.min_coda_batch_size
        while len(self.coda) >= need and len(self._head) < self.cfg.max_coda_in_flight:
            items = [self.coda.popleft() for _ in range(min(len(self.coda), self.cfg.max_num_seqs))]
            reqs = [it.req for it in items]
            op = self.ops.head(
                reqs, [it.position for it in items], [r.row for r in reqs], [True] * len(items),
                [it.index for it in items],
            )  # fmt: skip
            self._head[op.seq] = items
            ops.append(op)
            for it in items:  # successors start now; their prelude reads the sampled id from the token bank
                if it.index + 1 < it.req.max_tokens:
                    known = it.req.output[it.index] if it.index < len(it.req.output) else -1
                    self._spawn(it.req, it.index + 1, known)

    def _issue_refills(self, ops: list[StageOp]) -> None:
        self._drop_stale(self.refills)
        if not self.refills:
            return
        items = list(self.refills)
        self.refills.clear()
        reqs = [it.req for it in items]
        tokens = [it.input_token for it in items]
        op = self.ops.prelude(reqs, tokens, [it.position for it in items], [r.row for r in reqs])
        self._prelude[op.seq] = items
        ops.append(op)
        for it in items:  # the loop op that takes them will fence on this prelude op
            if self.cfg.mode is Mode.NO_REFILL:
                self.wave_next.append(it)
            elif it.index == 1:
                self._enqueue_new(it, tail=True)
            else:
                self._enqueue_new(it, tail=False)

    def _enqueue_new(self, it: Item, *, tail: bool) -> None:
        if self.ready:
            self.stats.refill_events += 1
        if tail:
            self.ready.append(it)
        else:
            self.ready.appendleft(it)

    def _start_wave(self) -> None:
        if self.cfg.mode is not Mode.NO_REFILL or not self.wave_next:
            return
        if self.ready or self._loop or self.coda or self._head or self.refills:
            return
        self.ready.extend(it for it in self.wave_next if it.live)
        self.wave_next.clear()

    def _issue_loop(self) -> StageOp:
        items: list[Item] = []
        while self.ready and len(items) < self.cfg.max_num_seqs:
            it = self.ready.popleft()
            if it.live:
                items.append(it)
        assert items, "ready queue held only stale items"  # schedule() drops them first
        steps = [it.next_step for it in items]
        reqs = [it.req for it in items]
        op = self.ops.loop(reqs, [it.position for it in items], [r.row for r in reqs], steps)
        self._loop[op.seq] = _LoopFlight(items, steps)
        self.stats.on_loop_issue(len(items), self.cfg.max_num_seqs)
        cont: list[Item] = []
        for it in items:
            it.next_step += 1
            it.pending_since = op.seq
            self._route(it, cont)
        self.ready.extendleft(reversed(cont))
        return op

    def _route(self, it: Item, cont: list[Item]) -> None:
        """Decide the fate of the last issued step of ``it`` if the horizon allows; route it."""
        step = it.next_step - 1
        decision = self._decide(it, step)
        if decision is None:
            return
        it.pending_since = -1
        if not decision:
            cont.append(it)
            return
        it.exited = True
        it.depth = step + 1
        if self.cfg.copy_on_exit and step + 1 < self.cfg.max_depth:
            self.ops.pending_copies.append(KVCopy(it.req.id, it.position, step))
        self.coda.append(it)

    def _decide(self, it: Item, step: int) -> bool | None:
        if it.forced_depth:
            return step + 1 >= it.forced_depth
        policy, st = it.req.policy, it.exit_state
        if not policy.needs_signals or step + 1 >= policy.max_depth or step + 1 < policy.min_depth:
            return policy.exits_after(st, step)
        have = st.observed
        if (policy.horizon is Horizon.ONE_AHEAD and have == step) or (
            policy.horizon is Horizon.SAME_STEP and have == step + 1
        ):
            return policy.exits_after(st, step)
        return None

    def _issue_prefill(self, ops: list[StageOp]) -> None:
        if self._prefill is not None:
            return
        picked, self._prefill_starved = pick_chunks(self.cfg, self.waiting, self.running, self.rows, self.blocks)
        if picked:
            chain, self._prefill = prefill_chain(self.cfg, self.ops, picked)
            self.stats.prefill_tokens += sum(end - start for _, start, end in picked)
            ops.extend(chain)

    def _grow_blocks(self, req: Request, num_tokens: int) -> bool:
        return grow_blocks(self.cfg, self.blocks, req, num_tokens, margin=False)

    # ----------------------------------------------------------------- results
    def on_result(self, res: StageResult) -> list[Event]:
        """Consume one stage result; returns the tokens and finishes it produced."""
        t0 = time.thread_time()
        events: list[Event] = []
        self.stats.compute_s[res.stage] += res.compute_s
        pf = self._prefill
        if pf is not None and pf.seqs.get(res.stage) == res.seq:
            self._on_prefill(pf, res, events)
        elif res.stage is Stage.LOOP:
            self._on_loop(res, events)
        elif res.stage is Stage.HEAD:
            self._on_head(res, events)
        else:
            items = self._prelude.pop(res.seq)
            if res.error:
                self._fail({it.req.id: it.req for it in items if it.live}.values(), res.error, events)
        self.stats.sched_cpu_s += time.thread_time() - t0
        return events

    def _on_loop(self, res: StageResult, events: list[Event]) -> None:
        flight = self._loop.pop(res.seq)
        if res.error:
            self._fail([it.req for it in flight.items if it.live], res.error, events)
            return
        for i, (it, step) in enumerate(zip(flight.items, flight.steps)):
            if it.live and it.req.policy.needs_signals and not it.forced_depth:
                look = res.lookahead[i] if res.lookahead else None
                it.req.policy.observe(it.exit_state, step, res.signals[i], look)
        # Fates that waited for these signals: this op's own (same-step), then later ops' (one-ahead).
        cont: list[Item] = []
        for seq in [res.seq, *sorted(self._loop)]:
            fl = flight if seq == res.seq else self._loop[seq]
            for it in fl.items:
                if it.live and it.pending_since == seq:
                    self._route(it, cont)
        self.ready.extendleft(reversed(cont))

    def _on_head(self, res: StageResult, events: list[Event]) -> None:
        items = self._head.pop(res.seq)
        if res.error:
            self._fail([it.req for it in items if it.live], res.error, events)
            return
        for i, it in enumerate(items):
            if not it.live:
                continue
            lp = res.logprobs[i] if res.logprobs else None
            self._accept(it.req, it.index, res.token_ids[i], it.depth, lp, events, replay=it.replay)

    def _on_prefill(self, pf: PrefillFlight, res: StageResult, events: list[Event]) -> None:
        del pf.seqs[res.stage]
        if res.error:
            self._fail([r for r, e in zip(pf.reqs, pf.epochs) if r.alive and r.epoch == e], res.error, events)
        elif res.stage is Stage.HEAD:
            sampled = iter(zip(res.token_ids, res.logprobs or [None] * len(res.token_ids)))
            for req, epoch, final in zip(pf.reqs, pf.epochs, pf.final):
                if not final:
                    continue
                token, lp = next(sampled)
                if req.alive and req.epoch == epoch:
                    self._accept(req, 0, token, self.cfg.max_depth, lp, events, replay=bool(req.output))
        if not pf.seqs:
            self._prefill = None

    def _accept(
        self,
        req: Request,
        index: int,
        token: int,
        depth: int,
        lp: TokenLogprobs | None,
        events: list[Event],
        *,
        replay: bool,
    ) -> None:
        """Token ``index`` of ``req`` was sampled: report it, finish the request or queue its successor."""
        if replay:
            token = req.output[index]  # recomputed after preemption: keep what was reported
        else:
            req.output.append(token)
            req.depths.append(depth)
            req.loop_steps += depth
            self.stats.on_token(depth)
            events.append(TokenOut(req.id, index, token, depth, lp))
        n = len(req.output)
        if index + 1 == n:  # the newest token: does the request end here?
            if token in req.stop_token_ids:
                events.append(self._finish(req, FinishReason.STOP))
                return
            if n >= req.max_tokens:
                events.append(self._finish(req, FinishReason.LENGTH))
                return
        if index == 0:  # decode successors were spawned when their predecessor went to the head
            self._spawn(req, 1, token)

    def _spawn(self, req: Request, index: int, input_token: int) -> None:
        """Queue the item of generated token ``index`` (its input is token ``index - 1``)."""
        it = Item(req, req.epoch, index, req.prompt_len + index - 1, input_token, req.policy.new_state())
        if index < len(req.output):
            it.forced_depth = req.depths[index]  # recomputing after preemption: the recorded depth
        elif req.replay_depths is not None:
            it.exit_state.target_depth = req.replay_depths[min(index - 1, len(req.replay_depths) - 1)]
        self._place_successor(it)

    def _place_successor(self, it: Item) -> None:
        if self._grow_blocks(it.req, it.position + 1):
            self.refills.append(it)
        else:
            self.stalled.append(it)

    def _retry_stalled(self) -> None:
        for _ in range(len(self.stalled)):
            it = self.stalled.popleft()
            if it.live:
                self._place_successor(it)

    def _preempt_one(self) -> bool:
        """Nothing can run and a token waits for KV: recompute the request with the fewest computed tokens."""
        victims = [r for r in self.running.values() if r.alive]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (r.computed_tokens, -r.id))
        self._release(victim)
        victim.status = Status.WAITING
        victim.prefilled = 0
        victim.epoch += 1
        victim.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return True

    def _release(self, req: Request) -> None:
        self.running.pop(req.id, None)
        if req.row >= 0:
            self.rows.free(req.id, [req.row])
            req.row = -1
        if req.blocks:
            self.blocks.free(req.id, req.blocks)
            req.blocks = []
        self.ops.forget(req)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> Finished:
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        return Finished(req.id, reason, len(req.output), req.loop_steps, error)

    def _fail(self, reqs: Iterable[Request], error: str, events: list[Event]) -> None:
        for req in list(reqs):
            if req.alive:
                events.append(self._finish(req, FinishReason.ERROR, error))

    @staticmethod
    def _drop_stale(q: deque[Item]) -> None:
        if any(not it.live for it in q):
            live = [it for it in q if it.live]
            q.clear()
            q.extend(live)

    # ----------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Ownership invariants (tests call this after every step): one row per running request, blocks owned
        by exactly the requests holding them, at most one token per request in the loop (queued or running)."""
        row_owners = self.rows.owners()
        assert sorted(row_owners.values()) == sorted(r.id for r in self.running.values()), "row ownership"
        for req in self.running.values():
            assert row_owners.get(req.row) == req.id
        block_owners = self.blocks.owners()
        held = {b: r.id for r in self.running.values() for b in r.blocks}
        assert block_owners == held, "KV block ownership"
        groups = [self.ready, self.refills, self.stalled, self.wave_next]
        groups += [[it for it in f.items if not it.exited] for f in self._loop.values()]
        count: dict[int, set[int]] = {}
        for group in groups:
            for it in group:
                if it.live:
                    count.setdefault(it.req.id, set()).add(id(it))
        assert all(len(v) == 1 for v in count.values()), "more than one token of a request in the loop"
