"""A resumed stream's ids are client state, bounded like a prompt: prompt and resumed ids within
``max_input_tokens`` (they are prefilled again) and the whole within ``max_total_tokens``; no id the request could
not have produced (a token its logit bias bans); a usage of the tokens this request generates, the resumed ones
counted apart; and their priming (a decode of every resumed id) off the caller's event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cdb_engine.client import InProcessClient
from cdb_engine.config import RequestParams, logits_processing
from cdb_engine.detokenizer import TextOutput
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import InvalidRequest
from cdb_engine.prepare import RequestPreparer
from cdb_model.tokenizer import SPECIAL_TOKENS
from cdb_scheduler.sampling import SamplingParams
from services.api.messages import finish_to_pb

from .test_resume import BASE, resumed, run

PROMPT = [5, 6, 7, 8, 9, 10]  # six ids
IM_START = SPECIAL_TOKENS.index("<|im_start|>")  # a special token that is no stop id


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(BASE) as eng:
        yield eng


def preparer(**limits: int) -> RequestPreparer:
    """Validation of the ouro-tiny engine under these limits (no engine thread)."""
    return RequestPreparer.of(replace(BASE, **limits))  # type: ignore[arg-type]


def resume(n: int, **fields: object) -> RequestParams:
    """A request resumed after ``n`` plain byte tokens, with room for more."""
    params = RequestParams(max_tokens=n + 4, resume_tokens=(40,) * n, resume_depths=(2,) * n)
    return replace(params, **fields)  # type: ignore[arg-type]


def refusal(prep: RequestPreparer, prompt: list[int], params: RequestParams) -> str:
    """The message of the ``InvalidRequest`` naming ``resume`` that ``prep`` refuses the request with."""
    with pytest.raises(InvalidRequest) as err:
        prep.validate(prompt, params)
    assert err.value.field == "resume", err.value
    return str(err.value)


def test_resumed_tokens_count_against_max_input_tokens() -> None:
    """The attack: a prompt within ``max_input_tokens`` and a resume that makes its prefill longer than the operator
    allows any prefill. Refused naming both counts and the limit; a resume that keeps the prefill within it passes."""
    prep = preparer(max_input_tokens=8, max_total_tokens=64)
    assert prep.validate(PROMPT, RequestParams(max_tokens=8)) == PROMPT  # the prompt alone fits
    why = refusal(prep, PROMPT, resume(3))
    assert "prompt (6) + resumed tokens (3) exceed max_input_tokens 8" in why
    assert prep.validate(PROMPT, resume(2)) == PROMPT  # 6 + 2 = 8: the limit itself


def test_prompt_resumed_and_new_tokens_stay_within_max_total_tokens() -> None:
    """The whole sequence (prompt, resumed, then new tokens) stays within ``max_total_tokens``: ``max_tokens``
    bounds resumed and new tokens together, and a resume that leaves it no room is refused."""
    prep = preparer(max_input_tokens=60, max_total_tokens=32)
    with pytest.raises(InvalidRequest, match=r"prompt \(6\) \+ max_tokens \(27\) exceed max_total_tokens 32") as err:
        prep.validate(PROMPT, resume(20, max_tokens=27))  # 6 + 20 resumed + 7 more = 33
    assert err.value.field == "max_tokens"
    assert "leave nothing to generate" in refusal(prep, PROMPT, resume(26, max_tokens=26))
    assert prep.validate(PROMPT, resume(20, max_tokens=26)) == PROMPT  # 6 + 26 = 32


def test_a_special_token_a_stream_delivered_is_resumed() -> None:
    """Not refused: a model samples special tokens (the sampled huginn-tiny stream of ``test_resume`` delivers
    ``<|im_start|>``) and a stream hands out every token's id whatever its text shows (``skip_special_tokens``), so
    a resume holding one is the client's own state; a prompt may hold them too. A model stop id among them is a
    stop (refused), unless ``ignore_eos`` generates past it."""
    prep = preparer()
    sampled = replace(resume(2), resume_tokens=(40, IM_START))
    assert prep.validate(PROMPT, sampled) == PROMPT
    assert prep.validate([*PROMPT, IM_START], RequestParams()) == [*PROMPT, IM_START]  # as a prompt may hold it
    prep.request(1, PROMPT, sampled)
    past_eos = replace(sampled, resume_tokens=(40, prep.model_config.stop_token_ids[0]))
    with pytest.raises(InvalidRequest, match="stop token"):
        prep.request(1, PROMPT, past_eos)
    prep.request(1, PROMPT, replace(past_eos, ignore_eos=True))


def test_a_token_the_logit_bias_bans_is_refused() -> None:
    """The attack: a resume holding a token the request's own ``logit_bias`` bans (-100), which it could never
    have generated. Refused; a bias short of the ban does not refuse it."""
    prep = preparer()

    def biased(bias: float) -> RequestParams:
        return resume(2, sampling=SamplingParams(processing=logits_processing(logit_bias={40: bias})))

    assert "token ids [40, 40] that logit_bias bans (-100)" in refusal(prep, PROMPT, biased(-100.0))
    assert prep.validate(PROMPT, biased(-99.0)) == PROMPT


def test_a_resumed_streams_usage_counts_only_the_tokens_it_generates(engine: Engine) -> None:
    """The resumed tokens were generated (and counted) by the broken stream: the resumed request's
    ``generated_tokens`` and ``total_loop_steps`` count only the tokens after them, ``resumed_tokens`` those."""
    params = RequestParams(max_tokens=10, ignore_eos=True)
    full = run(engine, "the loop", params)
    tokens = [e for e in full if isinstance(e, TokenEvent)]
    whole = full[-1]
    assert isinstance(whole, FinishEvent) and whole.generated_tokens == 10 and whole.resumed_tokens == 0
    end = run(engine, "the loop", resumed(params, tokens[:4]))[-1]
    assert isinstance(end, FinishEvent)
    assert (end.generated_tokens, end.resumed_tokens) == (6, 4)
    assert (
        end.total_loop_steps
        == sum(t.depth for t in tokens[4:])
        == whole.total_loop_steps - sum(t.depth for t in tokens[:4])
    )
    usage = finish_to_pb(end).usage  # gRPC's
    assert (usage.generated_tokens, usage.total_loop_steps, usage.resumed_tokens) == (6, end.total_loop_steps, 4)


def test_a_resumed_stream_is_primed_off_the_event_loop(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``InProcessClient.open_stream`` decodes a resumed stream's ids (``RequestPreparer.output``) on a worker
    thread, not on the event loop that serves every other stream; a request without resumed ids makes its text
    on the loop (no thread hop)."""
    params = RequestParams(max_tokens=8, ignore_eos=True)
    tokens = [e for e in run(engine, "the loop", params) if isinstance(e, TokenEvent)]
    ids = engine.validate("the loop", params)
    threads: list[int] = []
    output = RequestPreparer.output

    def recorded(self: RequestPreparer, p: RequestParams) -> TextOutput:
        threads.append(threading.get_ident())
        return output(self, p)

    monkeypatch.setattr(RequestPreparer, "output", recorded)
    client = InProcessClient(engine)

    async def stream(p: RequestParams, request_id: str) -> tuple[int, list[object]]:
        async with await client.open_stream(ids, p, request_id) as events:
            return threading.get_ident(), [ev async for ev in events]

    loop, events = asyncio.run(stream(resumed(params, tokens[:5]), "primed"))
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [t.token_id for t in tokens[5:]]
    assert len(threads) == 1 and threads[0] != loop
    threads.clear()
    loop, _ = asyncio.run(stream(params, "plain"))
    assert threads == [loop]
