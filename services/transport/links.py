"""One stage channel: its persistent ``Run`` stream (``StageLink``), the rings it may carry its data on, the form an
op takes on it (``wire``), and the options of the scheduler's stage channels.

With message rings (``services.transport.ring``) a link writes its ops straight onto the stage's ops ring from
the calling thread, and its replies are read by whichever thread calls :meth:`StageLink.drain` (the executor's
poller, woken by the doorbell the stages ring); the stream then carries nothing and only tells that the stage (or
the connection) is gone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_scheduler.plan import Stage, StageOp
from services.settings import Settings
from services.transport import records
from services.transport import ring as ring_transport
from services.transport.convert import op_to_pb
from services.transport.ring import MessageRing, RingClosed, RingFull

Rings = tuple[MessageRing, MessageRing]  # a stage's ops ring and replies ring
ReplyHandler = Callable[[Stage, int, pb.StageReply, "tuple[int, int] | None"], None]

_END = object()


class LinkOwner(Protocol):
    """What a link reports to (the ``GrpcExecutor``), from its stream's reader thread or the thread that drains its
    replies ring; ``epoch`` is the link's (replies of a link from before the stages were re-attached are void).
    Pongs stay with the link (``StageLink.ping``)."""

    def on_reply(
        self, stage: Stage, epoch: int, reply: pb.StageReply, stamps: tuple[int, int] | None = None
    ) -> None: ...

    def on_broken(self, stage: Stage, epoch: int, why: str) -> None: ...


def channel_options(settings: Settings) -> list[tuple[str, int]]:
    """Stage channel options: keepalive pings detect a frozen stage; no message size surprises."""
    keepalive_ms = int(settings.stage_keepalive_s * 1000)
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", keepalive_ms),  # other pings in flight would wait 60 s by default
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # A restarted stage is reconnected within ~0.1-0.25 s of listening (gRPC's default backoff grows to 120 s;
        # a stage is a local socket: an attempt on a dead one fails at once and costs nothing).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 250),
    ]


def new_rings(settings: Settings) -> dict[Stage, Rings]:
    """A fresh ops ring and replies ring per stage (none where rings are off or unsupported)."""
    rings: dict[Stage, Rings] = {}
    if not (settings.stage_rings and ring_transport.SUPPORTED):
        return rings
    try:
        for stage in Stage:
            ops = MessageRing.create(settings.stage_ring_bytes, f"{stage.role} stage's ops ring")
            try:
                replies = MessageRing.create(settings.stage_ring_bytes, f"{stage.role} stage's replies ring")
            except BaseException:
                ops.close()
                raise
            rings[stage] = (ops, replies)
    except BaseException:
        close_rings(rings)
        raise
    return rings


def close_rings(rings: Mapping[Stage, Rings]) -> None:
    """Unmap and unlink rings that no link owns."""
    for pair in rings.values():
        for ring in pair:
            ring.close()


class StageLink:
    """One stage's persistent Run stream: a send queue feeding gRPC, and a reader thread; with ``rings`` (the
    session's ops and replies rings, which the link then owns) the data goes on the rings instead (replies are
    read by :meth:`drain`)."""

    def __init__(
        self,
        stage: Stage,
        channel: grpc.Channel,
        owner: LinkOwner,
        epoch: int = 0,
        metadata: Sequence[tuple[str, str]] = (),
        rings: Rings | None = None,
        ring_timeout_s: float = 30.0,
        op_records: bool = False,
    ) -> None:
        self.stage = stage
        self.epoch = epoch
        self.op_records = op_records and rings is not None  # its stage reads op records (``records``) on the ring
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._rings = rings
        self._ring_timeout_s = ring_timeout_s
        stub = stage_pb2_grpc.StageStub(channel)
        # gRPC drains the iterator on its own thread
        self.call = stub.Run(iter(self._outbox.get, _END), metadata=tuple(metadata))
        self._owner = owner
        self._pongs: dict[int, threading.Event] = {}  # pings waiting for their pong, by token
        self._ring_lock = threading.RLock()  # one reader of the replies ring at a time; closing waits for it
        self._rings_closed = False
        self._unreadable = False  # a reply could not be read: the link is reported broken, its ring left unread
        self._thread = threading.Thread(target=self._read, name=f"cdb-link-{stage.role}", daemon=True)
        self._thread.start()

    @property
    def max_message(self) -> int | None:
        """The largest serialized batch the link can carry (None: gRPC's own limit)."""
        return self._rings[0].max_record if self._rings is not None else None

    def wire(
        self, op: StageOp, contexts: Mapping[int, str] | None, fence_timeout_s: float
    ) -> pb.StageBatch | bytearray:
        """``op`` as this link carries it: an op record where its stage reads them and the op fits one, else a
        message (ValueError for a value that neither can carry)."""
        if self.op_records and not contexts:
            record = records.encode(op, fence_timeout_s)
            if record is not None:
                return record
        msg = op_to_pb(op, trace_contexts=contexts)
        msg.fence_timeout_s = fence_timeout_s
        return msg

    def send(self, msg: pb.StageBatch | bytearray) -> None:
        """Send a batch message, or an op record (only where ``op_records``)."""
        if isinstance(msg, bytearray):
            assert self.op_records, "an op record on a link whose stage does not read them"
            self._put(msg)
        elif self._rings is None:
            self._outbox.put(msg)
        else:
            self._put(msg.SerializeToString())

    def _put(self, payload: bytes | bytearray) -> None:
        assert self._rings is not None
        try:
            self._rings[0].put(payload, self._ring_timeout_s)
        except RingClosed:
            pass  # the link was cancelled: what it carried is void
        except RingFull as exc:  # the stage takes nothing: a loss (reported off the caller's locks)
            self._report(f"{self.stage.role} stage failed ({exc})")

    def drain(self, handle: ReplyHandler | None = None) -> int:
        """Hand every reply waiting on the replies ring to ``handle`` (default: the owner's ``on_reply``), on the
        calling thread; how many there were. 0 without rings, and once the link is cancelled (its rings are then
        unmapped and unlinked)."""
        if self._rings is None:
            return 0
        n = 0
        handle = handle or self._owner.on_reply
        with self._ring_lock:
            if self._rings_closed or self._unreadable:
                return 0
            replies = self._rings[1]
            while True:
                try:
                    got = replies.get(timeout=0.0)
                    if got is None:
                        break
                    stamps = (got[1], time.perf_counter_ns())  # written by the stage, read here
                    reply = pb.StageReply.FromString(got[0])
                    if reply.pong:
                        self._pong(reply.seq)
                    else:
                        handle(self.stage, self.epoch, reply, stamps)
                except RingClosed:
                    break
                except Exception as exc:  # a record or a reply that cannot be read: the stage's loss, not ours
                    self._unreadable = True
                    why = f"{self.stage.role} stage sent a reply that cannot be read ({type(exc).__name__}: {exc})"
                    self._report(why)
                    break
                n += 1
        return n

    def _report(self, why: str) -> None:
        """Report this link broken (off the caller's locks: the owner cancels its links under its own)."""
        threading.Thread(target=self._owner.on_broken, args=(self.stage, self.epoch, why), daemon=True).start()

    def _read(self) -> None:
        replies: Iterator[pb.StageReply] = self.call
        try:
            for reply in replies:
                if reply.pong:
                    self._pong(reply.seq)
                else:
                    self._owner.on_reply(self.stage, self.epoch, reply)
            why = "stream ended"
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        self._owner.on_broken(self.stage, self.epoch, f"{self.stage.role} stage failed ({why})")

    def ping(self, timeout: float) -> float:
        """Round trip of an empty batch through the stream or rings (queued behind the pending batches)."""
        token = -(time.perf_counter_ns() & 0x3FFFFFFFFFFFFFFF) - 1  # negative: never a real op seq
        done = self._pongs[token] = threading.Event()
        start = time.perf_counter()
        self.send(pb.StageBatch(seq=token, ping=pb.Ping()))
        deadline = start + timeout
        while not done.is_set():  # (with rings the pong is read by a drain: the poller's, or this one when idle)
            left = deadline - time.perf_counter()
            if left <= 0:
                self._pongs.pop(token, None)
                raise TimeoutError(f"{self.stage.role} stage did not answer a ping in {timeout}s")
            if self._rings is not None:
                self.drain()
                left = min(left, 1e-3)
            done.wait(left)
        return time.perf_counter() - start

    def _pong(self, token: int) -> None:
        event = self._pongs.pop(token, None)
        if event is not None:
            event.set()

    def send_end(self) -> None:
        """Half-close: the stage finishes what it has, then ends the stream."""
        if self._rings is not None:
            self._put(b"")  # the end of the batches, in order behind them
        self._outbox.put(_END)

    def cancel(self) -> None:
        """End the stream now (the stage drops what it has); the rings are unmapped once no drain reads them.
        Does not wait for the stream's reader."""
        rings = self._rings
        if rings is not None:
            for ring in rings:
                ring.shut()
            with self._ring_lock:
                if not self._rings_closed:
                    self._rings_closed = True
                    for ring in rings:
                        ring.close()
        self._outbox.put(_END)
        self.call.cancel()

    def close(self) -> None:
        self.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
