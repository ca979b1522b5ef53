"""``Executor`` (``cdb_scheduler.plan``) over gRPC: one persistent ``Run`` stream per stage server.

The executor owns the shared memory: it creates the hidden-state bank and the fence board, ``Configure``s each
stage to attach them, then opens the three streams. ``submit`` converts an op to a ``StageBatch`` and queues it
on its stage's stream without waiting (so several batches are in flight per stage); replies become
``StageResult``s on a single result queue that ``poll`` reads, in causal order (a result never precedes the
results of the ops it was fenced on; per stage, ``seq`` order).

Healing (a stage that dies costs latency, not requests): when a stream breaks or ends (stage process killed,
connection lost, keepalive timeout on a frozen stage), the executor is in an *outage*: the fence board is
aborted (stages waiting on a fence give up at once), every outstanding op is void, the other streams are ended
and ``poll`` returns a ``StageLoss`` (ops submitted before that ``poll`` returns are dropped: the scheduler
voids its in-flight state and recomputes its running requests, ``Scheduler.recover``). A recovery thread
reconnects (backoff ``CDB_RECONNECT_BACKOFF_S``, doubling up to 0.5 s) and re-``Configure``s all three stages
with fresh state over a new fence board that starts at the last void ``seq`` of each stage; ops submitted
meanwhile wait in a backlog and go out, in order, once every stage is back. If no complete set of stages is
back within ``CDB_STAGE_DOWN_LIMIT_S``, the executor gives up for good (``broken``): every outstanding op gets
an error result and every later ``submit`` is answered with one at once. ``outage`` / ``broken`` are what the
service's health check reads.

Hung stages (``services.transport.watchdog``): a watchdog thread checks every stage's oldest outstanding op
against its budget (and, for a stage process on this host, whether it is stopped). A hung stage is a loss like a
death: the same ``StageLoss`` and recovery, and its process is SIGKILLed so that its supervisor restarts it (a
stage found stopped when the stages are re-attached is killed too). Each batch carries a fence-wait limit of its
own, twice the floor plus the budgets of every op outstanding when it is sent: a wait on a hung stage's op is
released by the loss well before it.

The data plane: with ``CDB_STAGE_RINGS`` (the default, on x86-64 Linux) each stage's ops and replies travel on
two shared-memory message rings made with the fence board (``services.transport.ring``): ``submit`` writes the
serialized batch straight onto the stage's ops ring, and ``poll`` reads the replies rings on the calling thread
(the engine's): it sleeps on one doorbell (``ring.Doorbell``) that every stage rings after a reply and that
everything else posting a result rings too, so a reply reaches the planner with no thread in between. The
``Run`` streams stay open beside them as each session's lifeline (their breaking is the loss signal, as before).
Without rings, one reader thread per stream delivers the replies.

Admission: every Stage call carries the deployment's stage secret (``services.stage_secret``) and this
executor's ``holder`` id, so a stage serves one scheduler's session at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Fence, Stage, StageLoss, StageOp, StageResult
from services.settings import Settings, load_settings
from services.stage_secret import call_metadata, load_stage_secret
from services.transport import records
from services.transport import ring as ring_transport
from services.transport.bank import SharedBank
from services.transport.convert import bank_spec_to_pb, op_to_pb, result_from_pb, role_to_pb
from services.transport.fences import FenceBoard
from services.transport.links import StageLink, channel_options
from services.transport.ring import Doorbell, MessageRing
from services.transport.watchdog import HangWatch, OldestOp, ProcessId, is_stopped, kill, op_units

_RECONNECT_BACKOFF_MAX_S = 0.5  # a restarted stage is re-attached within this of listening
_STANDBY_WAIT_S = 0.5  # how long a re-attach waits for a standby before it tries the lost stage's own address

log = logging.getLogger("cdb.executor")

_WAKE = object()


@dataclass(slots=True)
class StageCounters:
    """Per-stage figures accumulated from replies (benchmarks, idle fraction)."""

    ops: int = 0
    compute_s: float = 0.0
    fence_wait_s: float = 0.0
    errors: int = 0
    ping_rtts: list[float] = field(default_factory=list)


@dataclass(slots=True)
class HopLog:
    """When a benchmark asks (``GrpcExecutor.hops``): when each reply and op crossed each hand-over between the
    stages and the engine thread, in ``perf_counter_ns`` (``CLOCK_MONOTONIC``: comparable with the stages' op logs).
    Rings only (the gRPC streams carry no stamps). Bounded: the newest ``size`` of each."""

    size: int = 200_000
    replies: deque[tuple[int, int, int, int, int]] = field(init=False)  # stage, seq, written, read, polled
    sent: deque[tuple[int, int, int, int]] = field(init=False)  # stage, seq, written to its ops ring, CPU to send
    _read: dict[tuple[int, int], tuple[int, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.replies, self.sent = deque(maxlen=self.size), deque(maxlen=self.size)

    def read(self, stage: Stage, seq: int, stamps: tuple[int, int]) -> None:
        """A reply was read from its ring; its line is written when the engine polls it."""
        if len(self._read) >= self.size:  # replies of void ops are never polled
            self._read.clear()
        self._read[(stage, seq)] = stamps

    def polled(self, stage: Stage, seq: int) -> None:
        """The engine thread took the reply's result (those of void ops are never taken)."""
        read = self._read.pop((stage, seq), None)
        if read is not None:
            self.replies.append((stage, seq, *read, time.perf_counter_ns()))


@dataclass(frozen=True, slots=True)
class _Pending:
    """An op sent and not yet answered: what it waits for, its work (``op_units``) and its hang budget then."""

    fences: tuple[Fence, ...]
    units: int
    budget: float


class OpObserver(Protocol):
    """Optional per-op hooks, both called on the engine thread (``services.telemetry.recorder.OpRecorder``: metrics, and
    ``services.telemetry.RequestTraces`` when tracing is on)."""

    def contexts_for_op(self, op: StageOp) -> Mapping[int, str]:
        """Request id -> W3C traceparent to send with ``op`` (``StageBatch.trace_contexts``)."""
        ...

    def on_op_done(self, op: StageOp, result: StageResult, sent_ns: int, done_ns: int) -> None:
        """``op`` was sent at ``sent_ns`` and its result polled at ``done_ns`` (``time.time_ns``)."""
        ...


class GrpcExecutor:
    """Executes stage ops on three stage servers. Thread-safe ``submit``/``wake``; one poller at a time."""

    concurrent_stages = True  # three processes: an op whose fence is not met leaves its stage idle

    def __init__(
        self,
        setup: StageSetup,
        stage_addrs: Mapping[Stage, str],
        settings: Settings | None = None,
        observer: OpObserver | None = None,
        standby_addrs: Mapping[Stage, str] | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.observer = observer
        self._sent: dict[tuple[Stage, int], tuple[StageOp, int]] = {}  # with an observer: op, sent at (ns)
        self.hops: HopLog | None = None  # set by a benchmark: the hand-overs' times
        self.setup = setup
        self.stage_addrs = dict(stage_addrs)  # the address each stage is served from now (a standby may take over)
        # Every address of a role: the first stage process, then its warm standby (model loaded, no session).
        # A lost stage is re-attached on another address of its role first: a process that is already up.
        self._role_addrs = {
            s: [a, *([standby_addrs[s]] if standby_addrs and s in standby_addrs else [])]
            for s, a in stage_addrs.items()
        }
        self._lost: set[Stage] = set()  # stages lost since the last re-attach
        self.takeovers = 0  # losses healed by another process of the role (a standby)
        self.counters = {stage: StageCounters() for stage in Stage}
        self.broken: str | None = None  # gave up: no stages came back in time (permanent)
        self.outage: str | None = None  # a stage is lost; re-attaching (None: all attached)
        self.recoveries = 0  # outages healed
        self.recovery_s: list[float] = []  # loss -> every stage re-attached, per healed outage
        self.holder = uuid.uuid4().hex
        self._metadata = call_metadata(load_stage_secret(self.settings))
        self._lock = threading.Lock()
        self._results: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outstanding: dict[Stage, dict[int, _Pending]] = {stage: {} for stage in Stage}  # in seq order
        self._held: dict[Stage, deque[tuple[StageResult, tuple[Fence, ...]]]] = {stage: deque() for stage in Stage}
        self._delivered = [-1] * len(Stage)  # seq of the last result delivered, per stage
        self._last_seq = {stage: -1 for stage in Stage}  # seq of the last op submitted, per stage
        self._void = {stage: -1 for stage in Stage}  # the last void op per stage (issued before the last loss)
        self._backlog: list[tuple[StageOp, Mapping[int, str] | None, float]] = []  # submitted during an outage
        self._epoch = 0  # bumped at every loss: replies of older links are void
        self._loss_pending = False  # a StageLoss is queued and not yet polled: submits are pre-recovery, dropped
        self._lost_at = 0.0
        self._recovering = False  # the recovery thread runs
        self._pongs: dict[int, threading.Event] = {}
        self._closed = False
        self._closing = threading.Event()
        self._links: dict[Stage, StageLink] = {}
        self.channels: dict[Stage, grpc.Channel] = {}  # each stage's active channel (of ``stage_addrs``)
        self._by_addr: dict[str, grpc.Channel] = {}
        self.watch = HangWatch(self.settings.stage_hang_floor_s, self.settings.stage_hang_factor)
        self._procs: dict[Stage, ProcessId] = {}  # each stage's process, from its last Configure reply
        self._config_digests: dict[Stage, str] = {}  # each stage process's configuration digest, from the same
        self._op_records: dict[Stage, bool] = {}  # whether each stage reads op records on its ring (same reply)
        bank_device = setup.device if setup.device.startswith("cuda") else "cpu"
        self.bank = SharedBank.create(setup.bank_rows, setup.bank_width, setup.dtype, bank_device)
        self.tokens = SharedBank.create(setup.bank_rows, 1, "int64", bank_device)
        self.fences = FenceBoard.create()
        # The stages ring it after each reply (rings only): ``poll`` sleeps on it and reads the replies itself.
        self._doorbell: Doorbell | None = None
        rings: dict[Stage, tuple[MessageRing, MessageRing]] = {}
        try:
            if self.settings.stage_rings and ring_transport.SUPPORTED:
                self._doorbell = Doorbell.create("stages' replies doorbell")
            for stage in Stage:
                self.channels[stage] = self._connect(stage, self.stage_addrs[stage])
                self._by_addr[self.stage_addrs[stage]] = self.channels[stage]
                for other in self._role_addrs[stage][1:]:  # standbys connect in the background
                    self._by_addr[other] = grpc.insecure_channel(other, options=channel_options(self.settings))
            rings = self._new_rings()
            for stage in Stage:
                self._configure(stage, self.fences, rings.get(stage))
            for stage in Stage:
                self._links[stage] = self._link(stage, 0, rings.pop(stage, None))
        except BaseException:
            _close_rings(rings)
            self.close()
            raise
        threading.Thread(target=self._watchdog, name="cdb-stage-watchdog", daemon=True).start()

    def _connect(self, stage: Stage, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address, options=channel_options(self.settings))
        try:
            grpc.channel_ready_future(channel).result(timeout=self.settings.stage_connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ConnectionError(f"{stage.role} stage at {address} not reachable") from None
        return channel

    def _link(self, stage: Stage, epoch: int, rings: tuple[MessageRing, MessageRing] | None) -> StageLink:
        timeout = self.settings.stage_hang_floor_s
        op_records = self._op_records.get(stage, False)
        return StageLink(stage, self.channels[stage], self, epoch, self._metadata, rings, timeout, op_records)

    def _new_rings(self) -> dict[Stage, tuple[MessageRing, MessageRing]]:
        """A fresh ops ring and replies ring per stage (none where rings are off or unsupported)."""
        rings: dict[Stage, tuple[MessageRing, MessageRing]] = {}
        if not (self.settings.stage_rings and ring_transport.SUPPORTED):
            return rings
        size = self.settings.stage_ring_bytes
        try:
            for stage in Stage:
                ops = MessageRing.create(size, f"{stage.role} stage's ops ring")
                try:
                    replies = MessageRing.create(size, f"{stage.role} stage's replies ring")
                except BaseException:
                    ops.close()
                    raise
                rings[stage] = (ops, replies)
        except BaseException:
            _close_rings(rings)
            raise
        return rings

    def _configure(
        self,
        stage: Stage,
        fences: FenceBoard,
        rings: tuple[MessageRing, MessageRing] | None,
        timeout: float | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        s = self.setup
        request = pb.ConfigureRequest(
            role=role_to_pb(stage),
            model=s.model,
            dtype=s.dtype,
            bank=bank_spec_to_pb(self.bank.spec),
            token_bank=bank_spec_to_pb(self.tokens.spec),
            fences=pb.FenceBoardSpec(name=fences.name),
            kv=pb.KVSpec(
                policy=s.kv_policy,
                max_depth=s.max_depth,
                shared_after=s.kv_shared_after,
                num_blocks=s.num_kv_blocks,
                block_size=s.kv_block_size,
            ),
            holder=self.holder,
            device=s.device,
        )
        if rings is not None:
            request.rings.ops, request.rings.replies = rings[0].name, rings[1].name
            if self._doorbell is not None:
                request.rings.doorbell = self._doorbell.name
        stub = stage_pb2_grpc.StageStub(channel or self.channels[stage])
        reply = stub.Configure(
            request,
            timeout=timeout or self.settings.stage_connect_timeout_s,
            wait_for_ready=True,
            metadata=self._metadata,
        )
        p = reply.process
        self._procs[stage] = ProcessId(p.pid, p.pid_namespace, p.start_ticks)
        self._op_records[stage] = rings is not None and reply.op_records == records.VERSION
        self._config_digests[stage] = reply.config_digest

    # --- Executor protocol -----------------------------------------------------------------------------------

    def submit(self, op: StageOp) -> None:
        """Queue ``op`` on its stage's stream (or the outage backlog); never blocks on compute or the network.
        ValueError, before anything is queued, for an op that a value of does not fit on the wire."""
        contexts = self.observer.contexts_for_op(op) if self.observer is not None else None
        with self._lock:
            if self.broken is not None or self._closed:
                self._post(StageResult(op.stage, op.seq, 0.0, error=self.broken or "executor closed"))
                return
            if self._loss_pending:  # issued before the scheduler saw the loss: void (StageLoss contract)
                self._void[op.stage] = max(self._void[op.stage], op.seq)
                self._delivered[op.stage] = max(self._delivered[op.stage], op.seq)
                return
            units = op_units(op)
            pending = self._outstanding[op.stage]
            fence_timeout_s = 0.0
            if op.fences:  # bound its fence wait by the budgets of every op it could be waiting for
                waits = sum(p.budget for ops in self._outstanding.values() for p in ops.values())
                fence_timeout_s = 2 * (self.watch.floor_s + waits)
            link = self._links.get(op.stage) if self.outage is None else None
            wire = _wire(op, contexts, fence_timeout_s, link) if link is not None else None  # (may raise)
            pending[op.seq] = _Pending(op.fences, units, self.watch.budget(op.stage, units))
            self._last_seq[op.stage] = op.seq
            if self.observer is not None:
                self._sent[(op.stage, op.seq)] = (op, time.time_ns())
            if link is None or wire is None:  # an outage: sent once the stages are back
                self._backlog.append((op, contexts, fence_timeout_s))
                return
            try:
                cpu = time.thread_time_ns() if self.hops is not None else 0
                link.send(wire)
                if self.hops is not None:  # (the send's CPU: the ring write and the wake of a stage asleep on it)
                    self.hops.sent.append((op.stage, op.seq, time.perf_counter_ns(), time.thread_time_ns() - cpu))
            except ValueError as exc:  # larger than the stage ring: this op fails, nothing else
                del pending[op.seq]
                self._sent.pop((op.stage, op.seq), None)
                why = f"{exc}; raise CDB_STAGE_RING_BYTES"
                self._post(StageResult(op.stage, op.seq, 0.0, error=why))

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        item = self._next(timeout)
        if item is None:
            return None
        if isinstance(item, StageLoss):
            with self._lock:
                self._loss_pending = False  # the engine recovers now; what it submits next is valid
            return item
        if not isinstance(item, StageResult):
            return None
        if self.observer is not None and (sent := self._sent.pop((item.stage, item.seq), None)) is not None:
            self.observer.on_op_done(sent[0], item, sent[1], time.time_ns())
        if self.hops is not None:
            self.hops.polled(item.stage, item.seq)
        return item

    def _next(self, timeout: float | None) -> object:
        """The next item of the result queue within ``timeout`` (None: none came). With rings, the replies are read
        here, on the poller's thread, between sleeps on the doorbell."""
        bell = self._doorbell
        if bell is None:
            try:
                return self._results.get(timeout=timeout)
            except queue.Empty:
                return None
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            try:
                return self._results.get_nowait()
            except queue.Empty:
                pass
            word = bell.word()  # before looking: a reply written after this read changes it
            if self._drain():
                continue
            left = 1.0 if deadline is None else deadline - time.perf_counter()
            if left <= 0:
                return None
            if self._results.empty():
                bell.wait(word, left)

    def _drain(self) -> int:
        """Read every reply waiting on the current links' replies rings (they go to the result queue)."""
        return sum(link.drain() for link in list(self._links.values()))

    def _post(self, item: object) -> None:
        """Queue ``item`` for ``poll`` and wake a poller sleeping on the doorbell (from any thread)."""
        self._results.put(item)
        if self._doorbell is not None:
            self._doorbell.ring()

    def completed(self, stage: Stage) -> int:
        """The last op of ``stage`` whose completion its stage published on the fence board (before its reply)."""
        try:
            return self.fences.completed(stage)
        except ValueError:  # the board was replaced and the old one closed just now (recovery): nothing is known
            return -1

    def wake(self) -> None:
        self._post(_WAKE)

    def close(self) -> None:
        """End the streams, close the channels, free the shared memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = self._links, {}
        self._closing.set()
        for link in links.values():
            link.close()
        for channel in {*self.channels.values(), *self._by_addr.values()}:
            channel.close()
        self.fences.close()
        self.bank.close()
        self.tokens.close()
        if self._doorbell is not None:
            self._doorbell.ring()  # a poller asleep on it looks once more and finds nothing
            self._doorbell.close()

    # --- diagnostics -----------------------------------------------------------------------------------------

    def ping(self, stage: Stage, timeout: float = 5.0) -> float:
        """Round trip of an empty batch through ``stage``'s stream (queued behind its pending batches)."""
        token = -(time.perf_counter_ns() & 0x3FFFFFFFFFFFFFFF) - 1  # negative: never a real op seq
        done = threading.Event()
        with self._lock:
            link = self._links.get(stage)
            if link is None or self.outage is not None:
                raise ConnectionError(f"{stage.role} stage is not attached ({self.outage or self.broken})")
            self._pongs[token] = done
        start = time.perf_counter()
        link.send(pb.StageBatch(seq=token, ping=pb.Ping()))
        deadline = start + timeout
        while not done.is_set():  # (with rings the pong is read by a drain: the poller's, or this one when idle)
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{stage.role} stage did not answer a ping in {timeout}s")
            if self._doorbell is not None:
                if link.drain():
                    self._doorbell.ring()  # what this drain read may be a poller's: wake it
                left = min(left, 1e-3)
            done.wait(left)
        rtt = time.perf_counter() - start
        self.counters[stage].ping_rtts.append(rtt)
        return rtt

    # --- called by the links (the poller's drain; without rings, the stream reader threads) ---------------------

    def on_reply(self, stage: Stage, epoch: int, reply: pb.StageReply, stamps: tuple[int, int] | None = None) -> None:
        """A stage's reply (``stamps``: when the stage wrote it and when it was read, from a ring)."""
        if reply.pong:
            with self._lock:
                event = self._pongs.pop(reply.seq, None)
            if event is not None:
                event.set()
            return
        if stamps is not None and self.hops is not None:
            self.hops.read(stage, reply.seq, stamps)
        result = result_from_pb(reply)
        with self._lock:
            if epoch != self._epoch:
                return  # a reply of a link from before the loss: its op is void
            pending = self._outstanding[stage].pop(reply.seq, None)
            if pending is None:
                return  # already failed when the executor gave up
            c = self.counters[stage]
            c.ops += 1
            c.compute_s += reply.compute_s
            c.fence_wait_s += reply.fence_wait_s
            c.errors += bool(reply.error)
            if not reply.error:
                self.watch.on_reply(stage, pending.units, reply.compute_s)
            self._held[stage].append((result, pending.fences))
            self._release_held()

    def _release_held(self) -> None:
        """Deliver held results in causal order (caller holds the lock).

        A stage marks its completion on the fence board before it replies, so the reply of an op can overtake
        the reply of an op it was fenced on. The engine sees results in the order the in-process executor
        guarantees for dependencies: never before the results of the ops it was fenced on (failed ops excepted:
        their requests fail either way), and in ``seq`` order per stage.
        """
        progress = True
        while progress:
            progress = False
            for stage, held in self._held.items():
                while held and (held[0][0].error or all(self._delivered[f.stage] >= f.seq for f in held[0][1])):
                    result, _ = held.popleft()
                    self._delivered[stage] = result.seq
                    self._results.put(result)  # (read by the poller's drain; a ping's drain rings the doorbell)
                    progress = True

    def on_broken(self, stage: Stage, epoch: int, why: str) -> None:
        """A link's stream broke or ended: void every outstanding op and start re-attaching the stages."""
        with self._lock:
            if self._closed or self.broken is not None or epoch != self._epoch:
                return  # closing, given up, or a link already replaced
            self._epoch += 1
            if self.outage is None:
                self._lost_at = time.monotonic()
            self.outage = why
            self._lost.add(stage)
            self._loss_pending = True
            for pending in self._outstanding.values():
                pending.clear()
            for held in self._held.values():
                held.clear()
            self._backlog.clear()
            self._sent.clear()
            self._void = dict(self._last_seq)
            self._delivered = [self._last_seq[s] for s in Stage]  # void ops count as delivered for fences
            self.watch.reset()
            self.fences.abort()  # stages waiting on a fence of a void op give up now
            self._post(StageLoss(why))
            links, self._links = self._links, {}
            start = not self._recovering
            self._recovering = True
        log.warning("stage lost: %s; re-attaching the stages, running requests will be recomputed", why)
        for link in links.values():
            link.cancel()
        if start:
            threading.Thread(target=self._recover, name="cdb-stage-recovery", daemon=True).start()

    # --- recovery --------------------------------------------------------------------------------------------

    def _recover(self) -> None:
        """The recovery thread: re-attach every stage (backoff) until done, closed, or past the down limit."""
        backoff = self.settings.reconnect_backoff_s
        while True:
            with self._lock:
                if self._closed or self.broken is not None or self.outage is None:
                    self._recovering = False
                    return
                epoch, completed = self._epoch, dict(self._void)  # void ops count as done; the backlog does not
                deadline = self._lost_at + self.settings.stage_down_limit_s
            try:
                self._reattach(epoch, completed, deadline)
                continue  # installed (the loop ends) or a newer loss came meanwhile (the loop retries)
            except Exception as exc:  # a stage not back yet (connection refused, timeout, refused Configure)
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                self._give_up(
                    f"{self.outage}; no complete set of stages back within "
                    f"{self.settings.stage_down_limit_s:g}s (last: {problem})"
                )
                return
            log.info("stages not back yet (%s); retrying in %.2fs", problem.splitlines()[0][:200], backoff)
            if self._closing.wait(min(backoff, max(0.0, deadline - time.monotonic()))):
                continue  # closed: the loop ends
            backoff = min(backoff * 2, _RECONNECT_BACKOFF_MAX_S)

    def _reattach(self, epoch: int, completed: dict[Stage, int], deadline: float) -> None:
        for bank in (self.bank, self.tokens):  # a name unlinked meanwhile (by hand): no stage could attach it
            bank.renew_if_unlinked()
        for stage, proc in list(self._procs.items()):  # lost to keepalive while stopped: it would never answer
            if proc.local and is_stopped(proc) and kill(proc):
                log.error("%s stage process %d is stopped: killed, its supervisor restarts it", stage.role, proc.pid)
        board = FenceBoard.create(completed)
        links: dict[Stage, StageLink] = {}
        rings: dict[Stage, tuple[MessageRing, MessageRing]] = {}
        try:
            rings = self._new_rings()
            with self._lock:
                lost = set(self._lost)
            moved: dict[Stage, str] = {}
            for stage in Stage:  # waits for the channel to be ready (a restarting stage), bounded
                timeout = max(1.0, min(10.0, deadline - time.monotonic()))
                address = self._attach_one(stage, stage in lost, board, rings.get(stage), timeout)
                if address != self.stage_addrs[stage]:
                    moved[stage] = address
            for stage, address in moved.items():
                self.channels[stage] = self._by_addr[address]
                self.stage_addrs[stage] = address
            for stage in Stage:
                links[stage] = self._link(stage, epoch, rings.pop(stage, None))
            with self._lock:
                install = not self._closed and self.broken is None and self._epoch == epoch
                if install:
                    old, self.fences, self._links = self.fences, board, links
                    self.outage = None  # the recovery loop sees it and ends (or serves a newer loss)
                    for op, contexts, fence_timeout_s in self._backlog:
                        try:
                            links[op.stage].send(_wire(op, contexts, fence_timeout_s, links[op.stage]))
                        except ValueError as exc:  # larger than the stage ring: this op fails
                            self._outstanding[op.stage].pop(op.seq, None)
                            self._post(StageResult(op.stage, op.seq, 0.0, error=str(exc)))
                    self._backlog.clear()
                    self.recoveries += 1
                    self.takeovers += bool(moved)
                    self._lost.clear()
                    self.recovery_s.append(time.monotonic() - self._lost_at)
        except BaseException:
            for link in links.values():
                link.cancel()
            _close_rings(rings)
            board.close()
            raise
        if not install:  # a newer loss (or close) meanwhile: these links are stale
            for link in links.values():
                link.cancel()
            board.close()
            return
        old.close()
        log.warning("stages re-attached %.2fs after the loss (%d outages healed)", self.recovery_s[-1], self.recoveries)

    def stage_pids(self) -> dict[str, int]:
        """The process id serving each stage role (from its last ``Configure``)."""
        return {stage.role: proc.pid for stage, proc in list(self._procs.items())}

    def stage_config_digests(self) -> dict[str, str]:
        """The configuration digest of the process serving each stage role (from its last ``Configure``)."""
        return {stage.role: digest for stage, digest in list(self._config_digests.items())}

    def _attach_one(
        self,
        stage: Stage,
        lost: bool,
        board: FenceBoard,
        rings: tuple[MessageRing, MessageRing] | None,
        timeout: float,
    ) -> str:
        """Configure ``stage`` on one of its role's addresses; return that address. A lost stage tries the role's
        other addresses first (a warm standby answers at once; the lost process may still be restarting), each
        briefly, then waits for its own address as usual."""
        current = self.stage_addrs[stage]
        if lost:
            for address in self._role_addrs[stage]:
                if address == current:
                    continue
                try:
                    self._configure(stage, board, rings, timeout=_STANDBY_WAIT_S, channel=self._by_addr[address])
                except grpc.RpcError as exc:
                    log.info("%s stage standby at %s not available (%s)", stage.role, address, exc.code().name)
                    continue
                log.warning("%s stage: its standby at %s takes over", stage.role, address)
                return address
        self._configure(stage, board, rings, timeout=timeout)
        return current

    # --- the hang watchdog -----------------------------------------------------------------------------------

    def _watchdog(self) -> None:
        """The watchdog thread: every ``tick_s``, ask the hang rule about each stage's oldest outstanding op."""
        while not self._closing.wait(self.watch.tick_s):
            try:
                self._watch_once()
            except Exception:  # never end quietly: the next tick tries again
                log.exception("stage watchdog check failed")

    def _watch_once(self) -> None:
        procs = dict(self._procs)
        stopped = {stage: is_stopped(proc) for stage, proc in procs.items() if proc.local}
        with self._lock:
            if self._closed or self.broken is not None or self.outage is not None:
                return
            epoch = self._epoch
            hang = self.watch.check(time.monotonic(), {s: self._oldest(s) for s in Stage}, stopped)
        if hang is None:
            return
        proc = procs.get(hang.stage)
        if proc is None or not proc.local:
            self.on_broken(hang.stage, epoch, f"{hang.stage.role} stage hung: {hang.why}; not a process to kill here")
            return
        self.on_broken(hang.stage, epoch, f"{hang.stage.role} stage hung: {hang.why}; killing its process {proc.pid}")
        if not kill(proc):  # after the loss is declared: the broken stream then reads as this hang, not a death
            log.error("could not kill the hung %s stage's process %d", hang.stage.role, proc.pid)

    def _oldest(self, stage: Stage) -> OldestOp | None:
        """``stage``'s oldest op without a reply (caller holds the lock); runnable once its fences have replied."""
        pending = self._outstanding[stage]
        if not pending:
            return None
        seq = next(iter(pending))
        op = pending[seq]
        runnable = all(self._delivered[f.stage] >= f.seq for f in op.fences)
        return OldestOp(seq, op.units, runnable)

    def _give_up(self, why: str) -> None:
        with self._lock:
            if self.broken is not None or self._closed:
                return
            self.broken = why
            self._recovering = False
            failed = [(stage, sorted(pending)) for stage, pending in self._outstanding.items()]
            for pending in self._outstanding.values():
                pending.clear()
            self._backlog.clear()
        log.error("executor broken: %s", why)
        for stage, seqs in failed:
            for seq in seqs:
                self._post(StageResult(stage, seq, 0.0, error=why))


def _wire(
    op: StageOp, contexts: Mapping[int, str] | None, fence_timeout_s: float, link: StageLink
) -> pb.StageBatch | bytearray:
    """``op`` as ``link`` carries it: an op record where its stage reads them and the op fits one, else a message
    (ValueError for a value that neither can carry)."""
    if link.op_records and not contexts:
        record = records.encode(op, fence_timeout_s)
        if record is not None:
            return record
    msg = op_to_pb(op, trace_contexts=contexts)
    msg.fence_timeout_s = fence_timeout_s
    return msg


def _close_rings(rings: Mapping[Stage, tuple[MessageRing, MessageRing]]) -> None:
    """Unmap and unlink rings that no link owns."""
    for pair in rings.values():
        for ring in pair:
            ring.close()


class GrpcExecutorFactory:
    """``executor_factory`` for ``Engine``: builds a :class:`GrpcExecutor` and remembers it for health checks."""

    def __init__(
        self,
        stage_addrs: Mapping[Stage, str],
        settings: Settings | None = None,
        observer: OpObserver | None = None,
        standby_addrs: Mapping[Stage, str] | None = None,
    ) -> None:
        self.observer = observer
        self.standby_addrs = dict(standby_addrs or {})
        missing = set(Stage) - set(stage_addrs)
        if missing:
            raise ValueError(f"missing stage addresses: {sorted(s.role for s in missing)}")
        self.stage_addrs = dict(stage_addrs)
        self.settings = settings or load_settings()
        self.executor: GrpcExecutor | None = None

    def __call__(self, setup: StageSetup) -> GrpcExecutor:
        self.executor = GrpcExecutor(setup, self.stage_addrs, self.settings, self.observer, self.standby_addrs)
        return self.executor
