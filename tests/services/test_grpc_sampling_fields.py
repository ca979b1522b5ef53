"""The public gRPC API's sampling fields reach the engine: ``min_p`` as on HTTP (greedy at 1, refused outside
[0, 1] under its request path)."""

from __future__ import annotations

import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from services.api.errors import status_for
from services.api.messages import request_to_engine


def test_min_p_reaches_the_engine_and_one_is_greedy() -> None:
    req = pb.GenerateRequest(text="hi", max_tokens=6, sampling=pb.SamplingParameters(temperature=1.5, min_p=1.0))
    prompt, params = request_to_engine(req)
    assert params.sampling.min_p == 1.0 and params.sampling.temperature == 1.5
    with Engine(EngineConfig(model="ouro-tiny", num_threads=1)) as engine:
        sampled = [engine.generate([prompt], params)[0].token_ids for _ in range(2)]
        greedy = engine.generate([prompt], RequestParams(max_tokens=6))[0].token_ids
    assert sampled == [greedy, greedy]


def test_min_p_out_of_range_names_its_request_path() -> None:
    req = pb.GenerateRequest(text="hi", max_tokens=2, sampling=pb.SamplingParameters(min_p=1.5))
    _, params = request_to_engine(req)
    with Engine(EngineConfig(model="ouro-tiny", num_threads=1)) as engine, pytest.raises(InvalidRequest) as err:
        engine.validate("hi", params)
    assert "sampling.min_p" in status_for(err.value)[1]


def test_priority_reaches_the_engine_request() -> None:
    """``GenerateRequest.priority`` (lower first) is the scheduler's record's (tests/scheduler/test_priority.py)."""
    _, params = request_to_engine(pb.GenerateRequest(text="hi", max_tokens=2, priority=-4))
    assert params.priority == -4
    assert request_to_engine(pb.GenerateRequest(text="hi", max_tokens=2))[1].priority == 0
    with Engine(EngineConfig(model="ouro-tiny", num_threads=1)) as engine:
        assert engine.prep.request(1, [5, 6], params).priority == -4
