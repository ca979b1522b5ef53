"""Self-speculative decoding inside continuous depth batching: a looped model drafts its own next token.

A token ``X`` that has run ``d`` loop steps (the draft depth) is also read by the loop op's fused head: its state
at depth ``d`` is sampled exactly as its real exit will be (same sampling settings, same seeded uniform of
``(seed, token index)``) and the sample, the *draft*, is embedded as the input of ``X``'s successor ``S`` in a
bank row of its own. ``S`` runs its loop steps while ``X`` goes on looping, in the same loop ops as every other
request's tokens. When ``X`` exits, its real token is sampled as usual; if it equals the draft, ``S`` simply goes
on (its work so far is exactly the work it would have done), otherwise ``S`` and everything drafted from it are
dropped. ``X``'s real successor does not wait for that verdict: the head embeds the real token into ``X``'s row as
always, and that successor (the *fallback*) starts at once, beside ``S``; it is dropped if the draft was right and
goes on if not, so a wrong draft costs no loop op. Until the verdict a fallback drafts nothing and, should it exit,
samples nothing: what followed an alternative could overwrite the KV the other one's successors read.

Lossless by construction, for greedy and sampled decoding alike: every reported token is a real sample of a
token whose inputs are all real, and a draft only decides whether work done early can be kept. What makes the
kept work exact is the order in which ``S`` reads KV: step ``s`` of ``S`` attends to ``X``'s KV at depth slot
``s``, so it runs only in a loop op after the one that ran ``X``'s step ``s``, or after ``X`` has exited (KV policy
``last_exited`` copies ``X``'s exit-step KV into the deeper slots first, in the op that follows the decision).
That holds for ``last_exited`` and ``depth_indexed``; with ``single`` (one slot: every step reads the
predecessor's final KV) and ``first_then_shared`` nothing can start before the predecessor exits, so those
policies do not speculate. Exit decisions are each token's own: a kept ``S`` exits at the depth it would have.
A token that exits before its predecessor is verified is sampled as usual, but its token is held (``Item.sampled``)
and reported once the tokens before it are, so tokens are reported in order; its own successor follows its real
sample and stands or falls with it. Rejected work leaves no trace: its KV positions are rewritten by the fallback
before any later token reads them (loop ops run in order), its pending KV copies are dropped, its rows freed.

When it pays (the closed form the adaptive rule follows). With a mean depth ``D`` (loop steps per token), a
successor starts ``D`` loop ops after its predecessor without speculation; with a draft at depth ``d`` accepted
with probability ``a`` it starts after ``d`` ops, and after about ``D + 1`` when rejected (the fallback starts
with no delay, but drafts its own successor only once confirmed, an op later). So the expected ops per token are
``a d + (1 - a)(D + 1)``, below ``D`` exactly when ``a > 1 / (D + 1 - d)`` (the break-even acceptance), and the
speed-up at light load is ``D / (a d + (1 - a)(D + 1))``: at most ``D / d``. A draft costs one bank row and one
loop slot per op, so requests draft only while rows are free and no request waits for admission (at heavy load
CDB's own refill fills the width); under ``auto`` a draft is taken only where it raises the loop op's tokens per
second at the op's cost against its width, fitted online from the loop ops' times
(``cdb_scheduler.loop_cost``: on a CPU, where every token of an op costs compute, that is about never; on a GPU,
whose op costs nearly the same at any width, whenever ``E < D``), and only while the measured trial of drafting
against not drafting finds that it raises the tokens reported per second (``DraftTrial``: the host's own work per
draft, which the fit does not see, can decide it); ``--speculative-max-occupancy`` caps the op's
tokens where set (``on``: 0.5 of the width on a GPU, 0.25 on a CPU). Per request, the acceptance is a moving
average; when it falls below the break-even at the current depth the request drafts one step deeper (a deeper read
agrees more often, but leads less), and when no depth pays it pauses for a while and starts again.
"""

from __future__ import annotations

from dataclasses import replace

from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.loop_cost import (
    MIN_VERDICTS,
    DraftTrial,
    LoopCost,
    drafts_that_pay,
    expected_ops,
    judged_acceptance,
)
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.prefill import grow_blocks
from cdb_scheduler.request import FALLBACK, FOLLOWS_REAL, Event, Item, Request, SpecState, Status
from cdb_scheduler.residency import Residency
from cdb_scheduler.sampling import SamplingParams
from cdb_scheduler.stats import SchedulerStats
from cdb_scheduler.work import WorkQueues

ACCEPTANCE_WEIGHT = 0.25  # of the newest verdict in the moving average
PAUSE_TOKENS = 16  # generated tokens without drafting once no draft depth pays


_DRAFT_SAMPLING: dict[SamplingParams, SamplingParams] = {}


