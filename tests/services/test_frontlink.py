"""The front-end link in one process: a real engine and ``LinkServer``, front ends as ``LinkClient`` +
``RemoteClient``. Tokens equal the engine's own, ids and aborts reach across front ends, a front end that leaves
has its requests aborted, request metrics reach the scheduler's registry, and a wrong secret or a frame carrying
code is refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cdb_engine.client import InProcessClient
from cdb_engine.config import RequestParams, Structure, StructureKind
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_engine.events import FinishEvent, TokenEvent
from cdb_engine.prepare import RequestPreparer
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams, TokenLogprobs
from services.api.door import FrontDoor
from services.api.info import EngineInfo
from services.frontlink.client import LinkClient, MetricsRelay, RemoteClient
from services.frontlink.messages import (
    Abort,
    AskInfo,
    Events,
    LinkError,
    Reply,
    Submit,
    decode_call,
    decode_news,
    encode,
)
from services.frontlink.server import LinkServer
from services.frontlink.wire import Wire, client_handshake, server_handshake
from services.settings import Settings
from tests.services.tree import SHARED_CONFIG

pytestmark = pytest.mark.timeout(120)

SECRET = "front-end-link-test-secret"


class Link:
    def __init__(self, engine: Engine, door: FrontDoor, server: LinkServer, path: str) -> None:
        self.engine, self.door, self.server, self.path = engine, door, server, path
        self.prep = RequestPreparer.of(SHARED_CONFIG)  # (a front end's own: no engine)
        self.clients: list[LinkClient] = []

    def front_end(self, secret: str = SECRET) -> RemoteClient:
        client = LinkClient(self.path, secret).start()
        self.clients.append(client)
        return RemoteClient(self.prep, client)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    with tempfile.TemporaryDirectory() as tmp, Engine(SHARED_CONFIG) as engine:
        door = FrontDoor(InProcessClient(engine), Settings(health_interval_s=0.1))
        door.not_ready = None
        path = os.path.join(tmp, "link.sock")
        server = LinkServer(path, engine, door, EngineInfo(engine, door).reply, SECRET).start()
        out = Link(engine, door, server, path)
        try:
            yield out
        finally:
            for client in out.clients:
                client.close()
            # (each reader logs its front end's departure: done before the test's log capture ends)
            _wait(lambda: server.peers == 0, "the link server saw every front end leave")
            server.close()


def _ready(remote: RemoteClient) -> RemoteClient:
    assert remote.link.connected.wait(10), remote.link.reason
    deadline = time.monotonic() + 10
    while remote.link.reason is not None:  # the first status frame follows the handshake
        assert time.monotonic() < deadline, remote.link.reason
        time.sleep(0.01)
    return remote


async def _collect(remote: RemoteClient, ids: list[int], params: RequestParams, key: str) -> tuple[list, FinishEvent]:
    tokens: list[TokenEvent] = []
    async with await remote.open_stream(ids, params, key) as stream:
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            else:
                return tokens, ev
    raise AssertionError("no finish")


def test_tokens_through_two_front_ends_equal_the_engine(link: Link) -> None:
    a, b = _ready(link.front_end()), _ready(link.front_end())
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    params = [
        RequestParams(
            max_tokens=rng.randrange(1, 20),
            ignore_eos=True,
            sampling=SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(),
        )
        for i in range(8)
    ]
    # Half of them with a stop string cut from the middle of their own text (found by the front end's detokenizer:
    # the scheduler sends ids only), one that never occurs on the others.
    free = link.engine.generate(prompts, params)
    for i, done in enumerate(free):
        middle = done.text[len(done.text) // 3 : len(done.text) // 3 + 2]
        stop = middle if i % 2 == 0 and len(middle) == 2 and len(done.token_ids) > 2 else "\x00never"
        params[i] = replace(params[i], stop_strings=(stop,))
    expected = link.engine.generate(prompts, params)
    assert sum(e.finish_reason is FinishReason.STOP for e in expected) >= 2

    async def main() -> list[tuple[list, FinishEvent]]:
        runs = [_collect((a, b)[i % 2], prompts[i], params[i], f"eq-{i}") for i in range(8)]
        return await asyncio.gather(*runs)

    for exp, (tokens, finish) in zip(expected, asyncio.run(main())):
        assert [t.token_id for t in tokens] == exp.token_ids and [t.depth for t in tokens] == exp.depths
        assert "".join(t.text for t in tokens) + finish.text == exp.text
        assert finish.finish_reason == exp.finish_reason and finish.total_loop_steps == exp.total_loop_steps
        assert finish.generated_tokens == len(exp.token_ids)
    assert not a.link.streams and not b.link.streams
    _wait(lambda: link.engine.stats().running == 0 and link.engine.stats().used_kv_blocks == 0, "released")


def test_duplicate_ids_and_aborts_reach_across_front_ends(link: Link) -> None:
    a, b = _ready(link.front_end()), _ready(link.front_end())
    long = RequestParams(max_tokens=300, ignore_eos=True)

    async def main() -> None:
        stream = await a.open_stream([5, 6, 7], long, "x/shared-id")
        async with stream:
            first = await stream.__anext__()
            assert isinstance(first, TokenEvent)
            with pytest.raises(InvalidRequest) as err:
                await b.open_stream([5], long, "x/shared-id")  # the engine knows the id: another front end's
            assert err.value.field == "request_id"
            found = b.abort("x/shared-id")  # not b's own: asked of the scheduler
            assert not isinstance(found, bool)
            assert await found is True
            rest = [ev async for ev in stream]
            assert isinstance(rest[-1], FinishEvent) and rest[-1].finish_reason is FinishReason.CANCELLED
        assert await b.abort("x/never-seen") is False

    asyncio.run(main())
    _wait(lambda: link.engine.stats().running == 0 and link.engine.stats().waiting == 0, "engine idle")


def _wait(cond: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # the engine applies aborts on its own thread: there is no event to wait on


def test_a_front_end_that_leaves_has_its_requests_aborted(link: Link, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cdb.link")
    a = _ready(link.front_end())
    peers = link.server.peers

    async def main() -> None:
        stream = await a.open_stream([9, 9, 9], RequestParams(max_tokens=300, ignore_eos=True), "x/left")
        assert isinstance(await stream.__anext__(), TokenEvent)
        a.link.close()  # the process is gone, as far as the scheduler can tell

    asyncio.run(main())
    _wait(lambda: link.server.peers == peers - 1, "the link server dropped the front end")
    assert any("aborted its 1 live requests" in r.getMessage() for r in caplog.records)
    _wait(lambda: link.engine.stats().running == 0 and link.engine.stats().used_kv_blocks == 0, "released")


def test_a_stream_resumed_before_the_dead_front_ends_link_end_is_read_is_admitted(
    link: Link, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end dies with a live request; its client resumes the stream, same id, on another front end. The dead
    one's reader is still busy with an earlier frame (here: an Info call held open), so it has not read the end of
    the link: the resumed request is admitted all the same, and the dead one's request is aborted."""
    gate, busy = threading.Event(), threading.Event()
    info = link.server.info

    def held_info() -> object:
        busy.set()
        gate.wait(30)
        return info()

    monkeypatch.setattr(link.server, "info", held_info)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(link.path)
    dead = Wire(sock)
    client_handshake(dead, SECRET.encode())
    long = RequestParams(max_tokens=300, ignore_eos=True)
    dead.send(encode(Submit(1, "x/resumed", [4, 5, 6], long, "")))
    while not isinstance(frame := decode_news(dead.recv()), Reply):  # (status frames first)
        pass
    assert (frame.cid, frame.error) == (1, None), frame
    dead.send(encode(AskInfo(2)))
    assert busy.wait(10)
    dead.close()  # the front end's process is gone; its reader is still inside the Info call
    b = _ready(link.front_end())
    try:

        async def main() -> tuple[list, FinishEvent]:
            return await _collect(b, [4, 5, 6], RequestParams(max_tokens=4, ignore_eos=True), "x/resumed")

        tokens, finish = asyncio.run(main())
        assert len(tokens) == 4 and finish.finish_reason is FinishReason.LENGTH
    finally:
        gate.set()
    _wait(lambda: link.engine.stats().running == 0 and link.engine.stats().used_kv_blocks == 0, "released")


