"""``cdb.v1.Generation`` handlers over one started engine: protobuf -> engine -> protobuf.

- Every exception goes through ``services.scheduler.errors`` (the one status map).
- A request's events come from the engine's own stream (``Engine.open_stream``); its metrics and trace are
  recorded by an ``ObservedRequest`` the stream feeds. A client cancel, disconnect or deadline leaves the stream,
  which aborts the request.
- Request ids live in the caller's scope (``CallerAuth.scope``: its API key's digest, its client certificate, or
  the shared anonymous scope): the engine knows a request as ``"{scope}/{request_id}"``, so a caller can neither
  abort nor collide with another caller's ids; responses, spans and errors carry the caller's own ``request_id``
  (spans add the scope as ``cdb.caller``).
- ``add_generation_service`` registers the handlers with request deserializers that never raise
  (``services.scheduler.decoding``): an undecodable request gets INVALID_ARGUMENT naming the field.
- Fair shares (``services.scheduler.shares``): ``admit`` takes the caller's share (``CallerAuth.share_scope``: its
  key, else its host) before building a request, ``release`` gives it back; ``caps`` are the gRPC server's call
  caps (an interceptor); a ``GenerateStream`` whose client takes no message for ``CDB_STREAM_STALL_TIMEOUT_S`` is
  ended with DEADLINE_EXCEEDED and its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.config import RequestParams
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_engine.stream import RequestStream
from cdb_engine.validation import check_request_id
from cdb_scheduler.request import FinishReason
from services import telemetry
from services.scheduler import messages
from services.scheduler.decoding import Undecodable, tolerant_deserializer
from services.scheduler.errors import ServerDraining, StageFailed, UndecodableRequest, mapped_errors, status_for
from services.scheduler.security import CallerAuth
from services.scheduler.shares import CallCaps, CallerShares, Share, StallGuard
from services.settings import Resolved, Settings, served_names
from services.telemetry.metrics import Metrics
from services.telemetry.request_observer import ObservedRequest
from services.transport.executor import GrpcExecutorFactory
from services.version import server_version

_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
ACCEPTED_HEADER = "cdb-request-id"  # GenerateStream's initial metadata once admitted (clients.common reads it)

log = logging.getLogger("cdb.scheduler")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """``cdb.v1.Generation`` over one started engine, with each request's metrics and trace."""

    def __init__(
        self,
        engine: Engine,
        factory: GrpcExecutorFactory | None,
        settings: Settings,
        metrics: Metrics | None = None,
        traces: telemetry.RequestTraces | None = None,
        auth: CallerAuth | None = None,
    ) -> None:
        self.engine = engine
        self.factory = factory
        self.settings = settings
        self.resolved = Resolved(settings, engine.config)  # the configuration Info shows
        self.metrics = metrics or Metrics(engine.config.model, engine.limits.max_depth)
        self.traces = traces  # the executor's observer feeds it; None when tracing is off
        self.deployment = "microservices" if factory is not None else "in_process"
        self.auth = auth or CallerAuth()  # no API keys: callers are told apart by client certificate, if any
        self.live: dict[str, ObservedRequest] = {}  # scoped request id -> its observer, of in-flight Generate* calls
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.not_ready: str | None = "starting"  # the readiness check's last verdict (None: ready)
        self.cut = False  # drain deadline passed: remaining requests end with UNAVAILABLE
        self.shares = CallerShares.from_settings(settings)  # per-caller limits of both front ends
        self.caps = CallCaps(settings)  # the gRPC server's call caps (its interceptor)
        self._held: dict[str, Share] = {}  # key of a live request (as ``live``) -> its caller's share
        self._stall_aborts: set[asyncio.Task[None]] = set()  # statuses of stalled streams, until sent

    @property
    def broken(self) -> str | None:
        """Why the stage pipeline cannot serve (None: it can)."""
        executor = self.factory.executor if self.factory is not None else None
        return executor.broken if executor is not None else None

    def _observe(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str, scope: str
    ) -> ObservedRequest:
        span = telemetry.start_request_span(
            model=self.engine.config.model,
            max_tokens=messages.requested_max_tokens(request),
            metadata=context.invocation_metadata(),
            request_id=request_id,
        )
        span.set_attribute("cdb.caller", scope)

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
            request_id=request_id,
            caller=scope,
        )

    def _scoped(self, context: grpc.aio.ServicerContext, request_id: str) -> tuple[str, str]:
        """The caller's scope and the engine's id of its ``request_id``."""
        scope = self.auth.scope(context)
        return scope, f"{scope}/{request_id}"

    async def _events(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str, *, streaming: bool
    ) -> AsyncGenerator[list[Event]]:
        """One request's engine events (carrying the scoped id), in batches of what was ready together: tokens, or
        the finish alone (after the tokens before it); raises what the caller maps to a status."""
        check_request_id(request_id)
        scope, scoped_id = self._scoped(context, request_id)
        observer = self._observe(request, context, request_id, scope)

        def open_stream(ids: list[int], params: RequestParams) -> RequestStream | Awaitable[RequestStream]:
            return self._open(ids, params, scoped_id, request_id, observer)

        stream = await self.admit(
            lambda: messages.request_to_engine(request),
            open_stream,
            scoped_id,
            observer,
            caller=self.auth.share_scope(context),
            streaming=streaming,
        )
        try:
            if streaming:  # accepted: the client knows this server took the request (a break is then resumable)
                await context.send_initial_metadata(((ACCEPTED_HEADER, request_id),))
            async with stream:
                async for ev in stream:
                    batch = [ev, *stream.take_ready()]
                    last = batch[-1]
                    finish = last if isinstance(last, FinishEvent) else None  # a finish is always the last
                    if finish is not None:
                        batch.pop()
                    if batch:
                        yield batch
                    if finish is not None:
                        self.check_finish(finish)
                        yield [finish]
        finally:
            self.release(scoped_id)

    async def admit(
        self,
        prepare: Callable[[], tuple[str | list[int], RequestParams]],
        open_stream: Callable[[list[int], RequestParams], RequestStream | Awaitable[RequestStream]],
        key: str,
        observer: ObservedRequest,
        *,
        caller: str,
        streaming: bool,
    ) -> RequestStream:
        """Admission of one request of either front end (gRPC, HTTP): take a share of ``caller`` (its share scope;
        ``streaming``: a streamed response), build the request (``prepare``: prompt and params), validate it, refuse
        it while draining or when the stages are given up on, open its engine stream, and register it as live under
        ``key`` (the drain waits for it; ``release`` ends that and gives the share back). Every refusal is counted
        by ``observer`` and raised before anything is streamed; a refused request holds no share.

        Building and validating (chat template rendering, tokenization: bounded, but not free) run on a worker
        thread, never on the event loop that serves every other call."""
        share: Share | None = None
        try:
            share = self.shares.acquire(caller, streaming)
            ids, params = await asyncio.to_thread(self._build, prepare)
            observer.validated(len(ids), params)
            if self.draining:
                raise ServerDraining("server is shutting down")
            if self.broken:
                raise StageFailed(self.broken)
            opened = open_stream(ids, params)
            stream = await opened if inspect.isawaitable(opened) else opened  # a front end awaits the engine's ack
        except asyncio.CancelledError as exc:  # the caller left while its request was being built
            if share is not None:
                share.release()
            observer.gone(exc)
            raise
        except Exception as exc:
            if share is not None:
                share.release()
            observer.rejected(exc)
            raise
        observer.admitted(len(ids))
        self.live[key] = observer
        self._held[key] = share
        self.idle.clear()
        return stream

    def _build(self, prepare: Callable[[], tuple[str | list[int], RequestParams]]) -> tuple[list[int], RequestParams]:
        """The validated ids and params of one request (on a worker thread)."""
        prompt, params = prepare()
        return self.engine.validate(prompt, params), params

    def release(self, key: str) -> None:
        """A request registered by ``admit`` has ended: unregistered, its caller's share given back."""
        self.live.pop(key, None)
        share = self._held.pop(key, None)
        if share is not None:
            share.release()
        if not self.live:
            self.idle.set()

    def _open(
        self, ids: list[int], params: RequestParams, scoped_id: str, request_id: str, observer: ObservedRequest
    ) -> RequestStream | Awaitable[RequestStream]:
        """``Engine.open_stream`` under the scoped id (a front end's is awaited); a duplicate id is reported as the
        caller's own."""
        try:
            opened = self.engine.open_stream(ids, params, scoped_id, observer=observer)
        except InvalidRequest as exc:
            raise _own_id(exc, request_id) from None
        if not inspect.isawaitable(opened):
            return opened

        async def acked() -> RequestStream:
            try:
                return await opened
            except InvalidRequest as exc:
                raise _own_id(exc, request_id) from None

        return acked()

    def check_finish(self, ev: FinishEvent) -> None:
        """A failed finish raises ``StageFailed``; one cut by the drain deadline ``ServerDraining``."""
        if ev.finish_reason is FinishReason.ERROR:
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason is FinishReason.CANCELLED and self.cut:
            raise ServerDraining("server shut down before the request finished")

    @mapped_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        batched = request.batch_tokens
        guard = self._stall_guard(context, request_id)
        try:
            async with contextlib.aclosing(self._events(request, context, request_id, streaming=True)) as batches:
                async for events in batches:
                    if batched and len(events) > 1:  # tokens that were ready together: one message
                        out = [messages.tokens_to_pb(request_id, [e for e in events if isinstance(e, TokenEvent)])]
                    else:
                        out = [messages.event_to_pb(ev) for ev in events]
                        for msg in out:
                            msg.request_id = request_id  # the caller's id, not the engine's scoped one
                    for msg in out:
                        guard.sending()
                        yield msg  # gRPC sends it before asking for the next one: a full window holds us here
                        guard.sent()
        finally:
            guard.close()

    def _stall_guard(self, context: grpc.aio.ServicerContext, request_id: str) -> StallGuard:
        """A guard that ends this call (DEADLINE_EXCEEDED) when its client stops taking messages: the status is
        queued behind what the client has not read, and the call's task is cancelled, which closes the handler
        (the request is aborted, its share and slot freed). Made on the call's task (the one to cancel)."""
        task = asyncio.current_task()
        timeout = self.settings.stream_stall_timeout_s

        def stalled() -> None:
            message = f"the client took no message for {timeout:g}s (CDB_STREAM_STALL_TIMEOUT_S): stream cut"
            log.warning("GenerateStream %s from %s: %s", request_id, context.peer(), message)
            status = asyncio.ensure_future(_abort_quietly(context, grpc.StatusCode.DEADLINE_EXCEEDED, message))
            self._stall_aborts.add(status)
            status.add_done_callback(self._stall_aborts.discard)
            if task is not None:
                task.cancel()

        return StallGuard(timeout, stalled)

    @mapped_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        out = pb.GenerateResponse(request_id=request.request_id or uuid.uuid4().hex)
        async with contextlib.aclosing(self._events(request, context, out.request_id, streaming=False)) as batches:
            async for events in batches:
                for ev in events:
                    out.text += ev.text
                    if isinstance(ev, TokenEvent):
                        out.tokens.append(messages.token_to_pb(ev))
                    else:
                        out.finish.CopyFrom(messages.finish_to_pb(ev))
        return out

    @mapped_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        check_request_id(request.request_id)
        _, scoped_id = self._scoped(context, request.request_id)
        found = self.engine.abort(scoped_id)
        if inspect.isawaitable(found):  # a front end's engine asks the scheduler about another front end's request
            found = await found
        if found and (observer := self.live.get(scoped_id)) is not None:
            observer.cancelled("Abort")
        return pb.AbortResponse(found=found)

    @mapped_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info()

    def info(self) -> pb.InfoResponse:
        """The ``Info`` reply: the engine's model, limits and counters, this deployment and its configuration."""
        problem = self.broken or self.not_ready
        executor = self.factory.executor if self.factory is not None else None
        reply = messages.info_to_pb(self.engine, self.deployment, self.settings.max_concurrent_rpcs, problem, executor)
        reply.version = server_version()
        reply.served_model_names.extend(served_names(self.settings.served_model_name) or [self.engine.config.model])
        reply.config_json, reply.config_digest = self.resolved.shown(), self.resolved.digest()
        if executor is not None:
            reply.stage_config_digests.update(executor.stage_config_digests())
        return reply

    def abort_all(self) -> None:
        for scoped_id in list(self.live):
            self.engine.abort(scoped_id)


