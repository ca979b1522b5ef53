"""Generated requests — every field, at its edges and beyond (huge and negative integers, NaN and infinite floats,
huge strings, long lists, lone surrogates) — thrown at a real process tree over both APIs: each one gets a result or
a clear refusal naming a field (gRPC ``INVALID_ARGUMENT``; HTTP 4xx with ``error.param``, or 413 for a body over the
limit), and afterwards a normal request succeeds, the tree is healthy and nothing is left held."""

from __future__ import annotations

import http.client
import json
import math
from dataclasses import replace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from cdb_engine.limits import REQUEST_BOUNDS
from clients.sync_client import Client
from tests.services.tree import IDLE, SHARED_CONFIG, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CONFIG = replace(SHARED_CONFIG, allow_replay_depths=True)  # so that replay_depths reach their bounds too
EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# What a gRPC refusal may name (services.api.errors: the engine's fields as request paths).
GRPC_FIELDS = {
    "request_id",
    "prompt",
    "max_tokens",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.seed",
    "sampling.top_logprobs",
    "stop_token_ids",
    "stop_strings",
    "exit_threshold",
    "replay_depths",
}

INT_EDGES = [0, 1, -1, 20, 21, 2**31 - 1, 2**31, -(2**31), 2**32, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, 10**30]
FLOAT_EDGES = [0.0, -0.0, 1.0, 0.5, 1e-7, 1e-320, 5e-324, 100.0, 100.5, 1e308, -1e308, math.nan, math.inf, -math.inf]
BIG_PROMPT = "x" * (REQUEST_BOUNDS.max_prompt_bytes + 1)  # over the prompt limit, within the body limit
HUGE_PROMPT = "x" * (5 << 20)  # over the HTTP body limit (CDB_MAX_REQUEST_BYTES, 4 MiB)


def ints(lo: int | None = None, hi: int | None = None) -> st.SearchStrategy[int]:
    edges = [v for v in INT_EDGES if (lo is None or v >= lo) and (hi is None or v <= hi)]
    edges += [-v for v in edges if (lo is None or -v >= lo) and (hi is None or -v <= hi)]
    near = st.integers(-999 if lo is None else max(lo, -999), 999 if hi is None else min(hi, 999))
    return st.one_of(st.sampled_from(edges), near)


def mostly(benign: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``hostile`` one time in six, else ``benign``: requests with several fields often get past the first check,
    so that every field's own check is reached."""
    return st.integers(0, 5).flatmap(lambda i: hostile if i == 0 else benign)


floats = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats())
small_max_tokens = mostly(st.integers(1, 4), ints(-(2**31), 2**31 - 1))


def texts(*, surrogates: bool) -> st.SearchStrategy[str]:
    alphabet = st.characters() if surrogates else st.characters(exclude_categories=("Cs",))
    long = ["", "stop", "s" * 257, "é" * 129, "x" * 300]
    if surrogates:
        long.append("\ud800")
    return st.one_of(st.text(alphabet, max_size=24), st.sampled_from(long))


# ----------------------------------------------------------------------------------------------- gRPC


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    text = texts(surrogates=False)
    int32, int64 = ints(-(2**31), 2**31 - 1), ints(-(2**63), 2**63 - 1)
    req = pb.GenerateRequest(request_id=draw(mostly(st.sampled_from(["", "my-id"]), text | st.just("r" * 257))))
    if draw(st.booleans()):
        req.text = draw(mostly(st.sampled_from(["hello", "And God said"]), text | st.just(BIG_PROMPT)))
    else:
        hostile_ids = st.lists(int64, max_size=8) | st.just([5] * 201)
        req.token_ids.ids.extend(draw(mostly(st.lists(st.integers(3, 500), min_size=1, max_size=8), hostile_ids)))
    if draw(st.booleans()):
        req.max_tokens = draw(small_max_tokens)
    s = req.sampling
    s.temperature = draw(mostly(st.sampled_from([0.0, 0.7, 1.0]), floats))
    s.top_k = draw(mostly(st.sampled_from([0, 5]), int32))
    if draw(st.booleans()):
        s.top_p = draw(mostly(st.sampled_from([0.9, 1.0]), floats))
    s.seed = draw(mostly(st.integers(0, 99), ints(0, 2**64 - 1)))
    s.return_logprobs = draw(st.booleans())
    s.top_logprobs = draw(mostly(st.integers(0, 3), int32))
    req.stop_token_ids.extend(draw(mostly(st.just([]), st.lists(int64, max_size=4) | st.just([1] * 257))))
    req.stop_strings.extend(
        draw(mostly(st.sampled_from([[], ["x"]]), st.lists(text, max_size=4) | st.just(["s"] * 17)))
    )
    if draw(st.booleans()):
        req.exit_threshold = draw(mostly(st.sampled_from([0.3, 1.0]), floats))
    req.ignore_eos = draw(st.booleans())
    hostile_depths = st.lists(int32, max_size=4) | st.just([1] * 401)
    req.replay_depths.extend(draw(mostly(st.sampled_from([[], [], [1, 2]]), hostile_depths)))
    return req


@pytest.fixture(scope="session")
def tree(shared_http_tree: tuple[str, str]) -> tuple[str, str]:
    """The tree's gRPC address and the HTTP API's base URL (``CONFIG``: the session's tree with both APIs)."""
    return shared_http_tree


