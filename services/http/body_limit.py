"""``BodyLimit``: the HTTP API's request bodies bounded in bytes and in time before anything reads them.

An ASGI middleware in front of the app: a request whose ``Content-Length`` exceeds the limit, or whose body grows
past it while it is received, gets 413 (``request_too_large``) at once; one whose body has not arrived whole within
``read_timeout_s`` of its headers (``CDB_BODY_READ_TIMEOUT_S``; a client sending slowly or not at all) gets 408
(``request_timeout``) and its connection is closed. The app (JSON parsing, the API-key check, the route) never
sees either. A body within the limits is received whole (at most ``max_bytes`` held) and handed to the app as one
message; what the client sends afterwards (its disconnect) still reaches the app.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.http.errors import ApiError

_MAX_DIGITS = 18  # a longer Content-Length is over any limit (and not parsed)


class BodyLimit:
    """Refuse HTTP request bodies over ``max_bytes`` (413), or not received within ``read_timeout_s`` (408; None:
    no limit), before the wrapped ``app`` runs."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the request body exceeds {self.max_bytes} bytes (CDB_MAX_REQUEST_BYTES)",
            code="request_too_large",
        )

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body did not arrive within {self.read_timeout_s:g}s (CDB_BODY_READ_TIMEOUT_S)"
        response = ApiError(408, message, code="request_timeout").response()
        response.headers["Connection"] = "close"  # the rest of the body is not read: the connection cannot go on
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = None if self.read_timeout_s is None else asyncio.get_running_loop().time() + self.read_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await self._too_slow(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left before its body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    """The request's declared body length (None: not declared, or not a number: the server refuses those)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            if not text.isdigit():
                return None
            return int(text) if len(text) <= _MAX_DIGITS else 10**_MAX_DIGITS
    return None
