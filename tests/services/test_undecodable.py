"""Requests protobuf refuses to parse (invalid UTF-8 in a string field, broken wire format) get INVALID_ARGUMENT
naming the field; nothing is logged at ERROR and the server keeps serving."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.engine import Engine
from clients.sync_client import Client
from services.api.decoding import MAX_WALKED_FIELDS, Undecodable, describe_undecodable, tolerant_deserializer
from tests.services.public_port import PublicServer, assert_no_errors_logged, public_server, tiny_engine

pytestmark = pytest.mark.timeout(60)

BAD_UTF8 = b"ok\xff\xfe"  # 0xff never occurs in UTF-8


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field, by hand: tag (number, wire type 2), length, bytes."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string_fields(descriptor: Descriptor, prefix: str = "") -> set[str]:
    out = set()
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            out.add(prefix + f.name)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            out |= _string_fields(f.message_type, f"{prefix}{f.name}.")
    return out


# (method, raw request, the message's field path in the error); one case per string field
GOOD_PROMPT = _field(2, b"hello")
CASES = [
    ("Generate", _field(1, BAD_UTF8) + GOOD_PROMPT, "request_id"),
    ("Generate", _field(2, BAD_UTF8), "prompt.text"),
    ("Generate", GOOD_PROMPT + _field(7, b"fine") + _field(7, BAD_UTF8), "stop_strings[1]"),
    ("GenerateStream", _field(1, BAD_UTF8) + GOOD_PROMPT, "request_id"),
    ("GenerateStream", _field(2, BAD_UTF8), "prompt.text"),
    ("GenerateStream", _field(7, BAD_UTF8) + GOOD_PROMPT, "stop_strings[0]"),
    ("Abort", _field(1, BAD_UTF8), "request_id"),
    ("Generate", GOOD_PROMPT + _field(15, _field(1, BAD_UTF8)), "structured_output.kind.json_schema"),
    ("Generate", GOOD_PROMPT + _field(15, _field(3, BAD_UTF8)), "structured_output.kind.regex"),
    (
        "GenerateStream",
        GOOD_PROMPT + _field(15, _field(4, _field(1, BAD_UTF8))),
        "structured_output.kind.choice.choices[0]",
    ),
    ("GenerateStream", GOOD_PROMPT + _field(15, _field(5, BAD_UTF8)), "structured_output.kind.grammar"),
]
_STRUCTURED = {"json_schema", "regex", "choice.choices", "grammar"}


def test_the_cases_cover_every_string_field() -> None:
    structured = {f"structured_output.{f}" for f in _STRUCTURED}  # (a bad string names its oneof too: ``kind``)
    assert _string_fields(pb.GenerateRequest.DESCRIPTOR) == {"request_id", "text", "stop_strings"} | structured
    assert _string_fields(pb.AbortRequest.DESCRIPTOR) == {"request_id"}
    plain = {(m, p) for m in ("Generate", "GenerateStream") for p in ("request_id", "prompt.text", "stop_strings")}
    assert {(m, p.split("[")[0]) for m, _, p in CASES if "structured" not in p} == plain | {("Abort", "request_id")}
    assert {p.split("[")[0].replace(".kind", "") for _, _, p in CASES if "structured" in p} == structured


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with tiny_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[PublicServer]:
    with public_server(engine) as server:
        yield server


def _call_raw(address: str, method: str, payload: bytes) -> None:
    """Send ``payload`` as the request bytes of ``method``, unparsed; read every reply."""
    with grpc.insecure_channel(address) as channel:
        path = f"/cdb.v1.Generation/{method}"
        if method == "GenerateStream":
            list(channel.unary_stream(path)(payload, timeout=10))
        else:
            channel.unary_unary(path)(payload, timeout=10)


@pytest.mark.parametrize(("method", "payload", "path"), CASES, ids=[f"{m}-{p}" for m, _, p in CASES])
def test_invalid_utf8_names_the_field_and_the_server_keeps_serving(
    server: PublicServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    method: str,
    payload: bytes,
    path: str,
) -> None:
    caplog.set_level(logging.INFO)
    with pytest.raises(grpc.RpcError) as err:
        _call_raw(server.address, method, payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"{path}: not valid UTF-8"
    assert_no_errors_logged(caplog)
    assert "Traceback" not in capfd.readouterr().err  # nor printed by gRPC itself
    with Client(server.address, timeout=30) as client:
        assert len(client.generate("hello", max_tokens=3, ignore_eos=True).tokens) == 3
    assert not server.door.live


def test_a_broken_wire_format_is_invalid_argument(server: PublicServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for method, payload, message in [
        ("Generate", _field(1, b"abc")[:-1], "request: not a valid cdb.v1.GenerateRequest (field 1 is truncated)"),
        ("Info", b"\x08", "request: not a valid cdb.v1.InfoRequest (truncated or overlong varint)"),
        ("Abort", b"\x0f", "request: not a valid cdb.v1.AbortRequest (invalid wire type 7 of field 1)"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            _call_raw(server.address, method, payload)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message
    assert_no_errors_logged(caplog)


def test_decodable_requests_parse_as_before() -> None:
    request = pb.GenerateRequest(request_id="r", text="héllo", stop_strings=["a", "ü"])
    parsed = tolerant_deserializer(pb.GenerateRequest)(request.SerializeToString())
    assert parsed == request
    # unknown fields and groups are skipped, not mistaken for problems
    unknown = request.SerializeToString() + _field(99, b"\xff") + _varint(100 << 3 | 3) + _varint(100 << 3 | 4)
    assert isinstance(tolerant_deserializer(pb.GenerateRequest)(unknown), pb.GenerateRequest)


def test_nested_fields_are_named_by_their_path() -> None:
    broken_sampling = GOOD_PROMPT + _field(5, b"\x08")  # sampling.temperature's tag without a value
    decoded = tolerant_deserializer(pb.GenerateRequest)(broken_sampling)
    assert decoded == Undecodable("sampling: not a valid cdb.v1.SamplingParameters (truncated or overlong varint)")
    # a string inside a nested message gets a dotted path (Token.text inside GenerateResponse.tokens[1])
    response = _field(3, _field(2, b"fine")) + _field(3, _field(2, BAD_UTF8))
    assert describe_undecodable(response, pb.GenerateResponse.DESCRIPTOR) == "tokens[1].text: not valid UTF-8"


def test_the_walk_of_an_undecodable_request_is_bounded() -> None:
    """The walk runs where gRPC deserializes (the serving event loop): a request of more fields than
    ``MAX_WALKED_FIELDS`` before its bad one gets the message's name without the field, after that many reads; one
    within the budget still names it, unknown groups' fields included in the count."""
    filler = _varint(99 << 3 | 0) + b"\x01"  # an unknown varint field: two bytes each
    many = filler * MAX_WALKED_FIELDS + _field(1, BAD_UTF8)
    assert describe_undecodable(many, pb.GenerateRequest.DESCRIPTOR) == "request: not a valid cdb.v1.GenerateRequest"
    few = filler * (MAX_WALKED_FIELDS - 1) + _field(1, BAD_UTF8)
    assert describe_undecodable(few, pb.GenerateRequest.DESCRIPTOR) == "request_id: not valid UTF-8"
    group = _varint(98 << 3 | 3) + filler * MAX_WALKED_FIELDS + _varint(98 << 3 | 4)  # an unknown group
    assert describe_undecodable(group + _field(1, BAD_UTF8), pb.GenerateRequest.DESCRIPTOR).startswith("request:")
