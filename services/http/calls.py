"""One HTTP request's engine stream: validated, observed (metrics, trace) and registered with the public service.

Registration in ``GenerationService.live`` is what makes the scheduler's drain cover HTTP requests too: a drain
waits for them like for gRPC streams, and at its deadline aborts them (``service.cut``), which ends a streamed
response with an error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass

from cdb_engine.config import RequestParams
from cdb_engine.events import Event, FinishEvent
from cdb_engine.limits import INT32_MAX
from cdb_engine.stream import RequestStream
from services import telemetry
from services.http.responses import Render
from services.scheduler.errors import Unauthenticated, status_for
from services.scheduler.handlers import GenerationService
from services.scheduler.security import ANONYMOUS_SCOPE
from services.telemetry.request_observer import ObservedRequest

Prepare = Callable[[], tuple[str | list[int], RequestParams]]


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response, one engine request: how it is shaped (``render``, whose ``index`` it is), built
    (``prepare``), and how the engine's field names of its errors read in this API (``fields``); ``prompt``: a
    completion's prompt as sent (what ``echo`` gives back when it is text)."""

    render: Render
    prepare: Prepare
    fields: Mapping[str, str]
    prompt: str | list[int] | None = None

    @property
    def request_id(self) -> str:
        """The engine's id of the choice's request: the response's id, with ``-INDEX`` after the first choice."""
        index = self.render.index
        return self.render.id if index == 0 else f"{self.render.id}-{index}"


class Call:
    """The engine stream of one admitted request. ``events()`` yields its events (raising ``StageFailed`` or
    ``ServerDraining`` at a failed or cut finish); ``close()`` aborts it if it is unfinished and unregisters it."""

    def __init__(
        self, service: GenerationService, request_id: str, stream: RequestStream, prompt_ids: list[int]
    ) -> None:
        self.service = service
        self.request_id = request_id
        self.stream = stream
        self.prompt_ids = prompt_ids  # as validated (what ``echo`` gives back)
        self._closed = False

    @classmethod
    async def open(
        cls,
        service: GenerationService,
        request_id: str,
        prepare: Prepare,
        *,
        operation: str,
        max_tokens: int,
        headers: Iterable[tuple[str, str]],
        caller: str,
        streaming: bool,
    ) -> Call:
        """Build the request (``prepare``: prompt and params; may raise ``InvalidRequest``; run on a worker thread),
        validate and submit it as a request of ``caller`` (its share scope; ``streaming``: an SSE response, see
        ``GenerationService.admit``); every refusal raises (and is counted) before anything is streamed."""
        engine = service.engine
        span = telemetry.start_request_span(
            model=engine.config.model,
            max_tokens=max(-INT32_MAX, min(max_tokens, INT32_MAX)),  # as requested, within a span attribute's range
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
            request_id=request_id,
            caller=lambda: _caller(service, headers),
        )

        prompt_ids: list[int] = []

        def open_stream(ids: list[int], params: RequestParams) -> RequestStream:
            prompt_ids.extend(ids)
            return engine.open_stream(ids, params, request_id, observer=observer)

        stream = await service.admit(prepare, open_stream, request_id, observer, caller=caller, streaming=streaming)
        return cls(service, request_id, stream, prompt_ids)

    async def events(self) -> AsyncIterator[Event]:
        try:
            async with self.stream:
                async for ev in self.stream:
                    if isinstance(ev, FinishEvent):
                        self.service.check_finish(ev)
                    yield ev
        finally:
            await self.close()

    async def close(self, exc: BaseException | None = None) -> None:
        """Abort the request if it has not finished (the client left or the response failed); idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.stream.__aexit__(type(exc) if exc else None, exc, None)
        self.service.release(self.request_id)


def _caller(service: GenerationService, headers: Iterable[tuple[str, str]]) -> str:
    """The caller's scope, for the request log line (the request was authorised already)."""
    try:
        return service.auth.scope_of(headers)
    except Unauthenticated:  # a key this port's app accepts that the gRPC port's does not: no scope of its own
        return ANONYMOUS_SCOPE
