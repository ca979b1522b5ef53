"""Loading a sharded checkpoint shows a progress bar on stderr (one shard: none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdb_bench.random_checkpoint import write_random_checkpoint
from cdb_model.loader import load_model

SMALL = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2}  # fmt: skip


@pytest.mark.parametrize("shard_gb,bar", [(0.0001, True), (10.0, False)], ids=["sharded", "one file"])
def test_loading_a_sharded_checkpoint_shows_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shard_gb: float, bar: bool
) -> None:
    write_random_checkpoint("ouro-1.4b", tmp_path, overrides=SMALL, shard_gb=shard_gb)
    capsys.readouterr()
    load_model(str(tmp_path))
    err = capsys.readouterr().err
    assert ("loading " + tmp_path.name in err) is bar
    if bar:
        assert "shard" in err and "100%" in err
