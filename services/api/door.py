"""``FrontDoor``: the one way in for every public request, below both protocols and in every serving process.

A gRPC handler or an HTTP route translates its wire format into a call of the door and the door's events back into
its wire format; nothing else. The door holds what a request goes through between the two:

- admission (``admit``): the caller's share (``shares.CallerShares``: its share scope, taken before the request is
  built, so an over-limit caller costs no tokenization), building and validating the request on a worker thread
  (templates and tokenization are bounded, not free), refusal while draining or when the stages are given up on,
  the engine stream (``EngineClient.open_stream``). Every refusal is counted by the request's observer and raised
  before anything streams; a refused request holds no share.
- the live registry (``live``: one ``Ticket`` per admitted request, the drain waits for them) and finishing
  (``Ticket.batches``: a failed finish raises ``StageFailed``, one cut by the drain deadline ``ServerDraining``;
  however the request ends its ticket closes: aborted if unfinished, unregistered, its share given back).
- aborting by id (``abort``) and everything at the drain deadline (``abort_all``).
- the one health verdict (``verdict``): draining, the stages given up on, the engine's own verdict, else the last
  periodic readiness check's (``not_ready``, set by ``readiness.Readiness``).

The same door runs in the scheduler process over an ``InProcessClient`` and in a front-end process over the remote
client (``services.frontlink.client``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Protocol

from cdb_engine.client import EngineClient
from cdb_engine.config import RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_engine.events import Event, FinishEvent
from cdb_engine.prepare import RequestPreparer
from cdb_engine.stream import RequestStream
from cdb_scheduler.request import FinishReason
from services import telemetry
from services.api.errors import ServerDraining, StageFailed
from services.api.security import CallerAuth
from services.api.shares import CallerShares
from services.settings import Settings
from services.telemetry.metrics import Metrics
from services.telemetry.request_observer import ObservedRequest
from services.transport.executor import GrpcExecutorFactory

Prepare = Callable[[], tuple[str | list[int], RequestParams]]


class Exposition(Protocol):
    """Where ``/metrics`` comes from: this process's registry, or the scheduler's over the link."""

    def __call__(self, accept: str | None) -> Awaitable[tuple[bytes, str]]: ...


class Ticket:
    """One admitted request at the door, registered under ``key``: its engine stream and observer, and the share it
    holds of its caller (``caller``: the share scope; ``streaming``: a streamed response)."""

    __slots__ = ("_closed", "caller", "door", "key", "observer", "prompt_ids", "stream", "streaming")

    def __init__(
        self,
        door: FrontDoor,
        key: str,
        stream: RequestStream,
        observer: ObservedRequest,
        prompt_ids: list[int],
        caller: str,
        streaming: bool,
    ) -> None:
        self.door = door
        self.key = key
        self.stream = stream
        self.observer = observer
        self.prompt_ids = prompt_ids  # as validated (what ``echo`` gives back)
        self.caller = caller
        self.streaming = streaming
        self._closed = False

    async def batches(self) -> AsyncGenerator[list[Event]]:
        """The request's events in batches of what was ready together: tokens, or the finish alone (after the
        tokens before it); raises ``StageFailed`` or ``ServerDraining`` at a failed or cut finish. Leaving early
        aborts the request; the ticket is closed however it ends."""
        try:
            async with self.stream as stream:
                async for ev in stream:
                    batch = [ev, *stream.take_ready()]
                    last = batch[-1]
                    finish = last if isinstance(last, FinishEvent) else None  # a finish is always the last
                    if finish is not None:
                        batch.pop()
                    if batch:
                        yield batch
                    if finish is not None:
                        self.door.check_finish(finish)
                        yield [finish]
        finally:
            await self.close()

    async def events(self) -> AsyncIterator[Event]:
        """``batches`` one event at a time."""
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def close(self, exc: BaseException | None = None) -> None:
        """Abort the request if it has not finished (the client left or the response failed), unregister it and
        give its share back; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.stream.__aexit__(type(exc) if exc else None, exc, None)
        self.door.release(self)


