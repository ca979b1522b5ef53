"""``cdb bench apicost``: the serving processes' CPU per output token through the public API, and its split by
activity from sampled stacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cdb_bench.apicost.activities import NATIVE, OTHER, classify, split


def test_a_sample_goes_to_the_activity_of_its_innermost_named_frame() -> None:
    loop = "Runner.run (asyncio/runners.py:118)"
    send = "RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:503)"
    observe = "Histogram.observe (services/telemetry/metric_families.py:128)"
    sse = "sse_body (services/http/streaming.py:52)"
    assert classify([loop, sse, send]) == "stream encoding and writing"
    assert classify([loop, sse, observe]) == "metrics and tracing", "the innermost named frame decides"
    assert classify([loop]) == "event loop"
    assert classify(["<module> (x.py:1)"]) == OTHER
    assert classify([loop, "wait (services/transport/futex.py:50)"]) is None, "a waiting sample is no CPU"


def test_each_threads_cpu_is_split_by_its_own_busy_samples() -> None:
    raw = [
        "thread (11): MainThread;Runner.run (asyncio/runners.py:118);sse_body (services/http/streaming.py:52) 30",
        "thread (11): MainThread;Runner.run (asyncio/runners.py:118) 10",
        "thread (11): MainThread;Runner.run (asyncio/runners.py:118);wait (services/transport/futex.py:50) 99",
        "thread (12): cdb-scheduler;Engine._run (cdb_engine/engine.py:217) 5",
    ]
    shares = split(raw, {11: 0.4, 12: 0.1, 13: 0.5})  # thread 13 used CPU and was never seen busy
    assert shares == pytest.approx(
        {"stream encoding and writing": 0.3, "event loop": 0.1, "planning": 0.1, NATIVE: 0.5}
    )
    assert sum(shares.values()) == pytest.approx(1.0) and split(raw, {11: 0.0}) == {}


@pytest.mark.slow
def test_apicost_reports_cpu_per_token_by_process_and_activity(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "cdb", "bench", "apicost", "--model", "ouro-tiny", "--concurrency", "2"]
    argv += ["--max-num-seqs", "4", "--output-tokens", "16", "--prompt-tokens", "8", "--seconds", "1"]
    argv += ["--warmup", "0.3", "--profile", "--no-progress", "--out", str(tmp_path)]
    subprocess.run(argv, check=True, timeout=240, stdout=subprocess.DEVNULL)
    [row] = json.loads((tmp_path / "apicost.json").read_text())["points"]
    assert row["point"] == "cdb http c2" and row["tokens_per_s"] > 0 and row["client_cpu_us_per_token"] > 0
    cpu = row["cpu_us_per_token"]
    assert set(cpu) == {"scheduler", "stage-prelude", "stage-loop", "stage-head"}
    assert all(v > 0 for v in cpu.values()) and row["serving_cpu_us_per_token"] == pytest.approx(sum(cpu.values()))
    for proc, acts in row["activities"].items():
        assert sum(acts.values()) == pytest.approx(cpu[proc], rel=1e-6), proc
    assert (tmp_path / "apicost.png").stat().st_size > 0
