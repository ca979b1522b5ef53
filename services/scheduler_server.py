"""The public scheduler service: ``cdb.v1.Generation`` over an ``Engine`` driving the stage servers.

Run: ``python -m services.scheduler_server --listen 0.0.0.0:50051 --stage prelude=127.0.0.1:50061
--stage loop=127.0.0.1:50062 --stage head=127.0.0.1:50063 --model ouro-tiny`` (``--in-process``: no stages).

- Handlers: protobuf -> engine -> protobuf; every exception goes through ``public_api.status_for``.
- Client cancel, disconnect or deadline cancels the handler, which aborts the request (``GenerationService._serve``).
- Observability: one SERVER span per request (``services.telemetry``, configured by ``OTEL_*``; off by default)
  and Prometheus metrics on ``--metrics-listen`` (default ``CDB_METRICS_ADDR``, via ``services.settings``).
- ``grpc.health.v1``: SERVING only while the engine is healthy and either idle or making progress, the executor
  is not broken and every stage answers its own health check. Reflection is on.
- SIGTERM/SIGINT: NOT_SERVING, new work refused (UNAVAILABLE), in-flight streams finish up to the drain timeout,
  then the rest end with UNAVAILABLE and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import EngineStopped, InvalidRequest
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Executor, Stage
from services import public_api, telemetry
from services.grpc_executor import GrpcExecutorFactory
from services.launcher import add_engine_args, engine_config_from_args, parse_stage_addrs, write_ready_file
from services.metrics import Metrics, MetricsServer, serve_metrics
from services.observability import EngineGauges, ObservedExecutor, OpRecorder
from services.public_api import ServerDraining, StageFailed
from services.settings import Settings, is_host_port, load_settings

log = logging.getLogger("cdb.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def mapped_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn exceptions of a (streaming) handler into gRPC statuses via ``public_api.status_for``."""

    async def fail(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        code, message = public_api.status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", fn.__name__)
        await context.abort(code, message)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await fail(exc, context)

        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await fail(exc, context)

    return unary


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """``cdb.v1.Generation`` over one started engine, with each request's metrics and trace."""

    def __init__(
        self,
        engine: Engine,
        factory: GrpcExecutorFactory | None,
        settings: Settings,
        metrics: Metrics | None = None,
        traces: telemetry.RequestTraces | None = None,
    ) -> None:
        self.engine = engine
        self.factory = factory
        self.settings = settings
        self.metrics = metrics or Metrics(engine.config.model, engine.limits.max_depth)
        self.traces = traces  # the executor's observer feeds it; None when tracing is off
        self.deployment = "microservices" if factory is not None else "in_process"
        self.live: dict[str, telemetry.RequestSpan] = {}  # request id -> span, of in-flight Generate* calls
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.not_ready: str | None = "starting"  # the readiness check's last verdict (None: ready)
        self.cut = False  # drain deadline passed: remaining requests end with UNAVAILABLE

    @property
    def broken(self) -> str | None:
        """Why the stage pipeline cannot serve (None: it can)."""
        executor = self.factory.executor if self.factory is not None else None
        return executor.broken if executor is not None else None

    def _admit(self, rid: str, span: telemetry.RequestSpan) -> None:
        if self.draining:
            raise ServerDraining("server is shutting down")
        if self.broken:
            raise StageFailed(self.broken)
        if rid in self.live:
            raise InvalidRequest("request_id", f"{rid!r} is already used by a live request")
        self.live[rid] = span
        self.idle.clear()

    def _release(self, rid: str) -> None:
        self.live.pop(rid, None)
        if not self.live:
            self.idle.set()

    def _check_finish(self, ev: FinishEvent) -> None:
        if ev.finish_reason == "error":
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason == "cancelled" and self.cut:
            raise ServerDraining("server shut down before the request finished")

    def _on_queued(self, span: telemetry.RequestSpan) -> Callable[[int], None]:
        """``Engine.submit``'s hook (engine thread): key the span by the engine's id for the executor's ops."""
        traces = self.traces
        assert traces is not None

        def queued(internal_id: int) -> None:
            traces.register(internal_id, span)
            span.enqueued()

        return queued

    async def _serve(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        """One request: validate, submit, yield its engine events; records its metrics and trace. Raises what
        the caller should map to a status (``_check_finish``). Use with ``contextlib.aclosing``: leaving early
        (client cancel, disconnect, deadline) aborts the request."""
        arrival, start_ns, m = time.perf_counter(), telemetry.now_ns(), self.metrics
        rid = request.request_id or uuid.uuid4().hex
        span = telemetry.NOOP_REQUEST_SPAN
        if telemetry.enabled():
            span = telemetry.start_request_span(
                model=self.engine.config.model,
                max_tokens=public_api.requested_max_tokens(request),
                metadata=context.invocation_metadata(),
                request_id=rid,
                start_ns=start_ns,
            )
        try:
            prompt, params = public_api.request_to_engine(request)
            ids = self.engine.validate(prompt, params)
            span.phase("validate", start_ns, telemetry.now_ns())
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
            self._admit(rid, span)
        except Exception as exc:
            self._reject(span, exc)
            raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent | FinishEvent] = asyncio.Queue()

        def sink(ev: TokenEvent | FinishEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            on_queued = self._on_queued(span) if span.recording else None
            try:
                name = self.engine.submit(ids, params, sink, rid, on_queued=on_queued)
            except Exception as exc:
                self._reject(span, exc)
                raise
            m.observe_admitted(len(ids))
            depths: list[int] = []
            last = 0.0
            finish: FinishEvent | None = None
            try:
                while finish is None:
                    ev = await events.get()
                    if isinstance(ev, TokenEvent):
                        now = time.perf_counter()
                        if last:
                            m.observe_itl(now - last)
                        else:
                            m.observe_ttft(now - arrival)
                        last = now
                        m.observe_token_depth(ev.depth)
                        depths.append(ev.depth)
                    else:
                        finish = ev
                        self._record_finish(span, ev, depths, arrival)
                        self._check_finish(ev)
                    yield ev
            except BaseException as exc:
                if finish is None:  # the caller left (cancel, disconnect, deadline) or the handler failed
                    self.engine.abort(name)
                    self._record_gone(span, exc, context, depths, arrival)
                raise
        finally:
            self._release(rid)

    def _reject(self, span: telemetry.RequestSpan, exc: Exception) -> None:
        code = public_api.status_for(exc)[0].name
        self.metrics.observe_rejected(code)
        span.failed(exc, code)
        span.finish("error", 0)

    def _record_finish(self, span: telemetry.RequestSpan, ev: FinishEvent, depths: list[int], arrival: float) -> None:
        reason = ev.finish_reason
        if ev.queue_s > 0:
            self.metrics.observe_queue_time(ev.queue_s)
        self.metrics.observe_request_end(time.perf_counter() - arrival, reason)
        if span.recording:
            if reason == "error":
                span.failed(ev.error or "the engine failed the request", "UNAVAILABLE")
            elif reason == "cancelled" and self.cut:
                span.cancelled("server shut down before the request finished")
            span.finish(reason, ev.generated_tokens, depths, ev.total_loop_steps)

    def _record_gone(self, span: telemetry.RequestSpan, exc: BaseException, context: grpc.aio.ServicerContext,
                     depths: list[int], arrival: float) -> None:  # fmt: skip
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            remaining = context.time_remaining()
            reason = "cancelled"
            span.cancelled("deadline exceeded" if remaining is not None and remaining <= 0 else "client cancelled")
        else:
            reason = "error"
            span.failed(exc, public_api.status_for(exc)[0].name if isinstance(exc, Exception) else None)
        self.metrics.observe_request_end(time.perf_counter() - arrival, reason)
        span.finish(reason, len(depths), depths)

    @mapped_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with contextlib.aclosing(self._serve(request, context)) as events:
            async for ev in events:
                yield public_api.event_to_pb(ev)

    @mapped_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        out = pb.GenerateResponse()
        async with contextlib.aclosing(self._serve(request, context)) as events:
            async for ev in events:
                out.request_id = ev.request_id
                if isinstance(ev, TokenEvent):
                    out.tokens.append(public_api.token_to_pb(ev))
                    out.text += ev.text
                else:
                    out.text += ev.text
                    out.finish.CopyFrom(public_api.finish_to_pb(ev))
        return out

    @mapped_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = self.engine.abort(request.request_id)
        if found and (span := self.live.get(request.request_id)) is not None:
            span.cancelled("Abort")
        return pb.AbortResponse(found=found)

    @mapped_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        problem = self.broken or self.not_ready
        return public_api.info_to_pb(self.engine, self.deployment, self.settings.max_concurrent_rpcs, problem)

    def abort_all(self) -> None:
        for rid in list(self.live):
            self.engine.abort(rid)


class Readiness:
    """Periodic readiness check feeding ``grpc.health.v1`` (overall "" and ``cdb.v1.Generation``)."""

    def __init__(self, service: GenerationService, stage_addrs: Mapping[Stage, str] | None, settings: Settings):
        self.service = service
        self.settings = settings
        self.health = health.aio.HealthServicer()
        self.reason: str | None = "starting"
        self._channels = {s: grpc.aio.insecure_channel(a) for s, a in (stage_addrs or {}).items()}
        self._busy_since: float | None = None
        self.first_ready = asyncio.Event()

    async def check(self) -> str | None:
        """Why the server is not ready, or None."""
        st = self.service.engine.stats()
        if not st.healthy:
            return st.error or "engine stopped"
        if self.service.broken:
            return self.service.broken
        now = time.monotonic()
        if st.waiting + st.running == 0:
            self._busy_since = None
        else:
            self._busy_since = self._busy_since or now
            since = max(st.last_progress_monotonic, self._busy_since)
            if now - since > self.settings.stall_timeout_s:
                return f"no engine progress for {now - since:.1f}s with {st.waiting + st.running} requests"
        probes = [self._probe(stage, ch) for stage, ch in self._channels.items()]
        failures = [why for why in await asyncio.gather(*probes) if why]
        return "; ".join(failures) or None

    async def _probe(self, stage: Stage, channel: grpc.aio.Channel) -> str | None:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.settings.stage_probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{stage.name.lower()} stage does not answer ({exc.code().name})"
        return None if reply.status == _SERVING else f"{stage.name.lower()} stage not serving"

    async def run(self) -> None:
        """Re-check every ``health_interval_s`` until cancelled; log transitions."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        while True:
            reason = await self.check()
            if reason != self.reason:
                log.info("readiness: %s", "SERVING" if reason is None else f"NOT_SERVING ({reason})")
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, _SERVING if reason is None else _NOT_SERVING)
                self.reason = self.service.not_ready = reason
            if reason is None:
                self.first_ready.set()
            await asyncio.sleep(self.settings.health_interval_s)  # a period, not a synchronisation

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def serve(engine: Engine, factory: GrpcExecutorFactory | None, stage_addrs: Mapping[Stage, str] | None,
                listen: str, settings: Settings, ready_file: str | None = None, *, metrics: Metrics | None = None,
                traces: telemetry.RequestTraces | None = None) -> None:  # fmt: skip
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
    address = listen if listen.startswith("unix:") else f"{listen.rpartition(':')[0]}:{port}"
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


def run_scheduler(config: EngineConfig, listen: str, stage_addrs: Mapping[Stage, str] | None, *,
                  ready_file: str | None = None, settings: Settings | None = None,
                  metrics_listen: str | None = None) -> None:  # fmt: skip
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
            runner.run(serve(engine, factory, stage_addrs, listen, settings, ready_file, metrics=metrics,
                             traces=traces))  # fmt: skip
    finally:
        if engine is not None:
            with contextlib.suppress(EngineStopped):
                engine.shutdown(drain_timeout=0.0)
        if metrics_server is not None:
            metrics_server.close()
        telemetry.shutdown_tracing()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve cdb.v1.Generation over stage servers.")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0: any) or unix:PATH")
    parser.add_argument("--stage", action="append", default=[], metavar="ROLE=ADDR", help="prelude|loop|head")
    parser.add_argument("--in-process", action="store_true", help="run the stages in this process instead")
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: $CDB_METRICS_ADDR; "
                        "unset or empty: no endpoint)")  # fmt: skip
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        stage_addrs = None if args.in_process else parse_stage_addrs(args.stage)
        config = engine_config_from_args(args)
        if args.metrics_listen and not is_host_port(args.metrics_listen):
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}")
    except ValueError as exc:
        parser.error(str(exc))
    run_scheduler(config, args.listen, stage_addrs, ready_file=args.ready_file, metrics_listen=args.metrics_listen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