class FrontDoor:
    """The entrance of one serving process over ``client`` (the module docstring). Event-loop only.

    ``factory``: the stage executors of a scheduler process (their state is part of the verdict); ``exposition``:
    the ``/metrics`` source when it is not ``metrics``' own (a front end asks the scheduler's)."""

    def __init__(
        self,
        client: EngineClient,
        settings: Settings,
        metrics: Metrics | None = None,
        traces: telemetry.RequestTraces | None = None,
        *,
        auth: CallerAuth | None = None,
        factory: GrpcExecutorFactory | None = None,
        exposition: Exposition | None = None,
    ) -> None:
        self.client = client
        self.prep: RequestPreparer = client.prep
        self.settings = settings
        self.metrics = metrics or Metrics(self.prep.config.model, self.prep.limits.max_depth)
        self.traces = traces  # the executor's observer feeds it; None when tracing is off
        self.auth = auth or CallerAuth()  # no API keys: callers are told apart by client certificate, if any
        self.factory = factory
        self._exposition = exposition
        self.live: dict[str, Ticket] = {}  # engine id -> the ticket of each admitted request
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.not_ready: str | None = "starting"  # the readiness check's last verdict (None: ready)
        self.cut = False  # drain deadline passed: remaining requests end with UNAVAILABLE
        capacity = self.prep.config.max_num_seqs + self.prep.config.max_waiting
        self.shares = CallerShares.from_settings(settings, capacity)  # per-caller limits of both protocols

    # --- the verdict ---------------------------------------------------------------------------------------------
    @property
    def broken(self) -> str | None:
        """Why the stage pipeline cannot serve (None: it can)."""
        executor = self.factory.executor if self.factory is not None else None
        return executor.broken if executor is not None else None

    def verdict(self) -> str | None:
        """Why this server cannot take requests now (None: it can): draining, the stages given up on, the engine's
        own verdict, or the readiness check's last one (``starting`` until its first check)."""
        if self.draining:
            return "draining"
        return self.broken or self.client.health() or self.not_ready

    # --- admission and the registry ------------------------------------------------------------------------------
    async def admit(
        self, prepare: Prepare, key: str, observer: ObservedRequest, *, caller: str, streaming: bool, shown_id: str = ""
    ) -> Ticket:
        """Admit one request of either protocol under the engine id ``key``: take a share of ``caller`` (its share
        scope; ``streaming``: a streamed response), build it (``prepare``: prompt and params), validate it, refuse
        it while draining or when the stages are given up on, open its engine stream and register it. A duplicate
        id is reported under ``shown_id`` (the caller's own id, when ``key`` is scoped)."""
        taken = False
        try:
            self.shares.take(caller, streaming)
            taken = True
            ids, params = await asyncio.to_thread(self._build, prepare)
            observer.validated(len(ids), params)
            if self.draining:
                raise ServerDraining("server is shutting down")
            if self.broken:
                raise StageFailed(self.broken)
            try:
                stream = await self.client.open_stream(
                    ids, params, key, observer=observer, caller=caller, streaming=streaming
                )
            except InvalidRequest as exc:
                raise _own_id(exc, shown_id or key) from None
        except asyncio.CancelledError as exc:  # the caller left while its request was being built
            if taken:
                self.shares.give_back(caller, streaming)
            observer.gone(exc)
            raise
        except Exception as exc:
            if taken:
                self.shares.give_back(caller, streaming)
            observer.rejected(exc)
            raise
        observer.admitted(len(ids))
        ticket = self.live[key] = Ticket(self, key, stream, observer, ids, caller, streaming)
        self.idle.clear()
        return ticket

    def _build(self, prepare: Prepare) -> tuple[list[int], RequestParams]:
        """The validated ids and params of one request (on a worker thread)."""
        prompt, params = prepare()
        return self.prep.validate(prompt, params), params

    def release(self, ticket: Ticket) -> None:
        """An admitted request has ended: unregistered, its caller's share given back."""
        if self.live.get(ticket.key) is ticket:
            del self.live[ticket.key]
        self.shares.give_back(ticket.caller, ticket.streaming)
        if not self.live:
            self.idle.set()

    def check_finish(self, ev: FinishEvent) -> None:
        """A failed finish raises ``StageFailed``; one cut by the drain deadline ``ServerDraining``."""
        if ev.finish_reason is FinishReason.ERROR:
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason is FinishReason.CANCELLED and self.cut:
            raise ServerDraining("server shut down before the request finished")

    # --- ending requests -----------------------------------------------------------------------------------------
    async def abort(self, key: str) -> bool:
        """End the request with engine id ``key`` (of any front end of the engine); True if it was live."""
        found = await self.client.abort(key)
        if found and (ticket := self.live.get(key)) is not None:
            ticket.observer.cancelled("Abort")
        return found

    def abort_all(self) -> None:
        """The drain deadline passed: ask the engine to end every admitted request."""
        for ticket in list(self.live.values()):
            ticket.stream.cancel()

    async def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The Prometheus exposition ``/metrics`` serves."""
        if self._exposition is not None:
            return await self._exposition(accept)
        return self.metrics.exposition(accept)


def _own_id(exc: InvalidRequest, request_id: str) -> InvalidRequest:
    """A duplicate id as the caller knows it (the engine's may be scoped); any other refusal as it is."""
    if exc.field != "request_id":
        return exc
    return InvalidRequest("request_id", f"{request_id!r} is already used by a live request")
