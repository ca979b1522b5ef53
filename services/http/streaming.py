"""How a request's events reach the client: the SSE body of a streamed response, and the wait of a non-streamed
one. However the response ends (finished, failed, the client gone, the server stopping), the request is closed:
aborted in the engine if it had not finished, and unregistered from the service.

A response with several choices (a list of prompts, ``n`` > 1) has one engine request (``Ticket``) and one
``Render`` per choice: its SSE body interleaves their chunks as their events come, and ends, after every
choice's last chunk, with one usage chunk (when asked) and ``[DONE]``; the first failure ends it (and closes the
other choices' requests)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cdb_engine.events import Event, TokenEvent
from services.api.door import Ticket
from services.http.errors import ApiError, api_error
from services.http.responses import Render, usage_of

_JSON = msgspec.json.Encoder()


def sse_data(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


async def sse_body(
    calls: Sequence[Ticket], renders: Sequence[Render], fields: Mapping[str, str]
) -> AsyncIterator[bytes]:
    """The SSE body of the choices ``renders[k]`` of ``calls[k]``: chunks, then the usage chunk when asked, then
    ``[DONE]``; a failure after the headers went out is an ``error`` chunk. The chunks of the events that were
    ready together go out in one write."""
    try:
        first = b"".join(sse_data(chunk) for render in renders for chunk in render.first())
        if first:
            yield first
        async for k, batch in _batches(calls):
            render = renders[k]
            out: list[bytes] = []
            for ev in batch:
                out.extend(sse_data(chunk) for chunk in render.before(ev))
                out.append(sse_data(render.token(ev) if isinstance(ev, TokenEvent) else render.finish(ev)))
            yield b"".join(out)
        if renders[0].include_usage:
            yield sse_data(renders[0].usage_chunk(usage_of(renders)))
    except Exception as exc:
        yield sse_data(api_error(exc, fields).body())
    yield b"data: [DONE]\n\n"


async def _batches(calls: Sequence[Ticket]) -> AsyncIterator[tuple[int, list[Event]]]:
    """``(k, events of calls[k] that were ready together)`` as they come; one call's events in order. The first
    failure is raised."""
    if len(calls) == 1:  # the common case, without a task per call
        async for batch in calls[0].batches():
            yield 0, batch
        return
    merged: asyncio.Queue[tuple[int, list[Event] | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, call: Ticket) -> None:
        try:
            async for batch in call.batches():
                merged.put_nowait((k, batch))
        except Exception as exc:
            merged.put_nowait((k, exc))
        merged.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, call)) for k, call in enumerate(calls)]
    try:
        left = len(calls)
        while left:
            k, item = await merged.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventStream(StreamingResponse):
    """``text/event-stream`` whose requests are aborted however the response ends (also if it never started)."""

    def __init__(self, body: AsyncIterator[bytes], calls: Sequence[Ticket], headers: Mapping[str, str]) -> None:
        headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for call in self.calls:
                await call.close()


async def until_done_or_gone(calls: Sequence[Ticket], renders: Sequence[Render], request: Request) -> None:
    """Record every event of ``calls[k]`` into ``renders[k]``; a client that disconnects first aborts the
    requests."""

    async def collect() -> None:
        async for k, batch in _batches(calls):
            for ev in batch:
                renders[k].add(ev)

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
        for call in calls:
            await call.close()
    if done.cancelled():
        raise ApiError(499, "client disconnected")
    done.result()
