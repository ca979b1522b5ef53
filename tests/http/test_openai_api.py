"""The OpenAI-compatible API through the official ``openai`` client, on a real server over the shipped model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from cdb_engine.config import RequestParams
from tests.http.harness import TINY, Served, served, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "ouro-kjv"
PROMPT = "And God said"
CHAT = [{"role": "user", "content": "Who made the heaven and the earth?"}]


@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    with served(replace(TINY, model=MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(api: Served) -> openai.OpenAI:
    return api.client()


def depths_of(choice: object) -> dict:
    extra = choice.model_extra or {}  # type: ignore[attr-defined]
    return extra["cdb"]


def assert_depths(depths: list[int], api: Served, n: int) -> None:
    assert len(depths) == n
    assert all(1 <= d <= api.engine.limits.max_depth for d in depths), depths


def sse_events(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing."""
    events = body.decode().split("\n\n")
    assert events[-1] == "", "the stream ends with a blank line"
    assert all(e.startswith("data: ") for e in events[:-1]), events
    return [e.removeprefix("data: ") for e in events[:-1]]


# --- completions -------------------------------------------------------------------------------------------------
def test_completion_matches_the_engine_and_reports_usage_and_depths(api: Served, client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    reference = api.engine.generate([PROMPT], RequestParams(max_tokens=12))[0]
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(reference.prompt_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    cdb = depths_of(choice)
    assert cdb["depths"] == reference.depths
    assert_depths(cdb["depths"], api, 12)
    assert cdb["mean_depth"] == pytest.approx(sum(reference.depths) / 12)
    assert cdb["total_loop_steps"] == sum(reference.depths)


def test_a_prompt_of_token_ids_is_the_same_prompt(api: Served, client: openai.OpenAI) -> None:
    ids = api.engine.tokenizer.encode(PROMPT)
    texts = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, user="u1").choices[0].text
        for p in (PROMPT, [PROMPT], ids, [ids])
    ]
    assert len(set(texts)) == 1 and texts[0]


def test_streamed_completion_is_the_same_text_in_chunks_with_one_depth_each(api: Served, client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    token_chunks, last, usage = chunks[:-2], chunks[-2], chunks[-1]
    assert len(token_chunks) == 10
    for c in token_chunks:
        assert c.choices[0].finish_reason is None and c.usage is None
        assert_depths(depths_of(c.choices[0])["depths"], api, 1)
    assert last.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    streamed_depths = [d for c in token_chunks for d in depths_of(c.choices[0])["depths"]]
    assert streamed_depths == depths_of(whole.choices[0])["depths"]


def test_the_sse_stream_is_data_lines_ending_with_done(api: Served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    status, headers, raw = api.request("POST", "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4 and all("usage" not in c for c in chunks)  # no usage chunk unless asked
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert headers["x-request-id"] == chunks[0]["id"]


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = text.strip().split()[2]  # a later word of the greedy text
    cut = text[: text.index(stop)]
    for given in (stop, ["NEVER-SEEN", stop]):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=given)
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
        assert out.usage is not None and out.usage.completion_tokens < 24


def test_the_same_seed_gives_the_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95, seed=seed)
        return client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_a_broken_stream_resumed_with_its_token_ids_and_depths_continues_exactly(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 7, "stream": True}
    whole = [depths_of(c.choices[0]) | {"text": c.choices[0].text} for c in client.completions.create(**args)]
    tokens = [c for c in whole if c.get("token_ids")]
    assert len(tokens) == 16 and all(len(c["token_ids"]) == 1 for c in tokens)
    cut = 6  # the stream broke after six tokens: send them back, as GenerateRequest.resume does over gRPC
    resume = {"token_ids": [c["token_ids"][0] for c in tokens[:cut]], "depths": [c["depths"][0] for c in tokens[:cut]]}
    rest = [
        depths_of(c.choices[0]) | {"text": c.choices[0].text}
        for c in client.completions.create(**args, extra_body={"resume": resume})
    ]
    assert [c["text"] for c in tokens[:cut]] + [c["text"] for c in rest] == [c["text"] for c in whole]
    assert [c.get("depths") for c in rest] == [c.get("depths") for c in whole[cut:]]
    assert rest[-1]["total_loop_steps"] == whole[-1]["total_loop_steps"] - sum(resume["depths"])  # (its own)
    with pytest.raises(openai.BadRequestError, match="resume"):
        client.completions.create(**args, extra_body={"resume": {"token_ids": [1, 2], "depths": [4]}})


def test_a_resumed_streams_usage_counts_its_new_tokens_and_the_resumed_apart(api: Served) -> None:
    """The resumed tokens were generated, and billed, by the broken stream: the resumed request's usage counts only
    the tokens it generates (``completion_tokens``), the resumed ones apart (``resumed_tokens``, only when there
    are any), streamed or not; so do the server's token metrics."""
    plain = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    streamed = plain | {"stream": True, "stream_options": {"include_usage": True}}
    metrics = api.door.metrics
    # (token metrics are tallied once per event-loop pass: read before this test's first request, not between two)
    before = metrics.generated_tokens.value(), metrics.request_generation_tokens.sum()
    chunks = [json.loads(e) for e in sse_events(api.request("POST", "/v1/completions", streamed)[2])[:-1]]
    tokens = [c["choices"][0]["cdb"] for c in chunks if c["choices"] and c["choices"][0]["cdb"].get("token_ids")]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert len(tokens) == 8
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8}
    resume = {"token_ids": [t["token_ids"][0] for t in tokens[:3]], "depths": [t["depths"][0] for t in tokens[:3]]}
    want = {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5, "resumed_tokens": 3}
    status, _, raw = api.request("POST", "/v1/completions", streamed | {"resume": resume})
    assert status == 200 and json.loads(sse_events(raw)[-2])["usage"] == want
    counted = (before[0] + 8 + 5, before[1] + 8 + 5)  # the first request's 8, the resumed one's 5 new
    wait_until(lambda: (metrics.generated_tokens.value(), metrics.request_generation_tokens.sum()) == counted, "tally")
    status, _, reply = api.request("POST", "/v1/completions", plain | {"resume": resume})
    assert status == 200 and json.loads(reply)["usage"] == want


