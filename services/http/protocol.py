"""``guarded_protocol``: uvicorn's HTTP/1.1 protocol (h11) with the port's connection timeouts.

uvicorn times only the idle time between two requests of a keep-alive connection (``timeout_keep_alive``:
``CDB_HTTP_KEEP_ALIVE_S``). A connection of this port is also closed when
- its request's head (request line and headers) has not arrived whole within ``CDB_HEADER_READ_TIMEOUT_S``: of
  the connection's start for its first request, of the first byte for a later one (a client trickling its headers,
  or connecting and sending nothing, holds a connection no longer than that);
- its client has taken nothing of the response for ``CDB_STREAM_STALL_TIMEOUT_S`` while the server had more to
  send (the transport's buffer over its high-water mark, so that writes wait: ``pause_writing`` without
  ``resume_writing``): the connection is aborted, which the app sees as the client gone (a streamed response's
  request is aborted, its caller's share and its slot freed).
The request body's own time limit is ``body_limit.BodyLimit``'s (``CDB_BODY_READ_TIMEOUT_S``, 408).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("cdb.http")


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` with the header and stall timeouts of the module docstring (class attributes, set by
    ``guarded_protocol``)."""

    header_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._awaiting_head = True  # between requests: the next request's head is due
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and self._head_timer is None:  # the first byte of a later request
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived: its cycle began
            self._awaiting_head = False
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        self._awaiting_head = True  # set first: a pipelined request handled inside is a new head that arrived
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self.transport.is_closing():
            log.debug("%s: no request head within %gs (CDB_HEADER_READ_TIMEOUT_S)", self.client, self.header_timeout_s)
            self.transport.close()

    def _stalled(self) -> None:
        self._stall_timer = None
        if not self.transport.is_closing() or self.flow.write_paused:
            log.warning(
                "HTTP client %s took nothing of the response for %gs (CDB_STREAM_STALL_TIMEOUT_S): connection cut",
                self.client,
                self.stall_timeout_s,
            )
            self.transport.abort()


def guarded_protocol(header_timeout_s: float, stall_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for these timeouts."""
    attrs = {"header_timeout_s": header_timeout_s, "stall_timeout_s": stall_timeout_s}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)
