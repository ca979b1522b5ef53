"""``RequestStream``: one submitted request's events as an async iterator on the caller's event loop."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import ClassVar

from cdb_engine.detokenizer import TextOutput
from cdb_engine.events import Event, FinishEvent, RequestObserver


class LoopMailbox:
    """The engine thread's hand-over to one event loop, shared by every stream on that loop.

    ``post`` appends to a list and wakes the loop only when the list was empty: the events of one stage result
    (every token it produced, for every request on the loop) reach the loop in one wake-up and one drain, instead of
    a ``call_soon_threadsafe`` (a lock, a self-pipe write and a loop iteration) per token. Order is kept per loop,
    hence per stream.
    """

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]] = weakref.WeakKeyDictionary()
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's key: a strong reference would keep the loop alive
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Event], Event]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with cls._registry_lock:
            box = cls._by_loop.get(loop)
            if box is None:
                box = cls._by_loop[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue[Event], event: Event) -> None:
        """Any thread: deliver ``event`` to ``queue`` on the loop."""
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a drain is already scheduled and has not run yet: it takes this one too
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: its consumers are gone (the engine ends their requests)
            with self._lock:
                self._pending.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, event in batch:
            queue.put_nowait(event)


class RequestStream:
    """Events of one request, in order, ending with its ``FinishEvent``.

    Made by an engine client (``cdb_engine.client``), which has already submitted the request. Use as an async
    context manager: leaving it before the finish event (the consumer stopped, was cancelled, or failed) aborts the
    request and tells the observer why. ``text``: the request's output text when it is made on the consumer's side
    of a link (None: the engine made it).
    """

    def __init__(
        self, abort: Callable[[], object], observer: RequestObserver | None, text: TextOutput | None = None
    ) -> None:
        self._mailbox = LoopMailbox.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._abort = abort
        self._observer = observer
        self.text = text
        self.finished = False
        self.request_id = ""  # set by the engine once submitted

    def cancel(self) -> None:
        """Ask the engine to end the request; its stream still ends with the engine's finish event."""
        self._abort()

    def sink(self, event: Event) -> None:
        """The engine thread's end: hand ``event`` to the consumer's loop (batched with the other streams' events
        of the same stage result, ``LoopMailbox``)."""
        self._mailbox.post(self._queue, event)

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

    def take_ready(self) -> list[Event]:
        """The events already delivered and not yet read, without waiting (several tokens that were ready together:
        the consumer may send them as one message)."""
        out: list[Event] = []
        queue = self._queue
        while not self.finished and not queue.empty():
            event = queue.get_nowait()
            self.finished = isinstance(event, FinishEvent)
            if self._observer is not None:
                self._observer.event(event)
            out.append(event)
        return out

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
