"""The ``cdb.v1.Stage`` servicer of one stage role (prelude | loop | head) over an already loaded model.

``Configure`` attaches the bank and fence board the scheduler created and builds a ``StageWorker`` (fresh KV
pools). ``Run`` is the persistent batch stream, served by three threads so that the stage never waits for the
network:

    gRPC recv --reader--> inbox --executor: fences, compute, complete(seq)--> outbox --writer--> gRPC send

The executor thread runs batches back to back in ``seq`` order; it marks completion on the fence board BEFORE
the reply is sent, so a stage waiting on this one starts without a round trip through the scheduler. A batch
that fails (an exception, a fence timeout) gets a reply with ``error``; the stage keeps serving. Network bytes are
only ever parsed as protobuf (and its packed columns as fixed-width numbers: ``convert``) or as op records
(fixed-width numbers: ``records``), never as code.

A session configured with message rings (``ConfigureRequest.rings``, ``services.transport.ring``) takes its
batches from the ops ring and writes its replies to the replies ring, both on the executor thread itself:

    ops ring --executor: fences, compute, complete(seq)--> replies ring, doorbell

with no thread hop on the way (the doorbell, named in ``StageRings``, wakes the scheduler's engine thread, which
reads the replies itself); its Run stream carries nothing and only ends the session when it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import torch

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.stage_worker import StageWorker
from cdb_model.kv import KVLayout, KVPolicy
from cdb_scheduler.plan import Stage, StageOp, StageResult
from services.settings import Settings
from services.transport import records
from services.transport.bank import SharedBank
from services.transport.convert import (
    bank_spec_from_pb,
    op_from_pb,
    result_to_pb,
    role_from_pb,
    role_to_pb,
)
from services.transport.fences import FenceAborted, FenceBoard, FenceTimeout
from services.transport.ring import Doorbell, MessageRing, RingClosed, RingFull
from services.transport.watchdog import this_process

log = logging.getLogger("cdb.stage")

_END = object()
_T = TypeVar("_T")


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


@dataclass(slots=True)
class _Launched:
    """A batch taken off the inbox: launched on the worker (``finish`` waits for it and gives its result), or
    failed before it ran (``result``); a ping has neither."""

    batch: Batch
    arrived: int  # perf_counter_ns stamps of the op timeline (OP_LOG_FIELDS)
    dequeued: int = 0
    fenced: int = 0
    start_ns: int = 0  # time.time_ns() at launch, for the observer's span
    fence_wait: float = 0.0
    op: StageOp | None = None
    finish: Callable[[], StageResult] | None = None
    result: StageResult | None = None


@dataclass(slots=True)
class _Session:
    """One Configure: the attached shared memory, the worker over it and who holds it.

    ``lock`` is held while a batch runs and while closing, so a session is never unmapped under a running batch.
    ``streams`` counts its open Run streams: the session is live while one is open."""

    bank: SharedBank
    tokens: SharedBank
    fences: FenceBoard
    worker: Any  # a StageWorker; None once closed
    holder: str
    rings: tuple[MessageRing, MessageRing] | None = None  # ops, replies (``ConfigureRequest.rings``)
    doorbell: Doorbell | None = None  # rung after each reply on the replies ring (``StageRings.doorbell``)
    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: int = 0
    closed: bool = False
    timeline: list[tuple[int, ...]] | None = None  # with CDB_STAGE_OP_LOG: one record per op (OP_LOG_FIELDS)

    def close(self, op_log: str = "", role: str = "") -> None:
        """Unmap the shared memory once the running batch (if any) ends; write the timeline to ``op_log`` (a
        folder) if recorded. Idempotent."""
        if self.rings is not None:
            self.rings[0].interrupt()  # an executor waiting for its next op lets go of the lock's turn
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.worker = None  # drop the bank views before unmapping
            self.bank.close()
            self.tokens.close()
            self.fences.close()
            for ring in self.rings or ():
                ring.close()
            if self.doorbell is not None:
                self.doorbell.close()
            if op_log and self.timeline:
                write_op_log(op_log, role, self.holder, self.timeline)


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


def _device(name: str) -> torch.device:
    """``cuda`` and ``cuda:0`` are the same device (the current one is 0 in a stage process)."""
    device = torch.device(name)
    return torch.device(device.type, 0) if device.type == "cuda" and device.index is None else device


class BatchObserver(Protocol):
    """Optional per-batch hooks, called on the stage's executor thread (``services.telemetry.StageTracer`` fits)."""

    def update(self, contexts: Mapping[int, str], released: Iterable[int] = ()) -> None:
        """The batch's ``trace_contexts`` and ``released`` ids, before it runs."""
        ...

    def record_op(self, op: StageOp, start_ns: int, end_ns: int, compute_s: float, error: str | None = None) -> None:
        """The batch ran from ``start_ns`` to ``end_ns`` (``time.time_ns``)."""
        ...


