"""One stage process (prelude | loop | head): loads only its stage's weights and serves ``cdb.v1.Stage``.

Run: ``python -m services.stage_server --role loop --listen 127.0.0.1:50062 --model ouro-tiny``.

Tracing (``OTEL_*`` environment, service ``cdb-<role>``): a ``batch <role>`` span per executed batch, linked to
the requests it served (``services.telemetry.StageTracer``); off by default, and then not a call per batch.

Lifecycle: load weights -> listen (loopback or a Unix socket only) -> health SERVING. ``Configure`` attaches the
bank and fence board the scheduler created and builds a ``StageWorker`` (fresh KV pools). ``Run`` is the
persistent batch stream, served by three threads so that the stage never waits for the network:

    gRPC recv --reader--> inbox --executor: fences, compute, complete(seq)--> outbox --writer--> gRPC send

The executor thread runs batches back to back in ``seq`` order; it marks completion on the fence board BEFORE
the reply is sent, so a stage waiting on this one starts without a round trip through the scheduler. A batch
that fails (an exception, a fence timeout) gets a reply with ``error``; the stage keeps serving. Network bytes are
only ever parsed as protobuf.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.setup import torch_dtype
from cdb_engine.stage_worker import StageWorker
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model
from cdb_scheduler.plan import Stage, StageOp, StageResult
from services import telemetry
from services.bank import SharedBank
from services.convert import bank_spec_from_pb, op_from_pb, result_to_pb, role_from_pb, role_to_pb
from services.fences import FenceAborted, FenceBoard, FenceTimeout
from services.settings import Settings, load_settings

log = logging.getLogger("cdb.stage")

ROLES = {"prelude": Stage.PRELUDE, "loop": Stage.LOOP, "head": Stage.HEAD}
_END = object()


# The scheduler's channels send keepalive pings to detect a frozen stage, also while a stream carries no data;
# by default a server answers such pings with GOAWAY "too many pings", which would break an idle Run stream.
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def require_loopback(listen: str) -> str:
    """Return ``listen`` if it is a Unix socket or a loopback host:port; raise ValueError otherwise."""
    if listen.startswith("unix:"):
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be unix:PATH or HOST:PORT, got {listen!r}")
    host = host.strip("[]")
    if host == "localhost":
        return listen
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"stage servers listen on loopback or unix sockets only, refusing {listen!r}")
    return listen


@dataclass(slots=True)
class _Session:
    """One Configure: the attached shared memory and the worker over it."""

    bank: SharedBank
    tokens: SharedBank
    fences: FenceBoard
    worker: Any  # a StageWorker; None once closed

    def close(self) -> None:
        self.worker = None  # drop the bank views before unmapping
        self.bank.close()
        self.tokens.close()
        self.fences.close()


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
    ) -> None:
        self.worker_factory = worker_factory  # StageWorker's signature; tests pass a fake
        self.observer = observer
        self.stage = stage
        self.model_name = model_name
        self.dtype = dtype
        self.model = model
        self.settings = settings
        self._lock = threading.Lock()
        self._session: _Session | None = None

    def Configure(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> pb.ConfigureResponse:
        role = role_from_pb(request.role) if request.role else None
        for what, want, have in (
            ("role", role, self.stage),
            ("model", request.model, self.model_name),
            ("dtype", request.dtype, self.dtype),
        ):
            if want != have:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: caller wants {want}, stage has {have}")
        cfg = self.model.config
        if request.bank.width != cfg.bank_width:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"bank width {request.bank.width}, model needs {cfg.bank_width}"
            )
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
            bank = SharedBank.attach(bank_spec_from_pb(request.bank))
            tokens = SharedBank.attach(bank_spec_from_pb(request.token_bank))
            fences = FenceBoard.attach(request.fences.name)
            assert bank.tensor is not None and tokens.tensor is not None
            kv = request.kv
            layout = KVLayout(KVPolicy(kv.policy), kv.max_depth, kv.shared_after)
            worker = self.worker_factory(
                self.model, self.stage, bank.tensor, layout, kv.num_blocks, kv.block_size, tokens.tensor.view(-1)
            )
            self._session = _Session(bank, tokens, fences, worker)
        log.info("%s configured: %s bank, kv %s x %d", self.stage.name, bank.spec.kind, kv.policy, kv.num_blocks)
        return pb.ConfigureResponse(
            role=role_to_pb(self.stage),
            model=self.model_name,
            architecture=cfg.arch,
            bank_width=cfg.bank_width,
            device=str(self.model.device),
        )

    def Run(self, request_iterator: Iterator[pb.StageBatch], context: grpc.ServicerContext) -> Iterator[pb.StageReply]:
        session = self._session
        if session is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stage not configured: call Configure first")
        assert session is not None
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stop = threading.Event()

        def on_done() -> None:
            stop.set()
            inbox.put(_END)

        context.add_callback(on_done)

        def read() -> None:
            try:
                for msg in request_iterator:
                    inbox.put(msg)
            except grpc.RpcError:
                pass  # the caller went away; the callback stops the executor
            inbox.put(_END)

        def execute() -> None:
            while not stop.is_set() and (msg := inbox.get()) is not _END:
                if self._session is not session:
                    outbox.put(grpc.StatusCode.ABORTED)
                    return
                outbox.put(self._execute(session, msg))
            outbox.put(_END)

        for target, name in ((read, "reader"), (execute, "executor")):
            threading.Thread(target=target, name=f"cdb-{self.stage.name.lower()}-{name}", daemon=True).start()
        while (reply := outbox.get()) is not _END:
            if isinstance(reply, grpc.StatusCode):
                context.abort(reply, "stage was reconfigured by another caller")
            yield reply

    def _execute(self, session: _Session, msg: pb.StageBatch) -> pb.StageReply:
        """Wait for the batch's fences, run it, publish completion; never raises."""
        if msg.WhichOneof("work") == "ping":
            return pb.StageReply(seq=msg.seq, stage=role_to_pb(self.stage), pong=True)
        fence_wait = 0.0
        observer, op, start_ns = self.observer, None, 0
        try:
            op = op_from_pb(msg)
            if op.stage is not self.stage:
                raise ValueError(f"{op.stage.name} batch sent to the {self.stage.name} stage")
            if observer is not None:
                observer.update(msg.trace_contexts, op.released)
            fence_wait = session.fences.wait(op.fences, self.settings.fence_timeout_s, self.settings.fence_spin_s)
            start, start_ns = time.perf_counter(), time.time_ns()
            result = session.worker.execute(op)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)  # fence = host-side "done"; see services/fences.py
            result = dataclasses.replace(result, compute_s=time.perf_counter() - start)
        except (FenceTimeout, FenceAborted) as exc:
            result = StageResult(self.stage, msg.seq, 0.0, error=f"{self.stage.name} stage: {exc}")
        except Exception as exc:  # the op fails, the scheduler fails its requests, the stage keeps serving
            log.error("%s batch %d failed:\n%s", self.stage.name, msg.seq, traceback.format_exc())
            error = f"{self.stage.name} stage: {type(exc).__name__}: {exc}"
            result = StageResult(self.stage, msg.seq, 0.0, error=error)
        if observer is not None and op is not None and op.stage is self.stage:
            end_ns = time.time_ns()
            observer.record_op(op, start_ns or end_ns, end_ns, result.compute_s, result.error)
        session.fences.complete(self.stage, msg.seq)
        reply = result_to_pb(result)
        reply.fence_wait_s = fence_wait
        return reply

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None


