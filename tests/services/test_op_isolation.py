"""An op the gRPC executor cannot encode (a value beyond its wire field, sent past validation) fails only its own
request: its stand-in keeps the stages' op order and fences moving, the request decoding beside it finishes with
exactly the tokens it would have had, and the engine keeps serving."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_engine.isolation import isolating
from cdb_engine.memory import stage_weights
from cdb_model.loader import load_config, load_model
from cdb_scheduler.plan import Stage
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams
from services.transport.executor import GrpcExecutorFactory
from tests.services.stage_harness import FAST, stage_servers

pytestmark = pytest.mark.timeout(120)

CFG = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=4, num_kv_blocks=128)


class Collect:
    """One request's events, delivered on the engine thread."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first = threading.Event()
        self.done: queue.SimpleQueue[FinishEvent] = queue.SimpleQueue()

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev.token_id)
            self.first.set()
        else:
            self.done.put(ev)


def test_an_op_that_overflows_its_wire_field_fails_only_its_request(tmp_path: Path) -> None:
    long = RequestParams(max_tokens=24, ignore_eos=True)
    overflow = RequestParams(max_tokens=4, sampling=SamplingParams(temperature=1.0, top_k=2**63))  # int64 on the wire
    with Engine(CFG) as local:
        (expected,) = local.generate([[10, 11, 12]], long)
    config = load_config("ouro-tiny")
    weights = {s: load_model("ouro-tiny", dtype=torch.float64, stages=stage_weights(s, config)) for s in Stage}
    with stage_servers(tmp_path, weights.__getitem__) as running:
        factory = GrpcExecutorFactory({s: r.address for s, r in running.items()}, FAST)
        with Engine(CFG, executor_factory=isolating(factory)) as engine:
            other, bad = Collect(), Collect()
            engine.submit([10, 11, 12], long, other)
            assert other.first.wait(60)  # decoding: the overflowing request is prefilled in its own ops
            engine.submit([20, 21], overflow, bad)  # past Engine.validate, which would refuse it
            failed = bad.done.get(timeout=60)
            assert failed.finish_reason is FinishReason.ERROR and "a column value out of range" in (failed.error or "")
            assert other.done.get(timeout=60).finish_reason is FinishReason.LENGTH
            assert other.tokens == expected.token_ids
            again = Collect()
            engine.submit([10, 11, 12], long, again)
            assert again.done.get(timeout=60).finish_reason is FinishReason.LENGTH
            assert again.tokens == expected.token_ids
            stats = engine.stats()
            assert stats.healthy and factory.executor is not None and factory.executor.broken is None
