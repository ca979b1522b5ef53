"""A minimal batched driver of the three ``StageWorker``s with hand-built ops (no scheduler).

Requests arrive at given ticks; every tick issues at most: one PreludeOp (new decode tokens + the next prompt
chunk of prefilling requests), one prefill LoopOp, one decode LoopOp (every resident token at its own step) and
one HeadOp (tokens that exited + prompt chunks). Exit decisions follow the reference path's rules, so the
outputs must equal ``reference_generate`` exactly (in float64).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cdb_engine.stage_worker import StageWorker
from cdb_model.base import LoopedLM
from cdb_model.kv import KVLayout
from cdb_model.reference import ReferenceOutput
from cdb_scheduler.exit_policy import ExitPolicy, ExitState, Horizon
from cdb_scheduler.plan import HeadOp, KVCopy, KVUpdate, LoopOp, PreludeOp, Stage, StageOp, StageResult, derive_seed
from cdb_scheduler.sampling import SamplingParams


@dataclass
class _Token:
    rid: int
    index: int  # token_index of the token this loop pass produces
    position: int
    state: ExitState
    step: int = 0


class Workers:
    """The three workers over one bank, with per-stage sequence numbers."""

    def __init__(self, model: LoopedLM, layout: KVLayout, bank_rows: int, num_blocks: int, block_size: int):
        self.bank = torch.zeros(bank_rows, model.config.bank_width, dtype=model.dtype, device=model.device)
        self.workers = {s: StageWorker(model, s, self.bank, layout, num_blocks, block_size) for s in Stage}
        self.seq = dict.fromkeys(Stage, 0)
        self.pending_updates: dict[Stage, list[KVUpdate]] = {s: [] for s in Stage}

    def base(self, stage: Stage) -> dict:
        seq, self.seq[stage] = self.seq[stage], self.seq[stage] + 1
        updates, self.pending_updates[stage] = tuple(self.pending_updates[stage]), []
        return {"seq": seq, "fences": (), "kv_updates": updates, "released": ()}

    def run(self, op: StageOp) -> StageResult:
        return self.workers[op.stage].execute(op)


def drive_workers(
    model: LoopedLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    policy: ExitPolicy,
    layout: KVLayout,
    sampling: SamplingParams = SamplingParams(),  # noqa: B008
    stop_token_ids: Sequence[int] = (),
    prefill_chunk_size: int | None = None,
    init_seed: int = -1,
    block_size: int = 4,
    arrivals: Sequence[int] | None = None,
) -> list[ReferenceOutput]:
    n = len(prompts)
    arrivals = arrivals or [0] * n
    chunk = prefill_chunk_size or max(len(p) for p in prompts)
    per_req = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    ids = list(range(sum(per_req)))
    random.Random(0).shuffle(ids)  # non-contiguous block tables
    w = Workers(model, layout, n + n * chunk, sum(per_req), block_size)
    start = 0
    for rid, k in enumerate(per_req):
        for s in Stage:
            w.pending_updates[s].append(KVUpdate(rid, tuple(ids[start : start + k])))
        start += k

    def seed(p: int) -> int:
        return derive_seed(init_seed, p) if init_seed >= 0 else -1

    outs = [ReferenceOutput() for _ in prompts]
    prefill_at = [0] * n  # next prompt position to prefill
    new_tokens: list[tuple[_Token, int]] = []  # (token, input id) waiting for the prelude
    loop: list[_Token] = []
    copies: list[KVCopy] = []
    tick = 0
    while tick <= max(arrivals) or any(prefill_at[r] < len(prompts[r]) for r in range(n)) or new_tokens or loop:
        chunks = [
            (r, list(range(prefill_at[r], min(prefill_at[r] + chunk, len(prompts[r])))))
            for r in range(n)
            if arrivals[r] <= tick and prefill_at[r] < len(prompts[r])
        ]
        pre = [(t.rid, tok, t.position, t.rid) for t, tok in new_tokens]  # (rid, token, position, row)
        pre += [(r, prompts[r][p], p, n + r * chunk + j) for r, ps in chunks for j, p in enumerate(ps)]
        if pre:
            r_, t_, p_, rows_ = zip(*pre, strict=True)
            w.run(
                PreludeOp(
                    **w.base(Stage.PRELUDE),
                    rids=r_,
                    token_ids=t_,
                    positions=p_,
                    rows=rows_,
                    init_seeds=tuple(seed(p) for p in p_),
                )
            )
        loop += [t for t, _ in new_tokens]
        new_tokens = []
        pre_rows = [(r, p, n + r * chunk + j) for r, ps in chunks for j, p in enumerate(ps)]
        if pre_rows:
            r_, p_, rows_ = zip(*pre_rows, strict=True)
            w.run(
                LoopOp(
                    **w.base(Stage.LOOP),
                    rids=r_,
                    positions=p_,
                    rows=rows_,
                    steps=(0,) * len(r_),
                    prefill=True,
                    num_steps=policy.max_depth,
                )
            )
        exited: list[_Token] = []
        if loop:
            leave = {t.rid: policy.exits_after(t.state, t.step) for t in loop if policy.horizon is Horizon.ONE_AHEAD}
            res = w.run(
                LoopOp(
                    **w.base(Stage.LOOP),
                    rids=tuple(t.rid for t in loop),
                    positions=tuple(t.position for t in loop),
                    rows=tuple(t.rid for t in loop),
                    steps=tuple(t.step for t in loop),
                    kv_copies=tuple(copies),
                )
            )
            copies = []
            for i, t in enumerate(loop):
                policy.observe(t.state, t.step, res.signals[i], res.lookahead[i] if res.lookahead else None)
                if policy.horizon is Horizon.SAME_STEP:
                    leave[t.rid] = policy.exits_after(t.state, t.step)
                if leave[t.rid]:
                    exited.append(t)
                    if layout.copies_on_exit and t.step + 1 < layout.n_slots:
                        copies.append(KVCopy(t.rid, t.position, layout.slot(t.step)))
                else:
                    t.step += 1
            loop = [t for t in loop if all(t is not e for e in exited)]
        head = [(t.rid, t.position, t.rid, True, t.index) for t in exited]
        for r, ps in chunks:
            last = ps[-1] == len(prompts[r]) - 1
            head += [(r, p, n + r * chunk + j, last and p == ps[-1], 0) for j, p in enumerate(ps)]
            prefill_at[r] = ps[-1] + 1
        if head:
            r_, p_, rows_, smp, idx = zip(*head, strict=True)
            res = w.run(
                HeadOp(
                    **w.base(Stage.HEAD),
                    rids=r_,
                    positions=p_,
                    rows=rows_,
                    sample=smp,
                    sampling=(sampling,) * len(r_),
                    token_index=idx,
                )
            )
            sampled = [(r, p, i) for r, p, _, s, i in head if s]
            for (r, p, i), tok in zip(sampled, res.token_ids, strict=True):
                outs[r].tokens.append(tok)
                depth = policy.max_depth if i == 0 else next(t.step + 1 for t in exited if t.rid == r)
                outs[r].depths.append(depth)
                if tok not in stop_token_ids and len(outs[r].tokens) < max_new_tokens:
                    new_tokens.append((_Token(r, i + 1, p + 1, policy.new_state()), tok))
        tick += 1
    return outs
