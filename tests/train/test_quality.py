"""``cdb eval`` (``cdb_train.quality``): quality against depth per KV policy and exit threshold q."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cdb.cli import main as cdb_main
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_tokenizer
from cdb_model.ouro import OuroLM
from cdb_model.reference import reference_generate
from cdb_train.evaluate import score, windows
from cdb_train.quality import POLICIES, exit_policy, forced, greedy
from cdb_train.quality_report import agreement, knee

from .conftest import FOLDER


@pytest.fixture(scope="module")
def wins() -> torch.Tensor:
    ids = load_tokenizer(str(FOLDER)).encode((FOLDER / "heldout_sample.txt").read_text().rstrip("\n"))
    return windows(ids, 48, limit=2)  # [2, 49]


def test_depth_indexed_is_upstream_exact(model: OuroLM, wins: torch.Tensor) -> None:
    """All steps run, the exit step's head scores: q = 1.0 is full depth's perplexity (batched forward, computed
    independently) and every q's loss is the batched loss at that token's served depth."""
    full, half = forced(model, KVPolicy.DEPTH_INDEXED, [1.0, 0.5], wins, prefix=1)
    ce = score(model, wins).ce.view(model.config.max_depth, wins.shape[0], -1)[:, :, 1:].reshape(4, -1)  # [R, M]
    assert full["depths"] == [4] * ce.shape[1]
    torch.testing.assert_close(torch.tensor(full["nll"], dtype=torch.float64), ce[-1].double(), atol=1e-4, rtol=1e-4)
    ppl = math.exp(sum(full["nll"]) / len(full["nll"]))
    assert ppl == pytest.approx(math.exp(float(ce[-1].mean())), rel=1e-5)
    served = torch.tensor(half["depths"]) - 1
    assert 2.0 < float(served.float().mean() + 1) < 4.0
    want = ce.gather(0, served[None]).squeeze(0).double()
    torch.testing.assert_close(torch.tensor(half["nll"], dtype=torch.float64), want, atol=1e-4, rtol=1e-4)


def test_lower_threshold_serves_shallower(model: OuroLM, wins: torch.Tensor) -> None:
    for kv in (KVPolicy.DEPTH_INDEXED, KVPolicy.LAST_EXITED):
        depths = [sum(r["depths"]) / len(r["depths"]) for q in (0.2, 0.6, 1.0) for r in forced(model, kv, [q], wins, 1)]
        assert depths[0] < depths[1] < depths[2] == 4.0, (kv, depths)


@pytest.mark.parametrize("kv", [p for p in POLICIES if p is not KVPolicy.DEPTH_INDEXED])
def test_greedy_equals_reference_generate(model: OuroLM, kv: KVPolicy) -> None:
    """The evaluator's decode loop is the reference path's: same tokens, same served depths, same KV layout."""
    prompt = load_tokenizer(str(FOLDER)).encode("And the LORD said unto Moses,")
    policy = exit_policy(kv, 0.5, 4)
    ref = reference_generate(model, prompt, max_new_tokens=13, policy=policy, kv_layout=KVLayout(kv, 4, 2))
    (tokens,), depths = greedy(model, kv, 0.5, [prompt], 12)
    assert tokens == ref.tokens[1:] and depths == ref.depths[1:]


def test_agreement_and_knee() -> None:
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (4 / 6, 5 / 6)
    pts = [
        {"kv_policy": "last_exited", "q": 1.0, "mean_depth": 4.0, "ppl": 20.0},
        {"kv_policy": "last_exited", "q": 0.5, "mean_depth": 3.0, "ppl": 20.3},
        {"kv_policy": "last_exited", "q": 0.3, "mean_depth": 2.5, "ppl": 20.5},
        {"kv_policy": "single", "q": 0.3, "mean_depth": 2.0, "ppl": 20.0},
    ]
    assert knee(pts, 20.0, 0.02)["q"] == 0.5
    assert knee(pts, 20.0, 0.03)["q"] == 0.3
    assert knee(pts, 20.0, 0.001)["q"] == 1.0
    for p, a in zip(pts, (1.0, 0.7, 0.4, 0.1)):
        p["greedy_agreement"] = a
    assert knee(pts, 20.0, 0.03, min_agreement=0.6)["q"] == 0.5  # 0.3 is within 3 % but agrees too little


def test_cdb_eval_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What CI runs: the short ``cdb eval --quick``; every field, every policy, both thresholds."""
    assert cdb_main(["eval", "--quick", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "eval.json").read_text()) == result
    assert (tmp_path / "quality_vs_depth.png").stat().st_size > 10_000
    for key in ("model", "max_depth", "F0", "Fr", "default_threshold", "decisions", "heldout", "greedy", "knee"):
        assert key in result, key
    assert 200 <= result["heldout"]["tokens_scored"] <= 600 and result["wall_s"] > 0  # (time: a benchmark's)
    points = {(p["kv_policy"], p["q"]): p for p in result["points"]}
    assert set(points) == {(str(kv), q) for kv in POLICIES for q in (0.5, 1.0)}
    fields = {"min_depth", "mean_depth", "mean_steps_computed", "S", "ppl", "nll", "ppl_vs_full_depth"}
    fields |= {"depth_histogram", "greedy_agreement", "greedy_agreement_positionwise", "greedy_mean_depth"}
    for p in points.values():
        assert fields <= set(p), p
        assert sum(p["depth_histogram"]) == pytest.approx(1.0, abs=1e-3)
        assert 1.0 <= p["S"] <= 4.0 / 2.0 and 0.0 <= p["greedy_agreement"] <= p["greedy_agreement_positionwise"]
    full = points["depth_indexed", 1.0]
    assert full["ppl"] == result["full_depth_ppl"] and full["greedy_agreement"] == 1.0 and full["S"] == 1.0
    assert points["last_exited", 1.0]["ppl"] == full["ppl"]  # no exit before the last step: no copy
    assert points["depth_indexed", 0.5]["S"] == 1.0 < points["last_exited", 0.5]["S"]
    assert points["first_then_shared", 0.5]["min_depth"] == 2
    assert result["knee"]["kv_policy"] == "last_exited" and result["knee"]["q"] in (0.5, 1.0)
