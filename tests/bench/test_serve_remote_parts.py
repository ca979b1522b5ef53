"""The parts of ``cdb bench serve --base-url`` that need no server: data set files, the SSE chunks of cdb and of
other servers, the vLLM-named figures on hand-made timings, and the driver's concurrency cap."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import numpy as np
import pytest

from cdb_bench.serve.datasets import DatasetError, load_prompts
from cdb_bench.serve.driver import StreamItem, drive
from cdb_bench.serve.metrics import RequestRecord, Usage, peak_in_flight, request_times
from cdb_bench.serve.openai_target import OpenAIConnection, OpenAIServer, chunk_items
from cdb_bench.serve.requests import ServeRequest
from cdb_bench.serve.vllm_fields import field_names, percentile_key, vllm_fields
from cdb_model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(30)
TOK = ByteTokenizer()


def _sharegpt(*turns: str) -> dict:
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}


def test_sharegpt_takes_the_first_two_turns_and_filters_like_vllm(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    records = [
        _sharegpt("What is up?", "Not much, you?", "fine"),  # the third turn is ignored
        _sharegpt("lonely"),  # one turn: skipped
        _sharegpt("Say hi.", "hi"),  # answer under 4 tokens: skipped
        _sharegpt("hey", "a long enough answer"),  # prompt under 4 tokens: skipped
        _sharegpt("x" * 1025, "an answer"),  # prompt over 1024: skipped
        _sharegpt("Count to three.", "1 2 3"),
    ]
    path.write_text(json.dumps(records))
    prompts, distinct = load_prompts(path, 4, tokenizer=TOK, seed=1)
    assert distinct == 2 and len(prompts) == 4  # the two usable ones, taken again to reach 4
    assert {(p.prompt, p.prompt_tokens, p.output_tokens) for p in prompts} == {
        ("What is up?", 11, 14),
        ("Count to three.", 15, 5),
    }
    assert prompts[0] != prompts[1] and prompts[:2] == prompts[2:]
    assert load_prompts(path, 4, tokenizer=TOK, seed=1) == (prompts, distinct)  # the seed decides the order
    fixed, _ = load_prompts(path, 2, tokenizer=None, output_len=7)
    assert all(p.output_tokens == 7 and p.prompt_tokens == 0 for p in fixed)
    with pytest.raises(DatasetError, match="--tokenizer"):
        load_prompts(path, 2, tokenizer=None)
    with pytest.raises(DatasetError, match="no usable record"):
        load_prompts(path, 2, tokenizer=TOK, max_input=5)


def test_prompt_records_in_jsonl_and_their_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc", "output_len": 3}\n\n{"prompt": [7, 8], "max_tokens": 2}\n')
    prompts, distinct = load_prompts(path, 3, tokenizer=TOK)
    assert distinct == 2 and [p.as_tuple() for p in prompts] == [("abc", 3, 3), ((7, 8), 2, 2), ("abc", 3, 3)]
    assert [p.output_tokens for p in load_prompts(path, 2, tokenizer=None, output_len=9)[0]] == [9, 9]
    for text, message in (
        ('{"prompt": "abc"}\n', "needs 'output_len'"),
        ('{"prompt": "", "output_len": 2}\n', "non-empty string"),
        ('{"text": "abc"}\n', "neither 'conversations'"),
        ('{"prompt": "abc", "output_len": 2}\n{oops\n', r"p\.jsonl:2: not valid JSON"),
        ("[1, 2]", "record 1 is not a JSON object"),
    ):
        path.write_text(text)
        with pytest.raises(DatasetError, match=message):
            load_prompts(path, 1, tokenizer=TOK)


def test_chunks_of_cdb_and_of_other_servers() -> None:
    cdb = {"choices": [{"index": 0, "text": "", "finish_reason": None, "cdb": {"depths": [3]}}]}
    assert chunk_items(cdb) == ([3], None)  # a token with no text yet still counts: cdb reports each token
    last = {"choices": [{"text": "!", "finish_reason": "length", "cdb": {"depths": [], "mean_depth": 2.5}}]}
    assert chunk_items(last) == ([], "length")
    other = {"choices": [{"index": 0, "text": "two words", "finish_reason": None}]}
    assert chunk_items(other) == ([None], None)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert chunk_items(role) == ([], None)
    chat = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}
    assert chunk_items(chat) == ([None], "stop")
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}}
    assert chunk_items(usage) == ([Usage(4, 9)], None)
    with pytest.raises(RuntimeError, match="engine failed"):
        chunk_items({"error": {"message": "engine failed", "type": "server_error"}})


def test_request_bodies_and_base_urls() -> None:
    assert OpenAIServer.root_of("http://h:8000/v1/") == OpenAIServer.root_of("http://h:8000") == "http://h:8000"
    server = OpenAIServer("http://h:8000", "/v1/completions", "m", api_key="k")
    body = server.body(ServeRequest(0, 0.0, (5, 6), 4, None))
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 4 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    assert server.headers() == {"Authorization": "Bearer k"}
    chat = OpenAIServer("http://h:8000", "/v1/chat/completions", "m", ignore_eos=False)
    body = chat.body(ServeRequest(0, 0.0, "hello", 4, None, 5))
    assert body["messages"] == [{"role": "user", "content": "hello"}] and "ignore_eos" not in body
    assert chat.headers() == {}
    with pytest.raises(ValueError, match="--dataset-path"):
        chat.body(ServeRequest(0, 0.0, (5, 6), 4, None))


def _record(i: int, scheduled: float, sent: float, tokens: list[float], reported: int | None = None) -> RequestRecord:
    rec = RequestRecord(i, scheduled, prompt_tokens=10, sent_s=sent, token_s=tokens)
    rec.finished_s = rec.ended_s = tokens[-1]
    rec.reported_tokens = reported
    return rec


def test_vllm_named_figures_count_from_the_send() -> None:
    recs = [
        _record(0, 0.0, 0.5, [1.0, 1.5, 2.0]),  # TTFT 0.5 from the send (1.0 from the arrival), TPOT 0.5
        _record(1, 1.0, 1.0, [1.25, 1.5], reported=3),  # two chunks, three tokens by the server's usage: TPOT 0.125
    ]
    failed = RequestRecord(2, 1.0, sent_s=1.0)
    failed.error, failed.ended_s = "RuntimeError: boom", 1.1
    f = vllm_fields([*recs, failed], duration=2.0, rate=1.0, goodput=0.5, percentiles=(50, 99.9))
    assert f["completed"] == 2 and f["failed"] == 1 and f["num_prompts"] == 3
    assert f["total_input_tokens"] == 20 and f["total_output_tokens"] == 6
    assert f["request_throughput"] == 1.0 and f["output_throughput"] == 3.0 and f["total_token_throughput"] == 13.0
    assert f["mean_ttft_ms"] == pytest.approx(375.0) and f["std_ttft_ms"] == pytest.approx(125.0)
    assert f["mean_tpot_ms"] == pytest.approx((500.0 + 125.0) / 2)
    itl = [500.0, 500.0, 250.0]
    assert f["mean_itl_ms"] == pytest.approx(np.mean(itl)) and f["p99.9_itl_ms"] == pytest.approx(
        np.percentile(itl, 99.9)
    )
    assert f["median_e2el_ms"] == pytest.approx(1000.0) and f["max_concurrent_requests"] == 3  # at 1.0-1.1 s
    assert request_times(recs[1]).tpot == pytest.approx(0.125)  # this benchmark's own figures use the usage too
    assert vllm_fields([], duration=0.0, rate=float("inf"), goodput=0.0)["request_rate"] == "inf"
    assert vllm_fields([], duration=0.0, rate=1.0, goodput=0.0)["mean_ttft_ms"] == 0.0  # vLLM's 0 for no value
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    assert "p90_tpot_ms" in field_names((90,)) and "duration" in field_names(())


def test_peak_in_flight_counts_overlaps_not_handovers() -> None:
    recs = [_record(0, 0.0, 0.0, [1.0]), _record(1, 0.0, 1.0, [2.0]), _record(2, 0.0, 0.5, [1.5])]
    assert peak_in_flight(recs) == 2  # 0 ends when 1 is sent: they never overlap
    assert peak_in_flight([]) == 0


class _CountingConnection:
    """Streams two tokens per request, a loop turn apart; counts the requests it holds at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    async def stream(self, req: ServeRequest) -> AsyncIterator[StreamItem]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            for _ in range(2):
                await asyncio.sleep(0)  # another request may start meanwhile
                yield 1
            yield Usage(req.prompt_len, 2)
        finally:
            self.now -= 1

    async def queue(self) -> tuple[int, int]:
        return 0, self.now


