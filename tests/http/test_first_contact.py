"""What a vLLM user's tools ask of a server first: the served model names (every alias accepted as ``model``, the
first reported), ``/v1/models`` with the context length (``max_model_len``), ``GET /version``, and the version
and names in the gRPC ``Info`` reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import grpc
import openai
import pytest

from cdb_api.v1 import generation_pb2 as pb
from cdb_api.v1 import generation_pb2_grpc
from services.version import server_version
from tests.http.harness import SETTINGS, TINY, Served, served
from tests.services.tree import SharedTree

pytestmark = pytest.mark.timeout(120)

NAMES = ("ouro-cdb", "tiny")


@pytest.fixture(scope="module")
def api() -> Iterator[Served]:
    settings = replace(SETTINGS, served_model_name=",".join(NAMES))
    with served(replace(TINY, model="ouro-kjv"), settings=settings, api_keys=["key-1"]) as s:
        yield s


def test_models_lists_the_first_name_with_the_context_length(api: Served) -> None:
    models = api.client().models.list().data
    assert [m.id for m in models] == ["ouro-cdb"], "one entry: the first name"
    card = models[0].model_dump()
    assert card["max_model_len"] == api.engine.limits.max_total_tokens == TINY.max_total_tokens
    assert card["root"] == "ouro-kjv", "what was loaded"
    assert api.client().models.retrieve("tiny").id == "ouro-cdb", "an alias names the same model"


def test_every_name_is_accepted_and_responses_report_the_first(api: Served) -> None:
    client = api.client()
    for name in NAMES:
        reply = client.completions.create(model=name, prompt="And God said", max_tokens=2, temperature=0)
        assert reply.model == "ouro-cdb"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat.model == "ouro-cdb"
    with pytest.raises(openai.NotFoundError, match="served: 'ouro-cdb', 'tiny'"):
        client.completions.create(model="ouro-kjv", prompt="x", max_tokens=1)


def test_version_answers_without_an_api_key(api: Served) -> None:
    status, _, body = api.request("GET", "/version")
    assert status == 200 and json.loads(body) == {"version": server_version()}
    assert api.request("GET", "/v1/models")[0] == 401, "the API itself still needs a key"


@pytest.mark.slow
def test_info_reports_the_version_and_the_served_names(ouro_tiny_tree: SharedTree) -> None:
    with grpc.insecure_channel(ouro_tiny_tree.address) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert info.version == server_version() != ""
    assert list(info.served_model_names) == [ouro_tiny_tree.config.model], "no option: the model as configured"
