"""The continuous-depth-batching scheduler: requests and stage results in, stage ops out.

``schedule()`` is called whenever something changed; it issues every op that may run now, in the tick order of
the method (head, preludes of refills, prefill, loop steps, undersized head) and never waits for an op it has
issued. ``on_result()`` consumes one stage result. Exit decisions are taken as early as the decision horizon
allows: with one-ahead decisions the survivors of loop op k are known before k returns, so op k+1 is issued
while k runs (``loop_pipeline_depth`` ops in flight).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from cdb_scheduler import speculation
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import FixedDepth
from cdb_scheduler.invariants import check_invariants
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import KVCopy, LoopHead, Stage, StageOp, StageResult, TokenLogprobs
from cdb_scheduler.prefill import PrefillFlight, grow_blocks, pick_chunks, prefill_chain
from cdb_scheduler.refill import refill_policy
from cdb_scheduler.request import (
    FALLBACK,
    FOLLOWS_REAL,
    Event,
    FinishReason,
    Item,
    Request,
    SpecState,
    Status,
    TokenOut,
)
from cdb_scheduler.residency import Residency
from cdb_scheduler.stats import SchedulerStats

_FINISHED = Status.FINISHED


def _hand_out(ops: list[StageOp], start: int, emit: Callable[[StageOp], None]) -> float:
    """``emit`` each of ``ops[start:]``, in order; the CPU seconds it took."""
    t0 = time.thread_time()
    for i in range(start, len(ops)):
        emit(ops[i])
    return time.thread_time() - t0


@dataclass(slots=True)
class _LoopFlight:
    items: list[Item]
    steps: list[int]
    head: list[Item]  # fused head (``LoopHead``): tokens sampled at the start of the op
    drafts: list[Item]  # then the successors drafted in it (their inputs: the op's next token ids)


class Scheduler:
    """Decides what every stage runs. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.cfg = config
        self.ops = OpBuilder()
        self.stats = SchedulerStats()
        self.residency = Residency(config, self.ops, self.stats)
        self._scanned: dict[int, int] = {}  # id of a queue -> residency.releases at its last stale scan
        res = self.residency  # its queue, table and allocators under their usual names
        self.waiting, self.running, self.rows, self.blocks = res.waiting, res.running, res.rows, res.blocks
        self.ready: deque[Item] = deque()  # loop work, head = next to run
        self.head_queue: deque[Item] = deque()  # exited tokens waiting for the head
        self.refills: deque[Item] = deque()  # successors waiting for their prelude
        self.stalled: deque[Item] = deque()  # successors waiting for a KV block
        self.refill = refill_policy(config.mode)
        self._loop: dict[int, _LoopFlight] = {}
        self._head: dict[int, list[Item]] = {}
        self._prelude: dict[int, list[Item]] = {}
        self._prefill: PrefillFlight | None = None
        self._prefill_starved = False
        # Set by the engine where the stages run concurrently (separate processes): the last op of a stage known
        # complete (``Executor.completed``). A refill's input is written by its prelude op (or the head op that
        # embeds it), which waits for the loop op its predecessor left, the last one issued; the loop op formed
        # next starts right after that one, and would idle the loop stage through the whole chain. Tokens whose
        # input is not yet written skip that loop op where that wait costs more than their slots left empty for
        # one op (``_wait_pays``), and join the one after. None (one in-order worker, in-process): no fence idles a
        # stage, and every ready token joins the next op.
        self.stage_progress: Callable[[Stage], int] | None = None
        self._op_s = [0.0, 0.0, 0.0]  # per stage: moving average of its decode ops' compute time (s)

    # ----------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        """Queue a request for prefill. The engine has validated it against the limits."""
        if self.cfg.mode is Mode.FULL_DEPTH:
            req.policy = FixedDepth(self.cfg.max_depth, self.cfg.max_depth)
            req.replay_depths = None
        cfg = self.cfg
        wants = cfg.speculate if req.speculate is None else req.speculate
        proc = req.sampling.processing
        # (penalized sampling counts each sampled token on the stage: a draft must not be counted)
        if wants and cfg.spec_supported and not (proc is not None and proc.penalized):
            req.spec = SpecState(cfg.spec_depth)
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, rid: int, reason: FinishReason = FinishReason.CANCELLED) -> list[Event]:
        """End a request now; its row and blocks are free at once (ops already issued stay ordered by fences
        and stage order; their results for it are dropped)."""
        return self.residency.abort(rid, reason)

    def recover(self) -> list[Event]:
        """The stages lost their state (``StageLoss``: a stage died; all were re-attached fresh). Every op in
        flight is void; every running request is recomputed from its prompt and the tokens already reported, at
        their recorded depths (``Residency.requeue``), so its continuation is exactly what it would have been and
        nothing is reported twice. Waiting requests keep their place behind them."""
        self._loop.clear()
        self._head.clear()
        self._prelude.clear()
        self._prefill = None
        self._prefill_starved = False
        for q in (self.ready, self.head_queue, self.refills, self.stalled):
            q.clear()
        self.refill = refill_policy(self.cfg.mode)
        self.stats.recomputed += self.residency.requeue_all()  # frees every row and block: stages start empty
        self.ops.reset()
        self.stats.recoveries += 1
        return []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_flight(self) -> int:
        return len(self._loop) + len(self._head) + len(self._prelude) + (self._prefill is not None)

    # ----------------------------------------------------------------- planning
    def schedule(self, emit: Callable[[StageOp], None] | None = None) -> list[StageOp]:
        """Issue every op that may run now; returns them in issue order. ``emit(op)``, where given, is called for
        each of them in that order too: for a loop op (and what was issued before it) as soon as it is formed, so
        that the op a stage result lets the scheduler plan leaves before the rest of the round is planned (the
        loop stage waits for it; nothing waits for the rest). Its time is counted apart (``stats.emit_cpu_s``)."""
        t0 = time.thread_time()
        ops: list[StageOp] = []
        sent, emit_s = 0, 0.0
        fused = self.cfg.fuse_loop_head
        while True:
            self._prefill_starved = False
            self._retry_stalled()
            self._drop_stale(self.ready)
            if not fused:
                self._issue_heads(ops, flush=False)
            self._issue_refills(ops)
            self._issue_prefill(ops)
            idle = not (self.ready or self._loop or self.head_queue or self._head or self.refills)
            self.refill.start_wave(self.ready, idle=idle)
            if fused:  # exited tokens ride the next loop op, which also runs their successors' step 0
                self._drop_stale(self.head_queue)
            if (self.ready or (fused and self.head_queue)) and len(self._loop) < self.cfg.loop_pipeline_depth:
                # One loop op per round: tokens it lets exit go to the head (and their successors to the
                # prelude) before the next loop op is formed, so that op already includes the refills.
                op = self._issue_loop()
                if op is not None:
                    ops.append(op)
                    if emit is not None:
                        emit_s += _hand_out(ops, sent, emit)
                        sent = len(ops)
                    continue
            if not self.ready and not fused:
                self._issue_heads(ops, flush=True)
                self._issue_refills(ops)
                if self.ready and len(self._loop) < self.cfg.loop_pipeline_depth:
                    continue
            starved = bool(self.stalled) or self._prefill_starved
            if ops or self.in_flight() or not starved or not self.residency.preempt_one():
                break
        if emit is not None and sent < len(ops):
            emit_s += _hand_out(ops, sent, emit)
        self.stats.sched_cpu_s += time.thread_time() - t0 - emit_s
        self.stats.emit_cpu_s += emit_s
        return ops

    def _issue_heads(self, ops: list[StageOp], *, flush: bool) -> None:
        self._drop_stale(self.head_queue)
        drained = not self.ready and not self._loop and not self._head
        gate = self.refill.head_gate(waiting=bool(self.head_queue), loop_drained=drained)
        if gate is None:
            return
        flush = flush or gate
        # Head ops are batched (min_head_batch_size > 1: Huginn's coda is as large as its loop block, and a small
        # batch re-reads all its weights), but an exited token waits at most max_head_wait_steps loop ops.
        waited = self.stats.loop_steps - self.head_queue[0].exited_at if self.head_queue else 0
        need = 1 if flush or waited >= self.cfg.max_head_wait_steps else self.cfg.min_head_batch_size
        while len(self.head_queue) >= need and len(self._head) < self.cfg.max_head_in_flight:
            items = [self.head_queue.popleft() for _ in range(min(len(self.head_queue), self.cfg.max_num_seqs))]
            reqs = [it.req for it in items]
            # Successors start now. Their input is the id this op samples: the head embeds it into the row when
            # the model allows (fused refill), else their prelude reads it from the token bank. A recomputed
            # token's input is known (recorded) and goes through a prelude op with that id.
            known = [it.req.output[it.index] if it.index < len(it.req.output) else -1 for it in items]
            follows = [it.index + 1 < it.req.max_tokens for it in items]
            fuse = self.cfg.fuse_refill_embed
            embed = [fuse and f and k < 0 for f, k in zip(follows, known)]
            rows, positions = [it.row for it in items], [it.position for it in items]
            op = self.ops.head(reqs, positions, rows, [True] * len(items), [it.index for it in items], embed)
            self._head[op.seq] = items
            ops.append(op)
            for it, f, k, e in zip(items, follows, known, embed):
                if f:
                    succ = self._spawn(it.req, it.index + 1, k, embedded=e)
                    if e:  # its input is written by this op (else by its prelude: ``_issue_refills``)
                        succ.gate_seq, succ.gate_head = op.seq, True
                        succ.gate_loop = self.ops.next_seq(Stage.LOOP) + 1

    def _issue_refills(self, ops: list[StageOp]) -> None:
        self._drop_stale(self.refills)
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

    def _issue_loop(self) -> StageOp | None:
        # Runs once per loop step over every token in the batch: plain locals, Item.live inlined.
        head_items, embed_ids = self._fused_head() if self.cfg.fuse_loop_head else ([], [])
        ready, width = self.ready, self.cfg.max_num_seqs
        items: list[Item] = []
        early: list[Item] = []  # speculative items whose next step would read KV not yet written
        unwritten: list[Item] = []  # items whose input's writer is not yet complete (``stage_progress``)
        progress = self.stage_progress
        done_prelude = done_head = -2  # (read from ``progress`` once per op, and only if a token needs them)
        forming = self.ops.next_seq(Stage.LOOP)
        take = min(width, len(ready))
        while take and ready:
            it = ready.popleft()
            req = it.req
            if req.epoch == it.epoch and req.status is not _FINISHED:
                pred = it.pred
                if pred is not None:  # speculative: its step reads KV of the tokens before it at that depth
                    while pred is not None and pred.exited:
                        pred = pred.pred
                    if pred is not None and it.next_step >= pred.next_step:
                        early.append(it)  # the nearest one still looping has not run that step yet
                        continue
                if progress is not None and it.gate_seq >= 0 and forming < it.gate_loop:
                    if done_head == -2:
                        done_prelude, done_head = progress(Stage.PRELUDE), progress(Stage.HEAD)
                    if it.gate_seq > (done_head if it.gate_head else done_prelude):
                        unwritten.append(it)
                        continue
                    it.gate_seq = -1  # written: no later op waits for it either
                items.append(it)
                take -= 1
        if unwritten:  # taken where waiting for their input pays; else they lead the queue for the next op
            room = min(width - len(items), len(unwritten))
            if items and not self._wait_pays(unwritten, room, len(items)):
                room = 0
            items.extend(unwritten[:room])
            early.extend(unwritten[room:])
        if early:
            ready.extendleft(reversed(early))
        drafts = self._draft(items, width) if self.cfg.spec_supported and not self.waiting else []
        if not items and not head_items:
            return None
        head = self._loop_head(head_items, embed_ids, drafts) if head_items or drafts else None
        if drafts:
            items.extend(drafts)
        steps = [it.next_step for it in items]
        positions, rows = [it.position for it in items], [it.row for it in items]
        reqs = [it.req for it in items]
        head_reqs = [it.req for it in head_items] + [s.req for s in drafts]
        op = self.ops.loop(reqs, positions, rows, steps, head=head, head_reqs=head_reqs)
        seq = op.seq
        self._loop[seq] = _LoopFlight(items, steps, head_items, drafts)
        self.stats.on_loop_issue(len(items), width)
        cont: list[Item] = []
        leave = self._leave
        for it in items:  # the fate of the step just issued, if the horizon already allows deciding it
            step = it.next_step
            it.next_step = step + 1
            forced = it.forced_depth
            decision = step + 1 >= forced if forced else it.req.policy.decision(it.exit_state, step)
            if decision is None:
                it.pending_since = seq
            elif decision:
                it.pending_since = -1
                leave(it, step)
            else:
                it.pending_since = -1
                cont.append(it)
        ready.extendleft(reversed(cont))
        return op

    def _wait_pays(self, unwritten: list[Item], n: int, others: int) -> bool:
        """Whether a loop op of ``others`` tokens should take the first ``n`` of ``unwritten`` too and wait for their
        writers (the head op, and the prelude op after it) behind the loop op now running: that wait holds every
        token of the op (and idles the loop stage), leaving them out holds those ``n`` for one op. Estimated from
        the stages' recent decode ops (none yet: it waits, as with an in-order executor)."""
        est = self._op_s
        if est[Stage.LOOP] == 0.0:
            return True
        chain = est[Stage.HEAD] + (est[Stage.PRELUDE] if any(not it.gate_head for it in unwritten[:n]) else 0.0)
        return chain * (others + n) <= n * est[Stage.LOOP]

    def _fused_head(self) -> tuple[list[Item], list[int]]:
        """Take every exited token into the loop op being formed (``LoopHead``) and queue its successor, whose
        input embedding that op writes into the row before its step 0 (a recomputed token's recorded input is
        embedded as given). A token whose successor already runs from a draft gets this one too, as the
        ``fallback`` that goes on if the draft is wrong and is dropped if it is right (``_verdict``): a wrong draft
        then costs no more loop ops than no speculation. Returns the items and what each embeds
        (``LoopHead.embed_ids``)."""
        items = [it for it in self.head_queue if it.req.epoch == it.epoch and it.req.status is not _FINISHED]
        self.head_queue.clear()
        embed_ids: list[int] = []
        for it in items:
            req = it.req
            known = req.output[it.index] if it.index < len(req.output) else -1
            if it.index + 1 >= req.max_tokens:
                embed_ids.append(-2)  # the request ends with this token
                continue
            embed_ids.append(known)
            succ = self._spawn(req, it.index + 1, known, embedded=True, row=it.row)
            if it.succ is not None:  # an alternative to the drafted successor until the verdict
                it.fallback, succ.pred, succ.draft = succ, it, FALLBACK
            elif it.pred is not None:  # ``it`` is unverified: so is what follows its real token
                succ.pred, succ.draft, it.succ = it, FOLLOWS_REAL, succ
        return items, embed_ids

    def _loop_head(self, items: list[Item], embed_ids: list[int], drafts: list[Item]) -> LoopHead:
        """The fused head of a loop op: the exited ``items`` (each sampled into its own row), then the draft reads
        (each drafted token's row sampled, its successor's input embedded into the successor's row)."""
        reqs = [it.req for it in items]
        rows = [it.row for it in items]
        token_index = [it.index for it in items]
        history = self.ops.history(Stage.LOOP, reqs, rows, token_index)
        sampling = [r.sampling for r in reqs]
        positions = [it.position for it in items]
        targets: tuple[int, ...] = ()
        if drafts:
            targets = (*rows, *(s.row for s in drafts))
            for s in drafts:
                x = s.pred
                assert x is not None
                reqs.append(x.req)
                rows.append(x.row)
                token_index.append(x.index)
                sampling.append(speculation.draft_sampling(x.req.sampling))
                positions.append(x.position)
                embed_ids.append(-1)
        return LoopHead(
            rids=tuple(r.rid for r in reqs),
            positions=tuple(positions),
            rows=tuple(rows),
            sampling=tuple(sampling),
            token_index=tuple(token_index),
            embed_ids=tuple(embed_ids),
            history=history,
            embed_rows=targets,
        )

    def _draft(self, items: list[Item], width: int) -> list[Item]:
        """Speculative successors of the tokens in ``items`` that reach their request's draft depth in this op
        (while rows and width are free: no request waits for admission). Each runs its step 0 in this op."""
        drafts: list[Item] = []
        room = min(min(width, self.cfg.spec_max_width) - len(items), self.rows.num_free)
        for x in items:
            if room <= 0:
                break
            req = x.req
            state = req.spec
            if (
                state is None
                or x.next_step < state.depth
                or x.succ is not None
                or x.draft == FALLBACK  # (what follows an alternative could overwrite the other's KV)
                or x.forced_depth
                or x.index + 1 >= req.max_tokens
                or len(req.spec_rows) >= self.cfg.spec_max_tokens
                or len(req.output) < state.paused_until
            ):
                continue
            position = x.position + 1
            if position >= len(req.blocks) * self.cfg.kv_block_size and not grow_blocks(
                self.cfg, self.blocks, req, position + 1, margin=True
            ):
                continue
            got = self.rows.allocate(req.rid)
            assert got is not None
            s = self._new_item(req, x.index + 1, -1)
            s.row, s.pred, s.embedded = got[0], x, True
            req.spec_rows.append(s.row)
            x.succ = s
            drafts.append(s)
            self.stats.spec_draft_depth_sum += state.depth
            state.drafts += 1
            room -= 1
        self.stats.spec_drafts += len(drafts)
        return drafts

    def _leave(self, it: Item, step: int) -> None:
        """``it`` exits after ``step``: to the head queue (its KV copied into the deeper slots first, if the policy
        copies on exit)."""
        it.exited = True
        it.depth = step + 1
        if self.cfg.copy_on_exit and step + 1 < self.cfg.max_depth:
            it.copy = KVCopy(it.req.rid, it.position, step)
            self.ops.pending_copies.append(it.copy)
        it.exited_at = self.stats.loop_steps
        if it.draft == FALLBACK:
            it.held = True  # an alternative samples nothing before the verdict (``_verdict``)
        else:
            self.head_queue.append(it)

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
        self.stats.ops[res.stage] += 1
        pf = self._prefill
        if pf is not None and pf.seqs.get(res.stage) == res.seq:
            self._on_prefill(pf, res, events)
        else:
            if not res.error:  # a decode op's time (``_wait_pays``)
                est, s = self._op_s, int(res.stage)
                est[s] = res.compute_s if est[s] == 0.0 else est[s] + 0.125 * (res.compute_s - est[s])
            if res.stage is Stage.LOOP:
                self.stats.loop_decode_compute_s += res.compute_s
                self._on_loop(res, events)
            elif res.stage is Stage.HEAD:
                self._on_head(res, events)
            else:
                items = self._prelude.pop(res.seq)
                if res.error:
                    self.residency.fail({it.req.rid: it.req for it in items if it.live}.values(), res.error, events)
        self.stats.sched_cpu_s += time.thread_time() - t0
        return events

    def _on_loop(self, res: StageResult, events: list[Event]) -> None:
        flight = self._loop.pop(res.seq)
        if res.error:
            failed = {it.req.rid: it.req for it in (*flight.head, *flight.items) if it.live}
            self.residency.fail(failed.values(), res.error, events)
            return
        accept, logprobs, token_ids = self._accept, res.logprobs, res.token_ids
        if flight.drafts:
            for s, token in zip(flight.drafts, token_ids[len(flight.head) :]):
                s.draft = token
        for i, it in enumerate(flight.head):  # the fused head's tokens, sampled before the op's step
            req = it.req
            if req.epoch == it.epoch and req.status is not _FINISHED:
                lp = logprobs[i] if logprobs else None
                if it.pred is not None:  # unverified: reported once the tokens before it are (``_verdict``)
                    it.sampled = (token_ids[i], lp)
                    continue
                accept(req, it.index, token_ids[i], it.depth, lp, events, replay=it.forced_depth > 0)
                if it.succ is not None:
                    self._verify(it, token_ids[i], events)
        signals, lookahead = res.signals, res.lookahead
        for i, (it, step) in enumerate(zip(flight.items, flight.steps)):
            req = it.req
            policy = req.policy
            if policy.needs_signals and not it.forced_depth and req.epoch == it.epoch and req.status is not _FINISHED:
                policy.observe(it.exit_state, step, signals[i], lookahead[i] if lookahead else None)
        # Fates that waited for these signals: this op's own (same-step), then later ops' (one-ahead).
        cont: list[Item] = []
        leave = self._leave
        for seq in [res.seq, *sorted(self._loop)]:
            fl = flight if seq == res.seq else self._loop[seq]
            for it in fl.items:
                if it.pending_since == seq:
                    req = it.req
                    if req.epoch == it.epoch and req.status is not _FINISHED:
                        step = it.next_step - 1
                        decision = req.policy.decision(it.exit_state, step)  # (forced depths never wait)
                        if decision is not None:
                            it.pending_since = -1
                            if decision:
                                leave(it, step)
                            else:
                                cont.append(it)
        self.ready.extendleft(reversed(cont))

    def _on_head(self, res: StageResult, events: list[Event]) -> None:
        items = self._head.pop(res.seq)
        if res.error:
            self.residency.fail([it.req for it in items if it.live], res.error, events)
            return
        for i, it in enumerate(items):
            if not it.live:
                continue
            lp = res.logprobs[i] if res.logprobs else None
            self._accept(it.req, it.index, res.token_ids[i], it.depth, lp, events, replay=it.replay)

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
            events.append(TokenOut(req.rid, index, token, depth, lp))
        n = len(req.output)
        if index + 1 == n:  # the newest token: does the request end here?
            if token in req.stop_token_ids:
                events.append(self.residency.finish(req, FinishReason.STOP))
                return
            if n >= req.max_tokens:
                events.append(self.residency.finish(req, FinishReason.LENGTH))
                return
        if index == 0:  # decode successors were spawned when their predecessor went to the head
            self._spawn(req, 1, token)

    def _verify(self, x: Item, token: int, events: list[Event]) -> None:
        """``x`` was just reported with ``token``: verify what follows it, and report, in order, every token after
        it that was sampled early and is now verified."""
        req = x.req
        while (s := x.succ) is not None and req.status is not _FINISHED:
            if not self._verdict(x, s, token):
                continue  # x's fallback took the draft's place (or x's successor was queued afresh)
            if s.sampled is None:
                return
            (token, lp), s.sampled = s.sampled, None
            self._accept(req, s.index, token, s.depth, lp, events, replay=False)
            x = s

    def _verdict(self, x: Item, s: Item, token: int) -> bool:
        """``x``'s real token is ``token``; ``s`` was drafted from it (or follows its real sample). Keep ``s`` (and
        what follows it) if its input was right, else drop them all and start ``x``'s successor from ``token``, in
        ``x``'s row (its ``fallback`` already runs there). Returns whether ``s`` was kept; if not, ``x.succ`` is the
        fallback, which follows ``token``."""
        req = x.req
        x.succ = None
        follows = s.draft == FOLLOWS_REAL
        matched = follows or token == s.draft
        fallback, x.fallback = x.fallback, None
        if matched:
            if s.row != x.row:  # x's row is free; s's becomes the request's
                self.rows.free(req.rid, [req.row])
                req.row = s.row
                req.spec_rows.remove(s.row)
            s.pred = None
            if not follows:
                self.stats.spec_accepted += 1
            if fallback is not None:
                self._drop(fallback)
        else:
            self._drop(s)
            self.stats.spec_rejected += 1
            if fallback is None:  # (the draft's head was issued before x's: x's successor starts now)
                fallback = self._spawn(req, x.index + 1, -1, embedded=True, row=x.row)  # the head embedded it there
            fallback.pred, fallback.draft, x.succ = x, FOLLOWS_REAL, fallback
            if fallback.held:
                fallback.held = False
                self.head_queue.append(fallback)
        state = req.spec
        if state is not None and not follows:
            state.accepted += matched
            state.rejected += not matched
            cfg = self.cfg
            speculation.observe(
                req, state, matched, base_depth=cfg.spec_depth, max_depth=cfg.max_depth, adaptive=cfg.spec_adaptive
            )
        return matched

    def _drop(self, first: Item) -> None:
        """Make ``first`` and everything that follows it (drafted from it, or its fallbacks) stale: their spare rows
        freed, their KV copies not yet issued discarded (their KV positions are rewritten by the work that
        replaces them before any later token reads them), their loop steps counted as wasted."""
        req = first.req
        dropped: list[Item] = []
        todo = [first]
        while todo:
            it = todo.pop()
            dropped.append(it)
            it.epoch = -1  # stale everywhere it is queued or in flight
            todo.extend(x for x in (it.succ, it.fallback) if x is not None)
            it.succ = it.fallback = None
        rows = {d.row for d in dropped} & set(req.spec_rows)
        if rows:
            self.rows.free(req.rid, sorted(rows))
            req.spec_rows = [r for r in req.spec_rows if r not in rows]
        copies = {id(d.copy) for d in dropped if d.copy is not None}
        if copies:
            self.ops.pending_copies = [c for c in self.ops.pending_copies if id(c) not in copies]
        self.residency.releases += 1  # queues hold stale items now
        self.stats.spec_wasted_steps += sum(d.next_step for d in dropped)

    def _new_item(self, req: Request, index: int, input_token: int, row: int = -1) -> Item:
        it = Item(req, req.epoch, index, req.prompt_len + index - 1, input_token, req.policy.new_state())
        it.row = row if row >= 0 else req.row
        if index < len(req.output):
            it.forced_depth = req.depths[index]  # recomputing after preemption: the recorded depth
        elif req.replay_depths is not None:
            it.exit_state.target_depth = req.replay_depths[min(index - 1, len(req.replay_depths) - 1)]
        return it

    def _spawn(self, req: Request, index: int, input_token: int, *, embedded: bool = False, row: int = -1) -> Item:
        """Queue the item of generated token ``index`` (its input is token ``index - 1``), in ``row`` (default: the
        request's)."""
        it = self._new_item(req, index, input_token, row)
        it.embedded = embedded
        self._place_successor(it)
        return it

    def _place_successor(self, it: Item) -> None:
        req = it.req  # (the common case, a position inside the blocks it has, without a call)
        if it.position >= len(req.blocks) * self.cfg.kv_block_size and not self._grow_blocks(req, it.position + 1):
            self.stalled.append(it)
        elif it.embedded:  # its "prelude" is the head op that samples its input: fenced on by row
            self.refill.place(it, self.ready, self.stats)
        else:
            self.refills.append(it)

    def _retry_stalled(self) -> None:
        for _ in range(len(self.stalled)):
            it = self.stalled.popleft()
            if it.live:
                self._place_successor(it)

    def _drop_stale(self, q: deque[Item]) -> None:
        """Remove the stale items of ``q`` (one of the three queues). Items enter a queue live, and only a
        release (``Residency.releases``) makes one stale, so a queue scanned since the last release is clean."""
        releases = self.residency.releases
        if self._scanned.get(id(q)) == releases:
            return
        self._scanned[id(q)] = releases
        if any(not it.live for it in q):
            live = [it for it in q if it.live]
            q.clear()
            q.extend(live)

    def check_invariants(self) -> None:
        """Ownership invariants (tests call this after every step); see ``cdb_scheduler.invariants``."""
        check_invariants(self)
