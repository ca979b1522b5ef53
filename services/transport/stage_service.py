"""The ``cdb.v1.Stage`` servicer of one stage role (prelude | loop | head) over an already loaded model.

``Configure`` attaches the bank and fence board the scheduler created and builds a ``StageWorker`` (fresh KV
pools). ``Run`` is the persistent batch stream, served by three threads so that the stage never waits for the
network:

    gRPC recv --reader--> inbox --executor: fences, compute, complete(seq)--> outbox --writer--> gRPC send

The executor thread runs batches back to back in ``seq`` order; it marks completion on the fence board BEFORE
the reply is sent, so a stage waiting on this one starts without a round trip through the scheduler. A batch
that fails (an exception, a fence timeout) gets a reply with ``error``; the stage keeps serving. How batches come
in and replies go out: ``services.transport.stage_inbox``; what measurement sees of the ops: one probe per session
(``services.transport.stage_probe``).

A session configured with message rings (``ConfigureRequest.rings``, ``services.transport.ring``) takes its
batches from the ops ring and writes its replies to the replies ring, both on the executor thread itself:

    ops ring --executor: fences, compute, complete(seq)--> replies ring, doorbell

with no thread hop on the way (the doorbell, named in ``StageRings``, wakes the scheduler's engine thread, which
reads the replies itself); its Run stream carries nothing and only ends the session when it ends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import torch

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.stage_worker import StageWorker
from cdb_scheduler.plan import Stage, StageResult
from services.settings import Settings
from services.transport import records
from services.transport.convert import result_to_pb, role_from_pb, role_to_pb
from services.transport.fences import FenceAborted, FenceTimeout
from services.transport.stage_inbox import END, Batch, RingInbox, RingOutbox, sleep_for
from services.transport.stage_probe import BatchObserver, stage_probe
from services.transport.stage_session import Launched, Session
from services.transport.watchdog import this_process

log = logging.getLogger("cdb.stage")

_T = TypeVar("_T")


def _device(name: str) -> torch.device:
    """``cuda`` and ``cuda:0`` are the same device (the current one is 0 in a stage process)."""
    device = torch.device(name)
    return torch.device(device.type, 0) if device.type == "cuda" and device.index is None else device


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
        self._session: Session | None = None
        self._dropping: list[Session] = []  # sessions whose stream ended, being closed by its executor thread
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
            old.close()
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

    def _attach(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> Session:
        make_worker = functools.partial(self.worker_factory, self.model, self.stage)  # StageWorker's signature
        probe = stage_probe(self.settings.stage_op_log, self.stage.role, request.holder, self.observer)
        try:
            return Session.attach(request, make_worker, probe)
        except Exception as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach the shared memory: {exc}")
            raise  # not reached: abort raises

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
            inbox = RingInbox(session.rings[0], self._spin_s)
            sink = RingOutbox(session.rings[1], outbox, self.settings.stage_hang_floor_s, session.doorbell)
        stop = threading.Event()

        def on_done() -> None:
            stop.set()
            inbox.put(END)

        context.add_callback(on_done)

        def read() -> None:
            clock = time.perf_counter_ns
            try:
                for msg in request_iterator:
                    inbox.put((Batch.of_message(msg), clock()))
            except grpc.RpcError:
                pass  # the caller went away; the callback stops the executor
            if session.rings is None:
                inbox.put(END)  # with rings, the ops ring says where the batches end

        def execute() -> None:
            try:
                outbox.put(self._serve(session, inbox, sink, stop))
            finally:
                self._stream_ended(session)

        for target, name in ((read, "reader"), (execute, "executor")):
            threading.Thread(target=target, name=f"cdb-{self.stage.role}-{name}", daemon=True).start()
        while (reply := outbox.get()) is not END:
            if isinstance(reply, grpc.StatusCode):
                context.abort(reply, "stage was reconfigured by its scheduler")
            if isinstance(reply, tuple):
                context.abort(*reply)
            yield reply

    def _serve(self, session: Session, inbox: Any, sink: Any, stop: threading.Event) -> object:
        """The executor thread's loop: batches from ``inbox`` run in order, their replies go to ``sink``. Returns
        ``END`` when the batches end, ``ABORTED`` when the session was closed or replaced.

        Op k+1 is launched before op k is waited for when it arrives before op k is done and its fences are met, so
        its host-side preparation overlaps op k's device time (a worker without ``launch`` runs ops whole)."""
        launched: Launched | None = None
        held: Any = None  # the next message, taken from the inbox but not launched yet
        while True:
            if launched is None:
                got, held = (inbox.get() if held is None else held), None
                if got is END or stop.is_set():
                    return END
                launched = self._guarded(session, self._launch, got)
                if launched is None:
                    return grpc.StatusCode.ABORTED
            # Until op k is done (``ready_at``, when the worker knows it), the next message may arrive. The executor
            # sleeps meanwhile (a wake is early enough: op k+1 has until op k's end), so that it spins only when
            # idle, and leaves the cores to the others while a stage op runs. Host work on op k that no reply waits
            # for (``prepare``, where the worker has it) is done first.
            self._guarded(session, self._prepare, launched)
            ready_at = getattr(launched.finish, "ready_at", None)
            while held is None:
                left = ready_at - time.perf_counter() if ready_at is not None else 0.0
                try:
                    held = sleep_for(inbox, left) if left > 0 else inbox.get_nowait()
                except queue.Empty:
                    break
            following = None
            if held is not None and held is not END and self._launchable(session, held[0]):
                following, held = self._guarded(session, self._launch, held), None
                if following is None:
                    return grpc.StatusCode.ABORTED
            reply = self._guarded(session, self._finish, launched)
            if reply is None:
                return grpc.StatusCode.ABORTED
            sink.put(reply)
            launched = following

    def _stream_ended(self, session: Session) -> None:
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
            session.close()
            with self._lock:
                self._dropping.remove(session)
            log.info("%s stage: session of %s dropped (its stream ended)", self.stage.name, session.holder or "-")

    def _guarded(self, session: Session, step: Callable[[Session, Any], _T], arg: Any) -> _T | None:
        """``step(session, arg)`` under the session's lock; None if the session was closed or replaced."""
        with session.lock:
            if session.closed or self._session is not session:
                return None
            return step(session, arg)

    @staticmethod
    def _prepare(session: Session, launched: Launched) -> None:
        """Host work on a launched op that no reply waits for (the worker's ``prepare``, where it has one); a failure
        is left to the op's finish, which reports it."""
        prepare = getattr(launched.finish, "prepare", None)
        if prepare is not None:
            with contextlib.suppress(Exception):
                prepare()

    @staticmethod
    def _launchable(session: Session, batch: Batch) -> bool:
        """Whether ``batch`` may be launched now, behind the op in progress: the worker launches without waiting for
        the op (``launch``) and the batch's fences are already met."""
        if not session.overlaps or session.worker is None:
            return False  # ``execute`` runs an op whole: the op in progress is replied to first
        return batch.op is None or session.fences.ready(batch.op.fences)

    def _launch(self, session: Session, got: tuple[Batch, int]) -> Launched:
        """Wait for the batch's fences and launch it on the worker; never raises (a failure is the result)."""
        batch, arrived = got
        launched = Launched(batch, arrived)
        if batch.ping:
            return launched
        try:
            if batch.error is not None:
                raise batch.error
            op = launched.op = batch.op
            assert op is not None
            if op.stage is not self.stage:
                raise ValueError(f"{op.stage.name} batch sent to the {self.stage.name} stage")
            launched.mark = mark = session.probe.begin(op, batch.trace_contexts, arrived)
            limit = self.settings.fence_timeout_s
            if batch.fence_timeout_s > 0:  # the scheduler's bound on the ops waited for (its watchdog acts first)
                limit = min(limit, batch.fence_timeout_s)
            launched.fence_wait = session.fences.wait(op.fences, limit, self._spin_s)
            session.probe.fenced(mark)
            worker = session.worker
            if session.overlaps:
                launched.finish = worker.launch(op)  # the op runs (on the device, or modelled) behind the host
            else:
                done = worker.execute(op)
                launched.finish = lambda: done
        except Exception as exc:
            launched.result = self._failed(batch.seq, exc)
        return launched

    def _finish(self, session: Session, launched: Launched) -> pb.StageReply:
        """Wait for a launched batch, publish its completion, build its reply; never raises."""
        batch, op = launched.batch, launched.op
        if batch.ping:
            return pb.StageReply(seq=batch.seq, stage=role_to_pb(self.stage), pong=True)
        result = launched.result
        if result is None:
            assert launched.finish is not None
            try:
                result = launched.finish()  # compute_s: device-synchronised (or modelled) by the worker
            except Exception as exc:
                result = self._failed(batch.seq, exc)
        if launched.mark is not None:
            assert op is not None
            session.probe.end(launched.mark, op, result)
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
            session.close()
        for other in dropping:
            other.close()  # idempotent: waits while another thread closes
