"""The head: sampling the tokens that left the loop, and starting their successors.

Two shapes, by model. A head op of its own (``HeadOp``, on the head stage): exited tokens are batched
(``min_head_batch_size``) and their successors start from the ids it samples. A fused head (``LoopHead``, Ouro:
``fuse_loop_head``): every exited token rides the next loop op, which samples it at its start and embeds the
successor's input, and the successor runs its step 0 in that same op; with self-speculative decoding that head
also reads the drafts (``cdb_scheduler.speculation``).
"""

from __future__ import annotations

from collections import deque

from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import LoopHead, Stage, StageOp, StageResult
from cdb_scheduler.request import Event, Item, Status
from cdb_scheduler.residency import Residency
from cdb_scheduler.speculation import Speculation, draft_sampling
from cdb_scheduler.stats import SchedulerStats
from cdb_scheduler.work import WorkQueues

_FINISHED = Status.FINISHED


class HeadPlanner:
    """Forms the head ops (or a loop op's fused head) and reports the tokens they sample."""

    def __init__(
        self,
        config: SchedulerConfig,
        residency: Residency,
        ops: OpBuilder,
        stats: SchedulerStats,
        work: WorkQueues,
        speculation: Speculation,
    ) -> None:
        self.cfg = config
        self.residency = residency
        self.ops = ops
        self.stats = stats
        self.work = work
        self.speculation = speculation
        self.flights: dict[int, list[Item]] = {}  # seq of a head op in flight -> the items it samples

    def issue(self, out: list[StageOp], *, loop_drained: bool, flush: bool) -> None:
        """Issue the head ops due now (separate head stage) into ``out``; ``flush``: ignore the batch minimum."""
        work = self.work
        queue = work.head_queue
        work.drop_stale(queue)
        gate = work.refill.head_gate(waiting=bool(queue), loop_drained=loop_drained and not self.flights)
        if gate is None:
            return
        flush = flush or gate
        # Head ops are batched (min_head_batch_size > 1: Huginn's coda is as large as its loop block, and a small
        # batch re-reads all its weights), but an exited token waits at most max_head_wait_steps loop ops.
        waited = self.stats.loop_steps - queue[0].exited_at if queue else 0
        need = 1 if flush or waited >= self.cfg.max_head_wait_steps else self.cfg.min_head_batch_size
        while len(queue) >= need and len(self.flights) < self.cfg.max_head_in_flight:
            items = [queue.popleft() for _ in range(min(len(queue), self.cfg.max_num_seqs))]
            items = held_back(items, queue, wait=loop_drained)
            if not items:
                break
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
            self.flights[op.seq] = items
            out.append(op)
            for it, f, k, e in zip(items, follows, known, embed):
                if f:
                    succ = work.spawn(it.req, it.index + 1, k, embedded=e)
                    if e:  # its input is written by this op (else by its prelude: the scheduler's refill step)
                        succ.gate_seq, succ.gate_head = op.seq, True
                        succ.gate_loop = self.ops.next_seq(Stage.LOOP) + 1

    def on_result(self, res: StageResult, events: list[Event]) -> None:
        """A head op returned: report the tokens it sampled."""
        items = self.flights.pop(res.seq)
        if res.error:
            self.residency.fail([it.req for it in items if it.live], res.error, events)
            return
        work = self.work
        for i, it in enumerate(items):
            if not it.live:
                continue
            lp = res.logprobs[i] if res.logprobs else None
            work.accept(it.req, it.index, res.token_ids[i], it.depth, lp, events, replay=it.replay)

    def take_fused(self, wait: bool) -> tuple[list[Item], list[int]]:
        """Take every exited token into the loop op being formed (``LoopHead``) and queue its successor, whose
        input embedding that op writes into the row before its step 0 (a recomputed token's recorded input is
        embedded as given). Returns the items and what each embeds (``LoopHead.embed_ids``)."""
        queue = self.work.head_queue
        items = [it for it in queue if it.req.epoch == it.epoch and it.req.status is not _FINISHED]
        queue.clear()
        items = held_back(items, queue, wait)
        embed_ids: list[int] = []
        work, speculation = self.work, self.speculation
        for it in items:
            req = it.req
            known = req.output[it.index] if it.index < len(req.output) else -1
            if it.index + 1 >= req.max_tokens:
                embed_ids.append(-2)  # the request ends with this token
                continue
            embed_ids.append(known)
            speculation.follow(it, work.spawn(req, it.index + 1, known, embedded=True, row=it.row))
        return items, embed_ids

    def fused(self, items: list[Item], embed_ids: list[int], drafts: list[Item]) -> LoopHead:
        """The fused head of a loop op: the exited ``items`` (each sampled into its own row), then the draft reads
        (each drafted token's row sampled, its successor's input embedded into the successor's row)."""
        reqs = [it.req for it in items]
        rows = [it.row for it in items]
        token_index = [it.index for it in items]
        history = self.ops.history(Stage.LOOP, reqs, rows, token_index)
        sampling = [r.sampling for r in reqs]
        masks = [it.mask for it in items]  # (``held_back``)
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
                sampling.append(draft_sampling(x.req.sampling))
                masks.append(b"")
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
            masks=tuple(masks) if any(masks) else (),
        )

    def report_fused(self, items: list[Item], res: StageResult, events: list[Event]) -> None:
        """A loop op returned: report the tokens its fused head sampled (before the op's step)."""
        work, speculation = self.work, self.speculation
        logprobs, token_ids = res.logprobs, res.token_ids
        for i, it in enumerate(items):
            req = it.req
            if req.epoch == it.epoch and req.status is not _FINISHED:
                lp = logprobs[i] if logprobs else None
                if it.pred is not None:  # unverified: reported once the tokens before it are (``verify``)
                    it.sampled = (token_ids[i], lp)
                    continue
                work.accept(req, it.index, token_ids[i], it.depth, lp, events, replay=it.forced_depth > 0)
                if it.succ is not None:
                    speculation.verify(it, token_ids[i], events)


def held_back(items: list[Item], queue: deque[Item], wait: bool) -> list[Item]:
    """``items`` but those of structured-output requests whose mask is not known yet (the token before theirs has
    not come back, or its grammar walk is under way): those go back to ``queue``, for a later head. ``wait``: wait
    for the walks under way instead (nothing else would wake the scheduler: no loop op is in flight)."""
    if all(it.req.guide is None for it in items):
        return items
    due: list[Item] = []
    for it in items:
        guide = it.req.guide
        if guide is None or it.index < len(it.req.output):
            due.append(it)
        elif mask := guide.mask_now(it.index, wait):
            it.mask = mask
            due.append(it)
        else:
            queue.append(it)
    return due