def add_generation_service(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register ``service`` on ``server`` with request deserializers that never raise (see the module docstring)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in _SERVICE.methods:
        assert not method.client_streaming, f"{method.full_name}: client streaming is not handled"
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        kw = {
            "request_deserializer": tolerant_deserializer(request_cls),
            "response_serializer": response_cls.SerializeToString,
        }
        fn = getattr(service, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(_decoded_stream(fn), **kw)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_decoded_unary(fn), **kw)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)


def _own_id(exc: InvalidRequest, request_id: str) -> InvalidRequest:
    """A duplicate id as the caller knows it (the engine's is scoped); any other refusal as it is."""
    if exc.field != "request_id":
        return exc
    return InvalidRequest("request_id", f"{request_id!r} is already used by a live request")


async def _abort_quietly(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with this status; nothing if it has one already (finished, or its client gone)."""
    with contextlib.suppress(Exception):
        await context.abort(code, message)


async def _refuse_undecodable(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
    code, message = status_for(UndecodableRequest(request.message))
    await context.abort(code, message)


def _decoded_unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse_undecodable(request, context)
        return await fn(request, context)

    return unary


def _decoded_stream(fn: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]) -> Callable[..., Any]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _refuse_undecodable(request, context)
        async for item in fn(request, context):
            yield item

    return stream
