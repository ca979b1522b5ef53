"""Fair shares of the public port: per-caller limits, the gRPC server's call caps, streams whose client stalls.

- ``CallerShares``: per caller, its live generation requests (``CDB_MAX_REQUESTS_PER_CALLER``) and, among them,
  its streamed ones (``CDB_MAX_STREAMS_PER_CALLER``: gRPC ``GenerateStream``, HTTP ``stream: true``), one count
  for both protocols and for the whole tree: front-end processes count in their own (so that an over-limit
  caller costs them no tokenization) and the scheduler's, which holds every front end's requests, decides
  (``services.frontlink``: a caller's requests over two front ends are one caller's). By default one caller may
  hold half of what the server admits (``max_num_seqs + max_waiting``), so that no caller holds it all.
  ``FrontDoor.admit`` takes a share before it builds a request and gives it back if the request is refused;
  ``FrontDoor.release`` gives it back however an admitted request ends (finished, failed, cancelled, its client
  gone, stalled). Over a limit: ``CallerLimit`` (gRPC RESOURCE_EXHAUSTED, HTTP 429 ``rate_limit_exceeded``)
  naming the setting; nothing else is touched, the caller's other requests go on.
- Who the caller is (``share_scope``): its API key's scope, else its client certificate's (the scopes of request
  ids, ``CallerAuth.scope``), else its host (``peer-<address>``; an IPv6 host by its /64 network, which one
  machine usually holds whole): without keys or certificates callers are told apart by address for their shares
  only (request ids and Abort keep the one anonymous scope). Behind a proxy every caller is the proxy's address:
  give callers API keys there.
- ``CallCaps``: the public gRPC server's own caps, in place of grpc's ``maximum_concurrent_rpcs`` (which counts
  health ``Watch`` streams too): every call but ``grpc.health.v1`` counts against ``CDB_MAX_CONCURRENT_RPCS``,
  health ``Watch`` streams against ``CDB_MAX_HEALTH_WATCHES``, health ``Check`` against nothing (probes are never
  refused). A call counts while its handler runs (from the arrival of its request message to its end); beyond a
  cap it is refused with RESOURCE_EXHAUSTED naming the setting.
- ``StallGuard``: a streamed response whose client takes no message for ``CDB_STREAM_STALL_TIMEOUT_S`` (the
  message handed to gRPC is not sent: the client's HTTP/2 flow-control window is full) is cut: ``on_stall`` runs
  once. The gRPC handler then ends the call with DEADLINE_EXCEEDED and aborts the request (its share and slot
  freed); the HTTP API does the same at the connection (``services.http.protocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.api.errors import CallerLimit
from services.settings import Settings

ANONYMOUS_SCOPE = "anon"  # callers without an API key or a client certificate (``security.CallerAuth.scope``)
HEALTH_SERVICE = "grpc.health.v1.Health"
_MAX_CACHED_HANDLERS = 256  # the server's methods are a handful; a handler made per call is not worth keeping


def host_key(host: str) -> str:
    """The address a caller's host is known by: an IPv4 address, an IPv6 /64 network (an IPv4-mapped one as its
    IPv4 address), or ``host`` itself when it is no IP address (a unix socket: every local caller)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def grpc_peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.5:40312``, ``ipv6:[::1]:40312``, ``unix:/path``)."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return host_key(address.rpartition(":")[0])
    return kind or peer  # unix, unix-abstract, ...: the local host


def share_scope(scope: str, host: str) -> str:
    """The scope a caller's shares count in: ``scope`` (its key's or its certificate's), else its host."""
    return scope if scope != ANONYMOUS_SCOPE else f"peer-{host}"


class CallerShares:
    """Live requests and open streams per caller scope, each bounded (the module docstring). Thread-safe (the
    scheduler's is taken by the front-end link's readers and given back by the engine thread)."""

    def __init__(self, max_requests: int, max_streams: int) -> None:
        self.max_requests = max_requests
        self.max_streams = max_streams
        self._held: dict[str, list[int]] = {}  # scope -> [requests, streams]; a scope holding nothing is removed
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, capacity: int) -> CallerShares:
        """The limits of ``settings`` (auto: half of ``capacity``, the requests the server admits at once)."""
        return cls(*settings.caller_limits(capacity))

    def take(self, scope: str, streaming: bool) -> None:
        """A place for one more request of ``scope`` (``streaming``: a streamed one); raises ``CallerLimit``."""
        with self._lock:
            self._take(scope, streaming)

    def _take(self, scope: str, streaming: bool) -> None:
        held = self._held.get(scope)
        requests, streams = held if held is not None else (0, 0)
        if requests >= self.max_requests:
            raise CallerLimit(
                f"this caller has {requests} live requests, its limit (CDB_MAX_REQUESTS_PER_CALLER): "
                "send more once some have ended"
            )
        if streaming and streams >= self.max_streams:
            raise CallerLimit(
                f"this caller has {streams} open streams, its limit (CDB_MAX_STREAMS_PER_CALLER): "
                "open more once some have ended"
            )
        if held is None:
            held = self._held[scope] = [0, 0]
        held[0] += 1
        held[1] += streaming

    def give_back(self, scope: str, streaming: bool) -> None:
        """Give back a place ``take`` gave (once per place)."""
        with self._lock:
            held = self._held[scope]
            held[0] -= 1
            held[1] -= streaming
            if held[0] == 0:
                del self._held[scope]

    def held(self) -> dict[str, tuple[int, int]]:
        """``{scope: (live requests, open streams)}`` of every caller holding any."""
        with self._lock:
            return {scope: (r, s) for scope, (r, s) in self._held.items()}