def test_a_resumed_streams_usage_counts_the_resumed_tokens_apart_across_the_link(link: Link) -> None:
    """A resumed stream through a front end: the tokens after the resumed ones, and a finish (made in the scheduler
    process) whose usage counts only them, the resumed ones apart in ``resumed_tokens``."""
    a = _ready(link.front_end())
    params = RequestParams(max_tokens=8, ignore_eos=True)
    whole = link.engine.generate([[4, 5, 6]], params)[0]
    again = replace(params, resume_tokens=tuple(whole.token_ids[:3]), resume_depths=tuple(whole.depths[:3]))
    tokens, finish = asyncio.run(_collect(a, [4, 5, 6], again, "x/resumed-usage"))
    assert [t.token_id for t in tokens] == whole.token_ids[3:]
    assert (finish.generated_tokens, finish.total_loop_steps, finish.resumed_tokens) == (5, sum(whole.depths[3:]), 3)


def test_request_metrics_reach_the_scheduler_registry(link: Link) -> None:
    a = _ready(link.front_end())
    relay = MetricsRelay(a.link)
    metrics = link.door.metrics
    tokens, itl = metrics.generated_tokens.value(), metrics.itl.count()
    relay.observe_token_depth(3)
    relay.observe_token_depth(2)
    relay.observe_itl(0.01)
    relay.observe_admitted(7)
    relay.close()  # flushes
    _wait(lambda: metrics.generated_tokens.value() == tokens + 2, "relayed tokens")
    assert metrics.itl.count() == itl + 1
    body, content_type = asyncio.run(relay.exposition(None))
    assert b"cdb_generation_tokens_total" in body and content_type.startswith("text/plain")


