"""Every decode stage op's device part compiles as ONE graph (``torch.compile(fullgraph=True)``) at fixed buckets:
no graph break, no host sync, no data-dependent shape — what a CUDA graph capture needs. The compiled op computes
what the eager op computes."""

from __future__ import annotations

import pytest
import torch

from cdb_engine.stage_worker import StageWorker
from cdb_model.batched_sampling import SamplingColumns
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.presets import build_preset, preset_config
from cdb_scheduler.plan import KVUpdate, Stage
from cdb_scheduler.sampling import SamplingParams

BLOCK = 4
pytestmark = pytest.mark.timeout(300)


def worker(name: str, stage: Stage, rows: int = 8) -> StageWorker:
    c = preset_config(name)
    model = build_preset(name, stages={stage})
    bank = torch.randn(rows, c.bank_width, generator=torch.Generator().manual_seed(0))
    w = StageWorker(model, stage, bank, KVLayout(KVPolicy.DEPTH_INDEXED, c.max_depth), 4 * rows, BLOCK)
    w.tables.apply([KVUpdate(r, (4 * r, 4 * r + 1, 4 * r + 2)) for r in range(rows)])  # 12 positions each
    return w


def compiled(fn):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)


def same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, tuple | list):
        assert isinstance(b, tuple | list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
@pytest.mark.parametrize("width", [1, 4, 8])
def test_decode_loop_op_is_one_fullgraph(name: str, width: int) -> None:
    w = worker(name, Stage.LOOP)
    depth = preset_config(name).max_depth
    cols, _ = w._columns(
        list(range(width)),
        [5 + r for r in range(width)],
        [r % depth for r in range(width)],
        w.tables.lines(range(width)),
    )
    with torch.inference_mode():
        before = w.bank.clone()
        eager = w.loop_decode(cols, 12)
        after_eager = w.bank.clone()
        w.bank.copy_(before)
        graph = compiled(w.loop_decode)(cols, 12)
    same(eager, graph)
    torch.testing.assert_close(w.bank, after_eager, rtol=0, atol=0)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("width", [1, 8])
def test_fused_head_with_device_sampling_is_one_fullgraph(sampled: bool, width: int) -> None:
    w = worker("ouro-tiny", Stage.LOOP)
    w.model = build_preset("ouro-tiny")  # the fused head needs the LM head and the embedding too
    params = [SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.9, seed=r, logprobs=2) for r in range(width)]
    scols = SamplingColumns.build(params, list(range(width)), w.device)
    # each row's successor input goes to another row (as a draft's does), so the graph's writes are checked too
    targets = [width - 1 - r for r in range(width)]
    cols, table = w._columns(list(range(width)), [3] * width, [-1] * width, targets, floats=scols.table)
    with torch.inference_mode():
        before = w.bank.clone()
        eager = w.fused_head(cols, table, scols.any_sampled, scols.top_n)
        after_eager = w.bank.clone()
        w.bank.copy_(before)
        graph = compiled(w.fused_head)(cols, table, scols.any_sampled, scols.top_n)
    same(eager, graph)
    torch.testing.assert_close(w.bank, after_eager, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_head_and_prelude_decode_ops_are_one_fullgraph(name: str) -> None:
    width = 4
    head = worker(name, Stage.HEAD)
    params = [SamplingParams(temperature=1.0, top_k=5, seed=r) for r in range(width)]
    scols = SamplingColumns.build(params, list(range(width)), head.device)
    (rows, positions, lines), table = head._columns(
        list(range(width)), [7] * width, head.tables.lines(range(width)), floats=scols.table
    )

    def head_op(rows, positions, lines, table):  # type: ignore[no-untyped-def]
        kv = head._kv_for(range(width), [7] * width, lines, positions) if head.pool is not None else None
        hidden = head.model.coda(head._read(rows), positions, kv)
        return head.head_rows(hidden, rows, None, table, True, -1)

    prelude = worker(name, Stage.PRELUDE)
    (prows, ids, ppos, plines), _ = prelude._columns(
        list(range(width)), [-1, 3, -1, 9], [7] * width, prelude.tables.lines(range(width))
    )

    def prelude_op(prows, ids, ppos, plines):  # type: ignore[no-untyped-def]
        kv = prelude._kv_for(range(width), [7] * width, plines, ppos) if prelude.pool is not None else None
        prelude.prelude_rows([prows, ids, ppos], kv, [-1] * width)
        return prelude.bank.clone()

    with torch.inference_mode():
        same(head_op(rows, positions, lines, table), compiled(head_op)(rows, positions, lines, table))
        eager = prelude_op(prows, ids, ppos, plines)
        same(eager, compiled(prelude_op)(prows, ids, ppos, plines))
