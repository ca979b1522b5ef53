"""The HTTP API's structured-output fields become the engine's ``RequestParams.structure`` (kind, spec, and the
field path an engine refusal names), on both endpoints; malformed shapes and a second constraint are 400s in
OpenAI's error format naming the field, on a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from cdb_engine.config import Structure, StructureKind
from cdb_engine.errors import InvalidRequest
from services.http.schemas import ChatCompletionRequest, CompletionRequest
from services.http.tools import required_schema
from tests.http.harness import SETTINGS, TINY, Served, served

pytestmark = pytest.mark.timeout(120)

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "d", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
MESSAGES = [{"role": "user", "content": "Who?"}]


def structure_of(endpoint: str, **fields: Any) -> Structure | None:
    """The ``structure`` of the engine parameters a body with ``fields`` becomes."""
    if endpoint == "completion":
        return CompletionRequest(prompt="x", **fields).to_engine()[1].structure
    body = ChatCompletionRequest(messages=MESSAGES, **fields)
    body.refuse_unsupported()
    return body.to_params(8).structure


def dumped(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# (fields, kind, spec, field) of every form both endpoints take
FORMS = [
    ({"response_format": {"type": "json_object"}}, StructureKind.JSON_OBJECT, "", "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
        StructureKind.JSON,
        dumped(SCHEMA),
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": json.dumps(SCHEMA)}}},
        StructureKind.JSON,
        dumped(SCHEMA),
        "response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructureKind.JSON, dumped(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": "true"}}, StructureKind.JSON, "true", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructureKind.REGEX, "[a-z]+", "structured_outputs.regex"),
    (
        {"structured_outputs": {"choice": ["yes", "no", "é"]}},
        StructureKind.CHOICE,
        '["yes", "no", "é"]',
        "structured_outputs.choice",
    ),
    (
        {"structured_outputs": {"grammar": "start: 'a'+"}},
        StructureKind.GRAMMAR,
        "start: 'a'+",
        "structured_outputs.grammar",
    ),
    ({"structured_outputs": {"json_object": True}}, StructureKind.JSON_OBJECT, "", "structured_outputs.json_object"),
    (
        {"structured_outputs": {"regex": "a|b", "json_object": False, "backend": "guidance", "disable_fallback": True}},
        StructureKind.REGEX,
        "a|b",
        "structured_outputs.regex",
    ),
    ({"guided_json": SCHEMA}, StructureKind.JSON, dumped(SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, StructureKind.JSON, dumped(SCHEMA), "guided_json"),
    ({"guided_regex": r"\d{3}"}, StructureKind.REGEX, r"\d{3}", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructureKind.CHOICE, '["a", "b"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, StructureKind.GRAMMAR, 'root ::= "a"', "guided_grammar"),
    (
        {"guided_regex": "x+", "guided_decoding_backend": "auto", "response_format": {"type": "text"}},
        StructureKind.REGEX,
        "x+",
        "guided_regex",
    ),
]


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(("fields", "kind", "spec", "field"), FORMS)
def test_each_structured_output_form_becomes_its_structure_and_field_path(
    endpoint: str, fields: dict[str, Any], kind: StructureKind, spec: str, field: str
) -> None:
    assert structure_of(endpoint, **fields) == Structure(kind, spec, field)


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"structured_outputs": {}},
        {"structured_outputs": {"json_object": False}},
        {"structured_outputs": None, "guided_json": None, "response_format": None},
    ],
)
def test_fields_that_ask_for_no_structure_leave_the_text_free(endpoint: str, fields: dict[str, Any]) -> None:
    assert structure_of(endpoint, **fields) is None


def test_a_named_tool_choice_constrains_to_that_tools_parameters() -> None:
    choice = {"type": "function", "function": {"name": "weather"}}
    assert structure_of("chat", tools=TOOLS, tool_choice=choice) == Structure(
        StructureKind.JSON, dumped(WEATHER), "tool_choice"
    )
    empty = structure_of("chat", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert empty is not None and json.loads(empty.spec) == {"type": "object", "properties": {}}


def test_required_tool_choice_constrains_to_an_array_of_calls_of_any_tool() -> None:
    got = structure_of("chat", tools=TOOLS, tool_choice="required")
    assert got is not None and got.kind is StructureKind.JSON and got.field == "tool_choice"
    schema = json.loads(got.spec)
    assert schema == required_schema({"weather": WEATHER, "now": {"type": "object", "properties": {}}})
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["weather"], ["now"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    one = structure_of("chat", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one is not None and json.loads(one.spec)["maxItems"] == 1


def test_tool_choice_none_or_auto_without_tools_constrains_nothing() -> None:
    assert structure_of("chat", tools=TOOLS, tool_choice="none") is None
    assert structure_of("chat", tool_choice="auto") is None
    assert structure_of("chat", tools=[], tool_choice="auto") is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ],
)
def test_a_second_constraint_is_refused_naming_the_later_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        structure_of("completion", **fields)
    assert err.value.field == field and "one structured output per request" in err.value.message


# --- on a server: OpenAI's error format ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    with served(replace(TINY, model="ouro-kjv"), settings=replace(SETTINGS, chat_template=TEMPLATE)) as s:
        yield s


def post(api: Served, endpoint: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    if endpoint == "completion":
        path, body = "/v1/completions", {"prompt": "And God said", "max_tokens": 4, **fields}
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields}
    status, _, raw = api.request("POST", path, body)
    return status, json.loads(raw)


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


BAD_COMMON = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"json_schema": {"schema": SCHEMA}}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": json_schema("{not json")}, "response_format.json_schema.schema"),
    ({"response_format": json_schema([1, 2])}, "response_format.json_schema.schema"),
    ({"response_format": json_schema("3")}, "response_format.json_schema.schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
        "response_format.json_schema.name",
    ),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": 7}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    (
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
    ),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_grammar": {"a": 1}}, "guided_grammar"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": json_schema(SCHEMA), "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_grammar": "start: 'a'"}, "guided_grammar"),
]
WEATHER_CHOICE = {"type": "function", "function": {"name": "weather"}}
BAD_CHAT = [
    ({"tools": TOOLS}, "tools"),  # tool_choice omitted: auto, OpenAI's default with tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": WEATHER_CHOICE}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}], "tool_choice": "required"},
        "tools[0].function.description",
    ),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": json_schema(SCHEMA)}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": WEATHER_CHOICE, "guided_regex": "a"}, "tool_choice"),
]


def assert_refused(status: int, body: dict[str, Any], param: str) -> None:
    error = body["error"]
    assert status == 400, body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] is None, error
    assert error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
@pytest.mark.parametrize(("fields", "param"), BAD_COMMON)
def test_a_malformed_or_second_structured_output_is_a_400_naming_the_field(
    api: Served, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    assert_refused(*post(api, endpoint, **fields), param)


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT)
def test_a_tool_choice_that_cannot_be_forced_or_a_bad_tool_is_a_400_naming_the_field(
    api: Served, fields: dict[str, Any], param: str
) -> None:
    assert_refused(*post(api, "chat", **fields), param)


def test_auto_with_tools_is_refused_with_what_to_send_instead(api: Served) -> None:
    status, body = post(api, "chat", tools=TOOLS, tool_choice="auto")
    assert_refused(status, body, "tool_choice")
    assert "required" in body["error"]["message"] and "named function" in body["error"]["message"]


def test_tools_with_tool_choice_none_reach_the_template_and_the_text_is_free() -> None:
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}\n" + TEMPLATE
    with served(replace(TINY, model="ouro-kjv"), settings=replace(SETTINGS, chat_template=template)) as s:
        status, plain = post(s, "chat")
        status_tools, with_tools = post(s, "chat", tools=TOOLS, tool_choice="none")
        encode = s.engine.tokenizer.encode
    assert status == status_tools == 200
    text = "\nuser: Who?\nassistant: "
    added = len(encode("[weather][now]" + text)) - len(encode(text))
    assert added > 0 and with_tools["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + added
    message = with_tools["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message
