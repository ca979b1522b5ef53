"""The scheduler process: the engine over the stage servers, the public gRPC server, metrics, drain.

- ``run_scheduler``: build the engine (``GrpcExecutorFactory`` over the stages, or in-process), metrics and
  tracing, then ``serve`` until signalled.
- ``serve``: ``cdb.v1.Generation`` + ``grpc.health.v1`` + reflection; SIGTERM/SIGINT: NOT_SERVING, new work
  refused (UNAVAILABLE), in-flight streams finish up to the drain timeout, then the rest end with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_engine.errors import EngineStopped
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Executor, Stage
from services import telemetry
from services.net import bound_address, write_ready_file
from services.scheduler.handlers import GenerationService
from services.scheduler.readiness import SERVICE_NAME, Readiness
from services.settings import Settings, load_settings
from services.telemetry.metrics import Metrics, MetricsServer, serve_metrics
from services.telemetry.recorder import EngineGauges, ObservedExecutor, OpRecorder
from services.transport.executor import GrpcExecutorFactory

log = logging.getLogger("cdb.scheduler")


async def serve(
    engine: Engine,
    factory: GrpcExecutorFactory | None,
    stage_addrs: Mapping[Stage, str] | None,
    listen: str,
    settings: Settings,
    ready_file: str | None = None,
    *,
    metrics: Metrics | None = None,
    traces: telemetry.RequestTraces | None = None,
) -> None:
    """Serve the started ``engine`` on ``listen`` until SIGTERM/SIGINT, then drain and return."""
    service = GenerationService(engine, factory, settings, metrics, traces)
    readiness = Readiness(service, stage_addrs, settings)
    server = grpc.aio.server(maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(readiness.health, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    watcher = asyncio.create_task(readiness.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await readiness.first_ready.wait()
    address = bound_address(listen, port)
    log.info("cdb.v1.Generation (%s) serving on %s", service.deployment, address)
    if ready_file:
        write_ready_file(ready_file, address)
    await stop.wait()
    log.info("draining: up to %.1fs for %d in-flight requests", settings.drain_timeout_s, len(service.live))
    service.draining = True
    watcher.cancel()
    await readiness.health.enter_graceful_shutdown()
    try:
        await asyncio.wait_for(service.idle.wait(), settings.drain_timeout_s)
    except TimeoutError:
        service.cut = True
        service.abort_all()
        try:
            await asyncio.wait_for(service.idle.wait(), 5.0)
        except TimeoutError:
            log.warning("%d requests did not end after abort", len(service.live))
    await server.stop(grace=1.0)
    await readiness.close()


def run_scheduler(
    config: EngineConfig,
    listen: str,
    stage_addrs: Mapping[Stage, str] | None,
    *,
    ready_file: str | None = None,
    settings: Settings | None = None,
    metrics_listen: str | None = None,
) -> None:
    """Start the engine (connecting the stages; ``stage_addrs=None``: in-process) and serve until signalled.

    Tracing follows the ``OTEL_*`` environment (service ``cdb-scheduler``); metrics are always kept and served
    on ``metrics_listen`` (default: ``settings.metrics_addr``, i.e. ``CDB_METRICS_ADDR``; empty: no endpoint)."""
    settings = settings or load_settings()
    telemetry.init_tracing("cdb-scheduler")
    metrics_server: MetricsServer | None = None
    engine: Engine | None = None
    try:
        traces = telemetry.RequestTraces() if telemetry.enabled() else None
        factory = GrpcExecutorFactory(stage_addrs, settings) if stage_addrs is not None else None
        observer: OpRecorder | None = None

        def in_process(setup: StageSetup) -> Executor:
            from cdb_engine.inprocess import InProcessExecutor

            inner = InProcessExecutor(setup, num_threads=config.num_threads)
            return ObservedExecutor(inner, observer) if observer is not None else inner

        engine = Engine(config, executor_factory=factory or in_process)
        metrics = Metrics(config.model, engine.limits.max_depth)
        metrics.add_collector(EngineGauges(engine))
        observer = OpRecorder(metrics, config.max_num_seqs, traces)
        if factory is not None:
            factory.observer = observer
        engine.start()
        address = settings.metrics_addr if metrics_listen is None else metrics_listen
        if address:
            metrics_server = serve_metrics(metrics, address)
            log.info("Prometheus metrics on http://%s:%d/metrics", metrics_server.host, metrics_server.port)
        runner_kw: dict[str, Any] = {}
        if settings.uvloop:
            try:
                import uvloop

                runner_kw["loop_factory"] = uvloop.new_event_loop
            except ImportError:
                pass
        with asyncio.Runner(**runner_kw) as runner:
            runner.run(
                serve(engine, factory, stage_addrs, listen, settings, ready_file, metrics=metrics, traces=traces)
            )
    finally:
        if engine is not None:
            with contextlib.suppress(EngineStopped):
                engine.shutdown(drain_timeout=0.0)
        if metrics_server is not None:
            metrics_server.close()
        telemetry.shutdown_tracing()
