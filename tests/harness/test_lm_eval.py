"""The real evaluation harness (``lm_eval``: ``local-completions`` with the server's remote tokenizer, and
``local-chat-completions``) against a real ``cdb serve`` tree of the shipped model, offline, on the local tasks of
``tests/harness/tasks`` (log-likelihood and generate-until); and ``cdb eval --harness`` over q.

Skipped without ``lm_eval`` (the optional extra ``cdb[eval]``: ``pip install -e '.[eval]'``).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cdb_bench.harness import TASKS_DIR, load_tasks, plot, run_task, sweep

lm_eval = pytest.importorskip(
    "lm_eval", reason="the evaluation harness is the optional extra: pip install -e '.[eval]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT = 10


@pytest.fixture(scope="module")
def root(kjv_http_tree: str) -> str:
    """The shipped model's tree (``tests.conftest.KJV_HTTP``), offline: nothing may come from a hub (local data,
    the server's tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return kjv_http_tree.removesuffix("/v1")


def post(root: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{root}{path}", json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def tokens(root: str, text: str) -> list[int]:
    ids: list[int] = post(root, "/tokenize", {"prompt": text})["tokens"]
    return ids


def continuation_logprob(root: str, context: str, continuation: str) -> float:
    """The summed logprob of ``continuation`` after ``context`` from the API's echo (``max_tokens`` 0)."""
    ctx, whole = tokens(root, context), tokens(root, context + continuation)
    body = {"prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 1}
    lps = post(root, "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
    return float(sum(lps[len(ctx) :]))


def test_local_completions_loglikelihood_matches_the_apis_own_scores(root: str) -> None:
    (config,) = load_tasks(TASKS_DIR, ["kjv_cloze"])
    run = run_task(root, config, limit=LIMIT, batch_size=4, log_samples=True)
    assert run["metric"] == "acc" and run["samples"] == LIMIT
    docs = [json.loads(line) for line in (TASKS_DIR / "kjv_cloze.jsonl").read_text().splitlines()[:LIMIT]]
    right = 0
    for sample in run["logged"]:
        doc = docs[sample["doc_id"]]
        ours = [continuation_logprob(root, doc["context"], " " + choice) for choice in doc["choices"]]
        theirs = [resp[0][0] for resp in sample["resps"]]  # (loglikelihood, is_greedy) per choice
        assert theirs == pytest.approx(ours, abs=1e-4), doc
        right += max(range(len(ours)), key=ours.__getitem__) == doc["label"]
    assert run["score"] == pytest.approx(right / LIMIT)
    assert run["score"] > 0.5, "the shipped model should find most next words of held-out verses"
    assert run["mean_depth"] == 4.0, "log-likelihood requests generate one token, from the full-depth prefill"


def test_local_completions_generate_until_is_the_apis_greedy_completion(root: str) -> None:
    (config,) = load_tasks(TASKS_DIR, ["kjv_continue"])
    run = run_task(root, config, limit=LIMIT, log_samples=True)
    assert run["metric"] == "chrf" and run["samples"] == LIMIT
    for sample in run["logged"]:
        context = sample["doc"]["context"]
        body = {"prompt": context, "max_tokens": 16, "temperature": 0, "stop": ["\n"], "seed": 1234}
        assert sample["resps"][0][0] == post(root, "/v1/completions", body)["choices"][0]["text"]
    assert 0.0 < run["score"] <= 1.0 and 1.0 < run["mean_depth"] <= 4.0  # the server's default threshold


def test_local_chat_completions_generate_until_through_the_chat_template(root: str) -> None:
    (config,) = load_tasks(TASKS_DIR, ["kjv_continue"])
    run = run_task(root, config, chat=True, limit=4, log_samples=True)
    assert run["api"] == "chat" and run["samples"] == 4
    for sample in run["logged"]:
        messages = [{"role": "user", "content": sample["doc"]["context"]}]
        body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stop": ["\n"], "seed": 1234}
        reply = post(root, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        assert sample["resps"][0][0] == reply
    assert run["generated_tokens"] > 0 and 0.0 <= run["score"] <= 1.0  # (the model never saw chat data)


def test_the_harness_sweep_over_q_reports_accuracy_and_mean_depth(root: str, tmp_path: Path) -> None:
    result = sweep(root, load_tasks(TASKS_DIR), [0.2, 1.0], limit=6, batch_size=6)
    by = {(p["task"], p["q"]): p for p in result["points"]}
    assert set(by) == {(t, q) for t in ("kjv_cloze", "kjv_continue") for q in (0.2, 1.0)}
    assert by["kjv_cloze", 0.2]["score"] == by["kjv_cloze", 1.0]["score"], "scoring is full depth: q-free"
    assert by["kjv_continue", 1.0]["mean_depth"] == 4.0
    assert by["kjv_continue", 0.2]["mean_depth"] < 4.0, "a low threshold serves generated tokens shallower"
    path = plot(result, tmp_path / "harness.png")
    assert path.stat().st_size > 10_000
