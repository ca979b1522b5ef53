"""Blocking Python client of ``cdb.v1.Generation``.

    with Client("127.0.0.1:50051") as c:
        for item in c.stream("Hello", max_tokens=16):
            print(item.text if item.is_token else item.finish_reason)

Leaving a ``stream`` loop early cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
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


class Client:
    """A channel to one server. ``timeout`` is the default deadline of each call (None: no deadline)."""

    def __init__(self, address: str, *, timeout: float | None = None, metadata: Metadata = ()) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = tuple(metadata)  # e.g. W3C ``traceparent``, sent with every call
        self.channel = grpc.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None, metadata: Metadata) -> dict[str, object]:
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self.metadata + tuple(metadata)}

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Generate to completion (unary ``Generate``)."""
        reply = self._stub.Generate(build_request(prompt, options), **self._kw(timeout, metadata))
        return GenerateResult.from_pb(reply)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        **options: Unpack[GenerateOptions],
    ) -> Iterator[StreamToken | StreamFinish]:
        """Yield each token as it is generated, then one ``StreamFinish``."""
        call = self._stub.GenerateStream(build_request(prompt, options), **self._kw(timeout, metadata))
        try:
            for msg in call:
                yield stream_item(msg)
        finally:
            call.cancel()  # no-op when the stream ended; aborts the request when the caller stopped early

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a live request; False if the server does not know it."""
        return bool(self._stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout, ())).found)

    def info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo.from_pb(self._stub.Info(pb.InfoRequest(), **self._kw(timeout, ())))

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """``SERVING``, ``NOT_SERVING`` (or ``UNAVAILABLE`` when the server cannot be reached)."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNAVAILABLE"
            raise
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def wait_for_status(self, status: str = "SERVING", timeout: float = 60.0) -> None:
        """Block until ``health()`` reports ``status`` (health Watch stream; raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            watch = self._health.Watch(health_pb2.HealthCheckRequest(), timeout=left)
            try:
                for reply in watch:
                    if health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == status:
                        return
            except grpc.RpcError as exc:
                if status == "UNAVAILABLE" and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                time.sleep(min(0.05, max(0.0, left)))  # server restarting: retry the watch
            finally:
                watch.cancel()
        raise TimeoutError(f"{self.address} did not report {status} within {timeout}s")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
