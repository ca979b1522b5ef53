"""Synthetic stages: everything a stage does except the model's arithmetic, which becomes modelled device time.

A synthetic stage keeps the session, the bank, the KV block tables (and checks every position has its block), the
fences and the replies of a real one; instead of running the model it waits, asleep (no interpreter lock held,
no CPU burnt), for the op's modelled device time. It exists to measure the host path at GPU op speeds on a
machine without a GPU: its tokens mean nothing.

The device is modelled as one in-order stream per stage: an op starts when the stage has it ready and the
previous op has finished (``max(ready, previous end)``) and lasts its modelled time; the stage replies at its end.

Cost of one op: ``cdb_engine.synthetic_cost``. What the device computes (exit depths and signals, token ids, draft
reads): ``cdb_engine.synthetic_draws``.
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import repeat

import numpy as np
import torch
from torch import Tensor

from cdb_engine.synthetic_cost import SyntheticCost, parse_cost
from cdb_engine.synthetic_draws import SyntheticDepths, exit_signals, masked_ids, sampled_ids
from cdb_model.config import ModelConfig
from cdb_model.kv import BlockTables, KVLayout
from cdb_scheduler.plan import HeadOp, LoopHead, LoopOp, PreludeOp, Stage, StageOp, StageResult, derive_seed
from cdb_scheduler.sampling import SamplingParams, TokenLogprobs

__all__ = [  # (the cost model and the draws are imported from here too)
    "SyntheticDepths",
    "SyntheticModel",
    "SyntheticWorker",
    "exit_signals",
    "parse_cost",
    "sampled_ids",
    "synthetic_model",
]


@dataclass(slots=True)
class SyntheticModel:
    """What a synthetic stage knows of its model: the config (no weights), the device, the dtype and its costs."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    cost: SyntheticCost
    depths: SyntheticDepths


_PR_SET_TIMERSLACK = 29
_libc = ctypes.CDLL(None) if sys.platform == "linux" else None


@dataclass(slots=True)
class _Pending:
    """A launched synthetic op: ``prepare`` makes what the device computes (the op's signals and tokens); calling it
    prepares it if not done yet, waits for its modelled end (``ready_at``, perf_counter) and gives its result. The
    stage prepares an op once the op before it is replied to, and may launch the next op until its end; ops are
    prepared in launch order, so their results are made in it too."""

    worker: SyntheticWorker
    op: StageOp
    seconds: float
    ready_at: float
    result: StageResult | None = None

    def prepare(self) -> None:
        if self.result is None:
            self.result = self.worker._results(self.op)
            self.result.seq, self.result.compute_s = self.op.seq, self.seconds  # (the op's own result)

    def __call__(self) -> StageResult:
        self.prepare()
        self.worker._wait_until(self.ready_at)
        assert self.result is not None
        return self.result


