"""Causal order of stage results: which ops are outstanding, and when a reply may reach the engine.

A stage marks its completion on the fence board before it replies, so the reply of an op can overtake the reply of
an op it was fenced on (they come from different stage processes). The engine must see results in the order the
in-process executor guarantees for dependencies: never before the results of the ops it was fenced on (failed ops
excepted: their requests fail either way), and in ``seq`` order per stage. ``CausalOrder`` holds a reply back
until that holds, and keeps the per-stage book of the ops in flight that the hang watchdog and the outage
handling read. Pure bookkeeping: no threads, no clock, no I/O (the executor calls it under its own lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from cdb_scheduler.plan import Fence, Stage, StageResult
from services.transport.watchdog import OldestOp


@dataclass(frozen=True, slots=True)
class Pending:
    """An op sent and not yet answered: what it waits for, its work (``op_units``) and its hang budget then."""

    fences: tuple[Fence, ...]
    units: int
    budget: float


class CausalOrder:
    """The ops in flight per stage and the replies held back for causal order (module docstring)."""

    def __init__(self) -> None:
        self._outstanding: dict[Stage, dict[int, Pending]] = {stage: {} for stage in Stage}  # in seq order
        self._held: dict[Stage, deque[tuple[StageResult, tuple[Fence, ...]]]] = {stage: deque() for stage in Stage}
        self._holding = 0  # replies held, over every stage
        self._delivered = [-1] * len(Stage)  # seq of the last result delivered, per stage
        self.last_seq = {stage: -1 for stage in Stage}  # seq of the last op submitted, per stage
        self.void = {stage: -1 for stage in Stage}  # the last void op per stage (issued before the last loss)

    # --- ops going out ---------------------------------------------------------------------------------------

    def sent(self, stage: Stage, seq: int, pending: Pending) -> None:
        """Op ``seq`` of ``stage`` is outstanding (sent, or queued to be sent once the stages are back)."""
        self._outstanding[stage][seq] = pending
        self.last_seq[stage] = seq

    def unsent(self, stage: Stage, seq: int) -> None:
        """Op ``seq`` of ``stage`` could not be sent: it is no longer outstanding (its error result follows)."""
        self._outstanding[stage].pop(seq, None)

    def voided(self, stage: Stage, seq: int) -> None:
        """Op ``seq`` was issued before the engine saw a loss: it is void, and counts as delivered for fences."""
        self.void[stage] = max(self.void[stage], seq)
        self._delivered[stage] = max(self._delivered[stage], seq)

    def budgets(self) -> float:
        """The hang budgets of every op outstanding, summed: the longest an op fenced on them may have to wait."""
        return sum(p.budget for ops in self._outstanding.values() for p in ops.values())

    # --- replies coming in -----------------------------------------------------------------------------------

    def replied(self, result: StageResult) -> tuple[Pending | None, Sequence[StageResult]]:
        """A reply: the op it answers (None: not outstanding, the reply is void) and the results it lets through,
        in the order the engine must see them (none while it is held back)."""
        stage = result.stage
        pending = self._outstanding[stage].pop(result.seq, None)
        if pending is None:
            return None, ()
        if not self._holding and (result.error or self._met(pending.fences)):
            self._delivered[stage] = result.seq  # nothing held back: the reply goes straight through
            return pending, (result,)
        self._held[stage].append((result, pending.fences))
        self._holding += 1
        return pending, self._release()

    def _release(self) -> list[StageResult]:
        """The held results whose turn has come, in causal order."""
        out: list[StageResult] = []
        progress = True
        while progress:
            progress = False
            for stage, held in self._held.items():
                while held and (held[0][0].error or self._met(held[0][1])):
                    result, _ = held.popleft()
                    self._holding -= 1
                    self._delivered[stage] = result.seq
                    out.append(result)
                    progress = True
        return out

    def _met(self, fences: tuple[Fence, ...]) -> bool:
        delivered = self._delivered
        return all(delivered[f.stage] >= f.seq for f in fences)

    # --- the watchdog and losses -----------------------------------------------------------------------------

    def oldest(self, stage: Stage) -> OldestOp | None:
        """``stage``'s oldest op without a reply; runnable once every op it is fenced on has been delivered."""
        pending = self._outstanding[stage]
        if not pending:
            return None
        seq = next(iter(pending))
        op = pending[seq]
        return OldestOp(seq, op.units, self._met(op.fences))

    def lose(self) -> None:
        """A loss: every op outstanding or held is void, and every op issued so far counts as delivered."""
        for pending in self._outstanding.values():
            pending.clear()
        for held in self._held.values():
            held.clear()
        self._holding = 0
        self.void = dict(self.last_seq)
        self._delivered = [self.last_seq[s] for s in Stage]

    def fail(self) -> list[tuple[Stage, list[int]]]:
        """Give up: forget every outstanding op; return them per stage (they get error results)."""
        failed = [(stage, sorted(pending)) for stage, pending in self._outstanding.items()]
        for pending in self._outstanding.values():
            pending.clear()
        return failed
