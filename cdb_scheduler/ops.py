"""Builds stage ops: sequence numbers, row fences, block-table deltas, releases and KV copies.

Fence rule: an op on stage X touching bank rows R waits for the last op of every other stage that touched any
row of R. Stages run their own ops in order, so this orders every read-after-write and write-after-read on the
bank without a round trip through the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cdb_scheduler.plan import (
    Fence,
    HeadOp,
    HistorySeed,
    KVCopy,
    KVUpdate,
    LoopHead,
    LoopOp,
    PreludeOp,
    Stage,
    derive_seed,
)
from cdb_scheduler.request import Request
from cdb_scheduler.sampling import SamplingParams

_STAGES = (Stage.PRELUDE, Stage.LOOP, Stage.HEAD)
_OTHERS = {int(s): tuple(int(o) for o in _STAGES if o != s) for s in _STAGES}  # stage -> the other two, in order


class OpBuilder:
    """Per-stage bookkeeping shared by every op the scheduler issues."""

    def __init__(self) -> None:
        self._next_seq = [0, 0, 0]
        self._row_last: list[list[int]] = []  # [row] -> last seq per stage that touched it (-1: none)
        self._sent: list[dict[int, int]] = [{}, {}, {}]  # stage -> request id -> block-table length sent
        self._released: list[list[int]] = [[], [], []]
        self._seeded: list[dict[int, int]] = [{}, {}, {}]  # stage -> penalized request -> the row its history is in
        self.pending_copies: list[KVCopy] = []

    def next_seq(self, stage: Stage) -> int:
        """The sequence number the next op of ``stage`` gets."""
        return self._next_seq[stage]

    def forget(self, req: Request) -> None:
        """The request's block table is gone (finished or preempted): stages drop their mirror."""
        for stage in _STAGES:
            if self._sent[stage].pop(req.rid, None) is not None:
                self._released[stage].append(req.rid)
            self._seeded[stage].pop(req.rid, None)
        self.pending_copies = [c for c in self.pending_copies if c.rid != req.rid]

    def reset(self) -> None:
        """The stages lost their state (re-attached fresh): no block table is mirrored, no row has a writer in
        flight and no copy or release is owed. Sequence numbers go on (they stay unique per stage)."""
        self._row_last.clear()
        self._sent = [{}, {}, {}]
        self._released = [[], [], []]
        self._seeded = [{}, {}, {}]
        self.pending_copies.clear()

    def _common(
        self, stage: Stage, rows: Sequence[int], reqs: Iterable[Request]
    ) -> tuple[int, tuple[Fence, ...], tuple[KVUpdate, ...], tuple[int, ...]]:
        # Runs for every op over every row: plain ints and locals (the planning CPU per loop step is budgeted).
        s = int(stage)
        a, b = _OTHERS[s]
        seq = self._next_seq[s]
        self._next_seq[s] = seq + 1
        row_last = self._row_last
        if rows and max(rows) >= len(row_last):
            row_last.extend([-1, -1, -1] for _ in range(max(rows) + 1 - len(row_last)))
        wait_a = wait_b = -1
        for row in rows:
            last = row_last[row]
            if last[a] > wait_a:
                wait_a = last[a]
            if last[b] > wait_b:
                wait_b = last[b]
            last[s] = seq
        fences = tuple(Fence(_STAGES[st], w) for st, w in ((a, wait_a), (b, wait_b)) if w >= 0)  # in stage order
        sent = self._sent[s]
        updates = []
        seen: set[int] = set()
        for req in reqs:
            rid = req.rid
            if rid in seen:
                continue
            seen.add(rid)
            n = len(req.blocks)
            known = sent.get(rid, 0)
            if n > known:
                updates.append(KVUpdate(rid, tuple(req.blocks[known:])))
                sent[rid] = n
        released = tuple(self._released[s])
        self._released[s].clear()
        return seq, fences, tuple(updates), released

    def history(
        self, stage: Stage, reqs: Sequence[Request], rows: Sequence[int], token_index: Sequence[int]
    ) -> tuple[HistorySeed, ...]:
        """Seeds for the penalized requests among the sampled ``reqs`` that ``stage`` samples for the first time
        in that bank row (a prompt's last chunk is sampled in a prefill row, its decode tokens in the request's
        row; after a preemption everything is new): their prompt (for a repetition penalty) and the tokens
        before this one."""
        procs = [r.sampling.processing for r in reqs]
        if not any(procs):  # the common case, in one C loop
            return ()
        seeded = self._seeded[int(stage)]
        out = []
        for j, (req, row, index, proc) in enumerate(zip(reqs, rows, token_index, procs)):
            if proc is None or not proc.penalized or seeded.get(req.rid) == row:
                continue
            assert len(req.output) >= index, "a penalized token sampled before the tokens it follows are known"
            seeded[req.rid] = row
            prompt = tuple(req.prompt) if proc.repetition_penalty != 1.0 else ()
            out.append(HistorySeed(j, prompt, tuple(req.output[:index])))
        return tuple(out)

    def prelude(
        self, reqs: Sequence[Request], tokens: Sequence[int], positions: Sequence[int], rows: Sequence[int]
    ) -> PreludeOp:
        seq, fences, updates, released = self._common(Stage.PRELUDE, rows, reqs)
        seeds = tuple(-1 if r.init_seed < 0 else derive_seed(r.init_seed, p) for r, p in zip(reqs, positions))
        return PreludeOp(
            seq,
            fences,
            updates,
            released,
            tuple(r.rid for r in reqs),
            tuple(tokens),
            tuple(positions),
            tuple(rows),
            seeds,
        )

    def loop(
        self,
        reqs: Sequence[Request],
        positions: Sequence[int],
        rows: Sequence[int],
        steps: Sequence[int],
        *,
        prefill: bool = False,
        num_steps: int = 1,
        head: LoopHead | None = None,
        head_reqs: Sequence[Request] = (),
    ) -> LoopOp:
        if head is not None:
            seq, fences, updates, released = self._common(Stage.LOOP, [*rows, *head.rows], [*reqs, *head_reqs])
        else:
            seq, fences, updates, released = self._common(Stage.LOOP, rows, reqs)
        copies = tuple(self.pending_copies)
        self.pending_copies.clear()
        return LoopOp(
            seq,
            fences,
            updates,
            released,
            tuple(r.rid for r in reqs),
            tuple(positions),
            tuple(rows),
            tuple(steps),
            prefill,
            num_steps,
            copies,
            head,
        )

    def head(
        self,
        reqs: Sequence[Request],
        positions: Sequence[int],
        rows: Sequence[int],
        sample: Sequence[bool],
        token_index: Sequence[int],
        embed: Sequence[bool] = (),
        score_ids: Sequence[int] = (),
    ) -> HeadOp:
        seq, fences, updates, released = self._common(Stage.HEAD, rows, reqs)
        sampling: tuple[SamplingParams, ...] = tuple(r.sampling for r in reqs)
        masks = tuple(mask_of(r, i) if s else b"" for r, s, i in zip(reqs, sample, token_index))
        picked = [j for j, s in enumerate(sample) if s]
        history = self.history(
            Stage.HEAD, [reqs[j] for j in picked], [rows[j] for j in picked], [token_index[j] for j in picked]
        )
        return HeadOp(
            seq,
            fences,
            updates,
            released,
            tuple(r.rid for r in reqs),
            tuple(positions),
            tuple(rows),
            tuple(sample),
            sampling,
            tuple(token_index),
            tuple(embed) if any(embed) else (),
            tuple(score_ids) if any(t >= 0 for t in score_ids) else (),
            history,
            masks if any(masks) else (),
        )


def mask_of(req: Request, index: int) -> bytes:
    """Token ``index``'s mask with structured output, else b"" (a recomputed token's sample is not used: none)."""
    guide = req.guide
    if guide is None or index < len(req.output):
        return b""
    return guide.mask(index)
