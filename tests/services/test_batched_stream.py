"""Tokens that are ready together travel in one stream message when the caller asks (``batch_tokens``), each
with its own depth and time; the clients still yield them one by one, and callers who did not ask get one token
per message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.events import FinishEvent
from cdb_engine.stream import RequestStream
from clients.sync_client import Client
from tests.services.public_port import PublicServer, public_server, tiny_engine

N = 12


@pytest.fixture(scope="module")
def server() -> Iterator[PublicServer]:
    with tiny_engine() as engine, public_server(engine) as running:
        yield running


@pytest.fixture
def slow_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server side reads a request's first event only once the whole generation is queued (a caller that reads
    slower than tokens are produced), so every token is ready together."""
    first = RequestStream.__anext__

    async def anext_when_all_queued(self: RequestStream) -> object:
        deadline = time.monotonic() + 30
        while (
            not self.finished
            and not any(isinstance(e, FinishEvent) for e in self._queue._queue)
            and time.monotonic() < deadline
        ):  # type: ignore[attr-defined]
            await asyncio.sleep(0.001)  # polls a condition with a deadline
        return await first(self)

    monkeypatch.setattr(RequestStream, "__anext__", anext_when_all_queued)


def _request(batch: bool) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_tokens=N, ignore_eos=True, batch_tokens=batch)
    req.text = "the tokens of one answer"
    return req


def _stream(server: PublicServer, batch: bool) -> list[pb.GenerateStreamResponse]:
    with grpc.insecure_channel(server.address) as channel:
        return list(generation_pb2_grpc.GenerationStub(channel).GenerateStream(_request(batch), timeout=60))


def test_tokens_ready_together_travel_in_one_message_each_with_its_depth_and_time(
    server: PublicServer, slow_reader: None
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        reference = generation_pb2_grpc.GenerationStub(channel).Generate(_request(False), timeout=60)
    msgs = _stream(server, batch=True)
    assert [m.WhichOneof("event") for m in msgs] == ["tokens", "finish"]
    tokens = list(msgs[0].tokens.tokens)
    assert [(t.id, t.depth, t.text) for t in tokens] == [(t.id, t.depth, t.text) for t in reference.tokens]
    times = [t.time_unix_nano for t in tokens]
    assert times[0] > 0 and times == sorted(times)
    assert msgs[1].finish.usage.generated_tokens == N


def test_callers_that_did_not_ask_get_one_token_per_message(server: PublicServer, slow_reader: None) -> None:
    msgs = _stream(server, batch=False)
    assert [m.WhichOneof("event") for m in msgs] == ["token"] * N + ["finish"]


def test_the_client_yields_batched_tokens_one_by_one(server: PublicServer, slow_reader: None) -> None:
    with Client(server.address, timeout=60) as client:
        reference = client.generate("the tokens of one answer", max_tokens=N, ignore_eos=True)
        items = list(client.stream("the tokens of one answer", max_tokens=N, ignore_eos=True))
    tokens, finish = items[:-1], items[-1]
    assert [(t.id, t.depth) for t in tokens] == list(zip(reference.token_ids, reference.depths))
    assert all(t.is_token and t.time_unix_nano > 0 for t in tokens) and not finish.is_token
