"""How a request's events reach the client: the SSE body of a streamed response, and the wait of a non-streamed
one. However the response ends (finished, failed, the client gone, the server stopping), the request is closed:
aborted in the engine if it had not finished, and unregistered from the service."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cdb_engine.events import TokenEvent
from services.http.calls import Call
from services.http.errors import ApiError, api_error
from services.http.responses import Render


def sse_data(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse_body(call: Call, render: Render, fields: Mapping[str, str]) -> AsyncIterator[bytes]:
    """The SSE body: chunks, then ``[DONE]``; a failure after the headers went out is an ``error`` chunk."""
    try:
        for chunk in render.first():
            yield sse_data(chunk)
        async for ev in call.events():
            if isinstance(ev, TokenEvent):
                yield sse_data(render.token(ev))
            else:
                for chunk in render.finish(ev):
                    yield sse_data(chunk)
    except Exception as exc:
        yield sse_data(api_error(exc, fields).body())
    yield b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """``text/event-stream`` whose request is aborted however the response ends (also if it never started)."""

    def __init__(self, body: AsyncIterator[bytes], call: Call, headers: Mapping[str, str]) -> None:
        headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.call.close()


async def until_done_or_gone(call: Call, render: Render, request: Request) -> None:
    """Record every event of ``call`` into ``render``; a client that disconnects first aborts the request."""

    async def collect() -> None:
        async for ev in call.events():
            render.add(ev)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not done.done():
            done.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await done
        await call.close()
    if done.cancelled():
        raise ApiError(499, "client disconnected")
    done.result()
