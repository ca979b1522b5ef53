"""A peer's benchmark client against cdb's OpenAI API: GuideLLM, the client vLLM recommends, runs its own load
through ``/v1/completions`` of a served tree and reports what it measured. Marked ``peer_client`` and skipped
unless ``CDB_GUIDELLM`` names a ``guidellm`` command (it is not a dependency: ``pip install guidellm==0.8.1`` in a
virtual environment of its own; ``docs/benchmarks.md`` has the command)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cdb_bench.apicost.measure import Point, Window, _guidellm_argv
from cdb_engine.config import EngineConfig
from tests.http.tree import http_process_tree

GUIDELLM = os.environ.get("CDB_GUIDELLM", "")
pytestmark = [
    pytest.mark.peer_client,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not GUIDELLM, reason="CDB_GUIDELLM does not name a guidellm command"),
]


def test_guidellm_streams_completions_from_cdb_serve_and_reports_them(tmp_path: Path) -> None:
    config = EngineConfig(model="ouro-kjv", max_num_seqs=8)
    point = Point(model="ouro-kjv", mode="cdb", api="http", concurrency=4, prompt_tokens=32, output_tokens=32)
    window = Window(2.0, 8.0, False, "", GUIDELLM)
    with http_process_tree(config) as (_, base_url):
        argv = _guidellm_argv(point, window, base_url.removeprefix("http://").removesuffix("/v1"), 10)
        run = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(Path(argv[argv.index("--output") + 1].split("path=", 1)[1]).read_text())
    text = json.dumps(report)
    assert '"successful"' in text or '"requests_made"' in text, "GuideLLM wrote its report"
    benchmark = report["benchmarks"][0]
    assert benchmark["metrics"]["output_tokens_per_second"]["successful"]["mean"] > 0