class Gate:
    """A count of calls bounded by ``limit``; ``refusal`` is the message of a call beyond it. Event-loop only."""

    def __init__(self, limit: int, refusal: str) -> None:
        self.limit = limit
        self.refusal = refusal
        self.in_use = 0

    def enter(self) -> bool:
        if self.in_use >= self.limit:
            return False
        self.in_use += 1
        return True

    def leave(self) -> None:
        self.in_use -= 1


Handler = Callable[[Any, grpc.aio.ServicerContext], Any]


def _counted_unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], gate: Gate) -> Handler:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not gate.enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, gate.refusal)
        try:
            return await fn(request, context)
        finally:
            gate.leave()

    return call


def _counted_stream(fn: Handler, gate: Gate) -> Handler:
    if inspect.iscoroutinefunction(fn):  # the reader-writer style (the health servicer's Watch)
        return _counted_unary(fn, gate)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not gate.enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, gate.refusal)
        try:
            async with contextlib.aclosing(fn(request, context)) as items:
                async for item in items:
                    yield item
        finally:
            gate.leave()

    return stream


def counted(handler: grpc.RpcMethodHandler, gate: Gate) -> grpc.RpcMethodHandler:
    """``handler`` with its calls counted by ``gate`` (refused beyond it); a synchronous handler is left as it is."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, _counted_unary),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, _counted_unary),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, _counted_stream),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, _counted_stream),
    )
    for fn, make, wrap in kinds:
        if fn is None:
            continue
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            return handler
        return make(wrap(fn, gate), **kw)
    return handler


class CallCaps(grpc.aio.ServerInterceptor):
    """The public gRPC server's caps (module docstring): ``calls`` (every call but health) and ``watches``."""

    def __init__(self, settings: Settings) -> None:
        self.calls = Gate(
            settings.max_concurrent_rpcs,
            f"server busy: {settings.max_concurrent_rpcs} calls in progress, its limit (CDB_MAX_CONCURRENT_RPCS)",
        )
        self.watches = Gate(
            settings.max_health_watches,
            f"{settings.max_health_watches} health Watch streams open, the limit (CDB_MAX_HEALTH_WATCHES): "
            "use Check, or Watch again later",
        )
        self._counted: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # id -> (handler, counted)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without caps
            return handler
        method: str = handler_call_details.method
        service, _, name = method.lstrip("/").partition("/")
        if service == HEALTH_SERVICE:
            return self._counted_by(handler, self.watches) if name == "Watch" else handler
        return self._counted_by(handler, self.calls)

    def _counted_by(self, handler: grpc.RpcMethodHandler, gate: Gate) -> grpc.RpcMethodHandler:
        """``counted(handler, gate)``, made once per registered handler (a method's handler is the same object on
        every call; the cache holds it, so that its id is not reused)."""
        known = self._counted.get(id(handler))
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = counted(handler, gate)
        if len(self._counted) < _MAX_CACHED_HANDLERS:
            self._counted[id(handler)] = (handler, wrapped)
        return wrapped


class StallGuard:
    """Runs ``on_stall`` once when a message handed on (``sending``) has not been taken (``sent``) within
    ``timeout`` seconds. Costs a clock read per message and at most one timer per ``timeout`` period."""

    __slots__ = ("_loop", "_on_stall", "_since", "_timeout", "_timer", "stalled")

    def __init__(self, timeout: float, on_stall: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._on_stall = on_stall
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.stalled = False

    def sending(self) -> None:
        self._since = now = self._loop.time()
        if self._timer is None and not self.stalled:
            self._timer = self._loop.call_at(now + self._timeout, self._check)

    def sent(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._timer = None
        if self._since is None:
            return  # between messages: the next one re-arms the timer
        due = self._since + self._timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.stalled = True
        self._on_stall()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
