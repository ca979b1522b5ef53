"""asyncio Python client of ``cdb.v1.Generation`` (``grpc.aio``).

    async with AsyncClient("127.0.0.1:50051") as c:
        async for item in c.stream("Hello", max_tokens=16):
            ...

Leaving a ``stream`` loop early (or cancelling the task) cancels the call, which aborts the request on the server.
``tls=``, ``api_key=``, several replicas and ``lb_policy=`` / ``retry=`` / ``options=`` as for the blocking
``Client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2
from typing_extensions import Unpack

from cdb_api.v1 import generation_pb2 as pb
from clients.base import ClientBase, Metadata
from clients.messages import (
    GenerateOptions,
    GenerateResult,
    ServerInfo,
    StreamFinish,
    StreamToken,
    build_request,
    stream_items,
)
from clients.resume import RESUME_ATTEMPTS, Resumption


class AsyncClient(ClientBase):
    """A ``grpc.aio`` channel to one server or several replicas; create it inside a running event loop. ``tls``,
    ``api_key``, ``lb_policy``, ``retry``, ``options``: as for ``Client``."""

    _AIO = True
    channel: grpc.aio.Channel

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Generate to completion (unary ``Generate``)."""
        reply = await self._stub.Generate(build_request(prompt, options), **self._kw(timeout, metadata))
        return GenerateResult.from_pb(reply)

    async def stream(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        resume_attempts: int = RESUME_ATTEMPTS,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[StreamToken | StreamFinish]:
        """Yield each token as it is generated, then one ``StreamFinish``; a stream whose server died or drained is
        resumed where it stopped, as ``Client.stream`` does."""
        stream = Resumption(
            build_request(prompt, options), resume_attempts, self.timeout if timeout is None else timeout
        )
        while True:
            call = self._stub.GenerateStream(stream.next_request(), **self._kw(stream.left(), metadata))
            try:
                async for msg in call:
                    for item in stream_items(msg):
                        yield stream.keep(item)
                return
            except grpc.aio.AioRpcError as exc:
                wait_for_ready, seconds = stream.failed(exc, exc.initial_metadata())
            finally:
                call.cancel()
            if not wait_for_ready:
                await asyncio.sleep(seconds)
                continue
            try:  # a server took it and went away: wait for one (restarting, or another replica) to be ready
                await asyncio.wait_for(self.channel.channel_ready(), seconds)
            except TimeoutError:
                assert stream.error is not None
                raise stream.error from None

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        reply = await self._stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout, ()))
        return bool(reply.found)

    async def info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo.from_pb(await self._stub.Info(pb.InfoRequest(), **self._kw(timeout, ())))

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """``SERVING``, ``NOT_SERVING`` (or ``UNAVAILABLE`` when the server cannot be reached)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNAVAILABLE"
            raise
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
