"""The in-process engine's API: validation, stops, logprobs, streaming, cancellation, overload, stats."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.detokenizer import Detokenizer
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import InvalidRequest, Overloaded
from cdb_model.tokenizer import ByteTokenizer
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams

CFG = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=128, kv_block_size=8, max_waiting=2)


@pytest.fixture(scope="module")
def engine():
    with Engine(CFG) as eng:
        yield eng


def greedy(n: int, **kw) -> RequestParams:
    return RequestParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", greedy(4), "prompt"),
        ([600], greedy(4), "prompt"),
        ("x" * 1100, greedy(4), "prompt"),
        ("hi", greedy(-1), "max_tokens"),
        ("hi", greedy(1023), "max_tokens"),
        ("hi", greedy(4, sampling=SamplingParams(temperature=-1.0)), "temperature"),
        ("hi", greedy(4, sampling=SamplingParams(temperature=math.nan)), "temperature"),
        ("hi", greedy(4, sampling=SamplingParams(top_p=0.0)), "top_p"),
        ("hi", greedy(4, sampling=SamplingParams(top_p=1.5)), "top_p"),
        ("hi", greedy(4, sampling=SamplingParams(top_k=-2)), "top_k"),
        ("hi", greedy(4, sampling=SamplingParams(logprobs=99)), "logprobs"),
        ("hi", greedy(4, exit_threshold=0.0), "exit_threshold"),
        ("hi", greedy(4, exit_threshold=1.5), "exit_threshold"),
        ("hi", greedy(4, stop_token_ids=(9999,)), "stop_token_ids"),
        ("hi", greedy(4, stop_strings=("",)), "stop_strings"),
    ],
)
def test_bad_input_is_rejected_naming_the_field(engine: Engine, prompt, params, field) -> None:
    with pytest.raises(InvalidRequest) as info:
        engine.validate(prompt, params)
    assert info.value.field == field


def test_max_tokens_and_stop_ids_end_requests(engine: Engine) -> None:
    (full,) = engine.generate(["abc"], greedy(12))
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop = full.token_ids[5]
    first = full.token_ids.index(stop)
    (cut,) = engine.generate(["abc"], greedy(12, stop_token_ids=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: first + 1], "the stop id is the last token"


def test_stop_string_truncates_text_and_finishes(engine: Engine) -> None:
    (full,) = engine.generate([[10, 11, 12]], greedy(16))
    text = full.text
    assert len(text) > 4
    stop = text[3:5]
    (cut,) = engine.generate([[10, 11, 12]], greedy(16, stop_strings=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible_and_logprobs_are_returned(engine: Engine) -> None:
    p = greedy(10, sampling=SamplingParams(temperature=1.0, seed=42, logprobs=3, return_logprob=True))
    a, b = engine.generate(["hello", "hello"], p)
    assert a.token_ids == b.token_ids
    other = engine.generate(["hello"], replace(p, sampling=replace(p.sampling, seed=43)))[0]
    assert other.token_ids != a.token_ids
    for lp in a.logprobs:
        assert lp is not None and lp.logprob <= 0 and len(lp.top_ids) == 3
        assert lp.logprob <= lp.top_logprobs[0] + 1e-6


def test_stream_yields_tokens_then_one_finish(engine: Engine) -> None:
    async def collect():
        return [ev async for ev in engine.stream("stream me", greedy(6))]

    events = asyncio.run(collect())
    assert [type(e) for e in events] == [TokenEvent] * 6 + [FinishEvent]
    assert events[-1].generated_tokens == 6 and events[-1].total_loop_steps == sum(e.depth for e in events[:-1])


def test_leaving_the_stream_early_aborts_and_frees_resources(engine: Engine) -> None:
    async def take_two():
        got = []
        async for ev in engine.stream("cancel me", greedy(200)):
            got.append(ev)
            if len(got) == 2:
                break
        return got

    assert len(asyncio.run(take_two())) == 2
    done = threading.Event()
    engine.submit([5], greedy(1), lambda ev: done.set() if isinstance(ev, FinishEvent) else None)
    assert done.wait(30)  # the engine kept serving; the aborted request's resources are back:
    st = engine.stats()
    assert st.held_rows == 0 and st.used_kv_blocks == 0 and st.running == 0


def test_overload_is_refused_at_once() -> None:
    with Engine(replace(CFG, max_num_seqs=1, max_waiting=1)) as eng:
        gate = threading.Event()
        names = [
            eng.submit([5, 6], greedy(50), lambda ev: gate.set() if isinstance(ev, FinishEvent) else None)
            for _ in range(2)
        ]
        with pytest.raises(Overloaded):
            eng.submit([5, 6], greedy(5), lambda ev: None)
        for n in names:
            eng.abort(n)


def test_depth_indexed_with_early_exit_is_refused() -> None:
    with pytest.raises(ValueError, match="depth_indexed"):
        Engine(replace(CFG, kv_policy="depth_indexed", exit_threshold=0.5))
    Engine(replace(CFG, kv_policy="depth_indexed", mode="full-depth"))


def test_detokenizer_holds_back_a_possible_stop_string_prefix() -> None:
    tok = ByteTokenizer()
    d = Detokenizer(tok, ("END",))
    out = []
    for ch in "abcEN":
        delta, stopped = d.push(tok.encode(ch)[0])
        out.append(delta)
        assert not stopped
    assert "".join(out) == "abc"
    delta, stopped = d.push(tok.encode("D")[0])
    assert stopped and delta == ""


def test_detokenizer_decodes_a_bounded_window_whatever_the_ids() -> None:
    """Ids that decode to nothing (specials, ids past the byte range) or to broken UTF-8 cannot hold the window
    open: each push decodes a bounded number of ids, and valid text after them still streams whole."""
    seen: list[int] = []

    class Counting(ByteTokenizer):
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting()
    d = Detokenizer(tok, ())
    junk = [random.Random(3).choice([0, 1, 300, 400, 0xC3 + 3, 0xF0 + 3]) for _ in range(500)]
    for i in junk:
        d.push(i)
    seen.clear()
    text = "tail: é and 🙂"
    out = "".join(d.push(i)[0] for i in tok.encode(text)) + d.flush()
    assert out.endswith(text)
    assert max(seen) <= 16


def test_abort_right_after_submit_always_finds_the_request(engine: Engine) -> None:
    """The request id is registered synchronously: a cancel issued at once never misses, however the engine
    thread is scheduled, and every such request ends cancelled with its resources back."""
    finishes: list[FinishEvent] = []
    done = threading.Semaphore(0)

    def sink(ev: object) -> None:
        if isinstance(ev, FinishEvent):
            finishes.append(ev)
            done.release()

    n = 200
    for i in range(n):
        request_id = engine.submit([5, 6, 7], greedy(500), sink, f"race-{i}", force=True)
        assert engine.abort(request_id), f"abort right after submit missed {request_id}"
    for _ in range(n):
        assert done.acquire(timeout=30)
    assert len(finishes) == n and {f.finish_reason for f in finishes} == {FinishReason.CANCELLED}
    assert all(f.generated_tokens < 500 for f in finishes)
    st = engine.stats()
    assert st.held_rows == 0 and st.used_kv_blocks == 0 and st.running == 0 and st.waiting == 0


def test_a_live_request_id_cannot_be_reused(engine: Engine) -> None:
    engine.submit([5], greedy(500), lambda ev: None, "twice")
    try:
        with pytest.raises(InvalidRequest, match="request_id"):
            engine.submit([5], greedy(1), lambda ev: None, "twice")
    finally:
        assert engine.abort("twice")


def test_an_aborted_requests_id_is_free_at_once_and_its_end_goes_to_its_own_sink(engine: Engine) -> None:
    """A retry with the id of a request just aborted is admitted before the engine thread has applied the abort
    (here it is held); the aborted request still ends cancelled on its own sink, the retry runs to its end on its
    own, and the id stays the retry's until then."""
    ends: dict[str, list[object]] = {"old": [], "new": []}
    reuse: list[str] = []
    finished = threading.Semaphore(0)

    def sink(name: str):  # type: ignore[no-untyped-def]
        def put(ev: object) -> None:
            ends[name].append(ev)
            if name == "new" and isinstance(ev, TokenEvent) and ev.index == 0:  # the retry is live: its id is taken
                try:
                    engine.submit([5], greedy(1), lambda ev: None, "retried", force=True)
                    reuse.append("admitted")
                except InvalidRequest:
                    reuse.append("refused")
            if isinstance(ev, FinishEvent):
                finished.release()

        return put

    gate = threading.Event()
    engine.submit([5, 6], greedy(500), sink("old"), "retried", force=True)
    engine._command(lambda: gate.wait(30))  # the engine thread applies nothing until the gate opens
    try:
        assert engine.abort("retried")
        engine.submit([5, 6], greedy(3), sink("new"), "retried", force=True)
        assert not engine.abort("not-submitted")
    finally:
        gate.set()
    assert finished.acquire(timeout=30) and finished.acquire(timeout=30)
    old, new = ends["old"][-1], ends["new"][-1]
    assert isinstance(old, FinishEvent) and old.finish_reason is FinishReason.CANCELLED
    assert isinstance(new, FinishEvent) and new.finish_reason is FinishReason.LENGTH and new.generated_tokens == 3
    assert sum(isinstance(ev, TokenEvent) for ev in ends["new"]) == 3
    assert reuse == ["refused"]  # the aborted request's end did not free the id the retry holds


