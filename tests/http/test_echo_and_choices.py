"""``echo`` with prompt logprobs, ``max_tokens`` 0, lists of prompts, ``n`` > 1 and ``stop_token_ids`` on the
OpenAI-compatible API (what the evaluation harness sends), on a real server over the shipped model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from cdb_engine.config import RequestParams, Speculative
from cdb_scheduler.sampling import SamplingParams
from services.http.schemas import sample_seed
from tests.http.harness import SETTINGS, TINY, Served, served, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "ouro-kjv"
PROMPT = "And God said, Let there be light"
OTHER = "In the beginning"


@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    # (no drafts: whether auto drafts follows measured op times, and a drafted token's logprob comes from a loop op
    # of another composition, equal to the last float32 bits only; the tokens are the same either way)
    with served(replace(TINY, model=MODEL, speculative=Speculative.OFF)) as s:
        yield s


def complete(api: Served, **body: Any) -> dict[str, Any]:
    status, _, raw = api.request("POST", "/v1/completions", {"model": MODEL, **body})
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


def stream(api: Served, **body: Any) -> list[dict[str, Any]]:
    status, headers, raw = api.request("POST", "/v1/completions", {"model": MODEL, "stream": True, **body})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def scored(api: Served, ids: list[int], logprobs: int) -> list[Any]:
    """The engine's own prompt logprobs of ``ids`` (the reference of the API's echo)."""
    params = RequestParams(max_tokens=0, sampling=SamplingParams(logprobs=logprobs), prompt_logprobs=True)
    return api.engine.generate([ids], params)[0].prompt_logprobs


# --- echo and max_tokens 0 ----------------------------------------------------------------------------------------
def test_echo_with_max_tokens_zero_returns_only_the_prompt_and_its_logprobs(api: Served) -> None:
    ids = api.engine.tokenizer.encode(PROMPT)
    out = complete(api, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    (choice,) = out["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert choice["cdb"]["depths"] == [] and choice["cdb"]["mean_depth"] is None
    lp = choice["logprobs"]
    tok = api.engine.tokenizer
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
    reference = scored(api, ids, 2)
    assert lp["token_logprobs"][1:] == [r.logprob for r in reference]
    for top, r, logprob in zip(lp["top_logprobs"][1:], reference, lp["token_logprobs"][1:]):
        assert list(top.values()) == list(r.top_logprobs) and max(top.values()) >= logprob
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(text.startswith(t) for text, t in zip((PROMPT[o:] for o in lp["text_offset"]), lp["tokens"]))


def test_max_tokens_zero_without_echo_is_an_empty_completion(api: Served) -> None:
    out = complete(api, prompt=PROMPT, max_tokens=0)
    assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] > 0


def test_echo_with_generated_tokens_is_the_prompt_then_the_completion(api: Served) -> None:
    # what lm_eval's loglikelihood sends: echo, max_tokens 1, logprobs 1, token ids; it slices [ctxlen:-1]
    ids = api.engine.tokenizer.encode(PROMPT)
    plain = complete(api, prompt=ids, max_tokens=1, temperature=0, logprobs=1)["choices"][0]
    echo = complete(api, prompt=ids, echo=True, max_tokens=1, temperature=0, logprobs=1)["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"] == api.engine.tokenizer.decode(ids) + plain["text"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][1:-1] == [r.logprob for r in scored(api, ids, 1)]
    assert lp["token_logprobs"][-1] == plain["logprobs"]["token_logprobs"][0]
    assert lp["text_offset"][-1] == len(api.engine.tokenizer.decode(ids))
    greedy = lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    assert greedy, "a greedy token is its own top alternative"
    text = complete(api, prompt=PROMPT, echo=True, max_tokens=5, temperature=0)["choices"][0]["text"]
    assert text == PROMPT + complete(api, prompt=PROMPT, max_tokens=5, temperature=0)["choices"][0]["text"]


def test_streamed_echo_opens_with_the_prompt_and_joins_to_the_whole(api: Served) -> None:
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    whole = complete(api, **body)["choices"][0]
    chunks = stream(api, **body)
    assert chunks[0]["choices"][0]["text"] == PROMPT and chunks[0]["choices"][0]["cdb"]["depths"] == []
    texts = "".join(c["choices"][0]["text"] for c in chunks)
    assert texts == whole["text"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["token_logprobs"]
    zero = stream(api, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    assert [c["choices"][0]["text"] for c in zero] == [PROMPT, ""]
    assert zero[-1]["choices"][0]["finish_reason"] == "length"


# --- lists of prompts and n -------------------------------------------------------------------------------------
def test_a_list_of_prompts_gives_one_choice_each_in_order(api: Served) -> None:
    prompts = [PROMPT, OTHER, api.engine.tokenizer.encode("And the earth")]
    out = complete(api, prompt=prompts, max_tokens=6, temperature=0, logprobs=1, echo=True)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for prompt, choice in zip(prompts, out["choices"]):
        alone = complete(api, prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True)
        assert choice["text"] == alone["choices"][0]["text"]
        assert choice["cdb"]["depths"] == alone["choices"][0]["cdb"]["depths"]
        mine, its = choice["logprobs"]["token_logprobs"], alone["choices"][0]["logprobs"]["token_logprobs"]
        n = len(mine) - len(choice["cdb"]["depths"])  # the prompt's: from the prefill (float64 exactness of
        # batched vs alone: tests/engine/test_prompt_logprobs.py; here float32 matmuls over other batch shapes)
        assert mine[:n] == pytest.approx(its[:n], abs=1e-5), "batching changed a prompt logprob"  # (float32 ulps)
        assert mine[n:] == pytest.approx(its[n:], abs=1e-5)  # generated: float32 decode batches of other widths
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == sum(len(c["cdb"]["depths"]) for c in out["choices"])


def test_n_samples_are_seeded_per_sample_and_reproducible(api: Served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    out = complete(api, n=4, **body)
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert len(set(texts)) > 1, "the samples are not independent"
    for j, text in enumerate(texts):  # sample j alone, with its derived seed
        assert complete(api, **{**body, "seed": sample_seed(11, j)})["choices"][0]["text"] == text
    assert [c["text"] for c in complete(api, n=4, **body)["choices"]] == texts
    assert out["usage"]["prompt_tokens"] == complete(api, **body)["usage"]["prompt_tokens"]  # counted once
    both = complete(api, **{**body, "prompt": [PROMPT, OTHER]}, n=2)["choices"]
    assert [c["index"] for c in both] == [0, 1, 2, 3] and [c["text"] for c in both[:2]] == texts[:2]


def test_streamed_choices_interleave_and_end_with_one_usage_chunk(api: Served) -> None:
    body = {"prompt": [PROMPT, OTHER], "n": 2, "max_tokens": 5, "temperature": 0.8, "seed": 3}
    whole = complete(api, **body)
    chunks = stream(api, **body, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    by_index: dict[int, str] = {}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert by_index == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}


def test_chat_n_samples(api: Served) -> None:
    messages = [{"role": "user", "content": "Who made the heaven?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": 5}
    status, _, raw = api.request("POST", "/v1/chat/completions", {**body, "n": 3})
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    status, _, raw = api.request("POST", "/v1/chat/completions", {**body, "seed": sample_seed(5, 2)})
    assert json.loads(raw)["choices"][0]["message"] == choices[2]["message"]


# --- stop_token_ids -------------------------------------------------------------------------------------------------
def test_stop_token_ids_end_the_completion_at_that_token(api: Served) -> None:
    free = api.engine.generate([PROMPT], RequestParams(max_tokens=8, ignore_eos=True))[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    out = complete(api, prompt=PROMPT, max_tokens=8, temperature=0, stop_token_ids=[stop])
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == first + 1
    assert choice["text"] == api.engine.tokenizer.decode(free.token_ids[: first + 1])


def test_a_refused_choice_refuses_the_request_and_ends_the_choices_admitted_before_it(api: Served) -> None:
    long = {"max_tokens": 300, "ignore_eos": True}
    status, _, raw = api.request("POST", "/v1/completions", {"prompt": [PROMPT, OTHER, ""], **long})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "prompt[2]", error
    wait_until(lambda: not api.on_loop(lambda: dict(api.door.live)), "the admitted choices to end")
    wait_until(lambda: api.engine.stats().running == 0 and api.engine.stats().waiting == 0, "an idle engine")
    assert api.engine.stats().used_kv_blocks == 0


def test_more_choices_than_the_server_or_one_caller_holds_is_a_400_naming_n_not_an_overload() -> None:
    body = {"model": "ouro-tiny", "prompt": "hi", "max_tokens": 1, "n": 7}
    with served(replace(TINY, max_waiting=8)) as api:  # holds 4 resident + 8 waiting requests, a caller half
        status, _, raw = api.request("POST", "/v1/completions", body)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "n" and "CDB_MAX_REQUESTS_PER_CALLER" in error["message"]
        status, _, raw = api.request("POST", "/v1/completions", {**body, "n": 6, "stream": False})
        assert status == 200 and len(json.loads(raw)["choices"]) == 6
    with served(replace(TINY, max_waiting=8), settings=replace(SETTINGS, max_requests_per_caller=100)) as api:
        status, _, raw = api.request("POST", "/v1/completions", {**body, "n": 13})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "n" and "12 requests this server holds" in error["message"]
        status, _, raw = api.request("POST", "/v1/completions", {**body, "n": 12})
        assert status == 200 and len(json.loads(raw)["choices"]) == 12
