"""The queues a generated token's work item passes through, from its spawn to the report of its token.

An item is spawned when the token before it is sampled (with a fused refill or a fused loop head: when that token
goes to the head) and placed: in ``stalled`` while its request has no KV block for its position, in ``refills``
until the scheduler issues its prelude op, then in ``ready`` for the loop (``RefillPolicy.place``). It loops until
its exit is decided (``leave``), waits in ``head_queue`` for the head op that samples its token, and ``accept``
reports that token and ends the request or spawns the next item.
"""

from __future__ import annotations

from collections import deque

from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import KVCopy
from cdb_scheduler.prefill import grow_blocks
from cdb_scheduler.refill import refill_policy
from cdb_scheduler.request import FALLBACK, Event, FinishReason, Item, Request, TokenOut
from cdb_scheduler.residency import Residency
from cdb_scheduler.sampling import TokenLogprobs
from cdb_scheduler.stats import SchedulerStats


class WorkQueues:
    """The scheduler's four queues of work items and the moves between them."""

    def __init__(self, config: SchedulerConfig, residency: Residency, ops: OpBuilder, stats: SchedulerStats) -> None:
        self.cfg = config
        self.residency = residency
        self.ops = ops
        self.stats = stats
        self.refill = refill_policy(config.mode)
        self.ready: deque[Item] = deque()  # loop work, head = next to run
        self.head_queue: deque[Item] = deque()  # exited tokens waiting for the head
        self.refills: deque[Item] = deque()  # successors waiting for their prelude
        self.stalled: deque[Item] = deque()  # successors waiting for a KV block
        self._scanned: dict[int, int] = {}  # id of a queue -> residency.releases at its last stale scan

    def clear(self) -> None:
        """Every item is void (the stages lost their state): all queues empty, nothing held for a wave."""
        for q in (self.ready, self.head_queue, self.refills, self.stalled):
            q.clear()
        self.refill.reset()

    def new_item(self, req: Request, index: int, input_token: int, row: int = -1) -> Item:
        """The item of generated token ``index`` (its input is token ``index - 1``), in ``row`` (default: the
        request's), at its recorded depth if it is recomputed."""
        it = Item(req, req.epoch, index, req.prompt_len + index - 1, input_token, req.policy.new_state())
        it.row = row if row >= 0 else req.row
        if index < len(req.output):
            it.forced_depth = req.depths[index]  # recomputing after preemption: the recorded depth
        elif req.replay_depths is not None:
            it.exit_state.target_depth = req.replay_depths[min(index - 1, len(req.replay_depths) - 1)]
        elif req.guide is not None:
            it.skip_cap = self.skip_cap(req, index)
        return it

    def skip_cap(self, req: Request, index: int) -> int:
        """The depth from which item ``index`` of a structured-output request exits once its token is known to be
        forced, a function of the grammar alone (batching, timing and resumption must not change a depth). When the
        token before it is forced, its own fate is known at its spawn: the minimum depth if forced, else never.
        Otherwise that token is sampled (in the fused head of the loop op that runs this item's step 0, or by the
        prefill), and is back before its step ``loop_pipeline_depth`` is issued: from there on (no head op path:
        never), whenever its walk happens to end."""
        guide = req.guide
        assert guide is not None
        if guide.fate(index - 1) >= 0:
            return req.policy.min_depth if guide.fate(index) >= 0 else 0
        return max(req.policy.min_depth, self.cfg.loop_pipeline_depth + 1) if self.cfg.fuse_loop_head else 0

    def spawn(self, req: Request, index: int, input_token: int, *, embedded: bool = False, row: int = -1) -> Item:
        """Queue the item of generated token ``index`` (``new_item``)."""
        it = self.new_item(req, index, input_token, row)
        it.embedded = embedded
        self.place(it)
        return it

    def place(self, it: Item) -> None:
        req = it.req  # (the common case, a position inside the blocks it has, without a call)
        if it.position >= len(req.blocks) * self.cfg.kv_block_size and not grow_blocks(
            self.cfg, self.residency.blocks, req, it.position + 1, margin=False
        ):
            self.stalled.append(it)
        elif it.embedded:  # its "prelude" is the head op that samples its input: fenced on by row
            self.refill.place(it, self.ready, self.stats)
        else:
            self.refills.append(it)

    def retry_stalled(self) -> None:
        for _ in range(len(self.stalled)):
            it = self.stalled.popleft()
            if it.live:
                self.place(it)

    def drop_stale(self, q: deque[Item]) -> None:
        """Remove the stale items of ``q`` (one of the queues). Items enter a queue live, and only a release
        (``Residency.releases``) makes one stale, so a queue scanned since the last release is clean."""
        releases = self.residency.releases
        if self._scanned.get(id(q)) == releases:
            return
        self._scanned[id(q)] = releases
        if any(not it.live for it in q):
            live = [it for it in q if it.live]
            q.clear()
            q.extend(live)

    def leave(self, it: Item, step: int) -> None:
        """``it`` exits after ``step``: to the head queue (its KV copied into the deeper slots first, if the policy
        copies on exit)."""
        it.exited = True
        it.depth = step + 1
        if self.cfg.copy_on_exit and step + 1 < self.cfg.max_depth:
            it.copy = KVCopy(it.req.rid, it.position, step)
            self.ops.pending_copies.append(it.copy)
        it.exited_at = self.stats.loop_steps
        if it.draft == FALLBACK:
            it.held = True  # an alternative samples nothing before the verdict (``Speculation.verdict``)
        else:
            self.head_queue.append(it)

    def accept(
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
            if req.guide is not None and not req.guide.accept(index, token):
                self.residency.fail([req], f"structured output: {req.guide.error}", events)
                return
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
            self.spawn(req, 1, token)
