"""What measurement sees of a stage: one probe object per session, called by ``StageService`` at the three seams of
an op's life on its executor thread, and when the session closes.

The service knows nothing of what is measured: the per-op timeline (``CDB_STAGE_OP_LOG``, read by ``cdb bench
hostpath``) and the per-op trace spans (``BatchObserver``, ``services.telemetry.StageTracer``) are both behind
``RecordingProbe``. With neither on, the session holds ``NO_PROBE``, whose calls do nothing (no clock read).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cdb_scheduler.plan import StageOp, StageResult


class StageProbe(Protocol):
    """The seams of one op, in order: ``begin`` (the op is taken to launch on this stage, its fences not yet
    waited for), ``fenced`` (its fences are met: its work starts), ``end`` (its result, whatever became of it);
    then ``close`` when the session ends."""

    def begin(self, op: StageOp, contexts: Mapping[int, str], arrived: int) -> Any:
        """The op (its ``trace_contexts``, ``arrived``: ``perf_counter_ns`` when it came); returns its mark, which
        the op's other seams are given (None: ``end`` is not called for it)."""
        ...

    def fenced(self, mark: Any) -> None: ...

    def end(self, mark: Any, op: StageOp, result: StageResult) -> None: ...

    def close(self) -> None:
        """The session ends (under its lock: no op is running): keep what was recorded."""
        ...


class _NoProbe:
    """Nothing measured: every seam returns at once."""

    def begin(self, op: StageOp, contexts: Mapping[int, str], arrived: int) -> None:
        return None

    def fenced(self, mark: Any) -> None:
        pass

    def end(self, mark: Any, op: StageOp, result: StageResult) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROBE: StageProbe = _NoProbe()


class BatchObserver(Protocol):
    """Optional per-batch hooks, called on the stage's executor thread (``services.telemetry.StageTracer`` fits)."""

    def update(self, contexts: Mapping[int, str], released: Iterable[int] = ()) -> None:
        """The batch's ``trace_contexts`` and ``released`` ids, before it runs."""
        ...

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        """The batch ran from ``start_ns`` to ``end_ns`` (``time.time_ns``)."""
        ...


# A stage's per-op timeline (``CDB_STAGE_OP_LOG``): time.perf_counter_ns() stamps (CLOCK_MONOTONIC: comparable
# across the processes of a host) of each op's arrival, its turn on the executor thread, its fences satisfied,
# its work started and ended; and the op's tokens and compute (ns; modelled on a synthetic stage).
OP_LOG_FIELDS = ("seq", "tokens", "arrived", "dequeued", "fenced", "started", "ended", "compute_ns")


def write_op_log(folder: str, role: str, holder: str, records: list[tuple[int, ...]]) -> str:
    """Write ``records`` as ``FOLDER/ROLE-PID-N.json``; returns the path."""
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"{role}-{os.getpid()}")
    n = 0
    while os.path.exists(f"{base}-{n}.json"):
        n += 1
    path = f"{base}-{n}.json"
    with open(path + ".tmp", "w") as f:  # renamed when complete: a reader never sees half a file
        json.dump({"role": role, "holder": holder, "fields": OP_LOG_FIELDS, "ops": records}, f)
    os.replace(path + ".tmp", path)
    return path


@dataclass(slots=True)
class _Mark:
    arrived: int
    dequeued: int
    fenced: int = 0
    start_ns: int = 0  # time.time_ns() when the work started, for the observer's span


class RecordingProbe:
    """The timeline of a session's ops (written to ``op_log``, a folder, at its close) and/or an observer's spans."""

    def __init__(self, op_log: str, role: str, holder: str, observer: BatchObserver | None) -> None:
        self.op_log, self.role, self.holder = op_log, role, holder
        self.observer = observer
        self.timeline: list[tuple[int, ...]] = []  # one record per op that succeeded (OP_LOG_FIELDS)

    def begin(self, op: StageOp, contexts: Mapping[int, str], arrived: int) -> _Mark:
        mark = _Mark(arrived, time.perf_counter_ns())
        mark.fenced = mark.dequeued
        if self.observer is not None:
            self.observer.update(contexts, op.released)
        return mark

    def fenced(self, mark: _Mark) -> None:
        mark.fenced, mark.start_ns = time.perf_counter_ns(), time.time_ns()

    def end(self, mark: _Mark, op: StageOp, result: StageResult) -> None:
        if self.op_log and not result.error:
            ended = time.perf_counter_ns()
            compute_ns = int(result.compute_s * 1e9)
            stamps = (mark.arrived, mark.dequeued, mark.fenced, ended - compute_ns, ended)
            self.timeline.append((op.seq, len(op.rows), *stamps, compute_ns))
        if self.observer is not None:
            end_ns = time.time_ns()
            self.observer.record_op(op, mark.start_ns or end_ns, end_ns, result.compute_s, result.error)

    def close(self) -> None:
        if self.op_log and self.timeline:
            write_op_log(self.op_log, self.role, self.holder, self.timeline)


def stage_probe(op_log: str, role: str, holder: str, observer: BatchObserver | None) -> StageProbe:
    """The probe of one session: ``NO_PROBE`` unless an op log folder or an observer is given."""
    if not op_log and observer is None:
        return NO_PROBE
    return RecordingProbe(op_log, role, holder, observer)
