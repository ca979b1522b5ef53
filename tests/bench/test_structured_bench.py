"""``cdb bench structured --quick``: every constrained output is valid JSON of the schema, forced positions run
shallower than free ones with forced skips, and the figures come back in the JSON and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdb_bench.structured import MODES, SCHEMA, clauses, main, valid


def test_the_schemas_longest_instance_fits_max_tokens_on_a_byte_tokenizer() -> None:
    longest = {"book": "A" * 8, "chapter": 150, "speaker": "the lord", "words": ["a" * 6] * 2}
    longest["place"] = {"name": "B" * 8, "holy": False}
    text = json.dumps(longest, separators=(",", ":"))
    assert valid(text) and len(text.encode()) < 128
    assert not valid(text.replace("150", "151")) and not valid(text[:-1]) and not valid("in the beginning")
    assert SCHEMA["required"] == list(SCHEMA["properties"])


def test_prompts_are_clauses_of_the_shipped_text() -> None:
    prompts = clauses(40)
    assert len(set(prompts)) >= 24 and all(len(p.split()) >= 4 for p in prompts)


@pytest.mark.timeout(180)
def test_quick_structured_bench_reports_valid_constrained_outputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out, png = tmp_path / "structured.json", tmp_path / "structured.png"
    argv = ["--quick", "--model", "ouro-tiny", "--requests", "4", "--rounds", "1", "--seconds", "0.5"]
    argv += ["--warmup", "0.3", "--json", "--no-progress", "--out", str(out), "--plot", str(png)]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == s and png.stat().st_size > 0
    modes = s["modes"]
    assert tuple(modes) == MODES
    assert s["valid_rate"] == {"constrained": 1.0, "unconstrained": 0.0}
    on, off = modes["skip_on"], modes["skip_off"]
    assert off["valid_rate"] == 1.0 and on["not_following_the_grammar"] == off["not_following_the_grammar"] == 0
    assert 0 < on["forced_share"] < 1 and on["forced_over_free"] <= 0.5  # the goal, with forced skips
    assert on["forced_mean_depth"] < off["forced_mean_depth"]
    assert on["loop_steps_per_token"] < off["loop_steps_per_token"]
    assert modes["unconstrained"]["tokens_per_s_ratio"]["median"] == 1.0
    assert s["tokens_per_s_ratio"]["skip_on"] > 0
    cpu = s["cpu"]
    assert cpu["width"] == 64 and cpu["constrained_valid_rate"] == 1.0
    ratios = ("ratio_constrained_over_unconstrained", "ratio_masks_only_over_unconstrained")
    for key in (*ratios, *("per_token_" + r for r in ratios)):
        assert set(cpu[key]) == {"plan", "thread", "thread_and_guides", "scheduler_process", "process"}
        assert all(r["median"] > 0 for r in cpu[key].values())
    runs = [r for rs in cpu["runs"].values() for r in rs]
    assert len(runs) == 3 and all(r["failed_requests"] == 0 and r["loop_ops_window"] > 0 for r in runs)
    assert all(r["sched_cpu_us_per_step"]["plan"] > 0 for r in runs)