class StageService(stage_pb2_grpc.StageServicer):
    """The ``cdb.v1.Stage`` servicer of one stage role over an already loaded model."""

    def __init__(
        self,
        stage: Stage,
        model_name: str,
        dtype: str,
        model: Any,
        settings: Settings,
        worker_factory: Callable[..., Any] = StageWorker,
        observer: BatchObserver | None = None,
        config_digest: str = "",
    ) -> None:
        self.worker_factory = worker_factory  # StageWorker's signature; tests pass a fake
        self.config_digest = config_digest  # of the process's resolved configuration, reported by Configure
        self.observer = observer
        self.stage = stage
        self.model_name = model_name
        self.dtype = dtype
        self.model = model
        self.settings = settings
        self._spin_s = settings.spin_s  # resolved once (auto reads this host's usable cores)
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._dropping: list[_Session] = []  # sessions whose stream ended, being closed by its executor thread
        self._process = this_process()  # reported by Configure: a scheduler on this host can replace a hung stage

    def Configure(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> pb.ConfigureResponse:
        role = role_from_pb(request.role) if request.role else None
        for what, want, have in (
            ("role", role, self.stage),
            ("model", request.model, self.model_name),
            ("dtype", request.dtype, self.dtype),
        ):
            if want != have:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: caller wants {want}, stage has {have}")
        if request.device and _device(request.device) != _device(str(self.model.device)):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"device: caller wants {request.device}, stage has {self.model.device}",
            )
        cfg = self.model.config
        if request.bank.width != cfg.bank_width:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"bank width {request.bank.width}, model needs {cfg.bank_width}"
            )
        with self._lock:
            live = self._session
            if live is not None and live.streams and request.holder != live.holder:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the stage serves a live session of another scheduler; it is released when that one's stream ends",
                )
        session = self._attach(request, context)  # the new session first: a bad Configure harms nothing
        with self._lock:
            old, self._session = self._session, session
        if old is not None:
            old.close(self.settings.stage_op_log, self.stage.role)
        kv = request.kv
        bank = session.bank
        log.info("%s configured: %s bank, kv %s x %d", self.stage.name, bank.spec.kind, kv.policy, kv.num_blocks)
        return pb.ConfigureResponse(
            role=role_to_pb(self.stage),
            model=self.model_name,
            architecture=cfg.arch,
            bank_width=cfg.bank_width,
            device=str(self.model.device),
            process=pb.StageProcess(
                pid=self._process.pid,
                pid_namespace=self._process.namespace,
                start_ticks=self._process.start_ticks,
            ),
            config_digest=self.config_digest,
            op_records=records.VERSION if session.rings is not None else 0,
        )

    def _attach(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> _Session:
        attached: list[SharedBank | FenceBoard | MessageRing | Doorbell] = []
        try:
            bank = SharedBank.attach(bank_spec_from_pb(request.bank))
            attached.append(bank)
            tokens = SharedBank.attach(bank_spec_from_pb(request.token_bank))
            attached.append(tokens)
            fences = FenceBoard.attach(request.fences.name)
            attached.append(fences)
            rings, doorbell = None, None
            if request.HasField("rings"):
                ops = MessageRing.attach(request.rings.ops)
                attached.append(ops)
                replies = MessageRing.attach(request.rings.replies)
                attached.append(replies)
                rings = (ops, replies)
                if request.rings.doorbell:
                    doorbell = Doorbell.attach(request.rings.doorbell)
                    attached.append(doorbell)
            assert bank.tensor is not None and tokens.tensor is not None
            kv = request.kv
            layout = KVLayout(KVPolicy(kv.policy), kv.max_depth, kv.shared_after)
            worker = self.worker_factory(
                self.model, self.stage, bank.tensor, layout, kv.num_blocks, kv.block_size, tokens.tensor.view(-1)
            )
        except Exception as exc:
            for segment in reversed(attached):
                segment.close()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach the shared memory: {exc}")
            raise  # not reached: abort raises
        timeline: list[tuple[int, ...]] | None = [] if self.settings.stage_op_log else None
        return _Session(bank, tokens, fences, worker, request.holder, rings, doorbell, timeline=timeline)

    def Run(self, request_iterator: Iterator[pb.StageBatch], context: grpc.ServicerContext) -> Iterator[pb.StageReply]:
        with self._lock:
            session = self._session
            if session is not None:
                session.streams += 1
        if session is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stage not configured: call Configure first")
        assert session is not None
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        inbox: Any
        sink: Any
        if session.rings is None:
            inbox, sink = queue.SimpleQueue(), outbox
        else:  # the executor reads its ops and writes its replies itself; the stream is the session's lifeline
            inbox = _RingInbox(session.rings[0], self._spin_s)
            sink = _RingOutbox(session.rings[1], outbox, self.settings.stage_hang_floor_s, session.doorbell)
        stop = threading.Event()

        def on_done() -> None:
            stop.set()
            inbox.put(_END)

        context.add_callback(on_done)

        def read() -> None:
            clock = time.perf_counter_ns
            try:
                for msg in request_iterator:
                    inbox.put((Batch.of_message(msg), clock()))
            except grpc.RpcError:
                pass  # the caller went away; the callback stops the executor
            if session.rings is None:
                inbox.put(_END)  # with rings, the ops ring says where the batches end

        def execute() -> None:
            # Op k+1 is launched before op k is waited for when it arrives before op k is done and its fences are
            # met, so its host-side preparation overlaps op k's device time (a worker without ``launch`` runs ops
            # whole).
            launched: _Launched | None = None
            held: Any = None  # the next message, taken from the inbox but not launched yet
            try:
                while True:
                    if launched is None:
                        got, held = (inbox.get() if held is None else held), None
                        if got is _END or stop.is_set():
                            break
                        launched = self._guarded(session, self._launch, got)
                        if launched is None:
                            outbox.put(grpc.StatusCode.ABORTED)
                            return
                    # Until op k is done (``ready_at``, when the worker knows it), the next message may arrive. The
                    # executor sleeps meanwhile (a wake is early enough: op k+1 has until op k's end), so that it
                    # spins only when idle, and leaves the cores to the others while a stage op runs. Host work on
                    # op k that no reply waits for (``prepare``, where the worker has it) is done first.
                    self._guarded(session, self._prepare, launched)
                    ready_at = getattr(launched.finish, "ready_at", None)
                    while held is None:
                        left = ready_at - time.perf_counter() if ready_at is not None else 0.0
                        try:
                            held = _sleep_for(inbox, left) if left > 0 else inbox.get_nowait()
                        except queue.Empty:
                            break
                    following = None
                    if held is not None and held is not _END and self._launchable(session, held[0]):
                        following, held = self._guarded(session, self._launch, held), None
                        if following is None:
                            outbox.put(grpc.StatusCode.ABORTED)
                            return
                    reply = self._guarded(session, self._finish, launched)
                    if reply is None:
                        outbox.put(grpc.StatusCode.ABORTED)
                        return
                    sink.put(reply)
                    launched = following
                outbox.put(_END)
            finally:
                self._stream_ended(session)

        for target, name in ((read, "reader"), (execute, "executor")):
            threading.Thread(target=target, name=f"cdb-{self.stage.role}-{name}", daemon=True).start()
        while (reply := outbox.get()) is not _END:
            if isinstance(reply, grpc.StatusCode):
                context.abort(reply, "stage was reconfigured by its scheduler")
            if isinstance(reply, tuple):
                context.abort(*reply)
            yield reply

    def _stream_ended(self, session: _Session) -> None:
        """A Run stream of ``session`` ended. The last one: its scheduler is gone (or re-configures): drop the
        session, so the next Configure (a restarted scheduler's) finds the stage free."""
        with self._lock:
            session.streams -= 1
            drop = session.streams == 0 and self._session is session
            if drop:
                self._session = None
                self._dropping.append(session)  # ``close`` waits for it: the process must not exit mid-write
        if drop:
            session.fences.abort()  # a batch of it waiting on a fence gives up now
            session.close(self.settings.stage_op_log, self.stage.role)
            with self._lock:
                self._dropping.remove(session)
            log.info("%s stage: session of %s dropped (its stream ended)", self.stage.name, session.holder or "-")

    def _guarded(self, session: _Session, step: Callable[[_Session, Any], _T], arg: Any) -> _T | None:
        """``step(session, arg)`` under the session's lock; None if the session was closed or replaced."""
        with session.lock:
            if session.closed or self._session is not session:
                return None
            return step(session, arg)

    @staticmethod
    def _prepare(session: _Session, launched: _Launched) -> None:
        """Host work on a launched op that no reply waits for (the worker's ``prepare``, where it has one); a failure
        is left to the op's finish, which reports it."""
        prepare = getattr(launched.finish, "prepare", None)
        if prepare is not None:
            with contextlib.suppress(Exception):
                prepare()

    @staticmethod
    def _launchable(session: _Session, batch: Batch) -> bool:
        """Whether ``batch`` may be launched now, behind the op in progress: the worker launches without waiting for
        the op (``launch``) and the batch's fences are already met."""
        if not hasattr(session.worker, "launch"):
            return False  # ``execute`` runs an op whole: the op in progress is replied to first
        return batch.op is None or session.fences.ready(batch.op.fences)

    def _execute(self, session: _Session, msg: pb.StageBatch, arrived: int = 0) -> pb.StageReply:
        """Run one batch whole (launch, then finish); never raises."""
        return self._finish(session, self._launch(session, (Batch.of_message(msg), arrived)))

    def _launch(self, session: _Session, got: tuple[Batch, int]) -> _Launched:
        """Wait for the batch's fences and launch it on the worker; never raises (a failure is the result)."""
        batch, arrived = got
        launched = _Launched(batch, arrived)
        if batch.ping:
            return launched
        launched.dequeued = launched.fenced = time.perf_counter_ns()
        try:
            if batch.error is not None:
                raise batch.error
            op = launched.op = batch.op
            assert op is not None
            if op.stage is not self.stage:
                raise ValueError(f"{op.stage.name} batch sent to the {self.stage.name} stage")
            if self.observer is not None:
                self.observer.update(batch.trace_contexts, op.released)
            limit = self.settings.fence_timeout_s
            if batch.fence_timeout_s > 0:  # the scheduler's bound on the ops waited for (its watchdog acts first)
                limit = min(limit, batch.fence_timeout_s)
            launched.fence_wait = session.fences.wait(op.fences, limit, self._spin_s)
            launched.fenced, launched.start_ns = time.perf_counter_ns(), time.time_ns()
            worker = session.worker
            if hasattr(worker, "launch"):
                launched.finish = worker.launch(op)  # the op runs (on the device, or modelled) behind the host
            else:
                done = worker.execute(op)
                launched.finish = lambda: done
        except Exception as exc:
            launched.result = self._failed(batch.seq, exc)
        return launched

    def _finish(self, session: _Session, launched: _Launched) -> pb.StageReply:
        """Wait for a launched batch, publish its completion, build its reply; never raises."""
        batch, op = launched.batch, launched.op
        if batch.ping:
            return pb.StageReply(seq=batch.seq, stage=role_to_pb(self.stage), pong=True)
        result = launched.result
        if result is None:
            assert launched.finish is not None and op is not None
            try:
                result = launched.finish()  # compute_s: device-synchronised (or modelled) by the worker
            except Exception as exc:
                result = self._failed(batch.seq, exc)
            if session.timeline is not None and not result.error:
                tokens = len(op.rows)
                ended = time.perf_counter_ns()
                compute_ns = int(result.compute_s * 1e9)
                record = (op.seq, tokens, launched.arrived, launched.dequeued, launched.fenced, ended - compute_ns)
                session.timeline.append((*record, ended, compute_ns))
        if self.observer is not None and op is not None and op.stage is self.stage:
            end_ns = time.time_ns()
            self.observer.record_op(op, launched.start_ns or end_ns, end_ns, result.compute_s, result.error)
        session.fences.complete(self.stage, batch.seq)
        reply = result_to_pb(result)
        reply.fence_wait_s = launched.fence_wait
        return reply

    def _failed(self, seq: int, exc: Exception) -> StageResult:
        """The result of batch ``seq`` that failed: its requests fail, the stage keeps serving."""
        if isinstance(exc, FenceTimeout | FenceAborted):
            return StageResult(self.stage, seq, 0.0, error=f"{self.stage.name} stage: {exc}")
        log.error("%s batch %d failed:\n%s", self.stage.name, seq, traceback.format_exc())
        return StageResult(self.stage, seq, 0.0, error=f"{self.stage.name} stage: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Close the live session, and wait for sessions other threads are closing (their op logs written)."""
        with self._lock:
            session, self._session = self._session, None
            dropping = list(self._dropping)
        if session is not None:
            session.fences.abort()
            session.close(self.settings.stage_op_log, self.stage.role)
        for other in dropping:
            other.close(self.settings.stage_op_log, self.stage.role)  # idempotent: waits while another thread closes


def _sleep_for(inbox: Any, timeout: float) -> Any:
    """The inbox's next item within ``timeout`` s, without a busy-wait (queue.Empty at the timeout)."""
    return inbox.get(timeout=timeout, spin=False) if isinstance(inbox, _RingInbox) else inbox.get(timeout=timeout)


class _RingInbox:
    """The executor's inbox over a session's ops ring: ``(Batch, arrived_ns)`` items, ``_END`` at the end of
    the batches (an empty record), when the ring closes, or when ``put(_END)`` stops the stream. A message that
    comes on the stream itself (not sent by the project's executor) is taken too, before the ring's next one."""

    def __init__(self, ring: MessageRing, spin_s: float) -> None:
        self._ring = ring
        self._spin_s = spin_s
        self._side: deque[Any] = deque()
        self._stopped = False

    def put(self, item: Any) -> None:
        """From another thread: a message that came on the stream, or ``_END`` (the stream is over)."""
        if item is _END:
            self._stopped = True
        else:
            self._side.append(item)
        self._ring.interrupt()

    def get(self, timeout: float | None = None, spin: bool = True) -> Any:
        """The next item; ``spin=False``: sleep at once (no busy-wait first), for a wait that has time to spare."""
        spin_s = self._spin_s if spin else 0.0
        while True:
            if self._stopped:
                return _END
            if self._side:
                return self._side.popleft()
            try:
                got = self._ring.get(timeout, spin_s)
            except RingClosed:
                return _END
            if got is None:
                if timeout is None or self._stopped or self._side:
                    continue  # woken: look again
                raise queue.Empty
            payload, arrived = got
            if not payload:
                return _END  # the scheduler ended its batches (half-close)
            try:
                if records.is_record(payload):
                    return Batch.of_record(payload), arrived
                return Batch.of_message(pb.StageBatch.FromString(payload)), arrived
            except Exception:  # neither a batch nor a record: the session cannot go on
                log.error("a record on the ops ring is not a stage batch (%d bytes): ending the session", len(payload))
                return _END

    def get_nowait(self) -> Any:
        return self.get(timeout=0.0)


class _RingOutbox:
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
            self._stream.put(_END)  # the scheduler closed the session: nothing more to say
        except (RingFull, ValueError) as exc:
            log.error("%s: ending the session", exc)
            self._stream.put((grpc.StatusCode.ABORTED, f"replies ring: {exc}"))
