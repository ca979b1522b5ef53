"""The public scheduler service: ``cdb.v1.Generation`` over an ``Engine`` driving the stage servers.

Run: ``python -m services.scheduler_server --listen 0.0.0.0:50051 --stage prelude=127.0.0.1:50061
--stage loop=127.0.0.1:50062 --stage head=127.0.0.1:50063 --model ouro-tiny`` (``--in-process``: no stages).

- Handlers: protobuf -> engine -> protobuf; every exception goes through ``public_api.status_for``.
- Client cancel, disconnect or deadline cancels the handler, which aborts the request (``Engine.stream``).
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
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import EngineStopped, InvalidRequest
from cdb_scheduler.plan import Stage
from services import public_api
from services.grpc_executor import GrpcExecutorFactory
from services.launcher import add_engine_args, engine_config_from_args, parse_stage_addrs, write_ready_file
from services.public_api import ServerDraining, StageFailed
from services.settings import Settings, load_settings

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
    """``cdb.v1.Generation`` over one started engine."""

    def __init__(self, engine: Engine, factory: GrpcExecutorFactory | None, settings: Settings) -> None:
        self.engine = engine
        self.factory = factory
        self.settings = settings
        self.deployment = "microservices" if factory is not None else "in_process"
        self.live: set[str] = set()  # request ids of in-flight Generate/GenerateStream calls
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

    def _admit(self, request_id: str) -> str:
        if self.draining:
            raise ServerDraining("server is shutting down")
        if self.broken:
            raise StageFailed(self.broken)
        rid = request_id or uuid.uuid4().hex
        if rid in self.live:
            raise InvalidRequest("request_id", f"{rid!r} is already used by a live request")
        self.live.add(rid)
        self.idle.clear()
        return rid

    def _release(self, rid: str) -> None:
        self.live.discard(rid)
        if not self.live:
            self.idle.set()

    def _check_finish(self, ev: FinishEvent) -> None:
        if ev.finish_reason == "error":
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason == "cancelled" and self.cut:
            raise ServerDraining("server shut down before the request finished")

    @mapped_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        prompt, params = public_api.request_to_engine(request)
        rid = self._admit(request.request_id)
        try:
            async for ev in self.engine.stream(prompt, params, rid):
                if isinstance(ev, FinishEvent):
                    self._check_finish(ev)
                yield public_api.event_to_pb(ev)
        finally:
            self._release(rid)

    @mapped_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        prompt, params = public_api.request_to_engine(request)
        rid = self._admit(request.request_id)
        out = pb.GenerateResponse(request_id=rid)
        try:
            async for ev in self.engine.stream(prompt, params, rid):
                if isinstance(ev, TokenEvent):
                    out.tokens.append(public_api.token_to_pb(ev))
                    out.text += ev.text
                else:
                    self._check_finish(ev)
                    out.text += ev.text
                    out.finish.CopyFrom(public_api.finish_to_pb(ev))
        finally:
            self._release(rid)
        return out

    @mapped_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

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
                listen: str, settings: Settings, ready_file: str | None = None) -> None:  # fmt: skip
    """Serve the started ``engine`` on ``listen`` until SIGTERM/SIGINT, then drain and return."""
    service = GenerationService(engine, factory, settings)
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
                  ready_file: str | None = None, settings: Settings | None = None) -> None:  # fmt: skip
    """Start the engine (connecting the stages; ``stage_addrs=None``: in-process) and serve until signalled."""
    settings = settings or load_settings()
    factory = GrpcExecutorFactory(stage_addrs, settings) if stage_addrs is not None else None
    engine = Engine(config, executor_factory=factory).start()
    try:
        runner_kw: dict[str, Any] = {}
        if settings.uvloop:
            try:
                import uvloop

                runner_kw["loop_factory"] = uvloop.new_event_loop
            except ImportError:
                pass
        with asyncio.Runner(**runner_kw) as runner:
            runner.run(serve(engine, factory, stage_addrs, listen, settings, ready_file))
    finally:
        with contextlib.suppress(EngineStopped):
            engine.shutdown(drain_timeout=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve cdb.v1.Generation over stage servers.")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0: any) or unix:PATH")
    parser.add_argument("--stage", action="append", default=[], metavar="ROLE=ADDR", help="prelude|loop|head")
    parser.add_argument("--in-process", action="store_true", help="run the stages in this process instead")
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        stage_addrs = None if args.in_process else parse_stage_addrs(args.stage)
        config = engine_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    run_scheduler(config, args.listen, stage_addrs, ready_file=args.ready_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
