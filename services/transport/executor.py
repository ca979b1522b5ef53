"""``Executor`` (``cdb_scheduler.plan``) over gRPC: one persistent ``Run`` stream per stage server.

The executor owns the shared memory: it creates the hidden-state bank and the fence board, ``Configure``s each
stage to attach them, then opens the three streams. ``submit`` converts an op to a ``StageBatch`` (or an op record)
and queues it on its stage's stream without waiting (so several batches are in flight per stage); replies become
``StageResult``s that ``poll`` returns in causal order (a result never precedes the results of the ops it was
fenced on; per stage, ``seq`` order). With ``CDB_STAGE_RINGS`` (the default, on x86-64 Linux) ops and replies
travel on shared-memory rings and ``poll`` reads the replies itself, on the engine's thread; the ``Run`` streams
stay open beside them as each session's lifeline (their breaking is the loss signal). Without rings, one reader
thread per stream delivers the replies.

Its parts, each in its own module:

- ``ordering.CausalOrder``: the ops in flight and the replies held back for causal order (pure);
- ``links.StageLink``: one stage channel, sending and draining over its rings or its stream;
- ``stages.StageSet``: the stage processes, their addresses (standbys too) and ``Configure``;
- ``results.ResultQueue``: where results wait for the poller (a reply released by its own read comes straight);
- ``healing``: the outage state, the recovery thread (a stage lost costs latency, not requests: ``poll`` returns
  a ``StageLoss`` and the stages are re-attached) and the hang watchdog thread;
- ``services.telemetry.probe``: the one seam measurement goes through (per-op metrics and traces, benchmark
  stamps).

Admission: every Stage call carries the deployment's stage secret (``services.stage_secret``) and this
executor's ``holder`` id, so a stage serves one scheduler's session at a time.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from cdb_api.v1 import stage_pb2 as pb
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Stage, StageLoss, StageOp, StageResult
from services.settings import Settings, load_settings
from services.stage_secret import call_metadata, load_stage_secret
from services.telemetry.probe import NO_PROBE, ExecutorProbe, OpObserver, OpTimes
from services.transport import ring as ring_transport
from services.transport.convert import result_from_pb
from services.transport.fences import FenceBoard
from services.transport.healing import Healer, Outage, Reattach
from services.transport.links import Rings, StageLink, close_rings, new_rings
from services.transport.ordering import CausalOrder, Pending
from services.transport.results import ResultQueue
from services.transport.ring import Doorbell
from services.transport.stages import StageSet
from services.transport.watchdog import Hang, HangWatch, op_units

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


class GrpcExecutor:
    """Executes stage ops on three stage servers. Thread-safe ``submit``/``wake``; one poller at a time.

    ``probe`` (``services.telemetry.probe``): what measures its ops; ``OpTimes`` over ``observer`` when one is
    given, else nothing. A benchmark may replace it before the first op."""

    concurrent_stages = True  # three processes: an op whose fence is not met leaves its stage idle

    def __init__(
        self,
        setup: StageSetup,
        stage_addrs: Mapping[Stage, str],
        settings: Settings | None = None,
        observer: OpObserver | None = None,
        standby_addrs: Mapping[Stage, str] | None = None,
    ) -> None:
        self.settings = settings = settings or load_settings()
        self.probe: ExecutorProbe = OpTimes(observer) if observer is not None else NO_PROBE
        self.setup = setup
        self.holder = uuid.uuid4().hex
        self._metadata = call_metadata(load_stage_secret(settings))
        # With rings the stages ring it after each reply: ``poll`` sleeps on it and reads the replies itself.
        rings_on = settings.stage_rings and ring_transport.SUPPORTED
        self._results = ResultQueue(Doorbell.create("stages' replies doorbell") if rings_on else None)
        self.stages = StageSet(
            setup, stage_addrs, standby_addrs, settings, self._metadata, self.holder, self._results.doorbell
        )
        self.stage_addrs = self.stages.addrs  # the address each stage is served from now (a standby may take over)
        self.channels = self.stages.channels  # each stage's active channel (of ``stage_addrs``)
        self.bank, self.tokens = self.stages.bank, self.stages.tokens
        self.counters = {stage: StageCounters() for stage in Stage}
        self.watch = HangWatch(settings.stage_hang_floor_s, settings.stage_hang_factor)
        self._state = Outage()
        self._order = CausalOrder()
        self._lock = threading.Lock()
        self._backlog: list[tuple[StageOp, Mapping[int, str] | None, float]] = []  # submitted during an outage
        self._closed = False
        self._links: dict[Stage, StageLink] = {}
        self.fences = FenceBoard.create()
        self._healer = Healer(self, self.stages, settings, self.watch.tick_s)
        rings: dict[Stage, Rings] = {}
        try:
            self.stages.connect()
            rings = new_rings(settings)
            for stage in Stage:
                self.stages.configure(stage, self.fences, rings.get(stage))
            for stage in Stage:
                self._links[stage] = self.stages.link(stage, self, 0, rings.pop(stage, None))
        except BaseException:
            close_rings(rings)
            self.close()
            raise
        self._healer.start_watchdog()

    # --- health ----------------------------------------------------------------------------------------------

    @property
    def outage(self) -> str | None:
        """Why a stage is lost while the stages are re-attached; None while all are attached."""
        return self._state.why

    @property
    def broken(self) -> str | None:
        """Why the executor gave up for good (no stages came back in time); None while it serves."""
        return self._state.broken

    @property
    def recoveries(self) -> int:
        """Outages healed."""
        return self._state.recoveries

    @property
    def takeovers(self) -> int:
        """Outages healed by another process of a role (a standby)."""
        return self._state.takeovers

    @property
    def recovery_s(self) -> list[float]:
        """Loss -> every stage re-attached, per healed outage (seconds)."""
        return self._state.recovery_s

    def stage_pids(self) -> dict[str, int]:
        """The process id serving each stage role (from its last ``Configure``)."""
        return {stage.role: proc.pid for stage, proc in list(self.stages.procs.items())}

    def stage_config_digests(self) -> dict[str, str]:
        """The configuration digest of the process serving each stage role (from its last ``Configure``)."""
        return {stage.role: digest for stage, digest in list(self.stages.config_digests.items())}

    # --- Executor protocol -----------------------------------------------------------------------------------

    def submit(self, op: StageOp) -> None:
        """Queue ``op`` on its stage's stream (or the outage backlog); never blocks on compute or the network.
        ValueError, before anything is queued, for an op that a value of does not fit on the wire."""
        probe = self.probe
        contexts = probe.contexts_for_op(op)
        with self._lock:
            state = self._state
            if state.broken is not None or self._closed:
                self._results.post(StageResult(op.stage, op.seq, 0.0, error=state.broken or "executor closed"))
                return
            if state.loss_pending:  # issued before the scheduler saw the loss: void (StageLoss contract)
                self._order.voided(op.stage, op.seq)
                return
            units = op_units(op)
            fence_timeout_s = 0.0
            if op.fences:  # bound its fence wait by the budgets of every op it could be waiting for
                fence_timeout_s = 2 * (self.watch.floor_s + self._order.budgets())
            link = self._links.get(op.stage) if state.why is None else None
            wire = link.wire(op, contexts, fence_timeout_s) if link is not None else None  # (may raise)
            self._order.sent(op.stage, op.seq, Pending(op.fences, units, self.watch.budget(op.stage, units)))
            if link is None or wire is None:  # an outage: sent once the stages are back
                probe.queued(op)
                self._backlog.append((op, contexts, fence_timeout_s))
                return
            try:
                probe.send(link.send, wire, op)
            except ValueError as exc:  # larger than the stage ring: this op fails, nothing else
                self._order.unsent(op.stage, op.seq)
                self._results.post(StageResult(op.stage, op.seq, 0.0, error=f"{exc}; raise CDB_STAGE_RING_BYTES"))

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        item = self._results.next(timeout, self._read)
        if isinstance(item, StageResult):
            self.probe.polled(item)
            return item
        if isinstance(item, StageLoss):
            with self._lock:
                self._state.loss_pending = False  # the engine recovers now; what it submits next is valid
            return item
        return None

    def _read(self) -> int:
        """Read every reply waiting on the current links' replies rings, on the poller's thread."""
        return sum(link.drain(self._take) for link in list(self._links.values()))

    def completed(self, stage: Stage) -> int:
        """The last op of ``stage`` whose completion its stage published on the fence board (before its reply)."""
        try:
            return self.fences.completed(stage)
        except ValueError:  # the board was replaced and the old one closed just now (recovery): nothing is known
            return -1

    def wake(self) -> None:
        self._results.post(_WAKE)

    def close(self) -> None:
        """End the streams, close the channels, free the shared memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = self._links, {}
        self._healer.close()
        for link in links.values():
            link.close()
        self.stages.close()
        self.fences.close()
        self._results.close()

    # --- diagnostics -----------------------------------------------------------------------------------------

    def ping(self, stage: Stage, timeout: float = 5.0) -> float:
        """Round trip of an empty batch through ``stage``'s stream (queued behind its pending batches)."""
        with self._lock:
            link = self._links.get(stage)
            if link is None or self._state.why is not None:
                raise ConnectionError(f"{stage.role} stage is not attached ({self._state.why or self.broken})")
        rtt = link.ping(timeout)
        self.counters[stage].ping_rtts.append(rtt)
        return rtt

    # --- called by the links (the poller's drain; without rings, the stream reader threads) ---------------------

    def on_reply(self, stage: Stage, epoch: int, reply: pb.StageReply, stamps: tuple[int, int] | None = None) -> None:
        """A stage's reply (``stamps``: when the stage wrote it and when it was read, from a ring)."""
        self._reply(stage, epoch, reply, stamps, False)

    def _take(self, stage: Stage, epoch: int, reply: pb.StageReply, stamps: tuple[int, int] | None = None) -> None:
        """A reply read by the poller's own drain: what it releases may skip the result queue."""
        self._reply(stage, epoch, reply, stamps, True)

    def _reply(
        self, stage: Stage, epoch: int, reply: pb.StageReply, stamps: tuple[int, int] | None, poller: bool
    ) -> None:
        if stamps is not None:
            self.probe.read(stage, reply.seq, stamps)
        result = result_from_pb(reply)
        with self._lock:
            if epoch != self._state.epoch:
                return  # a reply of a link from before the loss: its op is void
            pending, released = self._order.replied(result)
            if pending is None:
                return  # already failed when the executor gave up
            c = self.counters[stage]
            c.ops += 1
            c.compute_s += reply.compute_s
            c.fence_wait_s += reply.fence_wait_s
            c.errors += bool(reply.error)
            if not reply.error:
                self.watch.on_reply(stage, pending.units, reply.compute_s)
            self._results.release(released, poller)

    def on_broken(self, stage: Stage, epoch: int, why: str) -> None:
        """A link's stream broke or ended: void every outstanding op and start re-attaching the stages."""
        with self._lock:
            state = self._state
            if self._closed or state.broken is not None or epoch != state.epoch:
                return  # closing, given up, or a link already replaced
            start = state.lose(stage, why)
            self._order.lose()
            self._backlog.clear()
            self.probe.lost()
            self.watch.reset()
            self.fences.abort()  # stages waiting on a fence of a void op give up now
            self._results.post(StageLoss(why))
            links, self._links = self._links, {}
        log.warning("stage lost: %s; re-attaching the stages, running requests will be recomputed", why)
        for link in links.values():
            link.cancel()
        if start:
            self._healer.start_recovery()

    # --- called by the healing threads -----------------------------------------------------------------------

    def reattach_plan(self) -> Reattach | None:
        with self._lock:
            state = self._state
            if self._closed or state.broken is not None or state.why is None:
                state.recovering = False
                return None
            deadline = state.lost_at + self.settings.stage_down_limit_s
            return Reattach(state.epoch, dict(self._order.void), set(state.lost), deadline)

    def install(self, epoch: int, board: FenceBoard, links: dict[Stage, StageLink], took_over: bool) -> bool:
        with self._lock:
            state = self._state
            if self._closed or state.broken is not None or state.epoch != epoch:
                return False
            old, self.fences, self._links = self.fences, board, links
            state.healed(took_over)
            for op, contexts, fence_timeout_s in self._backlog:
                link = links[op.stage]
                try:
                    link.send(link.wire(op, contexts, fence_timeout_s))
                except ValueError as exc:  # larger than the stage ring: this op fails
                    self._order.unsent(op.stage, op.seq)
                    self._results.post(StageResult(op.stage, op.seq, 0.0, error=str(exc)))
            self._backlog.clear()
        old.close()
        log.warning(
            "stages re-attached %.2fs after the loss (%d outages healed)", state.recovery_s[-1], state.recoveries
        )
        return True

    def give_up(self, why: str) -> None:
        with self._lock:
            if self._state.broken is not None or self._closed:
                return
            self._state.broken = why
            self._state.recovering = False
            failed = self._order.fail()
            self._backlog.clear()
        log.error("executor broken: %s", why)
        for stage, seqs in failed:
            for seq in seqs:
                self._results.post(StageResult(stage, seq, 0.0, error=why))

    def hang(self, stopped: dict[Stage, bool]) -> tuple[int, Hang] | None:
        with self._lock:
            state = self._state
            if self._closed or state.broken is not None or state.why is not None:
                return None
            hang = self.watch.check(time.monotonic(), {s: self._order.oldest(s) for s in Stage}, stopped)
            return (state.epoch, hang) if hang is not None else None


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
