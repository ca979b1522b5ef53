"""gRPC server reflection under both service names: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection (1.85) ships only ``grpc_reflection.v1alpha``. Clients ask for ``v1`` first (grpcurl, Postman,
grpc_cli fall back to ``v1alpha``; newer ones may not). The two protocols are the same messages with the same
field numbers under another package, so the library's servicer answers both: ``v1`` calls are decoded and encoded
with the ``v1alpha`` message classes (byte-identical on the wire). The ``v1`` file descriptor itself, built from
the ``v1alpha`` one with the package renamed, is added to the default descriptor pool, so that a client can
describe the ``v1`` service too; ``V1_REQUEST`` / ``V1_RESPONSE`` are its message classes (clients, tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


def _v1_file() -> Any:
    """The ``grpc/reflection/v1/reflection.proto`` descriptor in the default pool (added on first use)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, "grpc.reflection.v1"
    proto.name, proto.package = V1_FILE, new
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(f".{old}."):
                f.type_name = f".{new}." + f.type_name[len(old) + 2 :]
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{new}." + method.input_type.rsplit(".", 1)[1]
            method.output_type = f".{new}." + method.output_type.rsplit(".", 1)[1]
    return pool.AddSerializedFile(proto.SerializeToString())


_V1_FILE = _v1_file()
V1_REQUEST: Any = message_factory.GetMessageClass(_V1_FILE.message_types_by_name["ServerReflectionRequest"])
V1_RESPONSE: Any = message_factory.GetMessageClass(_V1_FILE.message_types_by_name["ServerReflectionResponse"])


def enable_reflection(server: grpc.Server | grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server`` (sync or asyncio, before it starts), listing
    ``service_names`` (fully qualified, e.g. ``cdb.v1.Generation``) and both reflection services."""
    names = sorted({*service_names, V1, V1ALPHA})
    servicer: Any
    if isinstance(server, grpc.aio.Server):
        servicer = reflection.aio.ReflectionServicer(names)
    else:
        servicer = reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (V1, V1ALPHA):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {_METHOD: handler}),))
        server.add_registered_method_handlers(service, {_METHOD: handler})
