"""Every request field bounded by ``Engine.validate`` (``cdb_engine.limits.REQUEST_BOUNDS``): the edges pass, one
step beyond is ``InvalidRequest`` naming the field, sizes are checked before the work they bound, and nothing that
passes can overflow a field of the stage protocol (the cause of an engine loop that once died on ``top_k``)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import INT32_MAX, REQUEST_BOUNDS, UINT64_MAX
from cdb_engine.validation import check_messages_size, check_request_id
from cdb_scheduler.plan import HeadOp
from cdb_scheduler.sampling import SamplingParams
from services.transport.convert import op_to_pb

pytestmark = pytest.mark.timeout(60)

B = REQUEST_BOUNDS
CFG = EngineConfig(
    model="ouro-tiny",
    max_num_seqs=4,
    num_kv_blocks=128,
    kv_block_size=8,
    max_total_tokens=400,
    allow_replay_depths=True,
)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(CFG)  # validation only: never started


def params(sampling: dict[str, Any] | None = None, **kw: Any) -> RequestParams:
    return RequestParams(max_tokens=kw.pop("max_tokens", 4), sampling=SamplingParams(**(sampling or {})), **kw)


ACCEPTED = [
    params({"temperature": 0.0}),
    params({"temperature": B.min_temperature}),
    params({"temperature": B.max_temperature}),
    params({"top_k": INT32_MAX}),
    params({"top_p": 5e-324}),
    params({"seed": 0}),
    params({"seed": UINT64_MAX}),
    params({"logprobs": B.max_logprobs, "return_logprob": True}),
    params(stop_strings=("s" * B.max_stop_string_bytes,) * B.max_stop_strings),
    params(stop_strings=("é" * (B.max_stop_string_bytes // 2),)),
    params(stop_token_ids=(1,) * B.max_stop_token_ids),
    params(replay_depths=(1,) * 400),
    params(max_tokens=398),
]

REFUSED = [
    (params({"temperature": math.inf}), "temperature"),
    (params({"temperature": -0.5}), "temperature"),
    (params({"temperature": B.max_temperature * 1.01}), "temperature"),
    (params({"temperature": 1e-300}), "temperature"),
    (params({"temperature": 5e-324}), "temperature"),
    (params({"top_p": math.nan}), "top_p"),
    (params({"top_p": -math.inf}), "top_p"),
    (params({"top_k": INT32_MAX + 1}), "top_k"),
    (params({"top_k": 2**200}), "top_k"),
    (params({"top_k": -1}), "top_k"),
    (params({"seed": -1}), "seed"),
    (params({"seed": UINT64_MAX + 1}), "seed"),
    (params({"logprobs": B.max_logprobs + 1}), "logprobs"),
    (params({"logprobs": -(2**70)}), "logprobs"),
    (params(max_tokens=2**63), "max_tokens"),
    (params(max_tokens=-(2**31)), "max_tokens"),
    (params(max_tokens=399), "max_tokens"),
    (params(stop_strings=("s",) * (B.max_stop_strings + 1)), "stop_strings"),
    (params(stop_strings=("s" * (B.max_stop_string_bytes + 1),)), "stop_strings"),
    (params(stop_strings=("é" * (B.max_stop_string_bytes // 2 + 1),)), "stop_strings"),
    (params(stop_strings=("\ud800",)), "stop_strings"),
    (params(stop_token_ids=(1,) * (B.max_stop_token_ids + 1)), "stop_token_ids"),
    (params(stop_token_ids=(2**63,)), "stop_token_ids"),
    (params(exit_threshold=math.nan), "exit_threshold"),
    (params(exit_threshold=1e308), "exit_threshold"),
    (params(replay_depths=(1,) * 401), "replay_depths"),
    (params(replay_depths=(2**31,)), "replay_depths"),
    (params(replay_depths=(0,)), "replay_depths"),
]


@pytest.mark.parametrize("p", ACCEPTED)
def test_every_bound_accepts_its_edge(engine: Engine, p: RequestParams) -> None:
    assert engine.validate("hi", p) == engine.tokenizer.encode("hi")


@pytest.mark.parametrize(("p", "field"), REFUSED)
def test_a_value_beyond_a_bound_is_refused_naming_its_field(engine: Engine, p: RequestParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        engine.validate("hi", p)
    assert info.value.field == field


def test_accepted_sampling_values_fit_the_stage_protocol(engine: Engine) -> None:
    for p in ACCEPTED:
        engine.validate("hi", p)
        op = HeadOp(
            seq=1,
            fences=(),
            kv_updates=(),
            released=(),
            rids=(1,),
            positions=(0,),
            rows=(0,),
            sample=(True,),
            sampling=(p.sampling,),
            token_index=(0,),
        )
        op_to_pb(op)  # raises ValueError for a value out of an int32 / uint64 field's range


def test_a_text_prompt_over_the_byte_limit_is_refused_before_it_is_tokenized(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(text: str) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(engine.tokenizer, "encode", never)
    for prompt in ("x" * (B.max_prompt_bytes + 1), "é" * (B.max_prompt_bytes // 2 + 1), "ok \udfff"):
        with pytest.raises(InvalidRequest) as info:
            engine.validate(prompt, params())
        assert info.value.field == "prompt"


def test_a_token_prompt_over_max_input_tokens_is_refused_before_its_ids_are_read(engine: Engine) -> None:
    class Unreadable(list[int]):
        def __iter__(self) -> Any:
            raise AssertionError("ids read")

    too_long = Unreadable([1] * (engine.limits.max_input_tokens + 1))
    with pytest.raises(InvalidRequest) as info:
        engine.validate(too_long, params())
    assert info.value.field == "prompt" and "max_input_tokens" in info.value.message


def test_chat_messages_are_bounded_in_number_and_bytes() -> None:
    check_messages_size([{"role": "user", "content": "x" * (B.max_prompt_bytes - 4)}])
    check_messages_size([{"role": "u", "content": ""}] * B.max_messages)
    for messages in (
        [{"role": "user", "content": "x" * (B.max_prompt_bytes - 3)}],
        [{"role": "u", "content": ""}] * (B.max_messages + 1),
        [{"role": "user", "content": "\ud800"}],
    ):
        with pytest.raises(InvalidRequest) as info:
            check_messages_size(messages)
        assert info.value.field == "messages"


def test_request_ids_are_bounded_in_bytes_and_printable_ascii() -> None:
    check_request_id("r" * B.max_request_id_bytes)
    check_request_id("batch 7/req-01_~!")
    bad = ["r" * (B.max_request_id_bytes + 1), "é" * (B.max_request_id_bytes // 2 + 1)]
    bad += ["café", "a\r\nforged log line", "tab\tid", "del\x7f", "\x00"]
    for request_id in bad:
        with pytest.raises(InvalidRequest) as info:
            check_request_id(request_id)
        assert info.value.field == "request_id"


def test_the_bounds_are_one_documented_table() -> None:
    import cdb_engine.limits as limits

    doc = limits.__doc__ or ""
    for name in ("max_prompt_bytes", "max_messages", "max_logprobs", "max_stop_strings", "max_request_id_bytes"):
        assert name in doc
