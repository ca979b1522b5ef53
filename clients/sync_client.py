"""Blocking Python client of ``cdb.v1.Generation``.

    with Client("127.0.0.1:50051") as c:
        for item in c.stream("Hello", max_tokens=16):
            print(item.text if item.is_token else item.finish_reason)

Leaving a ``stream`` loop early cancels the call, which aborts the request on the server. A secured server:
``Client(address, tls=TlsOptions.from_files(ca="ca.crt"), api_key=KEY)`` (see ``clients.channel``).

Several replicas: ``Client(["10.0.0.5:50051", "10.0.0.6:50051"])``, ``Client("10.0.0.5:50051,10.0.0.6:50051")``
or ``Client("dns:///cdb-headless.cdb.svc.cluster.local:50051")``: each call goes to the next replica
(``round_robin``); a call that fails with UNAVAILABLE or RESOURCE_EXHAUSTED is sent again elsewhere
(``clients.balancing``), and a stream whose server dies or drains is resumed where it stopped (``stream``).
``health``, ``wait_for_status`` and ``info`` ask the replica the policy picks for that call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
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


class Client(ClientBase):
    """A channel to one server or several replicas. ``timeout`` is the default deadline of each call, all its
    attempts included (None: no deadline); ``tls``: TLS (and mTLS) options, else plaintext; ``api_key``: sent as
    ``authorization: Bearer KEY`` on every call; ``lb_policy`` (``round_robin`` or ``pick_first``), ``retry``
    (None: no retries) and ``options`` (more channel arguments): see ``clients.channel.open_channel``."""

    channel: grpc.Channel

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
        resume_attempts: int = RESUME_ATTEMPTS,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[StreamToken | StreamFinish]:
        """Yield each token as it is generated, then one ``StreamFinish``.

        A stream that breaks because its server died or drained (UNAVAILABLE) is resumed, up to ``resume_attempts``
        times, on the channel's next pick (the restarted server, or another replica): the request is sent again
        with the tokens already yielded (``GenerateRequest.resume``) and continues exactly where it stopped; no
        token is yielded twice. ``timeout`` bounds all attempts together."""
        stream = Resumption(
            build_request(prompt, options), resume_attempts, self.timeout if timeout is None else timeout
        )
        while True:
            call = self._stub.GenerateStream(stream.next_request(), **self._kw(stream.left(), metadata))
            try:
                for msg in call:
                    for item in stream_items(msg):
                        yield stream.keep(item)
                return
            except grpc.RpcError as exc:
                wait_for_ready, seconds = stream.failed(exc, call.initial_metadata())
            finally:
                call.cancel()  # no-op when the stream ended; aborts the request when the caller stopped early
            if not wait_for_ready:
                time.sleep(seconds)
                continue
            try:  # a server took it and went away: wait for one (restarting, or another replica) to be ready
                grpc.channel_ready_future(self.channel).result(timeout=seconds)
            except grpc.FutureTimeoutError:
                assert stream.error is not None
                raise stream.error from None

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
