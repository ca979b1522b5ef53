"""A stage's session (one Configure: the shared memory it attached, the worker over it, who holds it) and a batch
on its way through the executor thread (``services.transport.stage_service``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from cdb_api.v1 import stage_pb2 as pb
from cdb_model.kv import KVLayout, KVPolicy
from cdb_scheduler.plan import StageOp, StageResult
from services.transport.bank import SharedBank
from services.transport.convert import bank_spec_from_pb
from services.transport.fences import FenceBoard
from services.transport.ring import Doorbell, MessageRing
from services.transport.stage_inbox import Batch
from services.transport.stage_probe import NO_PROBE, StageProbe

# (bank, KV layout, KV blocks, block size, token bank) -> the session's worker
WorkerMaker = Callable[[Tensor, KVLayout, int, int, Tensor], Any]


@dataclass(slots=True)
class Launched:
    """A batch taken off the inbox: launched on the worker (``finish`` waits for it and gives its result), or
    failed before it ran (``result``); a ping has neither."""

    batch: Batch
    arrived: int  # perf_counter_ns when it came (the probe's)
    mark: Any = None  # the probe's, from its ``begin``
    fence_wait: float = 0.0
    op: StageOp | None = None
    finish: Callable[[], StageResult] | None = None
    result: StageResult | None = None


@dataclass(slots=True)
class Session:
    """One Configure: the attached shared memory, the worker over it and who holds it.

    ``lock`` is held while a batch runs and while closing, so a session is never unmapped under a running batch.
    ``streams`` counts its open Run streams: the session is live while one is open."""

    bank: SharedBank
    tokens: SharedBank
    fences: FenceBoard
    worker: Any  # a StageWorker; None once closed
    holder: str
    rings: tuple[MessageRing, MessageRing] | None = None  # ops, replies (``ConfigureRequest.rings``)
    doorbell: Doorbell | None = None  # rung after each reply on the replies ring (``StageRings.doorbell``)
    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: int = 0
    closed: bool = False
    probe: StageProbe = NO_PROBE  # what measurement sees of its ops
    # Whether the worker launches an op without waiting for it: ``launch(op)`` returns a call that waits for the op
    # and gives its result, and may say when the op is done (``ready_at``, perf_counter) and have host work that no
    # reply waits for (``prepare``), as ``cdb_engine.synthetic``'s does. Else ``execute(op)`` runs an op whole.
    overlaps: bool = False

    def close(self) -> None:
        """Unmap the shared memory once the running batch (if any) ends; the probe keeps what it recorded.
        Idempotent."""
        if self.rings is not None:
            self.rings[0].interrupt()  # an executor waiting for its next op lets go of the lock's turn
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.worker = None  # drop the bank views before unmapping
            self.bank.close()
            self.tokens.close()
            self.fences.close()
            for ring in self.rings or ():
                ring.close()
            if self.doorbell is not None:
                self.doorbell.close()
            self.probe.close()

    @classmethod
    def attach(cls, request: pb.ConfigureRequest, make_worker: WorkerMaker, probe: StageProbe) -> Session:
        """Attach what ``request`` names and build the worker over it; on a failure, what was attached is closed
        again and the exception propagates."""
        attached: list[SharedBank | FenceBoard | MessageRing | Doorbell] = []
        try:
            bank = SharedBank.attach(bank_spec_from_pb(request.bank))
            attached.append(bank)
            tokens = SharedBank.attach(bank_spec_from_pb(request.token_bank))
            attached.append(tokens)
            fences = FenceBoard.attach(request.fences.name)
            attached.append(fences)
            rings, doorbell = None, None
            if request.HasField("rings"):
                ops = MessageRing.attach(request.rings.ops)
                attached.append(ops)
                replies = MessageRing.attach(request.rings.replies)
                attached.append(replies)
                rings = (ops, replies)
                if request.rings.doorbell:
                    doorbell = Doorbell.attach(request.rings.doorbell)
                    attached.append(doorbell)
            assert bank.tensor is not None and tokens.tensor is not None
            kv = request.kv
            layout = KVLayout(KVPolicy(kv.policy), kv.max_depth, kv.shared_after)
            worker = make_worker(bank.tensor, layout, kv.num_blocks, kv.block_size, tokens.tensor.view(-1))
        except Exception:
            for segment in reversed(attached):
                segment.close()
            raise
        overlaps = hasattr(worker, "launch")
        return cls(bank, tokens, fences, worker, request.holder, rings, doorbell, probe=probe, overlaps=overlaps)
