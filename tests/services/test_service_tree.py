"""The public API through the real process tree on loopback: equivalence with the in-process engine, validation,
aborts, and 50 concurrent streams with cancels and deadlines that leave nothing held."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import replace

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cdb_engine.config import RequestParams, Structure, StructureKind, logits_processing
from cdb_engine.engine import Engine
from cdb_scheduler.sampling import SamplingParams
from clients.async_client import AsyncClient
from clients.messages import GenerateOptions, StreamFinish, StreamToken
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from tests.services.tree import IDLE, SHARED_CONFIG, SharedTree, StreamRun, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONFIG = SHARED_CONFIG


@pytest.fixture
def tree(ouro_tiny_tree: SharedTree) -> ServeHandle:
    return ouro_tiny_tree.handle


@pytest.fixture
def client(tree: ServeHandle) -> Iterator[Client]:
    with Client(tree.address, timeout=60) as c:
        yield c


def test_health_reflection_and_info(tree: ServeHandle, client: Client) -> None:
    assert client.health() == "SERVING" and client.health("cdb.v1.Generation") == "SERVING"
    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert {"cdb.v1.Generation", "grpc.health.v1.Health"} <= set(services)
    info = client.info()
    assert (info.model, info.architecture, info.max_depth, info.deployment) == ("ouro-tiny", "ouro", 4, "microservices")
    assert info.limits["max_input_tokens"] == 200 and info.limits["max_total_tokens"] == 400
    assert info.kv_policy == "last_exited" and info.healthy and info.counters["total_kv_blocks"] == 512


def test_tokens_equal_the_in_process_engine(client: Client) -> None:
    rng = random.Random(1)
    requests: list[tuple[list[int], GenerateOptions]] = []
    for i in range(12):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
        opts = GenerateOptions(max_tokens=rng.randrange(1, 30), ignore_eos=i % 3 != 0)
        if i % 2:
            opts.update(temperature=0.7 + i / 20, top_p=0.9, top_k=40, seed=100 + i, top_logprobs=2)
        requests.append((prompt, opts))

    def params(o: GenerateOptions) -> RequestParams:
        sampling = SamplingParams(
            temperature=o.get("temperature", 0.0),
            top_k=o.get("top_k", 0),
            top_p=o.get("top_p", 1.0),
            seed=o.get("seed", 0),
            logprobs=o.get("top_logprobs", 0),
            return_logprob="top_logprobs" in o,
        )
        return RequestParams(max_tokens=o["max_tokens"], sampling=sampling, ignore_eos=o["ignore_eos"])

    with Engine(CONFIG) as local:
        expected = local.generate([p for p, _ in requests], [params(o) for _, o in requests])
    runs = [StreamRun(client, p, o).start() for p, o in requests[::2]]  # streams and unary calls concurrently
    unary = [client.generate(p, **o) for p, o in requests[1::2]]
    for run in runs:
        assert run.done.wait(60) and run.error is None
    streamed = [([t.id for t in r.tokens], [t.depth for t in r.tokens], r.finish) for r in runs]
    whole = [(u.token_ids, u.depths, u.finish) for u in unary]
    got = [None] * len(requests)
    got[::2], got[1::2] = streamed, whole
    for exp, (ids, depths, finish) in zip(expected, got):  # type: ignore[misc]
        assert (ids, depths) == (exp.token_ids, exp.depths)
        assert finish.finish_reason == exp.finish_reason and finish.generated_tokens == len(exp.token_ids)
        assert finish.total_loop_steps == sum(exp.depths)
    assert [t.logprob for t in unary[0].tokens] == [lp.logprob for lp in expected[1].logprobs]  # type: ignore[union-attr]


BAD_INPUTS: list[tuple[str, str | list[int], GenerateOptions, tuple[str, ...]]] = [
    ("empty prompt", "", {}, ("prompt", "empty")),
    ("prompt too long", [5] * 201, {}, ("prompt", "max_input_tokens 200")),
    ("prompt + max_tokens too long", [5] * 100, {"max_tokens": 301}, ("max_tokens", "max_total_tokens 400")),
    ("max_tokens zero", "hi", {"max_tokens": 0}, ("max_tokens", ">= 1")),
    ("negative temperature", "hi", {"temperature": -0.5}, ("sampling.temperature", ">= 0")),
    ("nan temperature", "hi", {"temperature": math.nan}, ("sampling.temperature",)),
    ("top_p zero", "hi", {"top_p": 0.0}, ("sampling.top_p", "(0, 1]")),
    ("top_p above one", "hi", {"top_p": 1.5}, ("sampling.top_p", "(0, 1]")),
    ("negative top_k", "hi", {"top_k": -1}, ("sampling.top_k", ">= 0")),
    ("too many logprobs", "hi", {"top_logprobs": 21}, ("sampling.top_logprobs", "20")),
    ("token id above vocab", [1, 512], {}, ("prompt", "unknown token ids", "512")),
    ("negative token id", [-1], {}, ("prompt", "unknown token ids")),
    ("unknown stop token id", "hi", {"stop_token_ids": [9999]}, ("stop_token_ids",)),
    ("empty stop string", "hi", {"stop": [""]}, ("stop_strings",)),
    ("exit threshold above one", "hi", {"exit_threshold": 1.5}, ("exit_threshold", "(0, 1]")),
    ("exit threshold zero", "hi", {"exit_threshold": 0.0}, ("exit_threshold",)),
    ("presence penalty too large", "hi", {"presence_penalty": 3.0}, ("sampling.presence_penalty", "[-2, 2]")),
    ("repetition penalty zero", "hi", {"repetition_penalty": 0.0}, ("sampling.repetition_penalty", "(0, 10]")),
    ("logit bias unknown id", "hi", {"logit_bias": {9999: 1.0}}, ("sampling.logit_bias", "unknown token ids")),
    ("logit bias too large", "hi", {"logit_bias": {5: 200.0}}, ("sampling.logit_bias", "[-100, 100]")),
    ("min_tokens above max_tokens", "hi", {"max_tokens": 3, "min_tokens": 4}, ("sampling.min_tokens",)),
]


@pytest.mark.parametrize("unary", [False, True], ids=["stream", "unary"])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_invalid_argument_naming_the_field(client: Client, case: tuple, unary: bool) -> None:
    _, prompt, options, expected = case
    with pytest.raises(grpc.RpcError) as err:
        if unary:
            client.generate(prompt, **options)
        else:
            list(client.stream(prompt, **options))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith(expected[0] + ":"), details
    for part in expected[1:]:
        assert part in details, details


def test_speculating_requests_through_the_tree_change_no_token(client: Client) -> None:
    """Drafts cross the stage transport (a fused head writing into other rows): requests that speculate, one at a
    time so that rows are free, give the tokens and depths of the in-process engine without speculation."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))] for _ in range(4)]
    options = [GenerateOptions(max_tokens=24, ignore_eos=True, speculative=True) for _ in prompts]
    for i in (1, 3):
        options[i].update(temperature=0.8, seed=7 + i)
    before = client.info().speculation["drafts"]
    got = [(r.token_ids, r.depths) for r in (client.generate(p, **o) for p, o in zip(prompts, options))]
    assert client.info().speculation["drafts"] > before
    params = [
        RequestParams(
            max_tokens=24,
            ignore_eos=True,
            sampling=SamplingParams(temperature=o.get("temperature", 0.0), seed=o.get("seed", 0)),
        )
        for o in options
    ]
    with Engine(replace(CONFIG, speculative="off")) as local:
        want = local.generate(prompts, params)
    assert got == [(w.token_ids, w.depths) for w in want]