class CountingTokenizer(ByteTokenizer):
    """Counts the ids it is asked to decode."""

    decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_detokenizer_is_incremental_and_exact_on_a_long_output() -> None:
    """A 4,000-token output with multi-byte characters and a stop string: the deltas add up to the full decode,
    and the decoding work per token stays bounded (not the whole output again for every token)."""
    rng = random.Random(3)
    text = "".join(rng.choice(["a", "b", " ", "é", "€", "😀", "\n"]) for _ in range(2500)) + "STOP tail"
    tok = CountingTokenizer()
    ids = tok.encode(text)
    assert len(ids) > 4000
    d = Detokenizer(tok, ("STOP",))
    out, stopped = [], False
    for i in ids:
        delta, stopped = d.push(i)
        out.append(delta)
        if stopped:
            break
    assert stopped and "".join(out) == text[: text.index("STOP")]
    assert tok.decoded < 12 * len(ids), f"{tok.decoded} ids decoded for {len(ids)} tokens"
    d2 = Detokenizer(tok, ())
    assert "".join(d2.push(i)[0] for i in ids) + d2.flush() == text


def test_replayed_depths_are_refused_unless_allowed_and_served_when_allowed(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="replay_depths: refused"):
        engine.validate([5, 6], greedy(4, replay_depths=(1, 2, 3)))
    with Engine(replace(CFG, allow_replay_depths=True)) as eng:
        with pytest.raises(InvalidRequest, match="replay_depths: depths must be in"):
            eng.validate([5, 6], greedy(4, replay_depths=(1, 9)))
        with pytest.raises(InvalidRequest, match="exit_threshold: not used with replay_depths"):
            eng.validate([5, 6], greedy(4, replay_depths=(1,), exit_threshold=0.5))
        replayed, live = eng.generate([[5, 6], [5, 6]], [greedy(5, replay_depths=(3, 1, 4, 2)), greedy(5)])
    assert replayed.depths == [eng.limits.max_depth, 3, 1, 4, 2]
    assert live.depths[0] == eng.limits.max_depth and len(live.depths) == 5
