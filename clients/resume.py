"""Resuming a broken stream: which failures are resumed, the request that continues after the tokens received,
the delays between attempts, and ``Resumption``, one stream across its attempts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import grpc

from cdb_api.v1 import generation_pb2 as pb
from clients.messages import StreamFinish, StreamToken

RESUME_ATTEMPTS = 3  # a broken stream is resumed this many times at most (``resume_attempts``)
RESUME_WAIT_S = 30.0  # how long a resume waits for a server to be ready (a scheduler restarting)
ACCEPTED_HEADER = "cdb-request-id"  # GenerateStream's initial metadata: the server admitted the request


def accepted_id(metadata: object) -> str | None:
    """The request id a server sent when it admitted a stream (``ACCEPTED_HEADER``), or None: the call never
    reached a server that took it (nothing to wait for: a retry fails fast or goes elsewhere)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == ACCEPTED_HEADER:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


def resumable(exc: grpc.RpcError, delivered: bool) -> bool:
    """Whether a stream that failed with ``exc`` is sent again: its server (or the connection) went away or is
    draining (UNAVAILABLE), or, before it ``delivered`` a token, it was refused for load (RESOURCE_EXHAUSTED);
    any other status is the request's own outcome."""
    code = exc.code() if hasattr(exc, "code") else None
    return code is grpc.StatusCode.UNAVAILABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and not delivered)


def resume_request(
    request: pb.GenerateRequest, received: Sequence[StreamToken], request_id: str | None = None
) -> pb.GenerateRequest:
    """``request`` sent again to continue after the tokens ``received`` (``GenerateRequest.resume``), under the id
    the broken stream had (``request_id``: the one its server accepted it under), so that the stream's items keep
    one request id."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    if received:
        request_id = received[0].request_id
        again.resume.token_ids.extend(t.id for t in received)
        again.resume.depths.extend(t.depth for t in received)
    if request_id:
        again.request_id = request_id
    return again


def resume_delay(attempt: int) -> float:
    """Seconds to wait before resume attempt ``attempt`` (1, 2, ...): 50 ms doubling, at most 1 s."""
    return min(1.0, 0.05 * 2 ** (attempt - 1))


class Resumption:
    """One stream across its attempts (``Client.stream`` / ``AsyncClient.stream``): what it delivered, the id a
    server accepted it under, the attempts left and the deadline of them all."""

    def __init__(self, request: pb.GenerateRequest, attempts: int, budget: float | None) -> None:
        self.request = request
        self.attempts = attempts
        self.deadline = None if budget is None else time.monotonic() + budget
        self.received: list[StreamToken] = []
        self.accepted: str | None = None  # the id a server admitted the request under
        self.attempt = 0
        self.error: grpc.RpcError | None = None

    def next_request(self) -> pb.GenerateRequest:
        return resume_request(self.request, self.received, self.accepted)

    def left(self) -> float | None:
        """Seconds left of the deadline (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def keep(self, item: StreamToken | StreamFinish) -> StreamToken | StreamFinish:
        """``item``, recorded; the finish of a resumed attempt with the whole stream's counts (its server counted
        only the tokens it generated after the ``resumed_tokens`` it was sent)."""
        if isinstance(item, StreamToken):
            self.received.append(item)
        elif item.resumed_tokens:
            earlier = self.received[: item.resumed_tokens]
            steps = item.total_loop_steps + sum(t.depth for t in earlier)
            item = replace(item, generated_tokens=item.generated_tokens + len(earlier), total_loop_steps=steps)
        return item

    def failed(self, exc: grpc.RpcError, initial_metadata: object) -> tuple[bool, float]:
        """After attempt ``exc`` failed: ``(wait_for_ready, seconds)``. True: a server had taken the request and
        went away (restarting, draining): wait up to ``seconds`` for one to be ready, then send it again. False:
        it never reached one: sleep ``seconds`` and send it again. Raises ``exc`` when the stream must end."""
        self.attempt += 1
        if not resumable(exc, bool(self.received)) or self.attempt > self.attempts:
            raise exc
        self.error = exc
        self.accepted = self.accepted or accepted_id(initial_metadata)
        if self.accepted is None:
            return False, resume_delay(self.attempt)
        left = self.left()
        return True, RESUME_WAIT_S if left is None else min(RESUME_WAIT_S, left)
