"""Structured output end to end, on a real server over the shipped model: the generated text follows what the
request asked for (a JSON schema, a regex, a list of choices, a tool's parameters), whatever the model would have
said; streamed tool calls read back as the whole ones do."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest

from tests.http.harness import SETTINGS, TINY, Served, served

pytestmark = pytest.mark.timeout(180)

MODEL = "ouro-kjv"
PROMPT = "And God said"
TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
)
MESSAGES: Any = [{"role": "user", "content": "Who made the heaven and the earth?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
DAY = {
    "type": "object",
    "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["day"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "weekday", "parameters": DAY}},
]
SCHEMAS = {"weather": WEATHER, "weekday": DAY}


@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    with served(replace(TINY, model=MODEL), settings=replace(SETTINGS, chat_template=TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(api: Served) -> openai.OpenAI:
    return api.client()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_json_schema_completion_parses_and_validates(client: openai.OpenAI, seed: int) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=64,
        temperature=1.0,
        seed=seed,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.text), PERSON)


def test_a_json_schema_chat_reply_parses_and_validates(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is not None, choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"regex": "[a-z]{3,8}( [a-z]{3,8}){0,2}"}},
        {"guided_regex": "[a-z]{3,8}( [a-z]{3,8}){0,2}"},
    ],
)
def test_a_regex_completion_fullmatches(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, extra_body=fields)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){0,2}", choice.text), choice.text


@pytest.mark.parametrize("key", ["structured_outputs", "guided_choice"])
def test_a_choice_completion_is_one_of_the_choices(client: openai.OpenAI, key: str) -> None:
    choices = ["light", "darkness", "the firmament"]
    fields = {"structured_outputs": {"choice": choices}} if key == "structured_outputs" else {key: choices}
    texts = {
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed, extra_body=fields
        )
        .choices[0]
        .text
        for seed in range(3)
    }
    assert texts <= set(choices), texts


def test_a_named_tool_call_has_arguments_that_parse_and_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_streamed_named_tool_call_reads_back_as_the_whole_one(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "weekday"}},
    }
    whole = client.chat.completions.create(**kw).choices[0]
    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            assert delta_call.index == 0 and delta_call.function is not None
            name = delta_call.function.name or name
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert whole.message.tool_calls is not None
    assert name == "weekday" and arguments == whole.message.tool_calls[0].function.arguments and finish == "stop"
    jsonschema.validate(json.loads(arguments), DAY)


def test_required_tool_calls_each_name_a_tool_and_validate_against_its_parameters(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=96,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the array ends after it
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
