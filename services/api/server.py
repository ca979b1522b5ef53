"""The scheduler process: the engine over the stage servers, the public gRPC server, metrics, drain.

- ``run_scheduler``: build the engine (``GrpcExecutorFactory`` over the stages, or in-process), metrics and
  tracing, then ``serve`` until signalled.
- ``serve``: ``cdb.v1.Generation`` + ``grpc.health.v1`` + reflection; SIGTERM/SIGINT: NOT_SERVING, new work
  refused (UNAVAILABLE), in-flight streams finish up to the drain timeout, then the rest end with UNAVAILABLE.
- ``build_server`` / ``listen_on``: the public server, fit to expose (docs/operations.md, "Exposing the public port"):
  - TLS when ``CDB_TLS_CERT`` + ``CDB_TLS_KEY`` are set; with ``CDB_TLS_CLIENT_CA`` clients must present a
    certificate signed by that CA (mTLS).
  - API keys (``CDB_API_KEYS``, ``CDB_API_KEYS_FILE``): every call but ``grpc.health.v1`` needs
    ``authorization: Bearer KEY``, else UNAUTHENTICATED before any handler runs (``security.ApiKeyInterceptor``).
  - Request ids and Abort are scoped to the caller (its API key, else its client certificate, else one shared
    anonymous scope; ``handlers``).
  - An undecodable request (e.g. invalid UTF-8 in a string field) gets INVALID_ARGUMENT naming the field
    (``decoding``), not UNKNOWN and a logged traceback.
  - HTTP/2 limits: at most ``CDB_MAX_STREAMS_PER_CONNECTION`` concurrent streams per connection (more wait in the
    client), client keepalive pings no more often than every ``CDB_KEEPALIVE_MIN_TIME_S`` and none on a
    connection without calls (else GOAWAY ``too_many_pings`` after ``_MAX_PING_STRIKES`` bad pings), and no
    ``SO_REUSEPORT``: a busy port is a ``ListenError`` (``cannot listen on ADDR: address already in use``), never
    a silently shared one.
  - Fair shares (``shares``): live requests and open streams per caller (``CDB_MAX_REQUESTS_PER_CALLER``,
    ``CDB_MAX_STREAMS_PER_CALLER``; a caller: its API key, else its client certificate, else its host), the server's
    calls but health checks (``CDB_MAX_CONCURRENT_RPCS``) and its health Watch streams
    (``CDB_MAX_HEALTH_WATCHES``) bounded apart, each RESOURCE_EXHAUSTED beyond, naming the setting; a stream whose
    client takes no message for ``CDB_STREAM_STALL_TIMEOUT_S`` is cut (DEADLINE_EXCEEDED, its request aborted).
  - Connections: the TLS and HTTP/2 handshake within ``CDB_HEADER_READ_TIMEOUT_S``, closed (GOAWAY) after
    ``CDB_IDLE_CONNECTION_TIMEOUT_S`` without calls, pinged every ``_KEEPALIVE_S`` (60 s) while they have calls and
    closed when a ping goes unanswered for ``_KEEPALIVE_TIMEOUT_S`` (20 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from cdb_engine.client import InProcessClient
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_engine.errors import EngineStopped
from cdb_engine.isolation import isolating
from cdb_engine.limits import describe
from cdb_engine.setup import StageSetup
from cdb_scheduler import _native as native
from cdb_scheduler.plan import Executor, Stage
from services import heap, telemetry
from services.api.door import FrontDoor
from services.api.fatal import ExitOnEngineFailure
from services.api.handlers import GenerationService, add_generation_service
from services.api.info import EngineInfo
from services.api.readiness import SERVICE_NAME, Readiness
from services.api.security import PortSecurity
from services.frontlink.server import LinkServer
from services.net import NO_REUSEPORT, bound_address, is_host_port, listen_on, require_loopback, write_ready_file
from services.reflection import enable_reflection
from services.settings import Settings, load_settings, served_names
from services.stage_secret import load_link_secret
from services.telemetry.logs import ThroughputLog
from services.telemetry.metrics import Metrics, MetricsServer, serve_metrics
from services.telemetry.recorder import EngineGauges, ObservedExecutor, OpRecorder
from services.transport.executor import GrpcExecutorFactory

log = logging.getLogger("cdb.scheduler")

Companion = Callable[[FrontDoor, Settings], Coroutine[Any, Any, None]]


@dataclasses.dataclass(frozen=True, slots=True)
class FrontEnd:
    """What a serving process serves the public port with: its service (over its door) and readiness, and how it
    shares the port with other front-end processes (``services.frontend``)."""

    service: GenerationService
    readiness: Readiness
    reuse_port: bool = False  # several front ends listen on the port (SO_REUSEPORT)
    join: bool = False  # another front end serves the port already: no probe bind first


_MAX_CONNECTION_AGE_S, _MAX_CONNECTION_AGE_GRACE_S = 300, 3600
_MAX_PING_STRIKES = 2  # pings too soon tolerated before GOAWAY (gRPC's default, set so that it is documented)
_KEEPALIVE_S, _KEEPALIVE_TIMEOUT_S = 60, 20  # the server pings a connection with calls; unanswered: it is closed


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    """gRPC core options of the public server: the HTTP/2 limits and connection timeouts of the module docstring."""
    return [
        *NO_REUSEPORT,
        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", round(settings.keepalive_min_time_s * 1000)),
        ("grpc.http2.max_ping_strikes", _MAX_PING_STRIKES),
        ("grpc.keepalive_permit_without_calls", 0),
        # a vanished client (no FIN) is found within a ping and its calls end (their requests aborted, shares freed)
        ("grpc.keepalive_time_ms", _KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.http2.max_pings_without_data", 0),  # also on a stream that sends nothing for long (a health Watch)
        ("grpc.max_connection_idle_ms", round(settings.idle_connection_timeout_s * 1000)),
        ("grpc.server_handshake_timeout_ms", round(settings.header_read_timeout_s * 1000)),
        # Clients balancing over a headless Service re-resolve when a connection ends: a GOAWAY after 5 minutes makes
        # them find scaled-up replicas. Calls already open on the old connection run on for up to an hour.
        ("grpc.max_connection_age_ms", _MAX_CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", _MAX_CONNECTION_AGE_GRACE_S * 1000),
    ]


def build_server(
    service: GenerationService,
    readiness: Readiness,
    settings: Settings,
    security: PortSecurity,
    *,
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """The public server (no port yet): Generation, health and reflection behind the API-key check.
    ``reuse_port``: several front-end processes share the port (``CDB_FRONTENDS``)."""
    # the call caps are the service's own (``shares.CallCaps``), not grpc's maximum_concurrent_rpcs, which would count
    # health Watch streams against the generation calls; after the API-key check: a refused call counts for nothing
    options = server_options(settings)
    if reuse_port:
        options = [o for o in options if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 1)]
    server = grpc.aio.server(interceptors=[*security.interceptors(), service.caps], options=options)
    add_generation_service(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(readiness.health, server)
    enable_reflection(server, (SERVICE_NAME, health.SERVICE_NAME))
    return server


def _warn_if_open(listen: str, security: PortSecurity) -> None:
    if security.credentials is not None or security.auth.keys_on or not is_host_port(listen):
        return
    try:
        require_loopback(listen)
    except ValueError:
        log.warning("%s accepts plaintext calls without an API key from any host that can reach it", listen)


async def serve(
    front: FrontEnd,
    listen: str,
    settings: Settings,
    ready_file: str | None = None,
    *,
    companion: Companion | None = None,
    link: LinkServer | None = None,
) -> None:
    """Serve ``front`` on ``listen`` until SIGTERM/SIGINT, then drain and return. ``companion``: a second protocol
    over the same door (the HTTP API), run beside the gRPC server until the drain is over; if it fails (e.g. its
    port), the server stops and the failure is raised. ``link``: the front-end link to serve too (``CDB_FRONTENDS``).

    Raises ``SecurityConfigError`` (TLS files, API keys) or ``ListenError`` (the port) before serving."""
    security = PortSecurity.from_settings(settings)
    service, readiness, door = front.service, front.readiness, front.service.door
    server = build_server(service, readiness, settings, security, reuse_port=front.reuse_port)
    port = listen_on(server, listen, security.credentials, check=not front.join)
    _warn_if_open(listen, security)
    if link is not None:
        link.start()
    await server.start()
    watcher = asyncio.create_task(readiness.run())
    stop = asyncio.Event()
    readiness.on_fatal = stop.set  # the stages were given up on: stop, then exit 1 (below)
    extra = asyncio.create_task(companion(door, settings)) if companion is not None else None
    if extra is not None:
        extra.add_done_callback(lambda _: stop.set())  # it only ends on its own by failing
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await readiness.first_ready.wait()
    address = bound_address(listen, port)
    log.info("cdb.v1.Generation (%s) serving on %s (%s)", service.deployment, address, security.describe())
    log.info("%s: %s", door.prep.config.model, describe(door.prep.limits))
    log.info("scheduler: %s", native.describe())
    if ready_file:
        write_ready_file(ready_file, address)
    await stop.wait()
    await _drain(door, readiness, watcher, settings, link)
    if extra is not None:
        extra.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await extra  # re-raises a failure of the companion
    await server.stop(grace=1.0)
    await readiness.close()
    if link is not None:
        link.close()
    if readiness.fatal is not None:
        raise SystemExit(1)  # an orchestrator restarts the group (the reason is logged by the readiness check)


async def _drain(
    door: FrontDoor, readiness: Readiness, watcher: asyncio.Task[None], settings: Settings, link: LinkServer | None
) -> None:
    """Refuse new work (the readiness check stops: NOT_SERVING), let in-flight requests finish up to the drain
    timeout, then cut the rest."""
    log.info("draining: up to %.1fs for %d in-flight requests", settings.drain_timeout_s, len(door.live))
    door.draining = True
    watcher.cancel()
    await readiness.health.enter_graceful_shutdown()
    try:
        await asyncio.wait_for(_drained(door, link), settings.drain_timeout_s)
    except TimeoutError:
        door.cut = True
        door.abort_all()
        try:
            await asyncio.wait_for(door.idle.wait(), 5.0)
        except TimeoutError:
            log.warning("%d requests did not end after abort", len(door.live))


def event_loop_runner(settings: Settings) -> asyncio.Runner:
    """The ``asyncio.Runner`` a serving process runs its event loop in: uvloop's loop when ``CDB_UVLOOP`` is on
    and uvloop is installed."""
    if settings.uvloop:
        try:
            import uvloop

            return asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            pass
    return asyncio.Runner()


async def _drained(door: FrontDoor, link_server: LinkServer | None) -> None:
    """Until no request of this server is live, nor of its front ends (they drain theirs first: the launcher
    stops them before the scheduler; this covers a scheduler stopped on its own)."""
    await door.idle.wait()
    while link_server is not None and link_server.live:
        await asyncio.sleep(0.05)  # the front ends' requests end on the engine thread: polled, not signalled


def run_scheduler(
    config: EngineConfig,
    listen: str,
    stage_addrs: Mapping[Stage, str] | None,
    *,
    ready_file: str | None = None,
    settings: Settings | None = None,
    companion: Companion | None = None,
    standby_addrs: Mapping[Stage, str] | None = None,
    link: str | None = None,
) -> None:
    """Start the engine (connecting the stages; ``stage_addrs=None``: in-process; ``standby_addrs``: a warm standby
    stage process per role, which takes over when its role's stage is lost) and serve until signalled
    (``companion``: see ``serve``).

    Tracing follows the ``OTEL_*`` environment (service ``cdb-scheduler``); metrics are always kept and served
    on ``settings.metrics_addr`` (``CDB_METRICS_ADDR``, ``--metrics-listen``; empty: no endpoint); the
    throughput line is logged every ``settings.throughput_log_interval_s``."""
    settings = settings or load_settings()
    telemetry.init_tracing("cdb-scheduler")
    metrics_server: MetricsServer | None = None
    engine: Engine | None = None
    throughput_log: ThroughputLog | None = None
    try:
        traces = telemetry.RequestTraces() if telemetry.enabled() else None
        factory = GrpcExecutorFactory(stage_addrs, settings, None, standby_addrs) if stage_addrs is not None else None
        observer: OpRecorder | None = None

        def in_process(setup: StageSetup) -> Executor:
            from cdb_engine.inprocess import in_process_executor

            inner = in_process_executor(config, setup, engine_model_config)
            return ObservedExecutor(inner, observer) if observer is not None else inner

        # An op that cannot be built or sent fails its own requests; a loop that cannot go on ends the process (exit 1).
        engine_failure = ExitOnEngineFailure(settings.drain_timeout_s + 10.0)
        engine = Engine(config, executor_factory=isolating(factory or in_process), on_fatal=engine_failure)
        engine_model_config = engine.model_config
        served = served_names(settings.served_model_name) or [config.model]  # the name the APIs report
        metrics = Metrics.from_settings(served[0], engine.limits.max_depth, settings)
        if config.synthetic_cost:
            metrics.set_synthetic(config.synthetic_cost)
            log.warning("SYNTHETIC stages (%s): they model device time; tokens mean nothing", config.synthetic_cost)
        metrics.add_collector(EngineGauges(engine, factory))
        observer = OpRecorder(metrics, config.max_num_seqs, traces)
        if factory is not None:
            factory.observer = observer
        engine.start()
        heap.settle()  # what startup loaded stays: no collection scans it while the engine plans
        throughput_log = ThroughputLog(metrics, settings.throughput_log_interval_s).start()
        if settings.metrics_addr:
            metrics_server = serve_metrics(metrics, settings.metrics_addr)
            log.info("Prometheus metrics on http://%s:%d/metrics", metrics_server.host, metrics_server.port)
        door = FrontDoor(
            InProcessClient(engine),
            settings,
            metrics,
            traces,
            auth=PortSecurity.from_settings(settings).auth,
            factory=factory,
        )
        info = EngineInfo(engine, door)
        front = FrontEnd(GenerationService(door, info, info.deployment), Readiness(door, stage_addrs, settings))
        link_server = LinkServer(link, engine, door, info.reply, load_link_secret(settings)) if link else None
        with event_loop_runner(settings) as runner:
            runner.run(serve(front, listen, settings, ready_file, companion=companion, link=link_server))
        if engine_failure.error is not None:
            raise SystemExit(1)  # the engine loop failed (logged): a supervisor restarts the process
    finally:
        if throughput_log is not None:
            throughput_log.close()
        if engine is not None:
            with contextlib.suppress(EngineStopped):
                engine.shutdown(drain_timeout=0.0)
        if metrics_server is not None:
            metrics_server.close()
        telemetry.shutdown_tracing()