def test_a_wrong_secret_is_refused(link: Link) -> None:
    peers = link.server.peers
    wrong = link.front_end("not-the-secret-of-this-link")
    assert not wrong.link.connected.wait(1.0)
    assert wrong.link.reason is not None and link.server.peers == peers
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: _quiet(client_handshake, Wire(b), b"another-secret-entirely"))
    t.start()
    try:
        with pytest.raises(LinkError):  # and the scheduler side of the same handshake
            server_handshake(Wire(a), SECRET.encode())
    finally:
        a.close()  # (the client's wait for our proof ends with the connection)
    t.join()
    b.close()


def _quiet(fn: object, *args: object) -> None:
    with contextlib.suppress(LinkError, OSError):
        fn(*args)  # type: ignore[operator]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_frames_carry_typed_data_not_code() -> None:
    processing = LogitsProcessing(presence_penalty=0.5, logit_bias=((3, 1.0),), min_tokens=2, stop_ids=(0,))
    sampling = SamplingParams(temperature=0.5, top_k=4, top_p=0.9, seed=1, logprobs=2, processing=processing)
    structure = Structure(StructureKind.REGEX, "[a-z]+", "structured_outputs.regex")
    params = RequestParams(max_tokens=3, sampling=sampling, stop_strings=("a",), structure=structure)
    event = FinishEvent("k", FinishReason.STOP, 1, 2, 3)
    assert decode_call(encode(Submit(1, "k", [1, 2], params, ""))) == Submit(1, "k", [1, 2], params, "")
    token = TokenEvent("k", 0, 5, "a", 3, TokenLogprobs(-0.5, (5, 6), (-0.5, -1.5)), 7)
    assert decode_news(encode(Events.of([token, event]))) == Events([token], [event])
    assert decode_call(encode(Abort(0, "k", FinishReason.STOP))).reason is FinishReason.STOP
    with pytest.raises(LinkError, match="not a message"):
        decode_call(pickle.dumps(_Evil()))
    with pytest.raises(LinkError, match="not a message"):
        decode_call(encode(Events.of([token])))  # a message of the other direction
    with pytest.raises(LinkError, match="not a message"):
        decode_call(encode(Submit(1, "k", [1, 2], params, ""))[:-1] + b"\xc1")  # a field that is no message
