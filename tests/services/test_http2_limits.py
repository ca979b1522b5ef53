"""HTTP/2 limits of the public server: concurrent streams per connection, keepalive ping enforcement."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cdb_engine.engine import Engine
from services.api.server import server_options
from services.settings import Settings
from tests.services.public_port import public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)  # never share a connection with another channel


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


def test_server_options_carry_the_settings() -> None:
    options = dict(server_options(Settings(max_streams_per_connection=7, keepalive_min_time_s=2.5)))
    assert options["grpc.so_reuseport"] == 0
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 2500
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.http2.max_ping_strikes"] == 2


def test_server_options_carry_the_connection_timeouts() -> None:
    settings = Settings(idle_connection_timeout_s=30, header_read_timeout_s=1.5)
    options = dict(server_options(settings))
    assert options["grpc.max_connection_idle_ms"] == 30_000  # a connection without calls: GOAWAY
    assert options["grpc.server_handshake_timeout_ms"] == 1500  # TLS + HTTP/2 preface of a new connection
    assert options["grpc.keepalive_time_ms"] == 60_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.max_pings_without_data"] == 0


def _check(channel: grpc.Channel, timeout: float) -> int:
    return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status)


def test_streams_beyond_the_limit_wait_for_a_free_one(engine: Engine) -> None:
    settings = Settings(max_streams_per_connection=1, health_interval_s=0.05)
    with public_server(engine, settings) as server, grpc.insecure_channel(server.address, [OWN_CONNECTION]) as busy:
        watch = health_pb2_grpc.HealthStub(busy).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # the connection's one stream is open
        with pytest.raises(grpc.RpcError) as err:
            _check(busy, timeout=0.5)  # a second stream on that connection waits for it
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with grpc.insecure_channel(server.address, [OWN_CONNECTION]) as other:
            assert _check(other, timeout=10) == health_pb2.HealthCheckResponse.SERVING  # another connection: at once
        watch.cancel()
        assert _check(busy, timeout=10) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("with_a_call", [False, True], ids=["idle", "during-a-call"])
def test_a_client_pinging_too_often_gets_goaway(engine: Engine, with_a_call: bool) -> None:
    settings = Settings(keepalive_min_time_s=10, health_interval_s=0.05)
    eager = [
        OWN_CONNECTION,
        ("grpc.keepalive_time_ms", 50),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with public_server(engine, settings) as server, grpc.insecure_channel(server.address, eager) as channel:
        ready, dropped = threading.Event(), threading.Event()

        def on_state(state: grpc.ChannelConnectivity) -> None:
            if state is grpc.ChannelConnectivity.READY:
                ready.set()
            elif ready.is_set():
                dropped.set()  # READY -> anything else: the server closed the connection (GOAWAY too_many_pings)

        channel.subscribe(on_state)
        try:
            assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING
            assert ready.wait(10)
            if with_a_call:  # an open stream on which nothing is sent: pings still come 200x too often
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert dropped.wait(20), "the server tolerated pings every 50 ms"
            if with_a_call:
                with pytest.raises(grpc.RpcError) as err:
                    next(watch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            channel.unsubscribe(on_state)


def test_a_connection_without_calls_is_closed_after_the_idle_timeout(engine: Engine) -> None:
    settings = Settings(idle_connection_timeout_s=0.3, health_interval_s=0.05)
    with public_server(engine, settings) as server, grpc.insecure_channel(server.address, [OWN_CONNECTION]) as channel:
        ready, dropped = threading.Event(), threading.Event()

        def on_state(state: grpc.ChannelConnectivity) -> None:
            if state is grpc.ChannelConnectivity.READY:
                ready.set()
            elif ready.is_set():
                dropped.set()  # READY -> anything else: the server sent GOAWAY and closed the idle connection

        channel.subscribe(on_state)
        try:
            assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING
            assert ready.wait(10)
            assert dropped.wait(20), "the server kept an idle connection open"
            assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING  # the client reconnects
        finally:
            channel.unsubscribe(on_state)
