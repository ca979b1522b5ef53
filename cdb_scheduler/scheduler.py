"""The continuous-depth-batching scheduler: requests and stage results in, stage ops out.

``schedule()`` is called whenever something changed; it issues every op that may run now, in the tick order of
the method (head, preludes of refills, prefill, loop steps, undersized head) and never waits for an op it has
issued. ``on_result()`` consumes one stage result. Exit decisions are taken as early as the decision horizon
allows: with one-ahead decisions the survivors of loop op k are known before k returns, so op k+1 is issued
while k runs (``loop_pipeline_depth`` ops in flight).

The parts it composes, each with its own state:

| part | module | what it does |
|---|---|---|
| ``residency`` | ``residency`` | waiting queue, running table, rows and KV blocks; finish, preempt, recompute |
| ``work`` | ``work`` | the queues of work items (ready, head, refills, stalled); spawn, exit, report a token |
| ``loop`` | ``loop`` | which ready tokens a loop op runs; each token's fate after its step |
| ``head`` | ``head`` | head ops, or a loop op's fused head; the tokens they sample |
| ``speculation`` | ``speculation`` | self-speculative drafts and their verdicts, called at a few seams |
| prefill | ``prefill`` | admission and the chunks of the next prefill chain |
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import islice

from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import FixedDepth
from cdb_scheduler.head import HeadPlanner
from cdb_scheduler.invariants import check_invariants
from cdb_scheduler.loop import LoopPlanner
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import Stage, StageOp, StageResult
from cdb_scheduler.prefill import PrefillFlight, pick_chunks, prefill_chain
from cdb_scheduler.prefix_cache import register
from cdb_scheduler.priority_depth import PriorityDepth
from cdb_scheduler.request import Event, FinishReason, Item, Request, Status
from cdb_scheduler.residency import Residency
from cdb_scheduler.speculation import Speculation
from cdb_scheduler.stats import SchedulerStats
from cdb_scheduler.work import WorkQueues


def _hand_out(ops: list[StageOp], start: int, emit: Callable[[StageOp], None]) -> float:
    """``emit`` each of ``ops[start:]``, in order; the CPU seconds it took."""
    t0 = time.thread_time()
    for i in range(start, len(ops)):
        emit(ops[i])
    return time.thread_time() - t0


class Scheduler:
    """Decides what every stage runs. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.cfg = config
        self.ops = OpBuilder()
        self.stats = SchedulerStats()
        self.residency = Residency(config, self.ops, self.stats)
        self.work = WorkQueues(config, self.residency, self.ops, self.stats)
        self.speculation = Speculation(config, self.residency, self.ops, self.stats, self.work)
        self.loop = LoopPlanner(config, self.ops, self.stats, self.work)
        self.head = HeadPlanner(config, self.residency, self.ops, self.stats, self.work, self.speculation)
        self.priority_depth = PriorityDepth() if config.priority_depth else None
        res, work = self.residency, self.work  # their queues, table and allocators under their usual names
        self.waiting, self.running, self.rows, self.blocks = res.waiting, res.running, res.rows, res.blocks
        self.ready, self.head_queue, self.refill = work.ready, work.head_queue, work.refill
        self.refills, self.stalled = work.refills, work.stalled
        self._prelude: dict[int, list[Item]] = {}  # seq of a prelude op of refills in flight -> its items
        self._prefill: PrefillFlight | None = None
        self._prefill_starved = False
        self._loop_done = 0.0  # time.perf_counter() when the last decode loop op's result was taken
        # Set by the engine where the stages run concurrently (separate processes): the last op of a stage known
        # complete (``Executor.completed``). A refill's input is written by its prelude op (or the head op that
        # embeds it), which waits for the loop op its predecessor left, the last one issued; the loop op formed
        # next starts right after that one, and would idle the loop stage through the whole chain. Tokens whose
        # input is not yet written skip that loop op where that wait costs more than their slots left empty for
        # one op (``LoopPlanner._wait_pays``), and join the one after. None (one in-order worker, in-process): no
        # fence idles a stage, and every ready token joins the next op.
        self.stage_progress: Callable[[Stage], int] | None = None

    # ----------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        """Queue a request for prefill. The engine has validated it against the limits."""
        if self.cfg.mode is Mode.FULL_DEPTH:
            req.policy = FixedDepth(self.cfg.max_depth, self.cfg.max_depth)
            req.replay_depths = None
            req.depth_policies = None
        self.speculation.admit(req)
        req.status = Status.WAITING
        self.residency.enqueue(req)  # (in priority order)

    def abort(self, rid: int, reason: FinishReason = FinishReason.CANCELLED) -> list[Event]:
        """End a request now; its row and blocks are free at once (ops already issued stay ordered by fences
        and stage order; their results for it are dropped)."""
        return self.residency.abort(rid, reason)

    def recover(self) -> list[Event]:
        """The stages lost their state (``StageLoss``: a stage died; all were re-attached fresh). Every op in
        flight is void; every running request is recomputed from its prompt and the tokens already reported, at
        their recorded depths (``Residency.requeue``), so its continuation is exactly what it would have been and
        nothing is reported twice. Waiting requests keep their place behind them."""
        self.loop.flights.clear()
        self.head.flights.clear()
        self._prelude.clear()
        self._prefill = None
        self._prefill_starved = False
        self.work.clear()
        self.stats.recomputed += self.residency.requeue_all()  # frees every row and block: stages start empty
        self.blocks.clear_cache()  # (their KV is gone with them)
        self.ops.reset()
        self.stats.recoveries += 1
        return []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_flight(self) -> int:
        return len(self.loop.flights) + len(self.head.flights) + len(self._prelude) + (self._prefill is not None)

    # ----------------------------------------------------------------- planning
    def schedule(self, emit: Callable[[StageOp], None] | None = None) -> list[StageOp]:
        """Issue every op that may run now; returns them in issue order. ``emit(op)``, where given, is called for
        each of them in that order too: for a loop op (and what was issued before it) as soon as it is formed, so
        that the op a stage result lets the scheduler plan leaves before the rest of the round is planned (the
        loop stage waits for it; nothing waits for the rest). Its time is counted apart (``stats.emit_cpu_s``).

        Planned in rounds: each refills (``_refill``) and forms at most one loop op, so that the tokens it lets
        exit go to the head (and their successors to the prelude) before the next loop op is formed, which then
        already includes the refills. Another round follows a loop op, heads flushed once the loop has nothing
        ready (``_flush_heads``), or a preemption that frees KV for a starved token (``_preempt_if_starved``)."""
        t0 = time.thread_time()
        if self.priority_depth is not None:
            self.priority_depth.update(self.residency)
        ops: list[StageOp] = []
        sent, emit_s = 0, 0.0
        more = True
        while more:
            self._refill(ops)
            formed = self._form_loop(ops)
            if formed and emit is not None:
                emit_s += _hand_out(ops, sent, emit)
                sent = len(ops)
            more = formed or self._flush_heads(ops) or self._preempt_if_starved(ops)
        if emit is not None and sent < len(ops):
            emit_s += _hand_out(ops, sent, emit)
        self.stats.sched_cpu_s += time.thread_time() - t0 - emit_s
        self.stats.emit_cpu_s += emit_s
        return ops

    def _refill(self, ops: list[StageOp]) -> None:
        """Queue what may run next: stalled successors that get a block now, the head ops due (separate head
        stage), the preludes of refills, a prefill chain; a wave starts where the loop is idle (no-refill)."""
        work = self.work
        self._prefill_starved = False
        work.retry_stalled()
        work.drop_stale(self.ready)
        if not self.cfg.fuse_loop_head:
            self.head.issue(ops, loop_drained=not self.ready and not self.loop.flights, flush=False)
        self._issue_refills(ops)
        self._issue_prefill(ops)
        idle = not (self.ready or self.loop.flights or self.head_queue or self.head.flights or self.refills)
        work.refill.start_wave(self.ready, idle=idle)
        if self.cfg.fuse_loop_head:  # exited tokens ride the next loop op, which also runs their successors' step 0
            work.drop_stale(self.head_queue)

    def _form_loop(self, ops: list[StageOp]) -> bool:
        """Issue the next loop op where there is loop work and room for another op in flight."""
        if not (self.ready or (self.cfg.fuse_loop_head and self.head_queue)) or not self.loop.has_room():
            return False
        op = self._issue_loop()
        if op is None:
            return False
        ops.append(op)
        return True

    def _flush_heads(self, ops: list[StageOp]) -> bool:
        """Separate head stage, nothing ready: issue the heads waiting (whatever their batch) and the preludes of
        their successors; whether that readied loop work with room for it."""
        if self.ready or self.cfg.fuse_loop_head:
            return False
        self.head.issue(ops, loop_drained=not self.loop.flights, flush=True)
        self._issue_refills(ops)
        return bool(self.ready) and self.loop.has_room()

    def _preempt_if_starved(self, ops: list[StageOp]) -> bool:
        """Nothing was issued, nothing runs, and a token or a prefill waits for KV blocks: recompute a request
        (``Residency.preempt_one``) and plan again."""
        starved = bool(self.stalled) or self._prefill_starved
        return not ops and not self.in_flight() and starved and self.residency.preempt_one()

    def _issue_refills(self, ops: list[StageOp]) -> None:
        self.work.drop_stale(self.refills)
        if not self.refills:
            return
        items = list(self.refills)
        self.refills.clear()
        reqs = [it.req for it in items]
        tokens = [it.input_token for it in items]
        op = self.ops.prelude(reqs, tokens, [it.position for it in items], [it.row for it in items])
        self._prelude[op.seq] = items
        ops.append(op)
        seq, gate_loop = op.seq, self.ops.next_seq(Stage.LOOP) + 1
        for it in items:  # the loop op that takes them will fence on this prelude op
            it.gate_seq, it.gate_head, it.gate_loop = seq, False, gate_loop
            self.refill.place(it, self.ready, self.stats)

    def _issue_prefill(self, ops: list[StageOp]) -> None:
        if self._prefill is not None:
            return
        # An urgent request does not wait for rows a less urgent one holds (``preempt_for_urgent``); it is then
        # admitted whatever the batch minimum of free rows.
        urgent = self.residency.preempt_for_urgent(self.cfg.admit_min_free_rows) > 0
        picked, self._prefill_starved = pick_chunks(
            self.cfg, self.waiting, self.running, self.rows, self.blocks, self.stats, urgent
        )
        if picked:
            chain, self._prefill = prefill_chain(self.cfg, self.ops, picked)
            self.stats.prefill_tokens += sum(end - start for _, start, end in picked)
            ops.extend(chain)

    def _issue_loop(self) -> StageOp | None:
        """The next loop op: the exited tokens its fused head samples, the ready tokens it runs, the drafts it
        starts (None: nothing to run)."""
        fused = self.cfg.fuse_loop_head
        head_items, embed_ids = self.head.take_fused(wait=not self.loop.flights) if fused else ([], [])
        items = self.loop.take(self.stage_progress)
        drafts = self._draft(items, self.cfg.max_num_seqs) if self.cfg.spec_supported and not self.waiting else []
        if not items and not head_items:
            return None
        head = self.head.fused(head_items, embed_ids, drafts) if head_items or drafts else None
        return self.loop.issue(items, head_items, head, drafts)

    def _draft(self, items: list[Item], width: int) -> list[Item]:
        """The drafts the loop op of ``items`` starts (``Speculation.draft``)."""
        return self.speculation.draft(items, width)

    # ----------------------------------------------------------------- results
    def on_result(self, res: StageResult) -> list[Event]:
        """Consume one stage result; returns the tokens and finishes it produced."""
        t0 = time.thread_time()
        events: list[Event] = []
        self.stats.compute_s[res.stage] += res.compute_s
        self.stats.ops[res.stage] += 1
        pf = self._prefill
        if pf is not None and pf.seqs.get(res.stage) == res.seq:
            self._on_prefill(pf, res, events)
        else:
            if not res.error:  # a decode op's time (``LoopPlanner._wait_pays``)
                self.loop.note_time(res.stage, res.compute_s)
            if res.stage is Stage.LOOP:
                self.stats.loop_decode_compute_s += res.compute_s
                self._on_loop(res, events)
            elif res.stage is Stage.HEAD:
                self.head.on_result(res, events)
            else:
                items = self._prelude.pop(res.seq)
                if res.error:
                    self.residency.fail({it.req.rid: it.req for it in items if it.live}.values(), res.error, events)
        self.stats.sched_cpu_s += time.thread_time() - t0
        return events

    def _on_loop(self, res: StageResult, events: list[Event]) -> None:
        flight = self.loop.flights.pop(res.seq)
        if res.error:
            failed = {it.req.rid: it.req for it in (*flight.head, *flight.items) if it.live}
            self.residency.fail(failed.values(), res.error, events)
            return
        if flight.drafts:
            self.speculation.drafted(flight.drafts, res.token_ids[len(flight.head) :])
        if self.cfg.spec_supported:  # what the op cost the whole path: from its issue or the last op's end
            now = time.perf_counter()
            self.speculation.observe_op(len(flight.items), now - max(flight.issued, self._loop_done))
            self._loop_done = now
        self.head.report_fused(flight.head, res, events)
        self.loop.on_result(res.seq, flight, res)

    def _on_prefill(self, pf: PrefillFlight, res: StageResult, events: list[Event]) -> None:
        del pf.seqs[res.stage]
        if res.error:
            self.residency.fail([r for r, e in zip(pf.reqs, pf.epochs) if r.alive and r.epoch == e], res.error, events)
        elif res.stage is Stage.HEAD:
            sampled = iter(zip(res.token_ids, res.logprobs or [None] * len(res.token_ids)))
            scored = iter(res.prompt_logprobs)
            for req, epoch, final, n_scored in zip(pf.reqs, pf.epochs, pf.final, pf.scored):
                live = req.alive and req.epoch == epoch
                scores = list(islice(scored, n_scored))
                if live:
                    req.prompt_logprobs.extend(scores)
                if not final:
                    continue
                if req.max_tokens == 0:  # prefill only (the prompt scored): nothing is sampled
                    if live:
                        events.append(self.residency.finish(req, FinishReason.LENGTH))
                    continue
                token, lp = next(sampled)
                if live:
                    self.work.accept(req, 0, token, self.cfg.max_depth, lp, events, replay=bool(req.output))
        if not pf.seqs:
            self._prefill = None
            if self.cfg.prefix_caching and not res.error:  # its KV is written on every stage: cache its blocks
                for req, epoch in zip(pf.reqs, pf.epochs):
                    if req.alive and req.epoch == epoch and req.prefix_hashes:
                        register(self.cfg, self.blocks, req)

    def check_invariants(self) -> None:
        """Ownership invariants (tests call this after every step); see ``cdb_scheduler.invariants``."""
        check_invariants(self)
