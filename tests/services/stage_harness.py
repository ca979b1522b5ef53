"""Stage servers inside the test process (threads, Unix sockets): fast tests of the stage protocol."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import grpc
import torch

from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import HeadOp, LoopOp, Stage, StageOp, StageResult
from services.settings.knobs import Settings
from services.transport.stage_server import build_server
from services.transport.stage_service import StageService

TEST_SECRET = "stage-secret-for-tests-0123456789"
FAST = Settings(fence_timeout_s=5.0, stage_connect_timeout_s=10.0, stage_secret=TEST_SECRET)


@dataclass
class RunningStage:
    service: StageService
    server: grpc.Server
    address: str


@contextmanager
def stage_servers(
    tmp_path: Path,
    model_for: Callable[[Stage], Any],
    worker_factory: Callable[..., Any] | None = None,
    model_name: str = "ouro-tiny",
    dtype: str = "float64",
    settings: Settings = FAST,
    observer_for: Callable[[Stage], Any] | None = None,
) -> Iterator[dict[Stage, RunningStage]]:
    """Three stage servers on ``unix:`` sockets under ``tmp_path``; stopped on exit."""
    running: dict[Stage, RunningStage] = {}
    try:
        for stage in Stage:
            kw: dict[str, Any] = {"worker_factory": worker_factory} if worker_factory is not None else {}
            if observer_for is not None:
                kw["observer"] = observer_for(stage)
            service = StageService(stage, model_name, dtype, model_for(stage), settings, **kw)
            address = f"unix://{tmp_path}/{stage.role}.sock"
            server, _ = build_server(service, address, TEST_SECRET)
            running[stage] = RunningStage(service, server, address)
        yield running
    finally:
        for r in running.values():
            r.server.stop(0).wait()
            r.service.close()


def fake_model(width: int = 8) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(bank_width=width, arch="ouro"), device=torch.device("cpu"))


def fake_setup(rows: int = 16, width: int = 8) -> StageSetup:
    return StageSetup("ouro-tiny", "float64", "cpu", rows, width, "last_exited", 2, 4, 64, 16)


class FakeWorker:
    """Echoes ops: loop ops add 1 to their rows, head ops return row values as token ids. Control knobs:
    ``fail_seqs`` raise, ``gates[seq]`` block until set; ``log`` records (stage, seq) in execution order."""

    log: ClassVar[list[tuple[Stage, int]]] = []
    fail_seqs: ClassVar[set[tuple[Stage, int]]] = set()
    gates: ClassVar[dict[tuple[Stage, int], threading.Event]] = {}
    started: ClassVar[dict[tuple[Stage, int], threading.Event]] = {}

    def __init__(self, model: Any, stage: Stage, bank: torch.Tensor, *args: Any) -> None:
        self.stage, self.bank = stage, bank

    def execute(self, op: StageOp) -> StageResult:
        key = (op.stage, op.seq)
        if key in FakeWorker.started:
            FakeWorker.started[key].set()
        if key in FakeWorker.gates:
            FakeWorker.gates[key].wait(30)
        FakeWorker.log.append(key)
        if key in FakeWorker.fail_seqs:
            raise RuntimeError(f"injected failure {key}")
        if isinstance(op, LoopOp):
            rows = torch.tensor(op.rows)
            self.bank[rows] += 1
            return StageResult(op.stage, op.seq, 0.0, signals=tuple(0.5 for _ in op.rows))
        if isinstance(op, HeadOp):
            ids = tuple(int(self.bank[r, 0]) for r in op.rows)
            return StageResult(op.stage, op.seq, 0.0, token_ids=ids, logprobs=(None,) * len(ids))
        return StageResult(op.stage, op.seq, 0.0)

    @classmethod
    def reset(cls) -> None:
        cls.log, cls.fail_seqs, cls.gates, cls.started = [], set(), {}, {}


def restart_stage(running: dict[Stage, RunningStage], stage: Stage, settings: Settings = FAST) -> None:
    """Stop ``stage``'s server (as a dying process would: its streams break) and serve a fresh one, with fresh
    state, on the same address."""
    old = running[stage]
    old.server.stop(0).wait()
    old.service.close()
    service = StageService(
        stage, old.service.model_name, old.service.dtype, old.service.model, settings, old.service.worker_factory
    )
    server, _ = build_server(service, old.address, TEST_SECRET)
    running[stage] = RunningStage(service, server, old.address)
