"""In-process executor: the three stage workers on one worker thread, fed in submission order.

One FIFO worker behaves like one device stream: an op runs after every op submitted before it, so every fence
is satisfied by construction (asserted). The scheduler thread plans the next op while this thread computes
(torch releases the GIL inside its kernels).
"""

from __future__ import annotations

import functools
import queue
import threading
import traceback
from collections.abc import Callable

import torch

from cdb_engine.config import EngineConfig
from cdb_engine.setup import StageSetup, torch_dtype
from cdb_engine.stage_worker import StageWorker
from cdb_engine.synthetic import SyntheticModel, SyntheticWorker, synthetic_model
from cdb_model.base import LoopedLM
from cdb_model.config import ModelConfig
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.loader import load_model
from cdb_scheduler.plan import Stage, StageOp, StageResult

_WAKE = object()


class InProcessExecutor:
    """``Executor`` over direct calls. ``model`` may be passed in to share weights between engines."""

    concurrent_stages = False  # one in-order worker: every fence is met by the time its op runs

    def __init__(
        self,
        setup: StageSetup,
        model: LoopedLM | SyntheticModel | None = None,
        num_threads: int | None = None,
        worker_factory: Callable[..., StageWorker | SyntheticWorker] = StageWorker,
    ) -> None:
        """``worker_factory``: ``StageWorker``'s signature (``SyntheticWorker`` over a ``SyntheticModel``)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        dtype = torch_dtype(setup.dtype)
        self.model = model if model is not None else load_model(setup.model, dtype=dtype, device=setup.device)
        self.bank = torch.zeros(setup.bank_rows, setup.bank_width, dtype=dtype, device=setup.device)
        self.tokens = torch.zeros(setup.bank_rows, dtype=torch.long, device=setup.device)
        layout = KVLayout(KVPolicy(setup.kv_policy), setup.max_depth, setup.kv_shared_after)
        self.workers = {
            stage: worker_factory(
                self.model, stage, self.bank, layout, setup.num_kv_blocks, setup.kv_block_size, self.tokens
            )
            for stage in Stage
        }
        self._done = [-1, -1, -1]
        self._ops: queue.SimpleQueue[StageOp | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[StageResult | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cdb-stage-worker", daemon=True)
        self._thread.start()

    def submit(self, op: StageOp) -> None:
        self._ops.put(op)

    def poll(self, timeout: float | None) -> StageResult | None:
        try:
            res = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        return res if isinstance(res, StageResult) else None

    def completed(self, stage: Stage) -> int:
        return self._done[stage]

    def wake(self) -> None:
        self._results.put(_WAKE)

    def close(self) -> None:
        self._ops.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            for fence in op.fences:
                assert self._done[fence.stage] >= fence.seq, f"fence {fence} not satisfied in FIFO order"
            try:
                res = self.workers[op.stage].execute(op)
            except Exception as exc:  # the op fails, the engine fails its requests, the worker keeps serving
                traceback.print_exc()
                res = StageResult(op.stage, op.seq, 0.0, error=f"{op.stage.name} stage: {type(exc).__name__}: {exc}")
            self._done[op.stage] = op.seq
            self._results.put(res)


def shared_model_factory(
    model: LoopedLM, decode_graphs: bool | None = None
) -> Callable[[StageSetup], InProcessExecutor]:
    """An ``executor_factory`` whose executors share ``model``'s weights (many engines, one model in memory).
    ``decode_graphs``: ``StageWorker``'s (None: captured graphs on CUDA)."""
    workers = functools.partial(StageWorker, decode_graphs=decode_graphs)
    return lambda setup: InProcessExecutor(setup, model=model, worker_factory=workers)


def in_process_executor(config: EngineConfig, setup: StageSetup, model_config: ModelConfig) -> InProcessExecutor:
    """The engine's default executor: the model's stage workers, or synthetic ones (``config.synthetic_cost``)."""
    if not config.synthetic_cost:
        return InProcessExecutor(setup, num_threads=config.num_threads)
    synth = synthetic_model(
        model_config, config.synthetic_cost, config.synthetic_depths, config.device, torch_dtype(config.dtype)
    )
    return InProcessExecutor(setup, synth, worker_factory=SyntheticWorker)
