"""Fair shares of the public gRPC port: a caller at its limit is refused (RESOURCE_EXHAUSTED naming the setting)
while a caller with another key is served; shares come back on every way a request ends; health Watch streams
have their own cap, not the calls'; a stream whose client stops reading is cut and its request aborted."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.client import InProcessClient
from cdb_engine.engine import Engine
from clients.messages import StreamFinish, StreamToken
from clients.sync_client import Client
from services.api.door import FrontDoor
from services.api.errors import CallerLimit
from services.api.shares import grpc_peer_host, host_key, share_scope
from services.settings import Settings
from tests.http.harness import wait_until
from tests.services.public_port import PublicServer, public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

LONG = {"max_tokens": 1000, "ignore_eos": True}  # seconds of generation here: still running when aborted
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


def _code(err: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    return err.value.code(), err.value.details() or ""


def settled(server: PublicServer, engine: Engine) -> None:
    """Wait until nothing is held: no share, no live request, no counted call, no engine work."""
    service = server.service

    def idle() -> bool:
        stats = engine.stats()
        return (
            not server.door.shares.held()
            and not server.door.live
            and service.caps.calls.in_use == 0
            and stats.running + stats.waiting == 0
        )

    wait_until(idle, "every share, call and request to be given back", timeout=20)


def test_the_share_scope_is_the_key_else_the_host() -> None:
    assert grpc_peer_host("ipv4:10.0.0.5:40312") == "10.0.0.5"
    assert grpc_peer_host("ipv6:[2001:db8:1:2:3:4:5:6]:40312") == "2001:db8:1:2::/64"  # one machine's network
    assert grpc_peer_host("ipv6:[::ffff:10.0.0.5]:1") == "10.0.0.5"
    assert grpc_peer_host("unix:/tmp/cdb.sock") == "unix"
    assert host_key("127.0.0.1") == "127.0.0.1" and host_key("testclient") == "testclient"
    assert share_scope("anon", "10.0.0.5") == "peer-10.0.0.5"
    assert share_scope("key-0123456789ab", "10.0.0.5") == "key-0123456789ab"


def test_by_default_one_caller_holds_at_most_half_of_what_the_server_admits(engine: Engine) -> None:
    assert Settings().caller_limits(32 + 256) == (144, 144)
    assert Settings(max_requests_per_caller=300).caller_limits(288) == (300, 300), "set: as set, streams too"
    assert Settings(max_streams_per_caller=5).caller_limits(288) == (144, 5)
    assert Settings().caller_limits(1) == (1, 1)
    door = FrontDoor(InProcessClient(engine), Settings())
    capacity = engine.config.max_num_seqs + engine.config.max_waiting
    assert (door.shares.max_requests, door.shares.max_streams) == (capacity // 2, capacity // 2)
    for _ in range(capacity // 2):
        door.shares.take("peer-198.51.100.7", True)
    with pytest.raises(CallerLimit, match="CDB_MAX_REQUESTS_PER_CALLER"):
        door.shares.take("peer-198.51.100.7", False)


def test_a_caller_at_its_limit_is_refused_and_another_key_is_served(engine: Engine) -> None:
    settings = Settings(api_keys="key-of-a,key-of-b", max_requests_per_caller=2, health_interval_s=0.05)
    with (
        public_server(engine, settings) as server,
        Client(server.address, timeout=30, api_key="key-of-a", retry=None) as a,
        Client(server.address, timeout=30, api_key="key-of-b", retry=None) as b,
    ):
        streams = [a.stream("hello", request_id=f"a{i}", **LONG) for i in range(2)]
        for stream in streams:
            assert isinstance(next(stream), StreamToken)
        with pytest.raises(grpc.RpcError) as err:
            a.generate("one too many", max_tokens=2)
        code, details = _code(err)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "CDB_MAX_REQUESTS_PER_CALLER" in details
        with pytest.raises(grpc.RpcError) as err:
            next(a.stream("nor a stream", max_tokens=2))
        assert _code(err)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        whole = b.generate("b's turn", max_tokens=3, ignore_eos=True)  # another key: served at once
        assert whole.finish.finish_reason == "length" and len(whole.tokens) == 3
        assert list(server.door.shares.held().values()) == [(2, 2)]  # A's two streams, nothing of B left
        for i, stream in enumerate(streams):
            assert isinstance(next(stream), StreamToken)  # A's requests went on
            assert a.abort(f"a{i}") is True
            *_, last = stream
            assert isinstance(last, StreamFinish) and last.finish_reason == "cancelled"
        settled(server, engine)
        assert len(a.generate("room again", max_tokens=2, ignore_eos=True).tokens) == 2


def test_without_keys_each_host_has_its_own_streams_share(engine: Engine) -> None:
    settings = Settings(max_streams_per_caller=1, health_interval_s=0.05)
    with public_server(engine, settings) as server, Client(server.address, timeout=30, retry=None) as client:
        stream = client.stream("hello", request_id="only-stream", **LONG)
        assert isinstance(next(stream), StreamToken)
        assert server.door.shares.held() == {"peer-127.0.0.1": (1, 1)}
        assert list(server.door.live) == ["anon/only-stream"]  # request ids keep the shared anonymous scope
        with pytest.raises(grpc.RpcError) as err:
            next(client.stream("a second stream", max_tokens=2))
        code, details = _code(err)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "CDB_MAX_STREAMS_PER_CALLER" in details
        assert len(client.generate("unary still fits", max_tokens=2, ignore_eos=True).tokens) == 2
        stream.close()  # the client cancels its stream
        settled(server, engine)


def test_every_way_a_request_ends_gives_its_share_back(engine: Engine) -> None:
    """With a share of one request, a share that was not given back would refuse the next request."""
    settings = Settings(max_requests_per_caller=1, health_interval_s=0.05)
    with public_server(engine, settings) as server, Client(server.address, timeout=30, retry=None) as client:

        def next_one_fits() -> None:
            settled(server, engine)
            assert len(client.generate("fits", max_tokens=2, ignore_eos=True).tokens) == 2

        next_one_fits()  # finished
        with pytest.raises(grpc.RpcError) as err:
            client.generate("bad", max_tokens=2, top_p=1.5)  # refused after the share was taken
        assert _code(err)[0] == grpc.StatusCode.INVALID_ARGUMENT
        next_one_fits()
        with pytest.raises(grpc.RpcError) as err:
            client.generate("too slow", timeout=0.3, **LONG)  # its deadline passes
        assert _code(err)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        next_one_fits()
        stream = client.stream("aborted", request_id="to-abort", **LONG)
        next(stream)
        assert client.abort("to-abort") is True
        *_, last = stream
        assert isinstance(last, StreamFinish) and last.finish_reason == "cancelled"
        next_one_fits()
        with Client(server.address, timeout=30) as gone:  # the client goes away mid-stream: its channel closes
            left = gone.stream("left behind", **LONG)
            next(left)
        next_one_fits()


def _watch(channel: grpc.Channel) -> Iterator[health_pb2.HealthCheckResponse]:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)


def test_health_watches_have_their_own_cap_and_leave_the_calls_cap_alone(engine: Engine) -> None:
    settings = Settings(max_concurrent_rpcs=2, max_health_watches=2, health_interval_s=0.05)
    with (
        public_server(engine, settings) as server,
        grpc.insecure_channel(server.address) as channel,
        Client(server.address, timeout=30, retry=None) as client,
    ):
        watches = [_watch(channel) for _ in range(2)]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            next(_watch(channel))
        code, details = _code(err)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "CDB_MAX_HEALTH_WATCHES" in details
        streams = [client.stream("hello", **LONG) for _ in range(2)]  # the two watches took none of these
        for stream in streams:
            assert isinstance(next(stream), StreamToken)
        with pytest.raises(grpc.RpcError) as err:
            client.info()
        code, details = _code(err)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "CDB_MAX_CONCURRENT_RPCS" in details
        assert client.health() == "SERVING"  # checks are never refused
        for stream in streams:
            stream.close()
        for watch in watches:
            watch.cancel()
        wait_until(lambda: server.service.caps.watches.in_use == 0, "the watches to be given back")
        settled(server, engine)
        assert client.info().model


def test_a_stream_whose_client_stops_reading_is_cut_and_its_request_aborted(engine: Engine) -> None:
    settings = Settings(stream_stall_timeout_s=0.5, health_interval_s=0.05)
    small_window = [OWN_CONNECTION, ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    with public_server(engine, settings) as server, grpc.insecure_channel(server.address, small_window) as channel:
        request = pb.GenerateRequest(text="hello", max_tokens=1000, ignore_eos=True)
        request.sampling.return_logprobs, request.sampling.top_logprobs = True, 20  # ~300 bytes a message
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=30)
        assert next(call).HasField("token")
        # no more reading: the window fills, the server's send waits, and the stall timeout cuts the stream
        settled(server, engine)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:  # what was in flight, then the status queued behind it
                pass
        code, details = _code(err)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "CDB_STREAM_STALL_TIMEOUT_S" in details