def draft_sampling(sampling: SamplingParams) -> SamplingParams:
    """A draft is sampled like the real token (same settings and seeded stream: the two agree whenever the states
    do) but reports no logprobs."""
    got = _DRAFT_SAMPLING.get(sampling)
    if got is None:
        if len(_DRAFT_SAMPLING) >= 4096:
            _DRAFT_SAMPLING.clear()
        got = _DRAFT_SAMPLING[sampling] = replace(sampling, logprobs=0, return_logprob=False)
    return got


def break_even(mean_depth: float, depth: int) -> float:
    """The acceptance above which drafting at ``depth`` shortens a token's ops (``1 / (D + 1 - d)``)."""
    lead = mean_depth + 1 - depth
    return 1.0 / lead if lead > 1 else 1.0


def mean_depth(req: Request, max_depth: int) -> float:
    """The request's own mean served depth so far (``max_depth`` before its first decode token)."""
    n = len(req.depths)
    return req.loop_steps / n if n and req.loop_steps else float(max_depth)


def observe(req: Request, state: SpecState, matched: bool, *, base_depth: int, max_depth: int, adaptive: bool) -> None:
    """A draft of ``req`` was verified: update its acceptance and, when adaptive, its draft depth or pause."""
    state.acceptance += ACCEPTANCE_WEIGHT * ((1.0 if matched else 0.0) - state.acceptance)
    if not adaptive or matched:
        return
    depth = mean_depth(req, max_depth)
    if state.acceptance >= break_even(depth, state.depth):
        return
    if state.depth + 1 < depth and state.depth + 1 < max_depth:
        state.depth += 1  # a deeper read agrees more often; start hopeful there
    else:
        state.depth = base_depth
        state.paused_until = len(req.output) + PAUSE_TOKENS
    state.acceptance = 1.0


def reads_ahead(it: Item) -> bool:
    """Whether the next step of speculative ``it`` would read KV not yet written: its step reads the KV of the
    tokens before it at that depth, and the nearest of them still looping has not run that step yet."""
    pred = it.pred
    while pred is not None and pred.exited:
        pred = pred.pred
    return pred is not None and it.next_step >= pred.next_step


