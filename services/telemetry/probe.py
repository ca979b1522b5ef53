"""The stage executor's measurement seam: one probe object that sees each op go out and its result come back.

``ExecutorProbe`` is the interface and the default: every hook does nothing, so production code calls its hooks
unconditionally (no ``if measuring:`` branches, no measurement fields in the executor) and pays one empty call per
hook when nothing measures. Implementations:

- ``OpTimes``: when each op was sent and when its result was polled, for an ``OpObserver`` (metrics, request
  traces: ``services.telemetry.recorder.OpRecorder``); used by the gRPC executor and by ``ObservedExecutor``.
- ``HopLog``: a benchmark's hand-over stamps (``cdb bench hostpath``: the reaction split) and the engine thread's CPU
  to send each op.

Hooks called on the engine thread: ``contexts_for_op``, ``queued``, ``send``, ``polled``; ``read`` on the thread that
drains a replies ring (the engine's, or a ping's); ``lost`` on the thread that declares a loss.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from cdb_scheduler.plan import Stage, StageOp, StageResult

W = TypeVar("W")


class ExecutorProbe:
    """What a stage executor reports for measurement; this base measures nothing (see the module docstring)."""

    __slots__ = ()

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str] | None:
        """Request id -> W3C traceparent to send with ``op`` (None: none)."""
        return None

    def queued(self, op: StageOp) -> None:
        """``op`` is accepted but not sent now: it waits in the outage backlog (or goes out through an executor
        that sends without this probe)."""

    def send(self, send: Callable[[W], None], wire: W, op: StageOp) -> None:
        """Send ``op`` (``send(wire)``): a probe may time it; what ``send`` raises propagates."""
        send(wire)

    def read(self, stage: Stage, seq: int, stamps: tuple[int, int]) -> None:
        """The reply to op ``seq`` of ``stage`` was read from its ring (``stamps``: written by the stage, read,
        ``perf_counter_ns``)."""

    def polled(self, result: StageResult) -> None:
        """The engine thread took ``result``."""

    def lost(self) -> None:
        """A stage was lost: every op sent before is void (its result is never polled)."""


NO_PROBE = ExecutorProbe()


class OpObserver(Protocol):
    """Per-op hooks, both called on the engine thread (``services.telemetry.recorder.OpRecorder``: metrics, and
    ``services.telemetry.RequestTraces`` when tracing is on)."""

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str]:
        """Request id -> W3C traceparent to send with ``op`` (``StageBatch.trace_contexts``)."""
        ...

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        """``op`` was sent at ``sent_ns`` and its result polled at ``done_ns`` (``time.time_ns``)."""
        ...


class OpTimes(ExecutorProbe):
    """Tells ``observer`` each op with its result and when it was sent and polled (``time.time_ns``)."""

    __slots__ = ("_sent", "observer")

    def __init__(self, observer: OpObserver) -> None:
        self.observer = observer
        self._sent: dict[tuple[Stage, int], tuple[StageOp, int]] = {}  # op, sent at (ns)

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str] | None:
        return self.observer.contexts_for_op(op)

    def queued(self, op: StageOp) -> None:
        self._sent[(op.stage, op.seq)] = (op, time.time_ns())

    def send(self, send: Callable[[W], None], wire: W, op: StageOp) -> None:
        key = (op.stage, op.seq)
        self._sent[key] = (op, time.time_ns())
        try:
            send(wire)
        except ValueError:  # not sent: its error result is not the op's
            self._sent.pop(key, None)
            raise

    def polled(self, result: StageResult) -> None:
        if (sent := self._sent.pop((result.stage, result.seq), None)) is not None:
            self.observer.on_op_done(sent[0], result, sent[1], time.time_ns())

    def lost(self) -> None:
        self._sent.clear()


@dataclass(slots=True)
class HopLog(ExecutorProbe):
    """When each reply and op crossed each hand-over between the stages and the engine thread, in
    ``perf_counter_ns`` (``CLOCK_MONOTONIC``: comparable with the stages' op logs), for a benchmark. Rings only
    (the gRPC streams carry no stamps). Bounded: the newest ``size`` of each."""

    size: int = 200_000
    replies: deque[tuple[int, int, int, int, int]] = field(init=False)  # stage, seq, written, read, polled
    sent: deque[tuple[int, int, int, int]] = field(init=False)  # stage, seq, written to its ops ring, CPU to send
    _read: dict[tuple[int, int], tuple[int, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.replies, self.sent = deque(maxlen=self.size), deque(maxlen=self.size)

    def send(self, send: Callable[[W], None], wire: W, op: StageOp) -> None:
        cpu = time.thread_time_ns()
        send(wire)  # (its CPU: the ring write and the wake of a stage asleep on it)
        self.sent.append((op.stage, op.seq, time.perf_counter_ns(), time.thread_time_ns() - cpu))

    def read(self, stage: Stage, seq: int, stamps: tuple[int, int]) -> None:
        if len(self._read) >= self.size:  # replies of void ops are never polled
            self._read.clear()
        self._read[(stage, seq)] = stamps

    def polled(self, result: StageResult) -> None:
        read = self._read.pop((result.stage, result.seq), None)
        if read is not None:
            self.replies.append((result.stage, result.seq, *read, time.perf_counter_ns()))
