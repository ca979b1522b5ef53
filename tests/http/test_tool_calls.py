"""A forced tool call's generated text becomes the chat response's ``tool_calls`` (``services.http.tools``): whole
responses and streamed chunks, for a named function and for ``tool_choice: required``, finished or cut short; each
shape is one the ``openai`` client parses. A chat's earlier calls and their results reach the chat template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cdb_engine.config import Structure, StructureKind
from cdb_engine.events import FinishEvent, TokenEvent
from cdb_model.tokenizer import ByteTokenizer
from cdb_scheduler.request import FinishReason
from services.http.schemas import ChatCompletionRequest
from services.http.tools import CallArray, ToolCall, ToolCallRender

NAMED = ToolCall("weather", Structure(StructureKind.JSON, "{}", "tool_choice"))
REQUIRED = ToolCall(None, Structure(StructureKind.JSON, "{}", "tool_choice"))
CALLS = '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'


def render(tool: ToolCall) -> ToolCallRender:
    return ToolCallRender("chatcmpl-t", "ouro-kjv", ByteTokenizer(), tool=tool)


def events(pieces: list[str], reason: FinishReason = FinishReason.STOP) -> list[TokenEvent | FinishEvent]:
    tokens: list[TokenEvent | FinishEvent] = [TokenEvent("t", i, 5, p, 2, None) for i, p in enumerate(pieces)]
    return [*tokens, FinishEvent("t", reason, 3, len(pieces), 2 * len(pieces))]


def whole(tool: ToolCall, pieces: list[str], reason: FinishReason = FinishReason.STOP) -> dict[str, Any]:
    """The non-streamed response's choice (checked against the ``openai`` client's type)."""
    r = render(tool)
    for ev in events(pieces, reason):
        r.add(ev)
    body = r.response()
    ChatCompletion.model_validate(body)
    return body["choices"][0]


def stream(tool: ToolCall, pieces: list[str], reason: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    """The streamed chunks' choices: the opening one, one per token, the finishing one."""
    r = render(tool)
    chunks = r.first()
    for ev in events(pieces, reason):
        chunks.append(r.token(ev) if isinstance(ev, TokenEvent) else r.finish(ev))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    return [chunk["choices"][0] for chunk in chunks]


def test_a_named_call_is_one_tool_call_whose_arguments_are_the_text() -> None:
    choice = whole(NAMED, ['{"city"', ": ", '"Paris"}'])
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and len(call["id"]) == len("call_") + 24
    assert choice["finish_reason"] == "stop"  # vLLM's and OpenAI's for a named function


def test_required_calls_are_the_arrays_items_with_their_parameters_as_arguments() -> None:
    choice = whole(REQUIRED, [CALLS[:30], CALLS[30:61], CALLS[61:]])
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["weather", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_a_named_stream_opens_the_call_then_sends_the_text_as_argument_fragments() -> None:
    pieces = ['{"city"', "", ': "Pa', 'ris"}']
    first, *tokens, last = stream(NAMED, pieces)
    opening = first["delta"]
    assert opening["role"] == "assistant" and opening["content"] is None
    [head] = opening["tool_calls"]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "weather", "arguments": ""}
    assert tokens[1]["delta"] == {}  # a token with no text yet
    fragments = [t["delta"]["tool_calls"] for t in tokens if t["delta"]]
    assert all(f[0]["index"] == 0 and set(f[0]) == {"index", "function"} for f in fragments)
    assert "".join(f[0]["function"]["arguments"] for f in fragments) == "".join(pieces)
    assert all(t["finish_reason"] is None for t in tokens)
    assert last["finish_reason"] == "stop" and last["delta"] == {}


def test_a_required_stream_sends_each_call_whole_in_the_chunk_that_completes_its_item() -> None:
    pieces = [
        '[{"name": "weather", ',
        '"parameters": {"city": "Paris"}',
        "}",
        ', {"name": "now", "parameters": {}}',
        "]",
    ]
    first, *tokens, last = stream(REQUIRED, pieces)
    assert first["delta"] == {"role": "assistant", "content": None}
    assert [t["delta"] for t in tokens[:2]] == [{}, {}] and tokens[4]["delta"] == {}
    [weather] = tokens[2]["delta"]["tool_calls"]
    assert weather["index"] == 0 and weather["type"] == "function" and weather["id"].startswith("call_")
    assert weather["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    [now] = tokens[3]["delta"]["tool_calls"]
    assert now["index"] == 1 and now["function"] == {"name": "now", "arguments": "{}"} and now["id"] != weather["id"]
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}


def test_a_named_call_cut_by_length_keeps_its_partial_arguments() -> None:
    choice = whole(NAMED, ['{"city"', ': "Pa'], FinishReason.LENGTH)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    *_, last = stream(NAMED, ['{"city"', ': "Pa'], FinishReason.LENGTH)
    assert last["finish_reason"] == "length"


def test_a_required_array_cut_by_length_keeps_its_complete_calls_and_the_text_as_content() -> None:
    text = '[{"name": "now", "parameters": {}}, {"name": "wea'
    choice = whole(REQUIRED, [text[:20], text[20:]], FinishReason.LENGTH)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == text
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["now"]
    *_, completing, last = stream(REQUIRED, [text[:20], text[20:]], FinishReason.LENGTH)
    assert completing["delta"]["tool_calls"][0]["function"]["name"] == "now"
    assert last["finish_reason"] == "length" and last["delta"] == {"content": text}


def test_a_text_that_is_no_call_array_is_content_and_no_call() -> None:
    choice = whole(REQUIRED, ["Hello"])
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize("step", [1, 2, 7])
def test_call_array_finds_the_items_as_the_text_grows_whatever_the_pieces(step: int) -> None:
    text = ' [ {"name": "a", "parameters": {"x": "}{]"}} ,\n{"name": "b", "parameters": [1]} ] '
    array, items, counts = CallArray(), [], []
    for end in range(step, len(text) + step, step):
        items.extend(array.advance(text[:end]))
        counts.append(len(items))
    assert items == json.loads(text) and array.closed
    assert counts == sorted(counts) and counts[0] == 0


def test_a_chats_earlier_tool_calls_and_results_reach_the_template_messages() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Ur"}'}}
    body = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "hot", "extra": 1},
        ]
    )
    assert body.chat_messages() == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "hot", "tool_call_id": "call_1"},
    ]
