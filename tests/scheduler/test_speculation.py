"""The scheduler's rules of self-speculative decoding, on hand-made state: a speculative item never reads KV its
predecessors have not written yet; a wrong draft leaves nothing behind; the adaptive rule follows the closed form."""

from __future__ import annotations

from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.exit_policy import FixedDepth
from cdb_scheduler.plan import KVCopy, LoopOp
from cdb_scheduler.request import Item, Request, SpecState, Status
from cdb_scheduler.scheduler import Scheduler
from cdb_scheduler.speculation import break_even, observe


def _running() -> tuple[Scheduler, Request]:
    cfg = SchedulerConfig(
        max_depth=4,
        max_num_seqs=4,
        num_kv_blocks=16,
        kv_block_size=4,
        copy_on_exit=True,
        fuse_loop_head=True,
        spec_supported=True,
        speculate=True,
    )
    sched = Scheduler(cfg)
    req = Request(rid=1, prompt=[3, 4, 5], max_tokens=8, policy=FixedDepth(4, 4))
    req.status = Status.RUNNING
    req.row = sched.rows.allocate(req.rid)[0]  # type: ignore[index]
    req.blocks = sched.blocks.allocate(req.rid, 2)  # type: ignore[assignment]
    req.spec = SpecState(1)
    req.output = [9]
    sched.running[req.rid] = req
    return sched, req


def _pair(sched: Scheduler, req: Request) -> tuple[Item, Item]:
    """Token 1 (``x``, in the request's row) and token 2 drafted from it (``s``, in a row of its own)."""
    x = sched.work.new_item(req, 1, 9)
    s = sched.work.new_item(req, 2, -1, row=sched.rows.allocate(req.rid)[0])  # type: ignore[index]
    req.spec_rows.append(s.row)
    s.pred, s.embedded, x.succ = x, True, s
    return x, s


def test_a_speculative_step_waits_until_the_token_before_it_has_run_that_step() -> None:
    sched, req = _running()
    req.spec = SpecState(1, paused_until=100)  # no new drafts: only the pair's steps
    x, s = _pair(sched, req)
    x.next_step, s.next_step = 1, 1  # x ran step 0 and waits for its fate; s would read x's step-1 KV
    sched.ready.append(s)
    assert sched._issue_loop() is None and list(sched.ready) == [s]
    x.next_step = 2  # x has issued step 1: s may run it
    op = sched._issue_loop()
    assert isinstance(op, LoopOp) and op.steps == (1,) and op.rows == (s.row,)
    s.next_step = 3
    sched.ready.clear()
    sched.ready.append(s)
    x.exited = True  # gone at depth 2: its deeper slots hold copies of its exit-step KV, so nothing is waited on
    op = sched._issue_loop()
    assert isinstance(op, LoopOp) and op.steps == (3,)
    sched.check_invariants()


def test_a_wrong_draft_leaves_nothing_behind_and_restarts_from_the_real_token() -> None:
    sched, req = _running()
    x, s = _pair(sched, req)
    s.draft = 11
    s.next_step = 2
    s.copy = KVCopy(req.rid, s.position, 1)  # s exited; its copy not yet issued
    sched.ops.pending_copies.append(s.copy)
    sched.ops.pending_copies.append(KVCopy(7, s.position, 1))  # another request's stays
    kept = sched.speculation.verdict(x, s, 12)
    assert not kept and not s.live and req.spec_rows == []
    assert sched.rows.owners() == {req.row: req.rid}
    assert [c.rid for c in sched.ops.pending_copies] == [7]
    (fallback,) = list(sched.ready)
    assert (fallback.index, fallback.row, fallback.embedded) == (2, x.row, True)
    assert (
        x.succ is fallback and sched.speculation.verdict(x, fallback, 12) and fallback.pred is None
    )  # it follows the token
    assert sched.stats.spec_rejected == 1 and sched.stats.spec_wasted_steps == 2
    sched.check_invariants()


def test_a_right_draft_drops_the_fallback_that_started_beside_it_and_its_copy() -> None:
    """The real successor starts in x's row when x is sampled (so a wrong draft costs no op): a right draft drops
    it, with the KV copy it may have queued (it shares the drafted successor's position, whose KV stays)."""
    sched, req = _running()
    x, s = _pair(sched, req)
    s.draft = 11
    fallback = sched.work.spawn(req, 2, -1, embedded=True, row=x.row)
    x.fallback = fallback
    fallback.next_step, fallback.copy = 1, KVCopy(req.rid, fallback.position, 0)
    s.copy = KVCopy(req.rid, s.position, 2)
    sched.ops.pending_copies += [fallback.copy, s.copy]
    assert sched.speculation.verdict(x, s, 11)
    assert not fallback.live and s.live and x.fallback is None
    assert sched.ops.pending_copies == [s.copy]
    assert sched.rows.owners() == {s.row: req.rid} and sched.stats.spec_wasted_steps == 1


def test_a_right_draft_keeps_the_work_and_hands_its_row_to_the_request() -> None:
    sched, req = _running()
    x, s = _pair(sched, req)
    s.draft = 11
    old = req.row
    assert sched.speculation.verdict(x, s, 11)
    assert s.live and s.pred is None and req.row == s.row != old and req.spec_rows == []
    assert sched.rows.owners() == {s.row: req.rid}
    assert sched.stats.spec_accepted == 1


def test_auto_drafts_deeper_below_the_break_even_and_pauses_when_no_depth_pays() -> None:
    req = Request(rid=1, prompt=[1], max_tokens=64, policy=FixedDepth(4, 4))
    req.output, req.depths, req.loop_steps = [1] * 5, [4, 3, 3, 3, 3], 12  # mean decode depth 3
    assert break_even(3.0, 1) == 1 / 3 and break_even(3.0, 2) == 1 / 2
    state = SpecState(1)
    for _ in range(4):  # acceptance 1 -> 0.32: below 1/3 at depth 1
        observe(req, state, False, base_depth=1, max_depth=4, adaptive=True)
    assert state.depth == 2 and state.acceptance == 1.0
    for _ in range(3):  # 1 -> 0.42: below 1/2 at depth 2; depth 3 would not lead (3 + 1 >= mean 3)
        observe(req, state, False, base_depth=1, max_depth=4, adaptive=True)
    assert state.depth == 1 and state.paused_until == len(req.output) + 16
    fixed = SpecState(1)
    for _ in range(10):
        observe(req, fixed, False, base_depth=1, max_depth=4, adaptive=False)
    assert fixed.depth == 1 and fixed.paused_until == 0 and fixed.acceptance < 0.1


def test_a_fallback_drafts_nothing_and_holds_its_exit_until_the_verdict() -> None:
    """Until the verdict a fallback is an alternative to the drafted successor: it must not start successors of
    its own (they could overwrite KV that the drafted chain's successors read), and an exit waits for the verdict."""
    sched, req = _running()
    x, s = _pair(sched, req)
    s.draft = 11
    x.exited, x.depth = True, 2
    sched.head_queue.append(x)
    (head,), embeds = sched.head.take_fused(wait=True)
    assert embeds == [-1]  # the real token goes into x's row, for the fallback
    fallback = x.fallback
    assert head is x and fallback is not None and fallback.row == x.row and fallback.pred is x
    fallback.next_step = 1  # at the draft depth: a normal item would be drafted from here
    assert sched._draft([fallback], 4) == []
    sched.work.leave(fallback, 1)
    assert fallback.exited and fallback not in sched.head_queue
    assert not sched.speculation.verdict(x, s, 12)  # wrong draft: the fallback is the successor now, its exit goes on
    assert x.succ is fallback and fallback in sched.head_queue
