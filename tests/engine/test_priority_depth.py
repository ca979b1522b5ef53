"""``--priority-depth``: while requests wait, running requests below the most urgent priority exit at the floor
threshold (shallower); the most urgent class and an unsaturated server are untouched; the option is refused where no
threshold decides the depth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.inprocess import shared_model_factory

from .test_equivalence import model64

BASE = EngineConfig(
    model="ouro-tiny", dtype="float64", max_num_seqs=4, num_kv_blocks=256, kv_block_size=8, exit_threshold=0.6
)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77, 12], [9, 9, 30], [200, 201], [17, 18, 19, 20]]


def run(cfg: EngineConfig, work: list[tuple[list[int], RequestParams]]) -> list[tuple[list[int], list[int]]]:
    with Engine(cfg, shared_model_factory(model64(cfg.model))) as eng:
        outs = eng.generate([p for p, _ in work], [r for _, r in work])
        stats = eng.stats()
        assert stats.held_rows == 0 and stats.used_kv_blocks == 0
        return [(o.token_ids, o.depths) for o in outs]


def test_without_waiting_requests_the_option_changes_nothing() -> None:
    work = [(PROMPTS[i], RequestParams(max_tokens=16, ignore_eos=True, priority=i)) for i in range(3)]
    assert run(replace(BASE, priority_depth=0.05), work) == run(BASE, work)


def test_while_requests_wait_lower_priorities_run_shallower_and_the_top_class_does_not() -> None:
    """Two urgent requests and four of priority 5 on four rows: two of the latter run beside the urgent ones while
    two wait. With the option they serve shallower depths; the urgent ones' tokens and depths are unchanged."""
    work = [(PROMPTS[i], RequestParams(max_tokens=24, ignore_eos=True, priority=0)) for i in range(2)]
    work += [(PROMPTS[i], RequestParams(max_tokens=12, ignore_eos=True, priority=5)) for i in range(2, 6)]
    plain, traded = run(BASE, work), run(replace(BASE, priority_depth=0.05), work)
    assert traded[:2] == plain[:2]
    low = [sum(d[1:]) for _, d in plain[2:4]], [sum(d[1:]) for _, d in traded[2:4]]
    assert sum(low[1]) < sum(low[0]), low


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"mode": "full-depth"}, "early exit"),
        ({"exit_rule": "fixed"}, "early exit"),
        ({"priority_depth": 1.5}, "priority_depth"),
    ],
)
def test_the_option_is_refused_where_no_threshold_decides_the_depth(extra: dict, why: str) -> None:
    cfg = replace(BASE, **({"priority_depth": 0.05} | extra))
    with pytest.raises(ValueError, match=why):
        Engine(cfg, shared_model_factory(model64(cfg.model)))