class SyntheticWorker:
    """``StageWorker``'s interface over a :class:`SyntheticModel`: bookkeeping, checks and replies of the real
    worker, modelled device time instead of arithmetic."""

    def __init__(
        self,
        model: SyntheticModel,
        stage: Stage,
        bank: Tensor,
        kv_layout: KVLayout,
        num_blocks: int,
        block_size: int,
        tokens: Tensor | None = None,
    ) -> None:
        c = model.config
        if bank.dim() != 2 or bank.shape[1] != c.bank_width:
            raise ValueError(f"bank must be [rows, {c.bank_width}], got {list(bank.shape)}")
        self.model, self.stage, self.kv_layout, self.block_size = model, stage, kv_layout, block_size
        self.cost = model.cost.of(stage)
        self.tokens = tokens if tokens is not None else torch.zeros(bank.shape[0], dtype=torch.long)
        self._tokens_np = self.tokens.numpy() if self.tokens.device.type == "cpu" else None  # (a view: same memory)
        self.tables = BlockTables()
        self.has_kv = (c.num_prelude_layers, c.num_loop_layers, c.num_coda_layers)[stage] > 0
        self._stops = frozenset(c.stop_token_ids)
        self._free_at = 0.0  # when the modelled device stream is done with the previous op (perf_counter)
        self._row_depth = np.zeros(bank.shape[0], np.int64)  # loop steps each bank row's state has run
        self._slack = threading.local()

    def execute(self, op: StageOp) -> StageResult:
        """Apply the op's table deltas, check its blocks, wait its modelled time; its result."""
        return self.launch(op)()

    def launch(self, op: StageOp) -> Callable[[], StageResult]:
        """Apply the op's table deltas, check its blocks and enqueue its modelled time on the device stream (after
        the ops launched before it); the returned call waits for the op's end (its ``ready_at``) and gives its
        result. The host may launch the next op before waiting, as it would with a GPU's asynchronous launches."""
        if op.stage is not self.stage:
            raise ValueError(f"{op.stage.name} op sent to the {self.stage.name} worker")
        self.tables.release(op.released)
        self.tables.apply(op.kv_updates)
        # Host work only (tables, checks, the op's modelled time): what the device computes (signals, tokens) is
        # modelled later (``_Pending.prepare``), inside its modelled time, as a GPU computes it while its host goes on.
        if isinstance(op, LoopOp):
            for c in op.kv_copies:
                self._check(c.rid, c.position)
            seconds = self._seconds(op.rids, op.positions, len(op.rows), op.prefill) * (
                op.num_steps if op.prefill else 1
            )
            if op.head is not None:  # fused head: the head's modelled time, in this op
                seconds += self.model.cost.head.seconds(len(op.head.rows), 0)
        elif isinstance(op, HeadOp):
            self._seconds(op.rids, op.positions, 0)  # every token's coda KV is checked
            seconds = self._seconds((), (), sum(op.sample)) if not self.has_kv else self._head_seconds(op)
        else:
            assert isinstance(op, PreludeOp)
            seconds = self._seconds(op.rids, op.positions, len(op.rows))
        return _Pending(self, op, seconds, self._enqueue(seconds))

    def _results(self, op: StageOp) -> StageResult:
        """What the device computes for ``op``: made once the op before it is replied to (``_Pending.prepare``), not
        at launch, as a GPU computes it after the launch returns (a launch made while the op before runs does not
        hold that op's reply)."""
        if isinstance(op, LoopOp):
            return self._loop_results(op)
        if isinstance(op, HeadOp):
            return self._head_results(op)
        return self._nothing()

    def _nothing(self) -> StageResult:
        return StageResult(self.stage, -1, 0.0)

    def _loop_results(self, op: LoopOp) -> StageResult:
        sampled = None
        if op.head is not None:  # read at the start of the op, before its steps
            h = op.head
            sampled = self._sample(h.rids, h.targets, (True,) * len(h.rows), h.sampling, h.token_index, h.masks)
            if h.embed_rows:
                sampled = replace(sampled, token_ids=self._drafted(h, sampled.token_ids))
            self._row_depth[list(h.targets)] = 0
        if op.prefill:
            self._row_depth[list(op.rows)] = self.kv_layout.max_depth
        elif op.rows:
            self._row_depth[list(op.rows)] = np.array(op.steps, np.int64) + 1
        result = self._signals(op) if not op.prefill and op.rows else self._nothing()
        if sampled is not None:  # (both results are this op's own, made above)
            result.token_ids, result.logprobs = sampled.token_ids, sampled.logprobs
        return result

    def _drafted(self, h: LoopHead, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Draft reads (a row sampled for a successor in another row) ``k`` loop steps short of the token's drawn
        depth give its id with probability ``accept ** k`` (a seeded draw of the token and the read depth), another
        id otherwise; a token's real read, at its depth, always gives its id."""
        m = self.model
        reads = self._row_depth[list(h.rows)]
        drawn = m.depths.draw_many(
            np.array(h.rids, np.uint64), np.array(h.positions, np.uint64), self.kv_layout.max_depth
        )
        out = list(ids)
        vocab = m.config.vocab_size
        for i, (row, target) in enumerate(zip(h.rows, h.targets)):
            short = int(drawn[i]) - int(reads[i])
            if row == target or short <= 0:
                continue
            u = derive_seed(derive_seed(h.rids[i], h.token_index[i]), 1000 + int(reads[i])) / 2.0**63
            if u >= m.depths.accept**short:
                token = (out[i] + 1) % vocab
                while token in self._stops or token == ids[i]:
                    token = (token + 1) % vocab
                out[i] = token
        return tuple(out)

    def _head_results(self, op: HeadOp) -> StageResult:
        result = self._sample(op.rids, op.rows, op.sample, op.sampling, op.token_index, op.masks)
        return replace(result, prompt_logprobs=self._scores(op)) if op.score_ids else result

    def _check(self, rid: int, position: int) -> None:
        if position // self.block_size >= len(self.tables.table(rid)):
            raise IndexError(f"request {rid}: position {position} has no KV block")

    def _seconds(self, rids: Sequence[int], positions: Sequence[int], tokens: int, chunks: bool = False) -> float:
        """The op's modelled time. Its context: the KV positions it reads, every token its own (a decode token
        reads its request's KV), or with ``chunks`` (a prefill op) each request's once, up to its chunk's last
        position (a prefill's attention reads the context once for the chunk's queries, as flash attention does)."""
        context = 0
        if self.has_kv and rids:
            held = self.tables.lengths(rids)  # every position's block is there (C-level maps over the op's rows)
            if any(map(operator.ge, map(operator.floordiv, positions, repeat(self.block_size)), held)):
                for rid, pos in zip(rids, positions):
                    self._check(rid, pos)  # (raises, naming the first that has not)
            if chunks:
                last: dict[int, int] = {}
                for rid, pos in zip(rids, positions):
                    last[rid] = max(pos, last.get(rid, -1))
                context = sum(last.values()) + len(last)
            else:
                context = sum(positions) + len(positions)
        return self.cost.seconds(tokens, context)

    def _head_seconds(self, op: HeadOp) -> float:
        context = sum(p + 1 for p in op.positions)  # the coda runs every token; its LM head the sampled ones
        return self.cost.seconds(sum(op.sample), context)

    def _signals(self, op: LoopOp) -> StageResult:
        """Exit signals that make each token leave at its drawn depth (read one step ahead)."""
        m = self.model
        ouro = m.config.arch == "ouro"
        signals = exit_signals(m.depths, op.rids, op.positions, op.steps, self.kv_layout.max_depth, ouro=ouro)
        look = signals if ouro and m.config.has_lookahead_gate else ()
        return StageResult(self.stage, op.seq, 0.0, signals=signals, lookahead=look)

    def _sample(
        self,
        rids: Sequence[int],
        op_rows: Sequence[int],
        sample: Sequence[bool],
        sampling: Sequence[SamplingParams],
        token_index: Sequence[int],
        masks: Sequence[bytes] = (),
    ) -> StageResult:
        """Token ids from the seeded stream of ``(seed, rid, token index)`` (``sampled_ids``), one vector draw per op
        (a GPU draws them in the op; the host does not loop over tokens); a masked token's (structured output) is
        the draw's pick among the ids its mask allows (``masked_ids``)."""
        picked = [i for i, take in enumerate(sample) if take]
        if not picked:
            return StageResult(self.stage, -1, 0.0, token_ids=(), logprobs=())
        every = len(picked) == len(sample)
        params = sampling if every else [sampling[i] for i in picked]
        ids = sampled_ids(
            [s.seed for s in params],
            rids if every else [rids[i] for i in picked],
            token_index if every else [token_index[i] for i in picked],
            self.model.config.vocab_size,
            self._stops,
        )
        rows = op_rows if every else [op_rows[i] for i in picked]
        if masks:
            ids = masked_ids(ids, masks if every else [masks[i] for i in picked], self._stops)
        token_ids = tuple(ids.tolist())
        lps: list[TokenLogprobs | None] = [None] * len(picked)
        vocab = self.model.config.vocab_size
        for j, s in enumerate(params):
            if s.return_logprob or s.logprobs:
                uniform = -math.log(vocab)
                top = tuple((token_ids[j] + k) % vocab for k in range(s.logprobs))
                lps[j] = TokenLogprobs(uniform, top, (uniform,) * len(top))
        # a following prelude op (Huginn) reads the sampled id here, as from a real head
        if self._tokens_np is not None:
            self._tokens_np[list(rows)] = ids
        else:
            self.tokens[torch.tensor(rows, dtype=torch.long)] = torch.from_numpy(ids.astype(np.int64))
        return StageResult(self.stage, -1, 0.0, token_ids=token_ids, logprobs=tuple(lps))

    def _scores(self, op: HeadOp) -> tuple[TokenLogprobs, ...]:
        """Prompt scoring, modelled: every scored token at the uniform logprob (the sampled tokens' too)."""
        vocab = self.model.config.vocab_size
        uniform = -math.log(vocab)
        out = []
        for target, s in zip(op.score_ids, op.sampling):
            if target >= 0:
                top = tuple((target + k) % vocab for k in range(s.logprobs))
                out.append(TokenLogprobs(uniform, top, (uniform,) * len(top)))
        return tuple(out)

    def _enqueue(self, seconds: float) -> float:
        """The op's modelled end (perf_counter) on the in-order device stream: it starts when launched or when the
        previous op ends, whichever is later."""
        end = max(time.perf_counter(), self._free_at) + seconds
        self._free_at = end
        return end

    def _wait_until(self, end: float) -> None:
        """Sleep until ``end`` (timer slack 1 ns: sub-ms sleeps are exact)."""
        if _libc is not None and not getattr(self._slack, "set", False):
            _libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)  # per thread
            self._slack.set = True
        left = end - time.perf_counter()
        if left > 0:
            time.sleep(left)


def synthetic_model(config: ModelConfig, cost: str, depths: str, device: str, dtype: torch.dtype) -> SyntheticModel:
    """The :class:`SyntheticModel` of a tree's settings (``EngineConfig.synthetic_cost`` / ``synthetic_depths``)."""
    return SyntheticModel(
        config, torch.device(device), dtype, parse_cost(cost), SyntheticDepths.parse(depths, config.arch)
    )
