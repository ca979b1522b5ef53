"""Loop ops: which ready tokens the next one runs, and each token's fate after the step it runs.

The hot path: ``take`` and ``issue`` run once per loop step over every token in the batch, ``on_result`` once per
returned loop op over its tokens (plain locals, ``Item.live`` inlined). A token's fate (exit or go on) is decided
as soon as its exit policy's horizon allows: at issue (forced and one-ahead decisions), or when the signals it
waits for return, in issue order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import LoopHead, LoopOp, Stage, StageResult
from cdb_scheduler.request import Item, Status
from cdb_scheduler.speculation import reads_ahead
from cdb_scheduler.stats import SchedulerStats
from cdb_scheduler.work import WorkQueues

_FINISHED = Status.FINISHED


@dataclass(slots=True)
class LoopFlight:
    items: list[Item]
    steps: list[int]
    head: list[Item]  # fused head (``LoopHead``): tokens sampled at the start of the op
    drafts: list[Item]  # then the successors drafted in it (their inputs: the op's next token ids)
    issued: float = 0.0  # time.perf_counter() when it was issued


class LoopPlanner:
    """Forms the decode loop ops and decides the fates of their tokens."""

    def __init__(self, config: SchedulerConfig, ops: OpBuilder, stats: SchedulerStats, work: WorkQueues) -> None:
        self.cfg = config
        self.ops = ops
        self.stats = stats
        self.work = work
        self.flights: dict[int, LoopFlight] = {}  # seq of a decode loop op in flight -> its tokens
        self.op_s = [0.0, 0.0, 0.0]  # per stage: moving average of its decode ops' compute time (s)

    def has_room(self) -> bool:
        """Whether another loop op may be in flight (``loop_pipeline_depth``)."""
        return len(self.flights) < self.cfg.loop_pipeline_depth

    def note_time(self, stage: Stage, compute_s: float) -> None:
        """A decode op of ``stage`` took ``compute_s`` (``_wait_pays``)."""
        est, s = self.op_s, int(stage)
        est[s] = compute_s if est[s] == 0.0 else est[s] + 0.125 * (compute_s - est[s])

    def take(self, progress: Callable[[Stage], int] | None) -> list[Item]:
        """The ready tokens the loop op being formed runs, in queue order (at most the width); the rest lead the
        queue for the next op. ``progress``: the scheduler's ``stage_progress``."""
        ready, width = self.work.ready, self.cfg.max_num_seqs
        items: list[Item] = []
        early: list[Item] = []  # speculative items whose next step would read KV not yet written
        unwritten: list[Item] = []  # items whose input's writer is not yet complete (``stage_progress``)
        done_prelude = done_head = -2  # (read from ``progress`` once per op, and only if a token needs them)
        forming = self.ops.next_seq(Stage.LOOP)
        take = min(width, len(ready))
        while take and ready:
            it = ready.popleft()
            req = it.req
            if req.epoch == it.epoch and req.status is not _FINISHED:
                if it.pred is not None and reads_ahead(it):
                    early.append(it)
                    continue
                if it.skip_cap and it.next_step + 1 >= it.skip_cap and unsettled(it, not self.flights):
                    early.append(it)  # its fate waits for its grammar walk (on the guide thread): not this op
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
        return items

    def _wait_pays(self, unwritten: list[Item], n: int, others: int) -> bool:
        """Whether a loop op of ``others`` tokens should take the first ``n`` of ``unwritten`` too and wait for their
        writers (the head op, and the prelude op after it) behind the loop op now running: that wait holds every
        token of the op (and idles the loop stage), leaving them out holds those ``n`` for one op. Estimated from
        the stages' recent decode ops (none yet: it waits, as with an in-order executor)."""
        est = self.op_s
        if est[Stage.LOOP] == 0.0:
            return True
        chain = est[Stage.HEAD] + (est[Stage.PRELUDE] if any(not it.gate_head for it in unwritten[:n]) else 0.0)
        return chain * (others + n) <= n * est[Stage.LOOP]

    def issue(self, items: list[Item], head_items: list[Item], head: LoopHead | None, drafts: list[Item]) -> LoopOp:
        """Issue the loop op of ``items`` (then ``drafts``, each at its step 0) with the fused ``head`` of
        ``head_items``, and decide the fate of each token's step where the horizon already allows it."""
        if drafts:
            items.extend(drafts)
        steps = [it.next_step for it in items]
        positions, rows = [it.position for it in items], [it.row for it in items]
        reqs = [it.req for it in items]
        head_reqs = [it.req for it in head_items] + [s.req for s in drafts]
        op = self.ops.loop(reqs, positions, rows, steps, head=head, head_reqs=head_reqs)
        seq = op.seq
        self.flights[seq] = LoopFlight(items, steps, head_items, drafts, time.perf_counter())
        self.stats.on_loop_issue(len(items), self.cfg.max_num_seqs)
        cont: list[Item] = []
        work = self.work
        for it in items:  # the fate of the step just issued, if the horizon already allows deciding it
            step = it.next_step
            it.next_step = step + 1
            forced = it.forced_depth
            if forced:
                decision: bool | None = step + 1 >= forced
            elif it.skip_cap and forced_now(it, step):
                decision = True  # its token is forced: only its KV is needed
            else:
                decision = it.req.policy.decision(it.exit_state, step)
            if decision is None:
                it.pending_since = seq
            elif decision:
                it.pending_since = -1
                work.leave(it, step)
            else:
                it.pending_since = -1
                cont.append(it)
        work.ready.extendleft(reversed(cont))
        return op

    def on_result(self, seq: int, flight: LoopFlight, res: StageResult) -> None:
        """Loop op ``seq`` (``flight``, no longer in ``flights``) returned: its tokens observe their signals, and
        the fates that waited for them are decided: this op's own (same-step), then later ops' (one-ahead)."""
        signals, lookahead = res.signals, res.lookahead
        for i, (it, step) in enumerate(zip(flight.items, flight.steps)):
            req = it.req
            policy = req.policy
            if policy.needs_signals and not it.forced_depth and req.epoch == it.epoch and req.status is not _FINISHED:
                policy.observe(it.exit_state, step, signals[i], lookahead[i] if lookahead else None)
        cont: list[Item] = []
        work = self.work
        for s in [seq, *sorted(self.flights)]:
            fl = flight if s == seq else self.flights[s]
            for it in fl.items:
                if it.pending_since == s:
                    req = it.req
                    if req.epoch == it.epoch and req.status is not _FINISHED:
                        step = it.next_step - 1
                        decision = req.policy.decision(it.exit_state, step)  # (forced depths never wait)
                        if it.skip_cap and forced_now(it, step):
                            decision = True
                        if decision is not None:
                            it.pending_since = -1
                            if decision:
                                work.leave(it, step)
                            else:
                                cont.append(it)
        work.ready.extendleft(reversed(cont))


def forced_now(it: Item, step: int) -> bool:
    """Whether a structured-output token exits after ``step``: at or past its ``skip_cap`` and known forced."""
    guide = it.req.guide
    return step + 1 >= it.skip_cap and guide is not None and guide.fate(it.index) >= 0


def unsettled(it: Item, wait: bool) -> bool:
    """Whether a structured-output token at its ``skip_cap`` cannot be told forced or not yet: the walk of the
    token before it is under way on the guide thread (``wait``: wait for it instead, where no loop op in flight
    would wake the scheduler). Such a token sits this loop op out: its depth never depends on the walk's timing."""
    guide = it.req.guide
    if guide is None or guide.fate(it.index) != -2:
        return False
    if wait:
        guide.forced(it.index)  # (waits for the walks under way)
    return guide.fate(it.index) == -2
