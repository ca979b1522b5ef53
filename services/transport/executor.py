"""``Executor`` (``cdb_scheduler.plan``) over gRPC: one persistent ``Run`` stream per stage server.

The executor owns the shared memory: it creates the hidden-state bank and the fence board, ``Configure``s each
stage to attach them, then opens the three streams. ``submit`` converts an op to a ``StageBatch`` and queues it
on its stage's stream without waiting (so several batches are in flight per stage); one reader thread per stream
turns replies into ``StageResult``s on a single result queue that ``poll`` reads, in causal order (a result never
precedes the results of the ops it was fenced on; per stage, ``seq`` order).

Failure contract (never hang): when a stream breaks or ends (stage process killed, connection lost, keepalive
timeout on a frozen stage), the executor becomes ``broken``: the fence board is aborted (stages waiting on a fence
give up at once), every outstanding op of every stage gets a ``StageResult`` with ``error`` (exactly once, in
``seq`` order per stage), and every later ``submit`` is answered with an error result at once. ``broken`` (the
reason) is what the service's health check reads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Fence, Stage, StageOp, StageResult
from services.settings import Settings, load_settings
from services.transport.bank import SharedBank
from services.transport.convert import bank_spec_to_pb, op_to_pb, result_from_pb, role_to_pb
from services.transport.fences import FenceBoard
from services.transport.links import StageLink, channel_options

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

    def __init__(
        self,
        setup: StageSetup,
        stage_addrs: Mapping[Stage, str],
        settings: Settings | None = None,
        observer: OpObserver | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.observer = observer
        self._sent: dict[tuple[Stage, int], tuple[StageOp, int]] = {}  # with an observer: op, sent at (ns)
        self.setup = setup
        self.counters = {stage: StageCounters() for stage in Stage}
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._results: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outstanding: dict[Stage, dict[int, tuple[Fence, ...]]] = {stage: {} for stage in Stage}
        self._held: dict[Stage, deque[tuple[StageResult, tuple[Fence, ...]]]] = {stage: deque() for stage in Stage}
        self._delivered = [-1] * len(Stage)  # seq of the last result delivered, per stage
        self._pongs: dict[int, threading.Event] = {}
        self._closed = False
        self._links: dict[Stage, StageLink] = {}
        self.channels: dict[Stage, grpc.Channel] = {}
        bank_device = setup.device if setup.device.startswith("cuda") else "cpu"
        self.bank = SharedBank.create(setup.bank_rows, setup.bank_width, setup.dtype, bank_device)
        self.tokens = SharedBank.create(setup.bank_rows, 1, "int64", bank_device)
        self.fences = FenceBoard.create()
        try:
            for stage in Stage:
                self.channels[stage] = self._connect(stage, stage_addrs[stage])
            for stage in Stage:
                self._configure(stage)
            for stage in Stage:
                self._links[stage] = StageLink(stage, self.channels[stage], self)
        except BaseException:
            self.close()
            raise

    def _connect(self, stage: Stage, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address, options=channel_options(self.settings))
        try:
            grpc.channel_ready_future(channel).result(timeout=self.settings.stage_connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ConnectionError(f"{stage.role} stage at {address} not reachable") from None
        return channel

    def _configure(self, stage: Stage) -> None:
        s = self.setup
        request = pb.ConfigureRequest(
            role=role_to_pb(stage),
            model=s.model,
            dtype=s.dtype,
            bank=bank_spec_to_pb(self.bank.spec),
            token_bank=bank_spec_to_pb(self.tokens.spec),
            fences=pb.FenceBoardSpec(name=self.fences.name),
            kv=pb.KVSpec(
                policy=s.kv_policy,
                max_depth=s.max_depth,
                shared_after=s.kv_shared_after,
                num_blocks=s.num_kv_blocks,
                block_size=s.kv_block_size,
            ),
        )
        stub = stage_pb2_grpc.StageStub(self.channels[stage])
        stub.Configure(request, timeout=self.settings.stage_connect_timeout_s, wait_for_ready=True)

    # --- Executor protocol -----------------------------------------------------------------------------------

    def submit(self, op: StageOp) -> None:
        """Queue ``op`` on its stage's stream; never blocks on compute or the network."""
        with self._lock:
            broken = self.broken
            if broken is None:
                self._outstanding[op.stage][op.seq] = op.fences
        if broken is not None:
            self._results.put(StageResult(op.stage, op.seq, 0.0, error=broken))
            return
        contexts = None
        if self.observer is not None:
            contexts = self.observer.contexts_for_op(op)
            self._sent[(op.stage, op.seq)] = (op, time.time_ns())
        self._links[op.stage].send(op_to_pb(op, trace_contexts=contexts))

    def poll(self, timeout: float | None) -> StageResult | None:
        try:
            item = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        if not isinstance(item, StageResult):
            return None
        if self.observer is not None and (sent := self._sent.pop((item.stage, item.seq), None)) is not None:
            self.observer.on_op_done(sent[0], item, sent[1], time.time_ns())
        return item

    def wake(self) -> None:
        self._results.put(_WAKE)

    def close(self) -> None:
        """End the streams, close the channels, free the shared memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for link in self._links.values():
            link.close()
        for channel in self.channels.values():
            channel.close()
        self.fences.close()
        self.bank.close()
        self.tokens.close()

    # --- diagnostics -----------------------------------------------------------------------------------------

    def ping(self, stage: Stage, timeout: float = 5.0) -> float:
        """Round trip of an empty batch through ``stage``'s stream (queued behind its pending batches)."""
        token = -(time.perf_counter_ns() & 0x3FFFFFFFFFFFFFFF) - 1  # negative: never a real op seq
        done = threading.Event()
        with self._lock:
            self._pongs[token] = done
        start = time.perf_counter()
        self._links[stage].send(pb.StageBatch(seq=token, ping=pb.Ping()))
        if not done.wait(timeout):
            raise TimeoutError(f"{stage.role} stage did not answer a ping in {timeout}s")
        rtt = time.perf_counter() - start
        self.counters[stage].ping_rtts.append(rtt)
        return rtt

    # --- called by the link threads --------------------------------------------------------------------------

    def on_reply(self, stage: Stage, reply: pb.StageReply) -> None:
        if reply.pong:
            with self._lock:
                event = self._pongs.pop(reply.seq, None)
            if event is not None:
                event.set()
            return
        result = result_from_pb(reply)
        with self._lock:
            fences = self._outstanding[stage].pop(reply.seq, None)
            if fences is None:
                return  # already failed when the executor broke
            c = self.counters[stage]
            c.ops += 1
            c.compute_s += reply.compute_s
            c.fence_wait_s += reply.fence_wait_s
            c.errors += bool(reply.error)
            self._held[stage].append((result, fences))
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
                    self._results.put(result)
                    progress = True

    def on_broken(self, why: str) -> None:
        with self._lock:
            if self._closed or self.broken is not None:
                return
            self.broken = why
            failed = [(stage, sorted(pending)) for stage, pending in self._outstanding.items()]
            for pending in self._outstanding.values():
                pending.clear()
            for held in self._held.values():  # completed, held for order: deliver before the failures
                while held:
                    self._results.put(held.popleft()[0])
        log.error("executor broken: %s", why)
        self.fences.abort()
        for stage, seqs in failed:
            for seq in seqs:
                self._results.put(StageResult(stage, seq, 0.0, error=why))
        for link in self._links.values():
            link.send_end()


class GrpcExecutorFactory:
    """``executor_factory`` for ``Engine``: builds a :class:`GrpcExecutor` and remembers it for health checks."""

    def __init__(
        self, stage_addrs: Mapping[Stage, str], settings: Settings | None = None, observer: OpObserver | None = None
    ) -> None:
        self.observer = observer
        missing = set(Stage) - set(stage_addrs)
        if missing:
            raise ValueError(f"missing stage addresses: {sorted(s.role for s in missing)}")
        self.stage_addrs = dict(stage_addrs)
        self.settings = settings or load_settings()
        self.executor: GrpcExecutor | None = None

    def __call__(self, setup: StageSetup) -> GrpcExecutor:
        self.executor = GrpcExecutor(setup, self.stage_addrs, self.settings, self.observer)
        return self.executor
