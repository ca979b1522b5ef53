"""Admission and prefill: which prompt chunks run next, and the prelude -> loop -> head chain that runs them.

Admission (the method's rule): a prefill starts only if at least ``max(1, width/8)`` resident slots are free
(admissions come in batches, then every free slot is filled), the free KV blocks stay above the margin after
taking the chunk's blocks (or nothing else is running), and the chunk fits the token budget. Chunk boundaries
depend only on the prompt (multiples of ``prefill_chunk_size``), so batching never changes a result. A request
whose prompt is only partly prefilled gets its next chunk before anyone new is admitted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cdb_scheduler.allocators import BlockAllocator, RowAllocator
from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.ops import OpBuilder
from cdb_scheduler.plan import Stage, StageOp
from cdb_scheduler.prefix_cache import release_blocks, share_prefix
from cdb_scheduler.request import Request, Status
from cdb_scheduler.stats import SchedulerStats

Chunk = tuple[Request, int, int]  # request, first position, end position (exclusive)


@dataclass(slots=True)
class PrefillFlight:
    """One prefill chain in flight over prompt chunks of several requests."""

    reqs: list[Request]
    epochs: list[int]
    final: list[bool]  # the chunk is the request's last: its head samples token 0
    scored: list[int] = field(default_factory=list)  # prompt positions of the chunk its head scores
    seqs: dict[Stage, int] = field(default_factory=dict)  # stage -> seq of the chain's op still to complete


def grow_blocks(cfg: SchedulerConfig, blocks: BlockAllocator, req: Request, num_tokens: int, *, margin: bool) -> bool:
    """Give ``req`` the blocks for ``num_tokens`` tokens; with ``margin``, only if the KV headroom stays."""
    need = blocks.blocks_for(num_tokens) - len(req.blocks)
    if need <= 0:
        return True
    if margin and blocks.num_free - need <= cfg.kv_margin * blocks.total:
        return False
    got = blocks.allocate(req.rid, need)
    if got is None:
        return False
    req.blocks.extend(got)
    return True


def pick_chunks(
    cfg: SchedulerConfig,
    waiting: deque[Request],
    running: dict[int, Request],
    rows: RowAllocator,
    blocks: BlockAllocator,
    stats: SchedulerStats,
    urgent: bool = False,
) -> tuple[list[Chunk], bool]:
    """The chunks of the next prefill op, admitting waiting requests as needed (``urgent``: rows were freed for
    urgent ones, admitted whatever the batch minimum); also whether a partly prefilled request is starved of KV
    blocks (the scheduler may then preempt)."""
    budget = cfg.prefill_token_budget
    picked: list[Chunk] = []
    partial = [r for r in running.values() if r.prefilled < len(r.prompt)]
    for req in partial:
        start = req.prefilled
        end = min(start + cfg.prefill_chunk_size, req.prompt_len)
        if end - start > budget:
            break
        if not grow_blocks(cfg, blocks, req, end, margin=False):
            return picked, True
        budget -= end - start
        picked.append((req, start, end))
    if partial:
        return picked, False
    if rows.num_free < cfg.admit_min_free_rows and running and not urgent:
        return picked, False
    while waiting and rows.num_free > 0:
        req = waiting[0]
        row = rows.allocate(req.rid)
        assert row is not None
        start = share_prefix(cfg, blocks, req)  # (prefix caching: the cached chunks it reuses)
        end = min(start + cfg.prefill_chunk_size, req.prompt_len)
        if start < 0 or end - start > budget or not grow_blocks(cfg, blocks, req, end, margin=bool(running)):
            rows.free(req.rid, row)
            release_blocks(blocks, req)
            break
        waiting.popleft()
        req.admitted = req.admitted or time.monotonic()
        req.row = row[0]
        req.status = Status.RUNNING
        running[req.rid] = req
        budget -= end - start
        picked.append((req, start, end))
        if req.prefix_hashes:
            stats.prefix_queries += req.prompt_len
            stats.prefix_hits += start
    return picked, False


def prefill_chain(cfg: SchedulerConfig, ops: OpBuilder, picked: list[Chunk]) -> tuple[list[StageOp], PrefillFlight]:
    """Prelude over the chunks' tokens, one loop op running all ``max_depth`` steps, head over the positions that
    need it (every position for Huginn's coda KV; the last prompt position of each final chunk, which is sampled
    unless ``max_tokens`` is 0; with ``score_prompt``, every position but the last, scored against the next)."""
    reqs: list[Request] = []
    positions: list[int] = []
    tokens: list[int] = []
    sample: list[bool] = []
    last: list[bool] = []
    scores: list[int] = []
    flight = PrefillFlight([], [], [])
    for req, start, end in picked:
        final = end == req.prompt_len
        flight.reqs.append(req)
        flight.epochs.append(req.epoch)
        flight.final.append(final)
        flight.scored.append(score_targets(req, start, end, scores))
        req.prefilled = end
        for p in range(start, end):
            reqs.append(req)
            positions.append(p)
            tokens.append(req.prompt[p])
            last.append(final and p == end - 1)
            sample.append(last[-1] and req.max_tokens > 0)
    rows = list(range(cfg.max_num_seqs, cfg.max_num_seqs + len(tokens)))  # the bank's prefill rows
    pre = ops.prelude(reqs, tokens, positions, rows)
    loop = ops.loop(reqs, positions, rows, [0] * len(rows), prefill=True, num_steps=cfg.max_depth)
    flight.seqs = {Stage.PRELUDE: pre.seq, Stage.LOOP: loop.seq}
    keep = [i for i, s in enumerate(scores) if last[i] or s >= 0 or cfg.head_has_kv]
    if not keep:  # an inner chunk of a model without coda KV: nothing for the head to do
        return [pre, loop], flight
    head = ops.head(
        [reqs[i] for i in keep],
        [positions[i] for i in keep],
        [rows[i] for i in keep],
        [sample[i] for i in keep],
        [0] * len(keep),
        score_ids=[scores[i] for i in keep],
    )
    flight.seqs[Stage.HEAD] = head.seq
    return [pre, loop, head], flight


def score_targets(req: Request, start: int, end: int, out: list[int]) -> int:
    """Append to ``out`` what the head scores at each position of the chunk ``[start, end)``: the next prompt
    token's id, or -1 (the last prompt position, a request without ``score_prompt``, or one whose prompt was
    scored and reported before it was recomputed: it has reported tokens). Returns how many are scored."""
    score = req.score_prompt and not req.output
    if score and start == 0:
        req.prompt_logprobs.clear()  # a prefill begun again after a preemption scores the prompt again
    n = 0
    for p in range(start, end):
        target = req.prompt[p + 1] if score and p + 1 < req.prompt_len else -1
        out.append(target)
        n += target >= 0
    return n