def build_server(service: StageService, listen: str, max_workers: int = 8) -> tuple[grpc.Server, int]:
    """A sync gRPC server with the stage, health and reflection services; returns (server, bound port)."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cdb-stage-rpc")
    server = grpc.server(pool, options=SERVER_OPTIONS)
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Stage"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(require_loopback(listen))
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    for name in ("", names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def bound_address(listen: str, port: int) -> str:
    """The address clients use: ``listen`` with a port-0 request replaced by the bound port."""
    if listen.startswith("unix:"):
        return listen
    host = listen.rpartition(":")[0]
    return f"{host}:{port}"


def run_stage(role: str, model: str, listen: str, *, dtype: str = "float32", device: str = "cpu",
              ready_file: str | None = None, settings: Settings | None = None) -> None:  # fmt: skip
    """Load ``role``'s weights of ``model``, serve until SIGTERM/SIGINT. Writes the bound address to
    ``ready_file`` (atomically) once serving."""
    from services.launcher import write_ready_file

    settings = settings or load_settings()
    stage = ROLES[role]
    require_loopback(listen)
    telemetry.init_tracing(f"cdb-{role}")
    try:
        torch.set_num_threads(settings.stage_threads)
        lm = load_model(model, dtype=torch_dtype(dtype), device=device, stages={stage})
        observer = telemetry.StageTracer(role) if telemetry.enabled() else None  # off: not even a call per batch
        service = StageService(stage, model, dtype, lm, settings, observer=observer)
        server, port = build_server(service, listen)
        address = bound_address(listen, port)
        log.info("%s stage of %s serving on %s", role, model, address)
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        if ready_file:
            write_ready_file(ready_file, address)
        done.wait()
        server.stop(grace=1.0).wait()
        service.close()
    finally:
        telemetry.shutdown_tracing()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve one stage of a looped LM (cdb.v1.Stage).")
    parser.add_argument("--role", required=True, choices=sorted(ROLES))
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT (port 0: any)")
    parser.add_argument("--model", default="ouro-tiny", help="preset name or checkpoint folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    try:
        run_stage(args.role, args.model, args.listen, dtype=args.dtype, device=args.device,
                  ready_file=args.ready_file)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