@pytest.mark.parametrize("cap", [1, 3, None])
def test_max_concurrency_caps_what_is_in_flight(cap: int | None) -> None:
    conn = _CountingConnection()
    reqs = [ServeRequest(i, 0.0, (5, 6, 7), 2, None) for i in range(8)]
    records, samples = asyncio.run(drive(conn, reqs, sample_interval=None, max_concurrency=cap))
    assert samples == [] and all(r.ok and r.output_tokens == 2 for r in records)
    assert conn.peak == peak_in_flight(records) == (cap or 8)  # the driver's records agree with the server's view
    assert all(r.prompt_tokens == 3 and r.ended_s is not None for r in records)


def test_a_dataset_file_and_the_cap_through_the_in_process_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cdb_bench.cli import main as bench_main

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "abc" * (i + 1), "output_len": 3 + i}) + "\n" for i in range(4)))
    args = ["serve", "--quick", "--json", "--no-progress", "--target", "in-process", "--modes", "cdb", "--rates", "inf"]
    args += ["--dataset-path", str(path), "--requests", "4", "--max-concurrency", "1", "--warmup", "0"]
    assert bench_main(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["workload"]["dataset_path"] == str(path) and s["workload"]["fit"] is None
    run = s["modes"]["cdb"]["runs"][0]
    assert run["completed"] == 4 and run["max_concurrent_requests"] == 1 and run["max_concurrency"] == 1
    assert run["total_output_tokens"] == 3 + 4 + 5 + 6 and run["total_input_tokens"] == 3 * (1 + 2 + 3 + 4)
    assert run["per_request"]["output_tokens"] == [3, 4, 5, 6]


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _other_server(request: httpx2.Request) -> httpx2.Response:
    """A chat server without cdb's depth extension: two tokens and three in one chunk, then its usage."""
    if request.url.path == "/metrics":
        return httpx2.Response(404)
    body = json.loads(request.content)
    if request.headers.get("authorization") != "Bearer k":
        return httpx2.Response(401, json={"error": {"message": "bad key", "type": "auth"}})
    if body["messages"][0]["content"] == "cut":
        sse = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
        return httpx2.Response(200, content=sse, headers={"content-type": "text/event-stream"})
    assert body["max_tokens"] == 5 and body["stream_options"] == {"include_usage": True}
    chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    words = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in ("Hi", " there you")]
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
    content = _sse(chunk, *words, end, usage)
    return httpx2.Response(200, content=content, headers={"content-type": "text/event-stream"})


def test_a_server_without_depths_counts_chunks_and_takes_its_usage() -> None:
    async def run(key: str) -> list[RequestRecord]:
        server = OpenAIServer("http://other", "/v1/chat/completions", "m", api_key=key)
        conn = OpenAIConnection(server, transport=httpx2.MockTransport(_other_server))
        try:
            assert not await conn.probe_queue()  # no queue gauges: the run has no samples
            reqs = [ServeRequest(0, 0.0, "hello", 5, None), ServeRequest(1, 0.0, "cut", 5, None)]
            records, samples = await drive(conn, reqs, sample_interval=None)
            assert samples == []
            return records
        finally:
            await conn.close()

    good, cut = asyncio.run(run("k"))
    assert good.ok and len(good.token_s) == 2 and good.depths == []  # two chunks carried text
    assert good.output_tokens == 5 and good.prompt_tokens == 7  # the server's usage
    assert request_times(good).tpot == pytest.approx((good.finished_s - good.token_s[0]) / 4)
    assert cut.error is not None and "before a finish reason" in cut.error
    refused = asyncio.run(run("wrong"))[0]
    assert refused.error is not None and "HTTP 401: bad key" in refused.error
