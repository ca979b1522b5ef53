"""``StageWorker``: executes the stage ops of one stage against the model, its paged KV pool and the bank.

The worker owns its stage's KV pool (prelude: Huginn prelude blocks, 1 depth slot; loop: the shared block,
``kv_layout.n_slots`` slots; head: Huginn coda blocks, 1 slot) and a mirror of every request's block table.
Hidden states travel only through the bank ``[rows, bank_width]``, read and written in place. Exceptions
propagate: the caller turns them into error results.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_model.attention import PagedKV
from cdb_model.base import LoopedLM
from cdb_model.kv import BlockTables, KVLayout, PagedKVPool
from cdb_model.sampling import sample
from cdb_scheduler.plan import HeadOp, LoopHead, LoopOp, PreludeOp, Stage, StageOp, StageResult, TokenLogprobs


class StageWorker:
    """Executes ``PreludeOp`` / ``LoopOp`` / ``HeadOp`` of ``stage`` in the order given."""

    def __init__(
        self,
        model: LoopedLM,
        stage: Stage,
        bank: Tensor,
        kv_layout: KVLayout,
        num_blocks: int,
        block_size: int,
        tokens: Tensor | None = None,
    ) -> None:
        """``tokens`` is the token bank ``[rows]`` (long): the head writes sampled ids there and the prelude reads
        them for ``token_ids[i] == -1`` (refills without a round trip through the scheduler)."""
        c = model.config
        if bank.dim() != 2 or bank.shape[1] != c.bank_width:
            raise ValueError(f"bank must be [rows, {c.bank_width}], got {list(bank.shape)}")
        if stage is Stage.LOOP and kv_layout.max_depth < 1:
            raise ValueError("loop stage needs a KV layout with max_depth >= 1")
        self.model, self.stage, self.bank, self.kv_layout = model, stage, bank, kv_layout
        self.device = bank.device
        self.tokens = tokens if tokens is not None else torch.zeros(bank.shape[0], dtype=torch.long, device=bank.device)
        self.tables = BlockTables()
        layers, slots = {
            Stage.PRELUDE: (c.num_prelude_layers, 1),
            Stage.LOOP: (c.num_loop_layers, kv_layout.n_slots),
            Stage.HEAD: (c.num_coda_layers, 1),
        }[stage]
        self.pool: PagedKVPool | None = None
        if layers > 0:
            self.pool = PagedKVPool(
                layers,
                slots,
                num_blocks,
                block_size,
                c.num_kv_heads,
                c.head_dim,
                dtype=model.dtype,
                device=model.device,
            )

    def _long(self, xs: Sequence[int]) -> Tensor:
        return torch.tensor(list(xs), dtype=torch.long, device=self.device)

    def _kv(self, rids: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> PagedKV | None:
        if self.pool is None:
            return None
        return PagedKV(self.pool, self.tables, rids, positions, slots)

    def _loop_kv(self, rids: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> PagedKV:
        assert self.pool is not None  # the loop stage always has layers
        return PagedKV(self.pool, self.tables, rids, positions, slots)

    def _read(self, rows: Tensor) -> Tensor:
        return self.bank.index_select(0, rows).to(self.model.dtype)  # [N, W]

    def _write(self, rows: Tensor, values: Tensor) -> None:
        self.bank.index_copy_(0, rows, values.to(self.bank.dtype))

    def execute(self, op: StageOp) -> StageResult:
        """Apply the op's table deltas, run it, return its result with ``compute_s`` (device-synchronised)."""
        if op.stage is not self.stage:
            raise ValueError(f"{op.stage.name} op sent to the {self.stage.name} worker")
        t0 = time.perf_counter()
        signals: tuple[float, ...] = ()
        lookahead: tuple[float, ...] = ()
        token_ids: tuple[int, ...] = ()
        logprobs: tuple[TokenLogprobs | None, ...] = ()
        with torch.inference_mode():
            self.tables.release(op.released)
            self.tables.apply(op.kv_updates)
            if isinstance(op, PreludeOp):
                self._prelude(op)
            elif isinstance(op, LoopOp):
                if op.head is not None:
                    token_ids, logprobs = self._fused_head(op.head)
                signals, lookahead = self._loop(op)
            else:
                token_ids, logprobs = self._head(op)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return StageResult(
            stage=self.stage,
            seq=op.seq,
            compute_s=time.perf_counter() - t0,
            signals=signals,
            lookahead=lookahead,
            token_ids=token_ids,
            logprobs=logprobs,
        )

    def _prelude(self, op: PreludeOp) -> None:
        if not op.rows:
            return
        kv = self._kv(op.rids, op.positions, [0] * len(op.rows))
        rows, ids = self._long(op.rows), self._long(op.token_ids)
        ids = torch.where(ids < 0, self.tokens.index_select(0, rows).to(ids.device), ids)  # -1: from the token bank
        out = self.model.prelude(ids, self._long(op.positions), kv, op.init_seeds)
        self._write(rows, out)

    def _loop(self, op: LoopOp) -> tuple[tuple[float, ...], tuple[float, ...]]:
        assert self.pool is not None
        for c in op.kv_copies:
            self.pool.copy_on_exit(self.tables.table(c.rid), c.position, c.from_slot)
        if not op.rows:
            return (), ()
        rows, positions = self._long(op.rows), self._long(op.positions)
        x = self._read(rows)  # [N, W]
        if op.prefill:
            for s in range(op.num_steps):
                kv = self._loop_kv(op.rids, op.positions, [self.kv_layout.slot(s)] * len(op.rows))
                x, _, _ = self.model.loop_step(x, positions, torch.full_like(positions, s), kv)
            self._write(rows, x)
            return (), ()
        kv = self._loop_kv(op.rids, op.positions, [self.kv_layout.slot(s) for s in op.steps])
        x, signal, look = self.model.loop_step(x, positions, self._long(op.steps), kv)
        self._write(rows, x)
        return tuple(signal.tolist()), tuple(look.tolist()) if look is not None else ()

    def _fused_head(self, h: LoopHead) -> tuple[tuple[int, ...], tuple[TokenLogprobs | None, ...]]:
        """A loop op's fused head (Ouro): sample the rows, then embed each successor's input into its row."""
        rows = self._long(h.rows)
        hidden = self.model.coda(self._read(rows), self._long(h.positions), None)  # [N, H]
        tokens, lps = sample(self.model.logits(hidden), list(h.sampling), list(h.token_index))
        self.tokens.index_copy_(0, rows, torch.tensor(tokens, dtype=torch.long).to(self.tokens.device))
        embed = [(row, tokens[j] if e == -1 else e) for j, (row, e) in enumerate(zip(h.rows, h.embed_ids)) if e != -2]
        if embed:
            self._write(self._long([r for r, _ in embed]), self.model.embed_input(self._long([t for _, t in embed])))
        return tuple(tokens), tuple(lps)

    def _head(self, op: HeadOp) -> tuple[tuple[int, ...], tuple[TokenLogprobs | None, ...]]:
        if not op.rows:
            return (), ()
        rows = self._long(op.rows)
        kv = self._kv(op.rids, op.positions, [0] * len(op.rows))
        hidden = self.model.coda(self._read(rows), self._long(op.positions), kv)  # [N, H]
        picked = [i for i, s in enumerate(op.sample) if s]
        if not picked:
            return (), ()
        logits = self.model.logits(hidden[self._long(picked)])  # [n_sampled, V] float32
        tokens, lps = sample(logits, [op.sampling[i] for i in picked], [op.token_index[i] for i in picked])
        sampled_rows = self._long([op.rows[i] for i in picked])
        self.tokens.index_copy_(0, sampled_rows, torch.tensor(tokens, dtype=torch.long).to(self.tokens.device))
        if op.embed:  # the successors' prelude, fused: their input embedding into the same rows
            fused = [j for j, i in enumerate(picked) if op.embed[i]]
            if fused:
                ids = self._long([tokens[j] for j in fused])
                self._write(self._long([op.rows[picked[j]] for j in fused]), self.model.embed_input(ids))
        return tuple(tokens), tuple(lps)
