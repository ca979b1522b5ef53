"""``services.reflection``: a v1 and a v1alpha reflection client list and describe the services of a small server
(sync and asyncio), on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.reflection import V1, V1_REQUEST, V1_RESPONSE, V1ALPHA, enable_reflection

pytestmark = pytest.mark.timeout(30)
LISTED = {health.SERVICE_NAME, V1, V1ALPHA}


def _v1_call(channel: grpc.Channel | grpc.aio.Channel) -> grpc.StreamStreamMultiCallable:
    return channel.stream_stream(
        f"/{V1}/ServerReflectionInfo",
        request_serializer=V1_REQUEST.SerializeToString,
        response_deserializer=V1_RESPONSE.FromString,
    )


def _services(response: object) -> set[str]:
    return {s.name for s in response.list_services_response.service}  # type: ignore[attr-defined]


def _file_of(response: object) -> descriptor_pb2.FileDescriptorProto:
    protos = response.file_descriptor_response.file_descriptor_proto  # type: ignore[attr-defined]
    return descriptor_pb2.FileDescriptorProto.FromString(protos[0])


@pytest.fixture
def sync_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    enable_reflection(server, [health.SERVICE_NAME])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_v1_client_lists_and_describes_the_services(sync_server: str) -> None:
    with grpc.insecure_channel(sync_server) as channel:
        requests = [
            V1_REQUEST(list_services=""),
            V1_REQUEST(file_containing_symbol=V1),
            V1_REQUEST(file_containing_symbol=health.SERVICE_NAME),
            V1_REQUEST(file_containing_symbol="no.such.Service"),
        ]
        listed, v1_file, health_file, missing = list(_v1_call(channel)(iter(requests), timeout=10))
    assert _services(listed) == LISTED
    assert listed.original_request.list_services == ""
    described = _file_of(v1_file)
    assert (described.name, described.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    (service,) = described.service
    assert (
        service.name == "ServerReflection"
        and service.method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    )
    assert _file_of(health_file).package == "grpc.health.v1"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1alpha_client_still_lists_the_services(sync_server: str) -> None:
    with grpc.insecure_channel(sync_server) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (listed,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert _services(listed) == LISTED


def test_asyncio_server_serves_v1() -> None:
    async def main() -> set[str]:
        server = grpc.aio.server()
        enable_reflection(server, ["cdb.v1.Generation"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = _v1_call(channel)(iter([V1_REQUEST(list_services="")]), timeout=10)
                return {name for response in [r async for r in call] for name in _services(response)}
        finally:
            await server.stop(grace=None)

    assert asyncio.run(main()) == {"cdb.v1.Generation", V1, V1ALPHA}
