"""A fake executor with a hand-made deterministic "model": scheduler tests run in milliseconds.

Ops run lazily, one per ``poll``, in submission order across stages (like one device stream), so several ops
are genuinely in flight when the scheduler plans. Every op's fences are checked at execution time.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque

from cdb_scheduler.exit_policy import ExitPolicy, Horizon
from cdb_scheduler.plan import HeadOp, LoopOp, PreludeOp, Stage, StageOp, StageResult
from cdb_scheduler.sampling import TokenLogprobs

VOCAB = 50
STOP_ID = 7


def unit(*key: int) -> float:
    """A deterministic number in [0, 1) for a key."""
    h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def signal(rid: int, position: int, step: int) -> float:
    return unit(1, rid, position, step)


def token(rid: int, position: int) -> int:
    return int(unit(2, rid, position) * VOCAB)


def score(rid: int, position: int, target: int) -> TokenLogprobs:
    """The "logprob" of prompt token ``target`` after ``position`` (prompt scoring)."""
    return TokenLogprobs(-unit(3, rid, position, target))


class FakeExecutor:
    """With ``rng``, the three stages run concurrently: each poll runs the next op of a random stage whose fences
    are satisfied (like separate stage processes), so results of different stages arrive in varying order.
    ``times``: the compute seconds its results report for a decode op of each stage (prelude, loop, head)."""

    def __init__(self, rng: random.Random | None = None, times: tuple[float, float, float] = (0.001, 0.002, 0.001)):
        self.rng = rng
        self.times = times
        self.queue: deque[StageOp] = deque()
        self.done = [-1, -1, -1]
        self.submitted: list[StageOp] = []
        self.delivered: list[StageOp] = []
        self.max_loop_in_flight = 0

    def submit(self, op: StageOp) -> None:
        assert op.seq == sum(1 for o in self.submitted if o.stage == op.stage), "seq must count per stage"
        for f in op.fences:
            assert any(o.stage == f.stage and o.seq == f.seq for o in self.submitted), "fence on unknown op"
        self.submitted.append(op)
        self.queue.append(op)
        loops = sum(1 for o in self.queue if isinstance(o, LoopOp) and not o.prefill)
        self.max_loop_in_flight = max(self.max_loop_in_flight, loops)

    def _next(self) -> StageOp:
        if self.rng is None:
            return self.queue.popleft()
        heads: dict[Stage, StageOp] = {}
        for o in self.queue:
            heads.setdefault(o.stage, o)
        runnable = [o for o in heads.values() if all(self.done[f.stage] >= f.seq for f in o.fences)]
        op = self.rng.choice(runnable)
        self.queue.remove(op)
        return op

    def poll(self, timeout: float | None) -> StageResult | None:
        if not self.queue:
            return None
        op = self._next()
        for f in op.fences:
            assert self.done[f.stage] >= f.seq, f"fence {f} unsatisfied"
        self.done[op.stage] = op.seq
        self.delivered.append(op)
        if isinstance(op, PreludeOp):
            return StageResult(Stage.PRELUDE, op.seq, self.times[Stage.PRELUDE])
        if isinstance(op, LoopOp):
            if op.prefill:
                return StageResult(Stage.LOOP, op.seq, 0.004)
            sig = tuple(signal(r, p, s) for r, p, s in zip(op.rids, op.positions, op.steps))
            return StageResult(Stage.LOOP, op.seq, self.times[Stage.LOOP], signals=sig)
        assert isinstance(op, HeadOp)
        ids = tuple(token(r, p) for r, p, s in zip(op.rids, op.positions, op.sample) if s)
        scored = tuple(score(r, p, t) for r, p, t in zip(op.rids, op.positions, op.score_ids) if t >= 0)
        return StageResult(Stage.HEAD, op.seq, self.times[Stage.HEAD], token_ids=ids, prompt_logprobs=scored)

    def overtakes(self) -> list[tuple[StageOp, StageOp]]:
        """``(later, earlier)`` pairs: the result of ``later`` was delivered while ``earlier``, submitted before it,
        was still undelivered (with one stream in submission order, there are none)."""
        index = {(o.stage, o.seq): i for i, o in enumerate(self.submitted)}
        done = [False] * len(self.submitted)
        first = 0  # the earliest submitted op not yet delivered
        pairs = []
        for op in self.delivered:
            i = index[op.stage, op.seq]
            done[i] = True
            while first < len(done) and done[first]:
                first += 1
            if first < i:
                pairs.append((op, self.submitted[first]))
        return pairs

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def expected(rid: int, prompt_len: int, max_tokens: int, policy: ExitPolicy) -> tuple[list[int], list[int]]:
    """Tokens and depths of one request run alone under the same rule (the sequential semantics)."""
    tokens = [token(rid, prompt_len - 1)]
    depths = [policy.max_depth]
    while len(tokens) < max_tokens and tokens[-1] != STOP_ID:
        pos = prompt_len + len(tokens) - 1
        st = policy.new_state()
        s = 0
        while True:
            if policy.horizon is Horizon.ONE_AHEAD:
                leave = policy.exits_after(st, s)
                policy.observe(st, s, signal(rid, pos, s))
            else:
                policy.observe(st, s, signal(rid, pos, s))
                leave = policy.exits_after(st, s)
            if leave:
                break
            s += 1
        depths.append(s + 1)
        tokens.append(token(rid, pos))
    return tokens, depths
