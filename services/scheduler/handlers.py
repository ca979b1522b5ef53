"""``cdb.v1.Generation`` handlers over one started engine: protobuf -> engine -> protobuf.

- Every exception goes through ``services.scheduler.errors`` (the one status map).
- A request's events come from the engine's own stream (``Engine.open_stream``); its metrics and trace are
  recorded by an ``ObservedRequest`` the stream feeds. A client cancel, disconnect or deadline leaves the stream,
  which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator

import grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.engine import Engine
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_scheduler.request import FinishReason
from services import telemetry
from services.scheduler import messages
from services.scheduler.errors import ServerDraining, StageFailed, mapped_errors, status_for
from services.settings import Settings
from services.telemetry.metrics import Metrics
from services.telemetry.request_observer import ObservedRequest
from services.transport.executor import GrpcExecutorFactory


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
        self.live: dict[str, ObservedRequest] = {}  # request id -> its observer, of in-flight Generate* calls
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

    def _observe(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str
    ) -> ObservedRequest:
        span = telemetry.start_request_span(
            model=self.engine.config.model,
            max_tokens=messages.requested_max_tokens(request),
            metadata=context.invocation_metadata(),
            request_id=request_id,
        )

        def deadline_passed() -> bool:
            remaining = context.time_remaining()
            return remaining is not None and remaining <= 0

        return ObservedRequest(
            self.metrics,
            self.traces,
            span,
            status_name=lambda e: status_for(e)[0].name,
            deadline_passed=deadline_passed,
            cut=lambda: self.cut,
        )

    async def _events(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncGenerator[Event]:
        """One request's engine events; raises what the caller maps to a status."""
        request_id = request.request_id or uuid.uuid4().hex
        observer = self._observe(request, context, request_id)
        try:
            prompt, params = messages.request_to_engine(request)
            ids = self.engine.validate(prompt, params)
            observer.validated(len(ids))
            if self.draining:
                raise ServerDraining("server is shutting down")
            if self.broken:
                raise StageFailed(self.broken)
            stream = self.engine.open_stream(ids, params, request_id, observer=observer)
        except Exception as exc:
            observer.rejected(exc)
            raise
        observer.admitted(len(ids))
        self.live[request_id] = observer
        self.idle.clear()
        try:
            async with stream:
                async for ev in stream:
                    if isinstance(ev, FinishEvent):
                        self._check_finish(ev)
                    yield ev
        finally:
            self.live.pop(request_id, None)
            if not self.live:
                self.idle.set()

    def _check_finish(self, ev: FinishEvent) -> None:
        if ev.finish_reason is FinishReason.ERROR:
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason is FinishReason.CANCELLED and self.cut:
            raise ServerDraining("server shut down before the request finished")

    @mapped_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse]:
        async with contextlib.aclosing(self._events(request, context)) as events:
            async for ev in events:
                yield messages.event_to_pb(ev)

    @mapped_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        out = pb.GenerateResponse()
        async with contextlib.aclosing(self._events(request, context)) as events:
            async for ev in events:
                out.request_id = ev.request_id
                out.text += ev.text
                if isinstance(ev, TokenEvent):
                    out.tokens.append(messages.token_to_pb(ev))
                else:
                    out.finish.CopyFrom(messages.finish_to_pb(ev))
        return out

    @mapped_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = self.engine.abort(request.request_id)
        if found and (observer := self.live.get(request.request_id)) is not None:
            observer.cancelled("Abort")
        return pb.AbortResponse(found=found)

    @mapped_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        problem = self.broken or self.not_ready
        return messages.info_to_pb(self.engine, self.deployment, self.settings.max_concurrent_rpcs, problem)

    def abort_all(self) -> None:
        for request_id in list(self.live):
            self.engine.abort(request_id)
