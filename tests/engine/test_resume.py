"""Resuming a broken stream (``RequestParams.resume_tokens`` / ``GenerateRequest.resume``): a request sent again
with the tokens and depths it had delivered continues exactly where it stopped: the same tokens at the same
depths, the same text, nothing delivered twice, and a usage of its own tokens (the resumed ones counted apart);
across KV policies, sampling and stop strings."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import InvalidRequest
from cdb_scheduler.sampling import SamplingParams

BASE = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=4, num_kv_blocks=128, kv_block_size=8)

CASES = [
    ("the loop", RequestParams(max_tokens=14, ignore_eos=True)),
    ([5, 6, 7, 8, 9], RequestParams(max_tokens=12, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=3))),
    (
        "abc def",
        RequestParams(max_tokens=16, sampling=SamplingParams(temperature=1.2, top_k=20, seed=11), ignore_eos=True),
    ),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(BASE) as eng:
        yield eng


def run(engine: Engine, prompt: str | list[int], params: RequestParams) -> list[TokenEvent | FinishEvent]:
    events: list[TokenEvent | FinishEvent] = []
    done = threading.Event()

    def sink(ev: TokenEvent | FinishEvent) -> None:
        events.append(ev)
        if isinstance(ev, FinishEvent):
            done.set()

    engine.submit(engine.validate(prompt, params), params, sink)
    assert done.wait(60)
    return events


def resumed(params: RequestParams, tokens: list[TokenEvent]) -> RequestParams:
    return replace(
        params, resume_tokens=tuple(t.token_id for t in tokens), resume_depths=tuple(t.depth for t in tokens)
    )


@pytest.mark.parametrize(
    ("model", "kv_policy"), [("ouro-tiny", "last_exited"), ("ouro-tiny", "single"), ("huginn-tiny", "last_exited")]
)
def test_a_resumed_stream_continues_exactly_where_it_stopped(model: str, kv_policy: str) -> None:
    cfg = replace(BASE, model=model, kv_policy=kv_policy)
    with Engine(cfg) as engine:
        for prompt, params in CASES:
            full = run(engine, prompt, params)
            tokens = [e for e in full if isinstance(e, TokenEvent)]
            finish = full[-1]
            assert isinstance(finish, FinishEvent) and len(tokens) >= 3
            for cut in (1, len(tokens) // 2, len(tokens) - 1):
                rest = run(engine, prompt, resumed(params, tokens[:cut]))
                got = [e for e in rest if isinstance(e, TokenEvent)]
                end = rest[-1]
                assert isinstance(end, FinishEvent)
                assert [(t.index, t.token_id, t.depth) for t in got] == [
                    (t.index, t.token_id, t.depth) for t in tokens[cut:]
                ]
                assert [t.text for t in got] == [t.text for t in tokens[cut:]] and end.text == finish.text
                # the usage is this request's: the tokens after the resumed ones, those counted apart
                assert (end.finish_reason, end.generated_tokens, end.total_loop_steps, end.resumed_tokens) == (
                    finish.finish_reason,
                    finish.generated_tokens - cut,
                    finish.total_loop_steps - sum(t.depth for t in tokens[:cut]),
                    cut,
                )


def test_a_stop_string_across_the_resume_point_is_still_found(engine: Engine) -> None:
    params = RequestParams(max_tokens=20, ignore_eos=True)
    tokens = [e for e in run(engine, "the loop", params) if isinstance(e, TokenEvent)]
    text = "".join(t.text for t in tokens)
    stop = text[5:8]  # three characters the generation produces
    with_stop = replace(params, stop_strings=(stop,))
    full = run(engine, "the loop", with_stop)
    first = [e for e in full if isinstance(e, TokenEvent)]
    for cut in range(1, len(first)):
        rest = run(engine, "the loop", resumed(with_stop, first[:cut]))
        assert "".join(t.text for t in first[:cut]) + "".join(e.text for e in rest) == "".join(e.text for e in full)
        assert rest[-1].finish_reason == full[-1].finish_reason


@pytest.mark.parametrize(
    ("tokens", "depths", "max_tokens", "why"),
    [
        ((5, 6), (4,), 8, "2 token ids but 1 depths"),
        ((5, 6, 7), (4, 2, 2), 3, "leave nothing to generate"),
        ((5, 9999), (4, 2), 8, "unknown token ids"),
        ((5, 6), (4, 99), 8, "depths must be in"),
    ],
)
def test_bad_resume_states_are_refused_naming_the_field(engine: Engine, tokens, depths, max_tokens, why) -> None:
    params = RequestParams(max_tokens=max_tokens, resume_tokens=tokens, resume_depths=depths)
    with pytest.raises(InvalidRequest, match=why) as err:
        engine.validate("hi", params)
    assert err.value.field == "resume"


def test_a_resume_that_already_ended_is_refused_and_leaves_the_id_free(engine: Engine) -> None:
    eos = engine.model_config.stop_token_ids[0]
    params = RequestParams(max_tokens=8, resume_tokens=(5, eos), resume_depths=(4, 2))
    ids = engine.validate("hi", params)
    with pytest.raises(InvalidRequest, match="stop token"):
        engine.submit(ids, params, lambda ev: None, "again")
    events = run(engine, "hi", RequestParams(max_tokens=2, ignore_eos=True))  # the engine still serves
    assert isinstance(events[-1], FinishEvent)
    engine.submit(ids, replace(params, resume_tokens=(), resume_depths=()), lambda ev: None, "again")