class Speculation:
    """The scheduler's self-speculative decoding, called at its seams: which requests speculate (``admit``), the
    drafts a loop op starts (``draft``), what follows an unverified token (``follow``), the drafts' tokens
    (``drafted``) and the verdict on each once the real token before it is known (``verify``). The links between
    a request's items (``Item.pred``, ``succ``, ``draft``, ``fallback``, ``sampled``, ``held``) are its state."""

    def __init__(
        self, config: SchedulerConfig, residency: Residency, ops: OpBuilder, stats: SchedulerStats, work: WorkQueues
    ) -> None:
        self.cfg = config
        self.residency = residency
        self.rows, self.blocks = residency.rows, residency.blocks
        self.ops = ops
        self.stats = stats
        self.work = work
        self.cost = LoopCost()
        self.trial = DraftTrial()
        self.judged_drafts = 0  # drafts the rule picked (``DraftTrial.observe``)

    def admit(self, req: Request) -> None:
        """``req`` is queued: it speculates where it (or the server) asks to and the model allows it."""
        cfg = self.cfg
        wants = cfg.speculate if req.speculate is None else req.speculate
        proc = req.sampling.processing
        # (penalized sampling counts each sampled token on the stage: a draft must not be counted)
        # (a structured-output request does not draft: its grammar walks only the tokens it keeps)
        if wants and cfg.spec_supported and not (proc is not None and proc.penalized) and req.guide is None:
            req.spec = SpecState(cfg.spec_depth, asked=req.speculate is True)

    def draft(self, items: list[Item], width: int) -> list[Item]:
        """Speculative successors of the tokens in ``items`` that reach their request's draft depth in this op
        (while rows and width are free: no request waits for admission; under auto, only drafts that raise the
        op's tokens per second at the fitted loop cost, in the trial's drafting epochs). Each runs its step 0 in
        this op."""
        drafts: list[Item] = []
        room = min(min(width, self.cfg.spec_max_width) - len(items), self.rows.num_free)
        if room <= 0:
            return drafts
        candidates = [x for x in items if self._may_draft(x)]
        stats = self.stats
        if candidates and self.cfg.spec_adaptive:
            asked: list[Item] = []
            judged: list[Item] = []
            for x in candidates:  # (each has its request's ``spec``: ``_may_draft``)
                (asked if x.req.spec is not None and x.req.spec.asked else judged).append(x)
            if judged and self.trial.drafting:
                if not self.cost.explore(stats.spec_accepted + stats.spec_rejected < MIN_VERDICTS):
                    judged = self._paying(items, judged)
                self.judged_drafts += len(judged)
                candidates = asked + judged
            else:
                candidates = asked
        for x in candidates:
            if room <= 0:
                break
            req = x.req
            state = req.spec
            assert state is not None
            position = x.position + 1
            if position >= len(req.blocks) * self.cfg.kv_block_size and not grow_blocks(
                self.cfg, self.blocks, req, position + 1, margin=True
            ):
                continue
            got = self.rows.allocate(req.rid)
            assert got is not None
            s = self.work.new_item(req, x.index + 1, -1)
            s.row, s.pred, s.embedded = got[0], x, True
            req.spec_rows.append(s.row)
            x.succ = s
            drafts.append(s)
            self.stats.spec_draft_depth_sum += state.depth
            state.drafts += 1
            room -= 1
        self.stats.spec_drafts += len(drafts)
        return drafts

    def _may_draft(self, x: Item) -> bool:
        """Whether ``x``'s successor may be drafted in this op (its request speculates and is not paused, ``x``
        reaches the draft depth, nothing follows it yet, its request has room to run ahead)."""
        req = x.req
        state = req.spec
        return not (
            state is None
            or x.next_step < state.depth
            or x.succ is not None
            or x.draft == FALLBACK  # (what follows an alternative could overwrite the other's KV)
            or x.forced_depth
            or x.index + 1 >= req.max_tokens
            or len(req.spec_rows) >= self.cfg.spec_max_tokens
            or len(req.output) < state.paused_until
        )

    def _paying(self, items: list[Item], candidates: list[Item]) -> list[Item]:
        """The candidates whose drafts pay at the fitted loop cost (``loop_cost.drafts_that_pay``), best first."""
        max_depth = self.cfg.max_depth
        seen: set[int] = set()
        base = 0.0
        for it in items:
            if it.req.rid not in seen:
                seen.add(it.req.rid)
                base += 1.0 / mean_depth(it.req, max_depth)
        accepted, verdicts = self.stats.spec_accepted, self.stats.spec_accepted + self.stats.spec_rejected
        ranked: list[tuple[float, int]] = []
        for k, x in enumerate(candidates):
            state = x.req.spec
            assert state is not None
            depth = mean_depth(x.req, max_depth)
            acceptance = judged_acceptance(state.acceptance, state.accepted + state.rejected, accepted, verdicts)
            ranked.append((1.0 / expected_ops(depth, state.depth, acceptance) - 1.0 / depth, k))
        ranked.sort(reverse=True)
        n = drafts_that_pay(self.cost, len(items), base, [gain for gain, _ in ranked])
        return [candidates[k] for _, k in ranked[:n]]

    def observe_op(self, width: int, seconds: float) -> None:
        """A decode loop op of ``width`` tokens took ``seconds`` (``LoopCost.observe``, ``DraftTrial.observe``)."""
        self.cost.observe(width, seconds)
        if self.cfg.spec_adaptive:
            self.trial.observe(seconds, self.stats.tokens, self.judged_drafts)

    def follow(self, it: Item, succ: Item) -> None:
        """``succ`` was just spawned from ``it``'s real token. If a drafted successor of ``it`` runs, ``succ`` is
        its alternative (the ``fallback``), kept only if the draft is wrong (a wrong draft then costs no more loop
        ops than no speculation); if ``it`` is unverified itself, so is what follows its real token."""
        if it.succ is not None:
            it.fallback, succ.pred, succ.draft = succ, it, FALLBACK
        elif it.pred is not None:
            succ.pred, succ.draft, it.succ = it, FOLLOWS_REAL, succ

    @staticmethod
    def drafted(drafts: list[Item], tokens: tuple[int, ...]) -> None:
        """The loop op that started ``drafts`` returned: their inputs, the drafts, are known."""
        for s, token in zip(drafts, tokens):
            s.draft = token

    def verify(self, x: Item, token: int, events: list[Event]) -> None:
        """``x`` was just reported with ``token``: verify what follows it, and report, in order, every token after
        it that was sampled early and is now verified."""
        req = x.req
        while (s := x.succ) is not None and req.status is not Status.FINISHED:
            if not self.verdict(x, s, token):
                continue  # x's fallback took the draft's place (or x's successor was queued afresh)
            if s.sampled is None:
                return
            (token, lp), s.sampled = s.sampled, None
            self.work.accept(req, s.index, token, s.depth, lp, events, replay=False)
            x = s

    def verdict(self, x: Item, s: Item, token: int) -> bool:
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
                self.drop(fallback)
        else:
            self.drop(s)
            self.stats.spec_rejected += 1
            if fallback is None:  # (the draft's head was issued before x's: x's successor starts now)
                fallback = self.work.spawn(req, x.index + 1, -1, embedded=True, row=x.row)  # the head embedded it
            fallback.pred, fallback.draft, x.succ = x, FOLLOWS_REAL, fallback
            if fallback.held:
                fallback.held = False
                self.work.head_queue.append(fallback)
        state = req.spec
        if state is not None and not follows:
            state.accepted += matched
            state.rejected += not matched
            cfg = self.cfg
            observe(req, state, matched, base_depth=cfg.spec_depth, max_depth=cfg.max_depth, adaptive=cfg.spec_adaptive)
        return matched

    def drop(self, first: Item) -> None:
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
