"""Random checkpoints in the released layouts load through the project's loader (sharded, upstream names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cdb_bench.random_checkpoint import main
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model
from cdb_model.reference import reference_generate
from cdb_scheduler.exit_policy import FixedDepth

SMALL = {
    "ouro-1.4b": ["hidden_size=64", "num_attention_heads=2", "num_key_value_heads=2", "head_dim=32"],
    "huginn-0125": ["n_embd=64", "n_heads=2", "n_layers_in_recurrent_block=2", "mean_recurrence=4"],
}
COMMON = ["intermediate_size=96", "vocab_size=300", "padded_vocab_size=300", "num_hidden_layers=2"]


@pytest.mark.parametrize("model", sorted(SMALL))
def test_a_shrunken_released_layout_loads_in_shards_and_generates(model: str, tmp_path: Path) -> None:
    sets = [a for kv in [*SMALL[model], *COMMON] for a in ("--set", kv)]
    assert main(["--model", model, "--out", str(tmp_path), "--dtype", "float32", "--shard-gb", "0.0001", *sets]) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "sharded"
    lm = load_model(str(tmp_path))
    assert lm.config.hidden_size == 64 and set(lm.state_dict()) == set(index["weight_map"])
    depth = lm.config.max_depth
    layout = KVLayout(KVPolicy.DEPTH_INDEXED, depth)
    out = reference_generate(lm, [5, 6, 7], max_new_tokens=3, policy=FixedDepth(depth, depth), kv_layout=layout)
    assert len(out.tokens) == 3 and all(0 <= t < 300 for t in out.tokens)
    assert torch.isfinite(next(iter(lm.parameters()))).all()


def test_the_overlap_probe_runs_on_a_cpu(capsys) -> None:  # type: ignore[no-untyped-def]
    from cdb_bench.gpu_overlap import main as overlap

    args = ["--device", "cpu", "--procs", "2", "--size", "64", "--iters", "20", "--dtype", "float32", "--json"]
    assert overlap(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["alone_s"]) == 2 and len(out["together_each_s"]) == 2 and out["overlap"] > 0


def test_the_gpu_check_script_is_valid_and_its_benchmark_flags_parse() -> None:
    import argparse
    import re
    import shlex
    import subprocess

    from cdb_bench.offline import add_arguments
    from cdb_bench.serve.cli import build_parser

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ").replace('"${GPU[@]}"', "--device cuda --dtype bfloat16")
    offline = argparse.ArgumentParser()
    add_arguments(offline)
    parsers = {"offline": offline, "serve": build_parser()}
    seen = set()
    for line in text.splitlines():
        found = re.search(r"-m cdb bench (offline|serve) (.*)", line)
        if found:
            argv = [a for a in shlex.split(found.group(2).replace("$CKPT", "/ckpt").replace("$OUT", "/out"))]
            parsers[found.group(1)].parse_args(argv)
            seen.add(found.group(1))
    assert seen == {"offline", "serve"}
