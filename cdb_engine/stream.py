"""``RequestStream``: one submitted request's events as an async iterator on the caller's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from cdb_engine.events import Event, FinishEvent, RequestObserver


class RequestStream:
    """Events of one request, in order, ending with its ``FinishEvent``.

    Made by ``Engine.open_stream``, which has already submitted the request. Use as an async context manager:
    leaving it before the finish event (the consumer stopped, was cancelled, or failed) aborts the request and
    tells the observer why.
    """

    def __init__(self, abort: Callable[[], object], observer: RequestObserver | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._abort = abort
        self._observer = observer
        self.finished = False
        self.request_id = ""  # set by the engine once submitted

    def sink(self, event: Event) -> None:
        """The engine thread's end: hand ``event`` to the consumer's loop."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        self.finished = isinstance(event, FinishEvent)
        if self._observer is not None:
            self._observer.event(event)
        return event

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.finished:
            self.finished = True
            self._abort()
            if self._observer is not None:
                self._observer.gone(exc)