def test_penalties_logit_bias_and_min_tokens_travel_through_grpc(client: Client) -> None:
    forced = client.generate("hi", max_tokens=5, ignore_eos=True, logit_bias={7: 100.0})
    assert forced.token_ids == [7] * 5
    late = client.generate("hi", max_tokens=3, ignore_eos=True, logit_bias={7: 100.0}, stop_token_ids=[7], min_tokens=2)
    assert late.token_ids[2] == 7 and 7 not in late.token_ids[:2] and late.finish.finish_reason == "stop"
    options = GenerateOptions(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.4)
    proc = logits_processing(frequency_penalty=1.5, repetition_penalty=1.4)
    with Engine(CONFIG) as local:
        plain, penalized = local.generate(
            ["In the beginning"] * 2,
            [
                RequestParams(max_tokens=24, ignore_eos=True),
                RequestParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(processing=proc)),
            ],
        )
    assert plain.token_ids != penalized.token_ids, "the penalties should change this greedy output"
    assert client.generate("In the beginning", **options).token_ids == penalized.token_ids


def test_structured_output_travels_through_the_tree_as_in_process(client: Client) -> None:
    """A schema through gRPC, the scheduler's guide and the stages' masks (op messages): the output validates, and
    its tokens and depths are the in-process engine's."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    schema |= {"required": ["n"], "additionalProperties": False}
    got = client.generate("In the beginning", max_tokens=32, temperature=0.8, seed=3, json_schema=json.dumps(schema))
    assert json.loads(got.text)["n"] in range(100) and got.finish.finish_reason == "stop"
    structure = Structure(StructureKind.JSON, json.dumps(schema))
    params = RequestParams(max_tokens=32, sampling=SamplingParams(temperature=0.8, seed=3), structure=structure)
    with Engine(CONFIG) as local:
        (want,) = local.generate(["In the beginning"], params)
    assert (got.token_ids, got.depths) == (want.token_ids, want.depths)


def test_duplicate_request_id_and_abort(client: Client) -> None:
    run = StreamRun(client, "hello", GenerateOptions(max_tokens=300, ignore_eos=True, request_id="dup-1")).start()
    assert run.first.wait(30) and run.error is None
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x", request_id="dup-1")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("request_id:")
    assert client.abort("dup-1") is True
    assert run.done.wait(30) and run.finish is not None and run.finish.finish_reason == "cancelled"
    assert client.abort("dup-1") is False and client.abort("never-seen") is False
    assert wait_idle(client) == IDLE


async def _one(c: AsyncClient, rng: random.Random, i: int) -> str:
    """Stream ``i``: one in three runs to its end, one in three is cancelled after a few tokens, and one in three
    asks for 300 tokens under a deadline of under a second (300 tokens take far longer here, so it fires)."""
    prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
    opts = GenerateOptions(max_tokens=rng.randrange(5, 80), ignore_eos=True, temperature=0.8, seed=i)
    kind = i % 3
    timeout = 60.0
    if kind == 1:
        opts["max_tokens"], timeout = 300, rng.uniform(0.05, 1.0)
    cancel_after = rng.randrange(0, 5) if kind == 2 else None
    n = 0
    try:
        async with aclosing(c.stream(prompt, timeout=timeout, **opts)) as stream:
            async for item in stream:
                if isinstance(item, StreamToken):
                    n += 1
                    if cancel_after is not None and n > cancel_after:
                        return "cancelled"  # closing the stream cancels the call
                else:
                    assert isinstance(item, StreamFinish) and item.generated_tokens == opts["max_tokens"]
                    return "finished"
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        return "deadline"
    raise AssertionError("stream ended without a finish")


def test_50_concurrent_streams_with_cancels_and_deadlines_leave_nothing_held(tree: ServeHandle) -> None:
    async def main() -> list[str]:
        rng = random.Random(50)
        async with AsyncClient(tree.address) as c:
            return await asyncio.gather(*[_one(c, rng, i) for i in range(50)])

    outcomes = asyncio.run(main())
    assert len(outcomes) == 50 and {"cancelled", "finished", "deadline"} <= set(outcomes), outcomes
    assert set(outcomes[::3]) == {"finished"} and set(outcomes[2::3]) == {"cancelled"}, outcomes
    with Client(tree.address) as client:
        assert wait_idle(client) == IDLE
        assert client.health() == "SERVING"
        assert client.generate("still fine", max_tokens=3).finish.generated_tokens == 3
