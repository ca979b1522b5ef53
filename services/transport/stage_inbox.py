"""How a stage's executor thread takes its batches and gives its replies (``services.transport.stage_service``):
a ``Batch`` whichever form it came in, and the inbox and outbox over a session's message rings.

Network bytes are only ever parsed as protobuf (and its packed columns as fixed-width numbers: ``convert``) or as
op records (fixed-width numbers: ``records``), never as code.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_scheduler.plan import StageOp
from services.transport import records
from services.transport.convert import op_from_pb
from services.transport.ring import Doorbell, MessageRing, RingClosed, RingCorrupt, RingFull

log = logging.getLogger("cdb.stage")

END = object()  # the end of a session's batches (on the inbox) or of its replies (on the stream's queue)


@dataclass(slots=True)
class Batch:
    """A batch as the executor takes it off the inbox, whichever form it came in (a ``StageBatch`` message, or an op
    record on the ops ring): its op, or why the op could not be read (it fails with that), or a ping."""

    seq: int
    op: StageOp | None = None
    error: Exception | None = None
    fence_timeout_s: float = 0.0  # the scheduler's bound on the op's fence wait (0: the stage's own)
    trace_contexts: Mapping[int, str] = field(default_factory=dict)
    ping: bool = False

    @classmethod
    def of_message(cls, msg: pb.StageBatch) -> Batch:
        if msg.WhichOneof("work") == "ping":
            return cls(msg.seq, ping=True)
        try:
            op = op_from_pb(msg)
        except Exception as exc:  # the op fails, naming why; the stage keeps serving
            return cls(msg.seq, error=exc)
        return cls(msg.seq, op, fence_timeout_s=msg.fence_timeout_s, trace_contexts=msg.trace_contexts)

    @classmethod
    def of_record(cls, payload: bytes) -> Batch:
        """Raises ValueError for a record whose header cannot be read (the session cannot go on)."""
        try:
            op, fence_timeout_s = records.decode(payload)
        except ValueError as exc:
            seq = records.seq_of(payload)  # (raises ValueError too where even the header is unreadable)
            return cls(seq, error=exc)
        return cls(op.seq, op, fence_timeout_s=fence_timeout_s)


def sleep_for(inbox: Any, timeout: float) -> Any:
    """The inbox's next item within ``timeout`` s, without a busy-wait (queue.Empty at the timeout)."""
    return inbox.get(timeout=timeout, spin=False) if isinstance(inbox, RingInbox) else inbox.get(timeout=timeout)


class RingInbox:
    """The executor's inbox over a session's ops ring: ``(Batch, arrived_ns)`` items, ``END`` at the end of
    the batches (an empty record), when the ring closes, or when ``put(END)`` stops the stream. A message that
    comes on the stream itself (not sent by the project's executor) is taken too, before the ring's next one."""

    def __init__(self, ring: MessageRing, spin_s: float) -> None:
        self._ring = ring
        self._spin_s = spin_s
        self._side: deque[Any] = deque()
        self._stopped = False

    def put(self, item: Any) -> None:
        """From another thread: a message that came on the stream, or ``END`` (the stream is over)."""
        if item is END:
            self._stopped = True
        else:
            self._side.append(item)
        self._ring.interrupt()

    def get(self, timeout: float | None = None, spin: bool = True) -> Any:
        """The next item; ``spin=False``: sleep at once (no busy-wait first), for a wait that has time to spare."""
        spin_s = self._spin_s if spin else 0.0
        while True:
            if self._stopped:
                return END
            if self._side:
                return self._side.popleft()
            try:
                got = self._ring.get(timeout, spin_s)
            except RingClosed:
                return END
            except RingCorrupt as exc:  # the session cannot go on; the scheduler heals it as this stage's loss
                log.error("the ops ring is corrupt (%s): ending the session", exc)
                return END
            if got is None:
                if timeout is None or self._stopped or self._side:
                    continue  # woken: look again
                raise queue.Empty
            payload, arrived = got
            if not payload:
                return END  # the scheduler ended its batches (half-close)
            try:
                if records.is_record(payload):
                    return Batch.of_record(payload), arrived
                return Batch.of_message(pb.StageBatch.FromString(payload)), arrived
            except Exception:  # neither a batch nor a record: the session cannot go on
                log.error("a record on the ops ring is not a stage batch (%d bytes): ending the session", len(payload))
                return END

    def get_nowait(self) -> Any:
        return self.get(timeout=0.0)


class RingOutbox:
    """Replies go onto a session's replies ring from the executor thread; stream items (the end, an abort) go to
    the stream's own queue. A replies ring its scheduler stops reading ends the stream (ABORTED)."""

    def __init__(
        self, ring: MessageRing, stream: queue.SimpleQueue[Any], timeout: float, doorbell: Doorbell | None = None
    ) -> None:
        self._ring = ring
        self._stream = stream
        self._timeout = timeout
        self._doorbell = doorbell  # the scheduler waits on it for every stage's replies (else on the ring's word)

    def put(self, item: Any) -> None:
        if not isinstance(item, pb.StageReply):
            self._stream.put(item)
            return
        try:
            self._ring.put(item.SerializeToString(), self._timeout, wake=self._doorbell is None)
            if self._doorbell is not None:
                self._doorbell.ring()
        except RingClosed:
            self._stream.put(END)  # the scheduler closed the session: nothing more to say
        except (RingFull, ValueError) as exc:
            log.error("%s: ending the session", exc)
            self._stream.put((grpc.StatusCode.ABORTED, f"replies ring: {exc}"))
