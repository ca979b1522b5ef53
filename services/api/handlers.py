"""``cdb.v1.Generation`` handlers over the front door (``services.api.door``): protobuf -> door -> protobuf.

- Every exception goes through ``services.api.errors`` (the one status map).
- Admission, shares, the live registry, finishing and aborting are the door's; a request's events come from its
  ticket (``Ticket.batches``). A client cancel, disconnect or deadline leaves the ticket, which aborts the request.
- Request ids live in the caller's scope (``CallerAuth.scope``: its API key's digest, its client certificate, or
  the shared anonymous scope): the engine knows a request as ``"{scope}/{request_id}"``, so a caller can neither
  abort nor collide with another caller's ids; responses, spans and errors carry the caller's own ``request_id``
  (spans add the scope as ``cdb.caller``).
- ``add_generation_service`` registers the handlers with request deserializers that never raise
  (``services.api.decoding``): an undecodable request gets INVALID_ARGUMENT naming the field.
- ``caps`` are the gRPC server's call caps (an interceptor, ``services.api.shares``); a ``GenerateStream``
  whose client takes no message for ``CDB_STREAM_STALL_TIMEOUT_S`` is ended with DEADLINE_EXCEEDED and its request
  aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.events import TokenEvent
from cdb_engine.validation import check_request_id
from services import telemetry
from services.api import messages
from services.api.decoding import Undecodable, tolerant_deserializer
from services.api.door import FrontDoor, Ticket
from services.api.errors import UndecodableRequest, mapped_errors, status_for
from services.api.shares import CallCaps, StallGuard
from services.telemetry.request_observer import ObservedRequest

_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
ACCEPTED_HEADER = "cdb-request-id"  # GenerateStream's initial metadata once admitted (clients.resume reads it)

log = logging.getLogger("cdb.scheduler")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """``cdb.v1.Generation`` over the front door: each handler translates protobuf to a door call and back.

    ``info``: the ``Info`` reply (built in the scheduler process, asked of it by a front end); ``deployment``: how
    the engine runs (``in_process``, ``microservices``), for the log."""

    def __init__(self, door: FrontDoor, info: Callable[[], Awaitable[pb.InfoResponse]], deployment: str) -> None:
        self.door = door
        self.info = info
        self.deployment = deployment
        self.caps = CallCaps(door.settings)  # the gRPC server's call caps (its interceptor)
        self._stall_aborts: set[asyncio.Task[None]] = set()  # statuses of stalled streams, until sent

    def _observe(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str, scope: str
    ) -> ObservedRequest:
        door = self.door
        span = telemetry.start_request_span(
            model=door.prep.config.model,
            max_tokens=messages.requested_max_tokens(request),
            metadata=context.invocation_metadata(),
            request_id=request_id,
        )
        span.set_attribute("cdb.caller", scope)

        def deadline_passed() -> bool:
            remaining = context.time_remaining()
            return remaining is not None and remaining <= 0

        return ObservedRequest(
            door.metrics,
            door.traces,
            span,
            status_name=lambda e: status_for(e)[0].name,
            deadline_passed=deadline_passed,
            cut=lambda: door.cut,
            request_id=request_id,
            caller=scope,
        )

    async def _admit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str, *, streaming: bool
    ) -> Ticket:
        """The door's ticket of one request, its engine id in the caller's scope (``"{scope}/{request_id}"``)."""
        check_request_id(request_id)
        auth = self.door.auth
        scope = auth.scope(context)
        return await self.door.admit(
            lambda: messages.request_to_engine(request),
            f"{scope}/{request_id}",
            self._observe(request, context, request_id, scope),
            caller=auth.share_scope(context),
            streaming=streaming,
            shown_id=request_id,
        )

    @mapped_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        batched = request.batch_tokens
        guard = self._stall_guard(context, request_id)
        try:
            ticket = await self._admit(request, context, request_id, streaming=True)
            # accepted: the client knows this server took the request (a break is then resumable)
            try:
                await context.send_initial_metadata(((ACCEPTED_HEADER, request_id),))
            except BaseException as exc:
                await ticket.close(exc)
                raise
            async with contextlib.aclosing(ticket.batches()) as batches:
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
        timeout = self.door.settings.stream_stall_timeout_s

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
        ticket = await self._admit(request, context, out.request_id, streaming=False)
        async with contextlib.aclosing(ticket.batches()) as batches:
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
        scope = self.door.auth.scope(context)
        return pb.AbortResponse(found=await self.door.abort(f"{scope}/{request.request_id}"))

    @mapped_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return await self.info()


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