def test_completion_logprobs_name_tokens_and_alternatives(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))  # greedy


def test_speculative_extension_changes_no_token(api: Served, client: openai.OpenAI) -> None:
    """``speculative`` (an extra body field) reaches the engine; drafting or not, the tokens are the same."""
    texts, drafts = [], []
    for on in (True, False):
        before = api.engine.sched_stats.spec_drafts
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"speculative": on}
        )
        texts.append(out.choices[0].text)
        drafts.append(api.engine.sched_stats.spec_drafts - before)
    assert texts[0] == texts[1] and drafts[0] > 0 and drafts[1] == 0


def test_exit_threshold_extension_changes_the_served_depths(api: Served, client: openai.OpenAI) -> None:
    def depths(threshold: float) -> list[int]:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"exit_threshold": threshold}
        )
        return depths_of(out.choices[0])["depths"]

    shallow, deep = depths(0.05), depths(1.0)
    assert deep == [api.engine.limits.max_depth] * 16  # q = 1: never exit early
    assert sum(shallow) < sum(deep)


# --- chat completions --------------------------------------------------------------------------------------------
def test_chat_completion_uses_the_chat_template(api: Served, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    ids = api.engine.tokenizer.apply_chat_template(CHAT)
    reference = api.engine.generate([ids], RequestParams(max_tokens=12))[0]
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    assert_depths(depths_of(choice)["depths"], api, 12)


def test_streamed_chat_opens_with_the_role_and_matches_the_whole_reply(api: Served, client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0.8, seed=11)
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    first, tokens, last, usage = chunks[0], chunks[1:-2], chunks[-2], chunks[-1]
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert depths_of(first.choices[0])["depths"] == []
    assert len(tokens) == 10
    for c in tokens:
        assert_depths(depths_of(c.choices[0])["depths"], api, 1)
    assert last.choices[0].finish_reason == "length"
    assert usage.usage is not None and usage.usage.completion_tokens == 10 and usage.choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_chat_logprobs_have_top_alternatives(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy: the best is the one taken
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.bytes == list(e.token.encode())


def test_chat_without_a_template_is_400_naming_messages() -> None:
    with served(TINY) as tiny, pytest.raises(openai.BadRequestError) as err:
        tiny.client().chat.completions.create(model="ouro-tiny", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert err.value.param == "messages" and "chat template" in err.value.message


# --- models, health, metrics -------------------------------------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info_in_vllms_shapes(api: Served) -> None:
    tok = api.engine.tokenizer

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        status, _, raw = api.request(method, path, body)
        return status, json.loads(raw)

    status, got = call("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    ids = tok.encode(PROMPT)
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == api.engine.limits.max_total_tokens
    assert "".join(got["token_strs"]) == PROMPT
    _, chat = call("POST", "/tokenize", {"messages": CHAT})
    assert chat["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert call("POST", "/detokenize", {"tokens": ids}) == (200, {"prompt": PROMPT})
    _, info = call("GET", "/tokenizer_info")
    assert info["model_max_length"] == api.engine.limits.max_total_tokens and info["chat_template"]
    assert info["vocab_size"] == api.engine.limits.vocab_size and info["eos_token_id"] == tok.eos_token_id
    assert tok.encode(info["eos_token"]) == [tok.eos_token_id]  # what the harness's remote tokenizer reads
    for path, body, param in (
        ("/tokenize", {"prompt": PROMPT, "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [api.engine.limits.vocab_size]}, "tokens"),
        ("/tokenize", {"prompt": PROMPT, "model": "nope"}, "model"),
    ):
        status, err = call("POST", path, body)
        assert status in (400, 404) and err["error"]["param"] == param, (path, body, err)


def test_models_lists_the_served_model_and_unknown_ones_are_404(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_health_and_metrics(api: Served, client: openai.OpenAI) -> None:
    status, _, body = api.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "serving"
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    status, headers, body = api.request("GET", "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = dict(line.rsplit(" ", 1) for line in body.decode().splitlines() if line and not line.startswith("#"))
    assert float(samples[f'cdb_generation_tokens_total{{model_name="{MODEL}"}}']) >= 2
    assert float(samples[f'cdb_requests_finished_total{{finish_reason="length",model_name="{MODEL}"}}']) >= 1


# --- bad requests ------------------------------------------------------------------------------------------------
def test_penalties_logit_bias_and_min_tokens_shape_the_completion(api: Served, client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    ids = api.engine.tokenizer.encode(plain.choices[0].text)
    forced = ids[0] if ids else 5
    # A large bias makes its token the greedy choice at every step; a frequency penalty then pushes it away.
    biased = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(forced): 100}
    )
    assert api.engine.tokenizer.encode(biased.choices[0].text) == [forced] * 6
    tempered = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(forced): 5}, frequency_penalty=2.0
    )
    assert tempered.choices[0].text != biased.choices[0].text
    # min_tokens bans the end ids: banning the greedy first token's id as a stop id changes the first token.
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"stop_token_ids": [forced]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    longer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"stop_token_ids": [forced], "min_tokens": 2},
    )
    assert forced not in api.engine.tokenizer.encode(longer.choices[0].text)[:2]
    rep = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    assert rep.choices[0].text and rep.usage is not None and rep.usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"n": "two"}, "n"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"seed": "s"}, "seed"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [["a"]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a"] * 300}, "prompt"),
        ({"prompt": {"text": "a"}}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": ["a", [1, 99999]]}, "prompt[1]"),
        ({"echo": "yes"}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
        ({"stop_token_ids": "7"}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids[0]"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"n": 2, "resume": {"token_ids": [5], "depths": [2]}}, "resume"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"exit_threshold": 7}, "exit_threshold"),
        ({"speculative": "yes"}, "speculative"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:  # extra_body: sent as given, past the SDK's types
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=fields)
    assert err.value.param == param, err.value.message
    assert err.value.type == "invalid_request_error" and err.value.body["message"].startswith(param)  # type: ignore[index]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": None, "max_tokens": 0}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"n": 0}, "n"),
        ({"n": 257}, "n"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=fields)  # type: ignore[arg-type]
    assert err.value.param == param, err.value.message


def test_a_body_that_is_not_json_is_400_and_unknown_fields_are_ignored(api: Served) -> None:
    status, _, body = api.request("POST", "/v1/completions", raw=b"{not json")
    error = json.loads(body)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and "JSON" in error["message"]
    status, _, body = api.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "metadata": {"a": 1}})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
