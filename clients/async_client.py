"""asyncio Python client of ``cdb.v1.Generation`` (``grpc.aio``).

    async with AsyncClient("127.0.0.1:50051") as c:
        async for item in c.stream("Hello", max_tokens=16):
            ...

Leaving a ``stream`` loop early (or cancelling the task) cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typing_extensions import Unpack

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from clients.common import (
    GenerateOptions,
    GenerateResult,
    ServerInfo,
    StreamFinish,
    StreamToken,
    build_request,
    stream_item,
)

Metadata = Sequence[tuple[str, str]]


class AsyncClient:
    """A ``grpc.aio`` channel to one server; create it inside a running event loop."""

    def __init__(self, address: str, *, timeout: float | None = None, metadata: Metadata = ()) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = tuple(metadata)
        self.channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None, metadata: Metadata) -> dict[str, object]:
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self.metadata + tuple(metadata)}

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
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[StreamToken | StreamFinish]:
        """Yield each token as it is generated, then one ``StreamFinish``."""
        call = self._stub.GenerateStream(build_request(prompt, options), **self._kw(timeout, metadata))
        try:
            async for msg in call:
                yield stream_item(msg)
        finally:
            call.cancel()

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
