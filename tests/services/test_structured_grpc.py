"""``GenerateRequest.structured_output`` becomes the engine's ``RequestParams.structure`` (kind, spec, and the
request path an engine refusal names); a malformed one is ``INVALID_ARGUMENT`` naming its path."""

from __future__ import annotations

import grpc
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.config import Structure, StructureKind
from cdb_engine.errors import InvalidRequest
from services.api.errors import status_for
from services.api.messages import request_to_engine

SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}}'


def structure_of(so: pb.StructuredOutput | None) -> Structure | None:
    req = pb.GenerateRequest(text="hi", max_tokens=4)
    if so is not None:
        req.structured_output.CopyFrom(so)
    req = pb.GenerateRequest.FromString(req.SerializeToString())  # as it arrives
    return request_to_engine(req)[1].structure


@pytest.mark.parametrize(
    ("so", "expected"),
    [
        (
            pb.StructuredOutput(json_schema=SCHEMA),
            Structure(StructureKind.JSON, SCHEMA, "structured_output.json_schema"),
        ),
        (
            pb.StructuredOutput(json_schema="true"),
            Structure(StructureKind.JSON, "true", "structured_output.json_schema"),
        ),
        (
            pb.StructuredOutput(json_object=True),
            Structure(StructureKind.JSON_OBJECT, "", "structured_output.json_object"),
        ),
        (pb.StructuredOutput(regex="[0-9]+"), Structure(StructureKind.REGEX, "[0-9]+", "structured_output.regex")),
        (
            pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no", "é"])),
            Structure(StructureKind.CHOICE, '["yes", "no", "é"]', "structured_output.choice"),
        ),
        (
            pb.StructuredOutput(grammar="start: 'a'+"),
            Structure(StructureKind.GRAMMAR, "start: 'a'+", "structured_output.grammar"),
        ),
    ],
)
def test_each_structured_output_becomes_its_structure_and_field_path(
    so: pb.StructuredOutput, expected: Structure
) -> None:
    assert structure_of(so) == expected


def test_an_unset_structured_output_or_json_object_false_leaves_the_text_free() -> None:
    assert structure_of(None) is None
    assert structure_of(pb.StructuredOutput()) is None
    assert structure_of(pb.StructuredOutput(json_object=False)) is None


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (pb.StructuredOutput(json_schema="{not json"), "structured_output.json_schema"),
        (pb.StructuredOutput(json_schema="[1, 2]"), "structured_output.json_schema"),
        (pb.StructuredOutput(json_schema=""), "structured_output.json_schema"),
        (pb.StructuredOutput(regex=""), "structured_output.regex"),
        (pb.StructuredOutput(grammar=""), "structured_output.grammar"),
        (pb.StructuredOutput(choice=pb.Choices()), "structured_output.choice"),
    ],
)
def test_a_malformed_structured_output_is_invalid_argument_naming_its_path(so: pb.StructuredOutput, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        structure_of(so)
    assert err.value.field == field
    code, message = status_for(err.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith(f"{field}: ")
