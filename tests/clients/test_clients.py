"""The sync and asyncio clients and ``cdb generate`` against the real process tree."""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import pytest

from clients.async_client import AsyncClient
from clients.cli import generate_main
from clients.messages import StreamFinish, StreamToken
from clients.sync_client import Client
from services.launcher.supervisor import ServeHandle
from tests.services.tree import SHARED_CONFIG, SharedTree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def tree(ouro_tiny_tree: SharedTree) -> ServeHandle:
    return ouro_tiny_tree.handle


def test_sync_client_generate_stream_info_health(tree: ServeHandle) -> None:
    with Client(tree.address, timeout=60) as c:
        c.wait_for_status("SERVING", timeout=10)
        assert c.health() == "SERVING"
        whole = c.generate("abc", max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
        items = list(c.stream("abc", max_tokens=6, ignore_eos=True))
        tokens = [i for i in items if isinstance(i, StreamToken)]
        finish = items[-1]
        assert isinstance(finish, StreamFinish) and finish.finish_reason == "length"
        assert [t.id for t in tokens] == whole.token_ids and [t.depth for t in tokens] == whole.depths
        assert whole.text == "".join(t.text for t in tokens) + finish.text
        assert all(t.logprob is not None and len(t.top_ids) == 2 for t in whole.tokens)
        assert finish.total_loop_steps == sum(whole.depths) and finish.prompt_tokens == 3
        assert c.info().architecture == "ouro"
        with pytest.raises(grpc.RpcError) as err:
            c.health("no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_client_of_a_dead_address_reports_unavailable() -> None:
    with Client("unix:///nonexistent/cdb.sock") as c:
        assert c.health(timeout=2) == "UNAVAILABLE"


def test_async_client(tree: ServeHandle) -> None:
    async def main() -> None:
        async with AsyncClient(tree.address, timeout=60) as c:
            assert await c.health() == "SERVING"
            whole = await c.generate([5, 6, 7], max_tokens=5, ignore_eos=True, temperature=0.9, seed=4)
            streamed = [i async for i in c.stream([5, 6, 7], max_tokens=5, ignore_eos=True, temperature=0.9, seed=4)]
            assert [i.id for i in streamed if isinstance(i, StreamToken)] == whole.token_ids
            info = await c.info()
            assert info.counters["total_kv_blocks"] == SHARED_CONFIG.num_kv_blocks
            assert await c.abort("unknown") is False

    asyncio.run(main())


def test_cli_json_lines_and_depths(tree: ServeHandle) -> None:
    out = io.StringIO()
    argv = ["hello", "--address", tree.address, "--max-tokens", "7", "--ignore-eos", "--json", "--logprobs", "1"]
    assert generate_main(argv, out=out) == 0
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["type"] for r in records] == ["token"] * 7 + ["finish"]
    assert all(1 <= r["depth"] <= 4 and len(r["top_ids"]) == 1 for r in records[:-1])
    assert records[-1]["finish_reason"] == "length" and records[-1]["generated_tokens"] == 7
    with Client(tree.address) as c:
        assert [r["id"] for r in records[:-1]] == c.generate("hello", max_tokens=7, ignore_eos=True).token_ids


def test_cli_show_depth_and_errors(tree: ServeHandle, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert generate_main(["hi", "--address", tree.address, "--max-tokens", "3", "--show-depth"], out=out) == 0
    text = out.getvalue()
    assert text.count("[") >= 3 and "loop steps" in text and "mean depth" in text
    assert generate_main(["hi", "--address", tree.address, "--top-p", "2"], out=io.StringIO()) == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in capsys.readouterr().err
