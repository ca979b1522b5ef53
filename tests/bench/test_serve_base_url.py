"""``cdb bench serve --base-url`` against a real ``cdb`` process tree's HTTP API: data set files in both formats,
the vLLM-named result fields, the server's token counts, ``--max-concurrency`` and the errors a user meets first.

The shared session tree (``ouro_tiny_tree``) serves no HTTP, so this module starts one tree of the same
configuration with the API on a free loopback port (``tests.http.tree.http_process_tree``) for all its tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cdb_bench.cli import main as bench_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# (prompt, reference answer): ASCII, so the preset's byte tokenizer counts one token per character
SHAREGPT = [
    ("Tell me about the sea.", "It is wide and deep."),
    ("Count to five.", "1 2 3 4 5"),
    ("Name a colour.", "Blue, like the sky."),
]
JSONL = [
    {"prompt": "hello world", "output_len": 5},
    {"prompt": [5, 6, 7, 8], "max_tokens": 3},
    {"prompt": "the quick brown fox", "output_len": 8},
    {"prompt": "jumps over", "output_len": 6},
    {"prompt": "the lazy dog", "output_len": 7},
    {"prompt": "once more", "output_len": 4},
]
VLLM = (
    "duration",
    "completed",
    "failed",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
)


@pytest.fixture(scope="session")
def base_url(shared_http_tree: tuple[str, str]) -> str:
    return shared_http_tree[1]


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert bench_main(["serve", "--json", "--no-progress", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _check_vllm_fields(run: dict[str, Any], percentiles: tuple[str, ...]) -> None:
    for key in VLLM:
        assert key in run, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", *percentiles):
            assert run[f"{stat}_{metric}_ms"] >= 0, (stat, metric)
        assert run[f"median_{metric}_ms"] == run[f"p50_{metric}_ms"]
    d = run["duration"]
    assert d == run["duration_s"] > 0
    assert run["request_throughput"] == pytest.approx(run["completed"] / d)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / d)
    assert run["total_token_throughput"] == pytest.approx((run["total_input_tokens"] + run["total_output_tokens"]) / d)
    assert run["mean_ttft_ms"] <= run["mean_e2el_ms"]
    # vLLM counts from the send, this benchmark's own figures from the scheduled arrival: never later
    assert run["mean_ttft_ms"] <= 1e3 * run["ttft_s"]["mean"] + 1e-6


def test_sharegpt_file_output_lengths_from_the_reference_answers(
    base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": a}]} for p, a in SHAREGPT]
    records.insert(1, {"conversations": [{"from": "human", "value": "Only one turn here."}]})  # skipped
    records.append({"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]})  # short
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    r = _bench(capsys, "--base-url", base_url, "--dataset-path", str(path), "--requests", "3", "--rates", "40")
    assert r["backend"] == "openai" and r["model_id"] == "ouro-tiny" and r["tokenizer_id"] == "ouro-tiny"
    assert r["workload"]["distinct"] == 3 and len(r["runs"]) == 1
    run = r["runs"][0]
    _check_vllm_fields(run, ("p50", "p90", "p99"))
    assert {k: r[k] for k in VLLM} == {k: run[k] for k in VLLM}  # one rate: a vLLM result file at the top level
    assert run["completed"] == run["num_prompts"] == 3 and run["failed"] == 0 and run["request_rate"] == 40.0
    per = run["per_request"]
    assert sorted(per["output_tokens"]) == sorted(len(a) for _, a in SHAREGPT)  # the server's usage
    assert sorted(per["prompt_tokens"]) == sorted(len(p) for p, _ in SHAREGPT)
    assert run["total_output_tokens"] == sum(len(a) for _, a in SHAREGPT)
    assert run["total_input_tokens"] == sum(len(p) for p, _ in SHAREGPT)
    # every token streamed on its own (cdb's depth extension): as many arrivals as the usage counts
    assert [len(x) + 1 for x in per["itl_s"]] == per["output_tokens"]
    assert run["mean_depth"] is not None and 1 <= run["mean_depth"] <= 4


def test_jsonl_file_under_max_concurrency(base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in JSONL) + "\n")
    out = tmp_path / "out"
    args = ["--base-url", base_url.removesuffix("/v1"), "--dataset-path", str(path), "--requests", str(len(JSONL))]
    args += ["--rates", "inf", "--max-concurrency", "2", "--percentiles", "50,99.9", "--warmup", "0", "--out", str(out)]
    r = _bench(capsys, *args)
    run = r["runs"][0]
    _check_vllm_fields(run, ("p50", "p99.9"))
    assert run["completed"] == run["num_prompts"] == len(JSONL) and run["request_rate"] == "inf"
    assert run["max_concurrency"] == 2 and run["max_concurrent_requests"] == 2  # six at once, two in flight
    assert run["per_request"]["arrival_s"] == [0.0] * len(JSONL)  # arrivals stay scheduled; the cap delays sends
    expect_out = [x.get("output_len", x.get("max_tokens")) for x in JSONL]
    expect_in = [len(x["prompt"]) for x in JSONL]
    assert run["per_request"]["output_tokens"] == expect_out and run["total_output_tokens"] == sum(expect_out)
    assert run["per_request"]["prompt_tokens"] == expect_in and run["total_input_tokens"] == sum(expect_in)
    if run["queue"]["samples"]:  # the server's own counters (cdb's gauges on /metrics) agree with the cap
        assert run["queue"]["max_running"] <= 2

    def strict(text: str) -> Any:  # every file is standard JSON (no Infinity)
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    saved = strict((out / "serve.json").read_text())
    assert saved["runs"][0]["per_request"]["output_tokens"] == expect_out
    assert "per_request" not in strict((out / "summary.json").read_text())["runs"][0]
    flat = strict((out / "result-inf.json").read_text())
    assert flat["completed"] == len(JSONL) and flat["model_id"] == "ouro-tiny" and flat["p99.9_e2el_ms"] > 0


def test_a_wrong_model_fails_the_warm_up_with_the_servers_message(
    base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(JSONL[0]) + "\n")
    args = ["serve", "--base-url", base_url, "--model", "nope", "--dataset-path", str(path), "--requests", "1"]
    assert bench_main([*args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "warm-up" in err and "HTTP 404" in err and "'nope' does not exist" in err