def check_unharmed(address: str, base_url: str) -> None:
    """A normal request succeeds on both APIs, both report healthy, and nothing is held."""
    with Client(address, timeout=60) as client:
        done = client.generate("hello", max_tokens=4, ignore_eos=True)
        assert done.finish.finish_reason == "length" and len(done.tokens) == 4
        assert client.health() == "SERVING"
        assert wait_idle(client) == IDLE
    status, reply = post(base_url, "/completions", {"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 4
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@given(req=grpc_requests())
@EXAMPLES
@example(req=pb.GenerateRequest(text="hi", max_tokens=2, sampling=pb.SamplingParameters(top_k=2**31 - 1)))
@example(req=pb.GenerateRequest(text="hi", max_tokens=2, sampling=pb.SamplingParameters(seed=2**64 - 1)))
def test_every_grpc_request_gets_a_result_or_invalid_argument_naming_a_field(
    tree: tuple[str, str], req: pb.GenerateRequest
) -> None:
    address, _ = tree
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            reply = stub.Generate(req, timeout=60)
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert (err.details() or "").split(":")[0] in GRPC_FIELDS, err.details()
            event(f"refused: {(err.details() or '').split(':')[0]}")
        else:
            event("served")
            assert reply.finish.reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), reply.finish


def test_the_service_is_unharmed_after_the_grpc_requests(tree: tuple[str, str]) -> None:
    check_unharmed(*tree)


# ----------------------------------------------------------------------------------------------- HTTP


def post(base_url: str, path: str, body: Any) -> tuple[int, bytes]:
    """POST ``body`` as JSON (NaN and infinities as Python writes them, lone surrogates escaped)."""
    host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", f"/v1{path}", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def common_fields(text: st.SearchStrategy[str]) -> dict[str, st.SearchStrategy[Any]]:
    any_int = ints()
    return {
        "model": st.sampled_from([None, "ouro-tiny", "another-model"]),
        "max_tokens": st.one_of(st.none(), small_max_tokens),
        "temperature": mostly(st.sampled_from([None, 0.0, 0.8]), floats | any_int),
        "top_p": mostly(st.sampled_from([None, 0.95]), floats),
        "top_k": mostly(st.sampled_from([None, 0, 8]), any_int),
        "seed": mostly(st.sampled_from([None, 7]), any_int),
        "n": mostly(st.sampled_from([None, 1]), any_int),
        "stop": mostly(
            st.sampled_from([None, "x", ["x", "y"]]), text | st.lists(text, max_size=4) | st.just(["s"] * 17)
        ),
        "exit_threshold": mostly(st.sampled_from([None, 0.4]), floats),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.none(), st.builds(dict, include_usage=st.booleans())),
        "presence_penalty": mostly(st.sampled_from([None, 0.0]), floats),
        "logit_bias": mostly(st.none(), st.dictionaries(text, floats, max_size=2)),
        "user": st.one_of(st.none(), text),
    }


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    text = texts(surrogates=True)
    common = common_fields(text)
    if draw(st.integers(0, 5)) == 0:  # ouro-tiny has no chat template: chats are refused, after their bounds
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", ""]), "content": text})
        fields = {
            **common,
            "max_completion_tokens": st.one_of(st.none(), small_max_tokens),
            "logprobs": st.booleans(),
            "top_logprobs": mostly(st.sampled_from([None, 2]), ints()),
        }
        messages = st.lists(message, max_size=3) | st.just([{"role": "user", "content": BIG_PROMPT}])
        return "/chat/completions", draw(st.fixed_dictionaries({"messages": messages}, optional=fields))
    hostile_prompt = st.one_of(
        text,
        st.sampled_from([BIG_PROMPT, HUGE_PROMPT, [5] * 201]),
        st.lists(ints(), min_size=0, max_size=6),
        st.lists(text, min_size=1, max_size=2),
    )
    fields = {
        **common,
        "logprobs": mostly(st.sampled_from([None, 0, 3]), ints()),
        "echo": mostly(st.just(False), st.booleans()),
        "best_of": mostly(st.sampled_from([None, 1]), ints()),
        "suffix": mostly(st.none(), text),
    }
    prompt = mostly(st.sampled_from(["hello", "And God said", [10, 11, 12]]), hostile_prompt)
    return "/completions", draw(st.fixed_dictionaries({"prompt": prompt}, optional=fields))


@given(call=http_requests())
@EXAMPLES
@example(call=("/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2147483648, "temperature": 1}))
@example(call=("/completions", {"prompt": HUGE_PROMPT}))
def test_every_http_request_gets_a_result_or_a_4xx_naming_a_field(
    tree: tuple[str, str], call: tuple[str, dict[str, Any]]
) -> None:
    _, base_url = tree
    path, body = call
    status, reply = post(base_url, path, body)
    event(f"HTTP {status}")
    if status == 200:
        if body.get("stream"):
            assert reply.endswith(b"data: [DONE]\n\n") and b'"error"' not in reply, reply[-300:]
        else:
            assert json.loads(reply)["choices"], reply
        return
    assert 400 <= status < 500, (status, reply[:300])
    error = json.loads(reply)["error"]
    if status == 413:
        assert error["code"] == "request_too_large"
    else:
        assert isinstance(error["param"], str) and error["param"], error


def test_the_service_is_unharmed_after_the_http_requests(tree: tuple[str, str]) -> None:
    check_unharmed(*tree)
