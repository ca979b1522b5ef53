"""A failure stays with its op: an executor wrapper whose ``submit`` never raises.

An executor may fail to build or send an op (a value its wire format cannot carry, a broken encoder, a closed
link). Raised into the engine loop, that would end the loop and every request with it. ``IsolatingExecutor`` turns
it into a failed result for that op alone: the scheduler then fails the requests in that op (as for an op the stage
failed) and nothing else.

Other stages' ops may already be fenced on the failed op's ``seq``, and each stage runs its ops in ``seq`` order, so
the op is not simply dropped: a stand-in with the same ``seq``, fences and table bookkeeping (``kv_updates``,
``released``, ``kv_copies``) but no tokens is submitted in its place. The stage runs it as an empty op and marks it
complete, so no later op waits on a fence that would never be satisfied; its result is replaced by the failure.
Only if the stand-in cannot be submitted either is the failure delivered directly (the executor is then broken,
and its own loss handling takes over).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable

from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Executor, HeadOp, LoopOp, PreludeOp, Stage, StageLoss, StageOp, StageResult

log = logging.getLogger("cdb.engine")


def stand_in(op: StageOp) -> StageOp:
    """``op`` without its tokens: the same ``seq``, fences and table bookkeeping, nothing to compute."""
    if isinstance(op, PreludeOp):
        return dataclasses.replace(op, rids=(), token_ids=(), positions=(), rows=(), init_seeds=())
    if isinstance(op, LoopOp):
        return dataclasses.replace(op, rids=(), positions=(), rows=(), steps=())
    if isinstance(op, HeadOp):
        return dataclasses.replace(
            op, rids=(), positions=(), rows=(), sample=(), sampling=(), token_index=(), embed=(), score_ids=()
        )
    raise TypeError(f"not a stage op: {type(op).__name__}")


class IsolatingExecutor:
    """``Executor`` over ``inner`` whose ``submit`` never raises (module docstring). Called by the engine thread
    only, like every executor."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self._failed: deque[StageResult] = deque()  # failures to deliver before the inner executor's results
        self._replaced: dict[tuple[Stage, int], str] = {}  # stand-in ops -> the error their result reports

    def submit(self, op: StageOp) -> None:
        try:
            self.inner.submit(op)
            return
        except Exception as exc:
            error = f"{op.stage.role} op {op.seq} could not be sent: {type(exc).__name__}: {exc}"
            log.exception("%s (its requests fail, the others go on)", error)
        try:
            self.inner.submit(stand_in(op))
        except Exception:
            log.exception("the stand-in of %s op %d could not be sent either", op.stage.role, op.seq)
            self._failed.append(StageResult(op.stage, op.seq, 0.0, error=error))
            return
        self._replaced[(op.stage, op.seq)] = error

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        if self._failed:
            return self._failed.popleft()
        res = self.inner.poll(timeout)
        if isinstance(res, StageLoss):
            self._replaced.clear()  # every op issued before the loss is void: no result will come for them
        elif res is not None and (error := self._replaced.pop((res.stage, res.seq), None)) is not None:
            return StageResult(res.stage, res.seq, res.compute_s, error=error)
        return res

    @property
    def concurrent_stages(self) -> bool:
        return self.inner.concurrent_stages

    def completed(self, stage: Stage) -> int:
        return self.inner.completed(stage)

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


def isolating(factory: Callable[[StageSetup], Executor]) -> Callable[[StageSetup], Executor]:
    """An ``executor_factory`` whose executors are wrapped in ``IsolatingExecutor``."""
    return lambda setup: IsolatingExecutor(factory(setup))
