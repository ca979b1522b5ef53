"""``guarded_protocol``: uvicorn's HTTP/1.1 protocol over httptools (llhttp, the C parser: a streamed token's
chunk costs one buffer write, where the pure-Python h11 state machine cost tens of microseconds) with the port's
connection limits.

uvicorn times only the idle time between two requests of a keep-alive connection (``timeout_keep_alive``:
``CDB_HTTP_KEEP_ALIVE_S``). A connection of this port is also closed when
- its request's head (request line and headers) has not arrived whole within ``CDB_HEADER_READ_TIMEOUT_S``: of
  the connection's start for its first request, of the first byte for a later one (a client trickling its headers,
  or connecting and sending nothing, holds a connection no longer than that);
- its request's head is larger than ``MAX_HEAD_BYTES`` (431, as h11 refuses one);
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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("cdb.http")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers of one request


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request's head passed ``MAX_HEAD_BYTES``."""


class GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the limits of the module docstring (class attributes, set by
    ``guarded_protocol``)."""

    header_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._awaiting_head = True  # between requests: the next request's head is due
        self._head_bytes = 0  # read while the head was due (a head still incomplete is held by the parser)
        self._head_size = 0  # the current request's head, as parsed
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            if self._head_timer is None:  # the first byte of a later request
                self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse_head()  # a head still incomplete past the limit (the parser holds what it read)

    # parser callbacks (inside ``data_received``): a whole head's size, its end, the request's end
    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True  # (a pipelined request's head may follow in the same read)
        self._head_bytes = 0

    def _count_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > MAX_HEAD_BYTES:
            raise _HeadTooLarge  # (the parser raises it on as an HttpParserError: ``send_400_response``)

    def send_400_response(self, msg: str) -> None:
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def _refuse_head(self) -> None:
        self._awaiting_head = False
        self._cancel_head_timer()
        body = f"request head over {MAX_HEAD_BYTES} bytes".encode()
        head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
        self.transport.write(head + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        self.transport.close()

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


def guarded_protocol(header_timeout_s: float, stall_timeout_s: float) -> type[GuardedProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for these timeouts."""
    attrs = {"header_timeout_s": header_timeout_s, "stall_timeout_s": stall_timeout_s}
    return type("GuardedProtocol", (GuardedProtocol,), attrs)
