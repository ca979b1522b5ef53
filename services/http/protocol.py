"""``guarded_protocol``: uvicorn's HTTP/1.1 protocol over httptools (llhttp, the C parser: a streamed token's
chunk costs one buffer write, where the pure-Python h11 state machine cost tens of microseconds) with the port's
connection limits.

uvicorn times only the idle time between two requests of a keep-alive connection (``timeout_keep_alive``:
``CDB_HTTP_KEEP_ALIVE_S``). A connection of this port is also closed when
- its request's head (request line and headers) has not arrived whole within ``CDB_HEADER_READ_TIMEOUT_S``: of
  the connection's start for its first request, of the first byte for a later one (a client trickling its headers,
  or connecting and sending nothing, holds a connection no longer than that);
- its request's head is larger than ``MAX_HEAD_BYTES`` (431, as h11 refuses one);
- its peer (the client's host: an IPv4 address, an IPv6 /64) holds ``CDB_HTTP_MAX_CONNECTIONS_PER_PEER``
  connections already: each request on it is answered 429 and the connection closed (a configured proxy,
  ``CDB_FORWARDED_ALLOW_IPS``, carries many clients and is not limited);
- its client has taken nothing of the response for ``CDB_STREAM_STALL_TIMEOUT_S`` while the server had more to
  send (the transport's buffer over its high-water mark, so that writes wait: ``pause_writing`` without
  ``resume_writing``): the connection is aborted, which the app sees as the client gone (a streamed response's
  request is aborted, its caller's share and its slot freed).
The request body's own time limit is ``body_limit.BodyLimit``'s (``CDB_BODY_READ_TIMEOUT_S``, 408).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.api.shares import host_key
from services.http.errors import ApiError

log = logging.getLogger("cdb.http")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers of one request


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request's head passed ``MAX_HEAD_BYTES``."""


class GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the limits of the module docstring (class attributes, set by
    ``guarded_protocol``)."""

    header_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0
    peers: PeerConnections  # the server's open connections per peer

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._peer: str | None = None  # counted in ``peers`` under this key
        self._awaiting_head = True  # between requests: the next request's head is due
        self._head_bytes = 0  # read while the head was due (a head still incomplete is held by the parser)
        self._head_size = 0  # the current request's head, as parsed
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)
        host = self.client[0] if self.client else ""
        if self.peers.enter(host):
            self._peer = host
        else:
            self.app = self.peers.refusal  # (this connection's requests only: the server's app is untouched)

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
        if self._peer is not None:
            self.peers.leave(self._peer)
            self._peer = None
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


class PeerConnections:
    """Open connections per peer host, each peer's bounded by ``limit`` (``trusted``: proxies, not bounded)."""

    def __init__(self, limit: int, trusted: str = "") -> None:
        self.limit = limit
        self._any = trusted.strip() == "*"
        self._trusted = [ipaddress.ip_network(t.strip(), strict=False) for t in trusted.split(",") if t.strip()]
        self.open: dict[str, int] = {}  # host key -> its open connections (a host with none is removed)
        self._error = ApiError(  # (CallerLimit's reply: the same type and code)
            429,
            f"this client holds {limit} open connections, the limit per client "
            "(CDB_HTTP_MAX_CONNECTIONS_PER_PEER): reuse them (keep-alive) or close some",
            "rate_limit_error",
            None,
            "rate_limit_exceeded",
        )

    def _key(self, host: str) -> tuple[str, bool]:
        """The key ``host``'s connections count under, and whether they are bounded (a trusted proxy's are not)."""
        key = host_key(host)
        if self._any:
            return key, False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a unix socket's peer: the local host
            return key, True
        return key, not any(ip in net for net in self._trusted)

    def enter(self, host: str) -> bool:
        """Count one more connection of ``host``; False (nothing counted) when it holds ``limit`` already."""
        key, bounded = self._key(host)
        held = self.open.get(key, 0)
        if bounded and held >= self.limit:
            return False
        self.open[key] = held + 1
        return True

    def leave(self, host: str) -> None:
        key, _ = self._key(host)
        held = self.open[key] - 1
        if held:
            self.open[key] = held
        else:
            del self.open[key]

    async def refusal(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection past its peer's limit: 429 in the OpenAI error format, then closed."""
        response = self._error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def guarded_protocol(
    header_timeout_s: float, stall_timeout_s: float, peers: PeerConnections | None = None
) -> type[GuardedProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for these timeouts and peer limits (one server's)."""
    attrs = {
        "header_timeout_s": header_timeout_s,
        "stall_timeout_s": stall_timeout_s,
        "peers": peers or PeerConnections(1 << 30),
    }
    return type("GuardedProtocol", (GuardedProtocol,), attrs)
