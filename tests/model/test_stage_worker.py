"""StageWorker details: result fields, op order of signals, token-bank refills, table release, misuse."""

from __future__ import annotations

import pytest
import torch

from cdb_engine.stage_worker import StageWorker
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.presets import build_preset
from cdb_scheduler.plan import HeadOp, KVUpdate, LoopOp, PreludeOp, Stage
from cdb_scheduler.sampling import SamplingParams


def _workers(name: str) -> tuple[dict[Stage, StageWorker], torch.Tensor]:
    model = build_preset(name)
    bank = torch.zeros(8, model.config.bank_width)
    tokens = torch.zeros(8, dtype=torch.long)
    layout = KVLayout(KVPolicy.LAST_EXITED, model.config.max_depth)
    return {s: StageWorker(model, s, bank, layout, 8, 4, tokens) for s in Stage}, tokens


def _base(seq: int, rids: tuple[int, ...] = (), released: tuple[int, ...] = ()) -> dict:
    return {
        "seq": seq,
        "fences": (),
        "kv_updates": tuple(KVUpdate(r, (2 * r, 2 * r + 1)) for r in rids),
        "released": released,
    }


def test_decode_results_and_token_bank_refill() -> None:
    w, tokens = _workers("huginn-tiny")
    g = SamplingParams()
    w[Stage.PRELUDE].execute(
        PreludeOp(
            **_base(0, (0, 1)),
            rids=(0, 0, 1),
            token_ids=(5, 6, 7),
            positions=(0, 1, 0),
            rows=(2, 3, 4),
            init_seeds=(-1, -1, -1),
        )
    )
    w[Stage.LOOP].execute(
        LoopOp(
            **_base(0, (0, 1)),
            rids=(0, 0, 1),
            positions=(0, 1, 0),
            rows=(2, 3, 4),
            steps=(0, 0, 0),
            prefill=True,
            num_steps=8,
        )
    )
    res = w[Stage.HEAD].execute(
        HeadOp(
            **_base(0, (0, 1)),
            rids=(0, 0, 1),
            positions=(0, 1, 0),
            rows=(2, 3, 4),
            sample=(False, True, True),
            sampling=(g, g, g),
            token_index=(0, 0, 0),
        )
    )
    assert res.stage is Stage.HEAD and res.seq == 0 and res.compute_s > 0 and len(res.token_ids) == 2
    assert tokens[3] == res.token_ids[0] and tokens[4] == res.token_ids[1]
    # Refill rows 0 and 1 from the token bank (-1), using the rows the head wrote; compare with explicit ids.
    tokens[0], tokens[1] = tokens[3], tokens[4]
    w[Stage.PRELUDE].execute(
        PreludeOp(**_base(1), rids=(0, 1), token_ids=(-1, -1), positions=(2, 1), rows=(0, 1), init_seeds=(-1, -1))
    )
    bank = w[Stage.LOOP].bank
    rows = bank[:2].clone()
    w[Stage.PRELUDE].execute(
        PreludeOp(
            **_base(2), rids=(0, 1), token_ids=tuple(res.token_ids), positions=(2, 1), rows=(0, 1), init_seeds=(-1, -1)
        )
    )
    assert torch.equal(bank[:2], rows)
    res = w[Stage.LOOP].execute(LoopOp(**_base(1), rids=(1, 0), positions=(1, 2), rows=(1, 0), steps=(0, 0)))
    assert len(res.signals) == 2 and res.signals[0] == pytest.approx(1.0) and res.lookahead == ()
    res2 = w[Stage.LOOP].execute(LoopOp(**_base(2), rids=(0,), positions=(2,), rows=(0,), steps=(1,)))
    assert len(res2.signals) == 1 and 0 < res2.signals[0] < 1  # the relative latent difference of step 1


def test_release_and_misuse() -> None:
    w, _ = _workers("ouro-tiny")
    w[Stage.LOOP].execute(LoopOp(**_base(0, (3,)), rids=(), positions=(), rows=(), steps=()))
    assert 3 in w[Stage.LOOP].tables
    w[Stage.LOOP].execute(LoopOp(**_base(1, released=(3,)), rids=(), positions=(), rows=(), steps=()))
    assert 3 not in w[Stage.LOOP].tables
    with pytest.raises(ValueError, match="LOOP op sent to the HEAD worker"):
        w[Stage.HEAD].execute(LoopOp(**_base(0), rids=(), positions=(), rows=(), steps=()))
    with pytest.raises(KeyError, match="request 9"):  # errors propagate to the caller
        w[Stage.LOOP].execute(LoopOp(**_base(2), rids=(9,), positions=(0,), rows=(0,), steps=(0,)))
