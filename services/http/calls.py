"""One HTTP request's engine stream: validated, observed (metrics, trace) and registered with the public service.

Registration in ``GenerationService.live`` is what makes the scheduler's drain cover HTTP requests too: a drain
waits for them like for gRPC streams, and at its deadline aborts them (``service.cut``), which ends a streamed
response with an error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

from cdb_engine.config import RequestParams
from cdb_engine.events import Event, FinishEvent
from cdb_engine.stream import RequestStream
from cdb_scheduler.request import FinishReason
from services import telemetry
from services.scheduler.errors import ServerDraining, StageFailed, status_for
from services.scheduler.handlers import GenerationService
from services.telemetry.request_observer import ObservedRequest

Prepare = Callable[[], tuple[str | list[int], RequestParams]]


class Call:
    """The engine stream of one admitted request. ``events()`` yields its events (raising ``StageFailed`` or
    ``ServerDraining`` at a failed or cut finish); ``close()`` aborts it if it is unfinished and unregisters it."""

    def __init__(self, service: GenerationService, request_id: str, stream: RequestStream) -> None:
        self.service = service
        self.request_id = request_id
        self.stream = stream
        self._closed = False

    @classmethod
    def open(
        cls,
        service: GenerationService,
        request_id: str,
        prepare: Prepare,
        *,
        operation: str,
        max_tokens: int,
        headers: Iterable[tuple[str, str]],
    ) -> Call:
        """Build the request (``prepare``: prompt and params; may raise ``InvalidRequest``), validate and submit
        it; every refusal raises (and is counted) before anything is streamed."""
        engine = service.engine
        span = telemetry.start_request_span(
            model=engine.config.model,
            max_tokens=max_tokens,
            metadata=headers,
            request_id=request_id,
            operation=operation,
        )
        observer = ObservedRequest(
            service.metrics,
            service.traces,
            span,
            status_name=lambda e: status_for(e)[0].name,
            deadline_passed=lambda: False,
            cut=lambda: service.cut,
        )
        try:
            prompt, params = prepare()
            ids = engine.validate(prompt, params)
            observer.validated(len(ids), params)
            if service.draining:
                raise ServerDraining("server is shutting down")
            if service.broken:
                raise StageFailed(service.broken)
            stream = engine.open_stream(ids, params, request_id, observer=observer)
        except Exception as exc:
            observer.rejected(exc)
            raise
        observer.admitted(len(ids))
        service.live[request_id] = observer
        service.idle.clear()
        return cls(service, request_id, stream)

    async def events(self) -> AsyncIterator[Event]:
        try:
            async with self.stream:
                async for ev in self.stream:
                    if isinstance(ev, FinishEvent):
                        self._check_finish(ev)
                    yield ev
        finally:
            await self.close()

    def _check_finish(self, ev: FinishEvent) -> None:
        if ev.finish_reason is FinishReason.ERROR:
            raise StageFailed(ev.error or "the engine failed the request")
        if ev.finish_reason is FinishReason.CANCELLED and self.service.cut:
            raise ServerDraining("server shut down before the request finished")

    async def close(self, exc: BaseException | None = None) -> None:
        """Abort the request if it has not finished (the client left or the response failed); idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.stream.__aexit__(type(exc) if exc else None, exc, None)
        live = self.service.live
        live.pop(self.request_id, None)
        if not live:
            self.service.idle.set()
