"""No vLLM request field is silently ignored: each of vLLM's completion and chat fields (the list kept in
``services/http/vllm_fields.py``) is declared by this server's request models (honoured) or refused 400 naming it,
on a real server; and the honoured ones do what they ask."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from services.http.schemas import ChatCompletionRequest, CompletionRequest
from services.http.vllm_fields import CHAT, COMPLETION, REFUSED
from tests.http.harness import SETTINGS, TINY, Served, served

pytestmark = pytest.mark.timeout(120)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if greeting %}{{ greeting }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A value of each refused field that asks for something (not its neutral value).
ASKING: dict[str, Any] = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 8,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "spaces_between_special_tokens": False,
    "prompt_embeds": "AAAA",
    "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "logits_processors": ["a.b"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "reasoning_effort": "low",
    "include_reasoning": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"a": 1},
    "echo": True,
    "best_of": 2,
    "add_special_tokens": True,
}


@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    with served(replace(TINY, model="ouro-kjv"), settings=replace(SETTINGS, chat_template=TEMPLATE)) as s:
        yield s


def completion(api: Served, **fields: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": "ouro-kjv", "prompt": "And God said", "max_tokens": 8, "temperature": 0, **fields}
    status, headers, raw = api.request("POST", "/v1/completions", body)
    return status, headers, json.loads(raw)


def chat(api: Served, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": "ouro-kjv", "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, **fields}
    status, _, raw = api.request("POST", "/v1/chat/completions", body)
    return status, json.loads(raw)


def test_every_vllm_field_is_declared_or_refused() -> None:
    for fields, model in ((COMPLETION, CompletionRequest), (CHAT, ChatCompletionRequest)):
        loose = [f for f in fields if f not in model.model_fields and f not in REFUSED]
        assert not loose, f"{model.__name__}: vLLM fields neither honoured nor refused: {loose}"
    assert set(ASKING) == set(REFUSED), "a value that asks for something, per refused field"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_a_400_naming_it_and_its_neutral_value_is_accepted(api: Served, name: str) -> None:
    endpoints = [e for e, fields in (("completion", COMPLETION), ("chat", CHAT)) if name in fields]
    for endpoint in endpoints:
        model = CompletionRequest if endpoint == "completion" else ChatCompletionRequest
        if name in model.model_fields:
            continue  # declared there: the model's own checks (best_of, echo on completions)
        send = (lambda **kw: completion(api, **kw)[::2]) if endpoint == "completion" else (lambda **kw: chat(api, **kw))
        status, body = send(**{name: ASKING[name]})
        assert status == 400, (endpoint, name, body)
        assert body["error"]["param"] == name, (endpoint, name, body)
        for neutral in (*REFUSED[name][0], None):
            status, body = send(**{name: neutral})
            assert status == 200, (endpoint, name, neutral, body)


def test_min_p_one_is_greedy_whatever_the_temperature(api: Served) -> None:
    _, _, greedy = completion(api)
    for seed in range(3):
        status, _, body = completion(api, temperature=1.5, min_p=1.0, seed=seed)
        assert status == 200 and body["choices"][0]["text"] == greedy["choices"][0]["text"]
    status, _, body = completion(api, min_p=1.5)
    assert status == 400 and body["error"]["param"] == "min_p"


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(api: Served) -> None:
    _, _, free = completion(api, max_tokens=24)
    text = free["choices"][0]["text"]
    stop = text[4:7]
    assert stop and stop not in text[:6]
    _, _, cut = completion(api, max_tokens=24, stop=[stop])
    _, _, kept = completion(api, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    assert kept["choices"][0]["finish_reason"] == cut["choices"][0]["finish_reason"] == "stop"


def test_skip_special_tokens_false_keeps_the_special_tokens_text(api: Served) -> None:
    tokenizer = api.engine.tokenizer
    special = tokenizer.encode("<|im_end|>")
    assert len(special) == 1 and tokenizer.decode(special) == ""
    bias = {str(special[0]): 100}  # the special token first, whatever the model says
    _, _, skipped = completion(api, max_tokens=1, logit_bias=bias, ignore_eos=True)
    _, _, kept = completion(api, max_tokens=1, logit_bias=bias, ignore_eos=True, skip_special_tokens=False)
    assert skipped["choices"][0]["text"] == "" and kept["choices"][0]["text"] == "<|im_end|>"


def test_x_request_id_names_the_response_and_a_bad_one_is_refused(api: Served) -> None:
    status, headers, body = completion(api, request_id="from-body-1")
    assert status == 200 and body["id"] == "cmpl-from-body-1"
    status, headers, raw = api.request(
        "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"}
    )
    assert status == 200 and json.loads(raw)["id"] == "cmpl-trace-42" and "trace-42" in headers["x-request-id"]
    status, _, body = completion(api, request_id="bad\tid")
    assert status == 400 and body["error"]["param"] == "request_id"


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(api: Served) -> None:
    tokenize = lambda **kw: json.loads(  # noqa: E731
        api.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], **kw})[2]
    )["count"]
    plain = tokenize()
    status, with_kwargs = chat(api, chat_template_kwargs={"greeting": "Hello there. " * 4}, max_tokens=1)
    status_plain, without = chat(api, max_tokens=1)
    assert status == status_plain == 200
    assert with_kwargs["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] == plain
    status, no_prompt = chat(api, add_generation_prompt=False, max_tokens=1)
    assert status == 200 and no_prompt["usage"]["prompt_tokens"] < plain
    status, body = chat(api, chat_template_kwargs={"messages": []})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def test_a_forced_tool_call_needs_tools_and_a_json_response_format_is_accepted(api: Served) -> None:
    """Structured output and tool calls themselves: tests/http/test_structured_api.py, test_tool_calls.py."""
    assert chat(api, tool_choice="none")[0] == 200
    status, body = chat(api, tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, _, body = completion(api, response_format={"type": "json_object"})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(api: Served) -> None:
    body = {"model": "ouro-kjv", "prompt": "And God said", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, _, raw = api.request("POST", "/v1/completions", body)
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert status == 200 and chunks
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert counts == sorted(counts) and counts[-1] == 5 and len(prompt) == 1 and prompt.pop() > 0
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 5  # the closing usage


def test_prompt_logprobs_score_the_prompt_as_echo_does_in_vllms_shape(api: Served) -> None:
    prompt = "And God said, Let there be light"
    status, _, scored = completion(api, prompt=prompt, prompt_logprobs=2, max_tokens=1)
    assert status == 200
    entries = scored["choices"][0]["prompt_logprobs"]
    _, _, echoed = completion(api, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    reference = echoed["choices"][0]["logprobs"]  # the same prefill scores, in the legacy shape
    assert entries[0] is None and reference["token_logprobs"][0] is None
    ids = api.engine.tokenizer.encode(prompt)
    assert len(entries) == len(ids) == len(reference["token_logprobs"])
    for token, entry, logprob, top in zip(
        ids[1:], entries[1:], reference["token_logprobs"][1:], reference["top_logprobs"][1:]
    ):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob)
        ranked = sorted((v for v in entry.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert sorted(v["logprob"] for v in ranked) == pytest.approx(sorted(top.values()))
    status, _, streamed = api.request(
        "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, "stream": True}
    )
    chunks = [json.loads(e[6:]) for e in streamed.decode().split("\n\n") if e.startswith("data: {")]
    carrying = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert status == 200 and len(carrying) == 1 and carrying[0]["choices"][0]["prompt_logprobs"] == entries
    status, _, body = completion(api, prompt_logprobs=2, logprobs=3)
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def test_priority_is_honoured_on_both_endpoints_and_bounded(api: Served) -> None:
    """vLLM's ``priority`` (lower first) orders the waiting queue (tests/scheduler/test_priority.py); here: taken by
    both endpoints, the tokens unchanged by it, an int32 at most."""
    _, _, plain = completion(api)
    status, _, urgent = completion(api, priority=-3)
    assert status == 200 and urgent["choices"][0]["text"] == plain["choices"][0]["text"]
    assert chat(api, priority=7)[0] == 200
    status, _, body = completion(api, priority=2**31)
    assert status == 400 and body["error"]["param"] == "priority"
    status, _, body = completion(api, priority="high")
    assert status == 400 and "priority" in json.dumps(body["error"])
