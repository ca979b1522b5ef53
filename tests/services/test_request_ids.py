"""A caller's request id travels in gRPC metadata (``cdb-request-id``, printable ASCII only) and into log lines: an
id either could not carry is refused before admission (``INVALID_ARGUMENT`` naming ``request_id``), so no request
is left running that its caller cannot read, and a caller that leaves between admission and its first token
leaves nothing held (the ``ouro_tiny_tree`` fixture checks the tree is idle and healthy afterwards)."""

from __future__ import annotations

import grpc
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from clients.sync_client import Client
from tests.services.tree import IDLE, SharedTree, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

UNCARRIABLE = ["café", "a\r\nforged log line", "nul\x00", "\x7f", "名前"]


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, text="And God said", max_tokens=300, ignore_eos=True)


@pytest.mark.parametrize("request_id", UNCARRIABLE)
def test_an_id_no_wire_or_log_can_carry_is_refused_before_admission(
    ouro_tiny_tree: SharedTree, request_id: str
) -> None:
    with grpc.insecure_channel(ouro_tiny_tree.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for call in (
            lambda: next(iter(stub.GenerateStream(_request(request_id), timeout=30))),
            lambda: stub.Generate(_request(request_id), timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id" in (info.value.details() or "")
    with Client(ouro_tiny_tree.address, timeout=30) as client:
        assert wait_idle(client) == IDLE, "nothing was admitted"


def test_a_caller_gone_after_admission_leaves_no_request_running(ouro_tiny_tree: SharedTree) -> None:
    """Admitted (the ``cdb-request-id`` header came), then the caller cancels before reading a token: the request
    is aborted, not run on to its 300 tokens."""
    with grpc.insecure_channel(ouro_tiny_tree.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(_request("gone-before-its-first-token"), timeout=60)
        assert dict(call.initial_metadata())["cdb-request-id"] == "gone-before-its-first-token"
        call.cancel()
    with Client(ouro_tiny_tree.address, timeout=30) as client:
        assert wait_idle(client) == IDLE, "the request was aborted with its caller"
