"""Request ids and Abort are scoped to the caller (its API key): a caller can neither abort nor squat another
caller's request id; without keys (or client certificates) every caller shares one anonymous scope."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cdb_engine.engine import Engine
from clients.messages import StreamFinish, StreamToken
from clients.sync_client import Client
from services.api.security import ANONYMOUS_SCOPE
from services.settings import Settings
from tests.services.public_port import PublicServer, public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

LONG = {"max_tokens": 1000, "ignore_eos": True}  # seconds of generation here: still running when aborted


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def keyed(engine: Engine) -> Iterator[PublicServer]:
    with public_server(engine, Settings(api_keys="key-of-a,key-of-b", health_interval_s=0.05)) as server:
        yield server


def _finish(stream: Iterator[StreamToken | StreamFinish]) -> StreamFinish:
    *_, last = stream
    assert isinstance(last, StreamFinish)
    return last


def test_abort_from_another_key_finds_nothing_and_leaves_the_stream_running(
    keyed: PublicServer, engine: Engine
) -> None:
    with Client(keyed.address, timeout=30, api_key="key-of-a") as a, Client(keyed.address, api_key="key-of-b") as b:
        stream = a.stream("hello", request_id="job-1", **LONG)
        first = next(stream)
        assert isinstance(first, StreamToken) and first.request_id == "job-1"
        assert b.abort("job-1") is False
        assert engine.stats().running + engine.stats().waiting == 1  # A's request is still live ...
        following = next(stream)
        assert isinstance(following, StreamToken)  # ... and still streaming
        assert a.abort("job-1") is True  # only its own caller aborts it
        finish = _finish(stream)
        assert finish.finish_reason == "cancelled" and finish.request_id == "job-1"


def test_the_same_request_id_from_two_keys_gives_two_independent_requests(keyed: PublicServer) -> None:
    with Client(keyed.address, timeout=30, api_key="key-of-a") as a, Client(keyed.address, api_key="key-of-b") as b:
        stream_a = a.stream("hello", request_id="shared-id", **LONG)
        assert next(stream_a).request_id == "shared-id"
        # B's request with A's id is neither refused as a duplicate nor merged with A's
        whole_b = b.generate("abc", request_id="shared-id", max_tokens=5, ignore_eos=True)
        assert whole_b.request_id == "shared-id" and len(whole_b.tokens) == 5
        assert whole_b.finish.finish_reason == "length"
        stream_b = b.stream("abc", request_id="shared-id", **LONG)
        assert next(stream_b).request_id == "shared-id"
        assert b.abort("shared-id") is True
        assert _finish(stream_b).finish_reason == "cancelled"
        next(stream_a)  # A's stream outlived B's abort of "its" id
        assert a.abort("shared-id") is True
        assert _finish(stream_a).finish_reason == "cancelled"


def test_a_duplicate_id_of_the_same_caller_is_refused_naming_its_own_id(keyed: PublicServer) -> None:
    with Client(keyed.address, timeout=30, api_key="key-of-a") as a:
        stream = a.stream("hello", request_id="dup-1", **LONG)
        next(stream)
        with pytest.raises(grpc.RpcError) as err:
            a.generate("x", request_id="dup-1")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "request_id: 'dup-1' is already used by a live request"
        assert a.abort("dup-1") is True
        assert _finish(stream).finish_reason == "cancelled"


def test_server_assigned_ids_are_echoed_and_abortable_by_their_caller(keyed: PublicServer) -> None:
    with Client(keyed.address, timeout=30, api_key="key-of-b") as b, Client(keyed.address, api_key="key-of-a") as a:
        stream = b.stream("hello", **LONG)
        first = next(stream)
        assert first.request_id and "/" not in first.request_id  # the caller's id, not the engine's scoped one
        assert a.abort(first.request_id) is False
        assert b.abort(first.request_id) is True
        assert _finish(stream).request_id == first.request_id


def test_scoped_ids_name_the_key_by_digest_only(keyed: PublicServer) -> None:
    with Client(keyed.address, timeout=30, api_key="key-of-a") as a:
        stream = a.stream("hello", request_id="visible", **LONG)
        next(stream)
        (scoped,) = keyed.service.door.live
        scope, _, request_id = scoped.partition("/")
        assert request_id == "visible" and scope.startswith("key-") and len(scope) == 16
        assert "key-of-a" not in scoped
        assert a.abort("visible") is True
        _finish(stream)


def test_without_keys_every_caller_shares_the_anonymous_scope(engine: Engine) -> None:
    with public_server(engine) as server, Client(server.address, timeout=30) as a, Client(server.address) as b:
        stream = a.stream("hello", request_id="anon-job", **LONG)
        next(stream)
        assert list(server.door.live) == [f"{ANONYMOUS_SCOPE}/anon-job"]
        with pytest.raises(grpc.RpcError) as err:
            b.generate("x", request_id="anon-job")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert b.abort("anon-job") is True  # documented: one shared scope
        assert _finish(stream).finish_reason == "cancelled"
