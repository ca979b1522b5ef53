"""``StageWorker``: executes the stage ops of one stage against the model, its paged KV pool and the bank.

The worker owns its stage's KV pool (prelude: Huginn prelude blocks, 1 depth slot; loop: the shared block,
``kv_layout.n_slots`` slots; head: Huginn coda blocks, 1 slot) and a mirror of every request's block table, also
resident on the device. Hidden states travel only through the bank ``[rows, bank_width]``, read and written in
place. Exceptions propagate: the caller turns them into error results.

What an op costs the host: its columns (rows, positions, steps, table lines, sampling) go to the device as one
packed copy; a decode op (one token per request) then runs as a fixed sequence of kernels for its width with no
host sync and no Python over its tokens (``DecodeKV``, the batched sampler); its results (exit signals, token ids,
logprobs) come back as one copy. Prompt chunks (several tokens of one request) take ``PagedKV``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_engine.decode_graphs import DecodeGraphs
from cdb_engine.head_sampling import History, sample_with_history
from cdb_engine.op_copies import Outputs, Sampled, columns_to_device
from cdb_model.attention import DecodeKV, KVAccess, PagedKV
from cdb_model.base import LoopedLM
from cdb_model.batched_sampling import Processing, SamplingColumns, logprob_columns, unpack_logprobs
from cdb_model.kv import DeviceBlockTables, KVLayout, PagedKVPool
from cdb_scheduler.plan import HeadOp, HistorySeed, LoopHead, LoopOp, PreludeOp, Stage, StageOp, StageResult
from cdb_scheduler.sampling import SamplingParams, TokenLogprobs

SCORE_SLICE = 256  # prompt positions projected to logits at once when a prompt is scored


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
        *,
        decode_graphs: bool | None = None,
    ) -> None:
        """``tokens`` is the token bank ``[rows]`` (long): the head writes sampled ids there and the prelude reads
        them for ``token_ids[i] == -1`` (refills without a round trip through the scheduler).

        ``decode_graphs``: run decode loop ops through ``DecodeGraphs`` (captured CUDA graphs per width and context
        bucket; on a CPU the same padded buffers, run eagerly). None: on CUDA only."""
        c = model.config
        if bank.dim() != 2 or bank.shape[1] != c.bank_width:
            raise ValueError(f"bank must be [rows, {c.bank_width}], got {list(bank.shape)}")
        if stage is Stage.LOOP and kv_layout.max_depth < 1:
            raise ValueError("loop stage needs a KV layout with max_depth >= 1")
        self.model, self.stage, self.bank, self.kv_layout = model, stage, bank, kv_layout
        self.device = bank.device
        self.tokens = tokens if tokens is not None else torch.zeros(bank.shape[0], dtype=torch.long, device=bank.device)
        use_graphs = (self.device.type == "cuda") if decode_graphs is None else decode_graphs
        use_graphs = use_graphs and stage is Stage.LOOP
        # With graphs the tables never grow (capture pins the tensor): a line per bank row, a column per block.
        self.tables = (
            DeviceBlockTables(self.device, bank.shape[0] + 1, num_blocks)
            if use_graphs
            else DeviceBlockTables(self.device)
        )
        self.block_size = block_size
        # The depth slot of each loop step, looked up on the device.
        self._slot_of_step = torch.tensor(
            [kv_layout.slot(s) for s in range(kv_layout.max_depth)], dtype=torch.long, device=self.device
        )
        model.fuse_projections()
        layers, slots = {
            Stage.PRELUDE: (c.num_prelude_layers, 1),
            Stage.LOOP: (c.num_loop_layers, kv_layout.n_slots),
            Stage.HEAD: (c.num_coda_layers, 1),
        }[stage]
        self.history: History | None = None  # allocated when a penalized request is first sampled here
        self.pool: PagedKVPool | None = None
        self.graphs: DecodeGraphs | None = None
        if layers > 0:
            self.pool = PagedKVPool(
                layers,
                slots,
                num_blocks + use_graphs,  # with graphs, block ``num_blocks`` is the padding's scratch block
                block_size,
                c.num_kv_heads,
                c.head_dim,
                dtype=model.dtype,
                device=model.device,
            )
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.loop_compute,
                lambda: self.tables.tensor,
                self.tables.reserve_scratch(num_blocks),
                bank.shape[0],
                block_size,
                self.device,
                capture=self.device.type == "cuda",
            )

    # ----------------------------------------------------------------- columns in
    def _columns(self, *columns: Sequence[int], floats: Tensor | None = None) -> tuple[list[Tensor], Tensor | None]:
        return columns_to_device(self.device, *columns, floats=floats)

    def _context_length(self, rids: Sequence[int], positions: Sequence[int]) -> int:
        """The context bucket of decode tokens (whole blocks past the last position), after the one check a device
        gather cannot make: every position lies inside its request's block table."""
        bs, tables = self.block_size, self.tables
        for rid, p in zip(rids, positions):
            if p >= len(tables.table(rid)) * bs:
                raise IndexError(
                    f"position {p} beyond the block table of request {rid} ({len(tables.table(rid))} blocks of {bs})"
                )
        return -(-(max(positions) + 1) // bs) * bs

    def _read(self, rows: Tensor) -> Tensor:
        x = self.bank.index_select(0, rows)  # [N, W]
        return x if x.dtype == self.model.dtype else x.to(self.model.dtype)

    def _write(self, rows: Tensor, values: Tensor) -> None:
        self.bank.index_copy_(0, rows, values if values.dtype == self.bank.dtype else values.to(self.bank.dtype))

    # ----------------------------------------------------------------- ops
    def execute(self, op: StageOp) -> StageResult:
        """Apply the op's table deltas, run it, return its result with ``compute_s`` (device-synchronised)."""
        if op.stage is not self.stage:
            raise ValueError(f"{op.stage.name} op sent to the {self.stage.name} worker")
        t0 = time.perf_counter()
        out = Outputs()
        signal_slot = lookahead_slot = -1
        sampled: Sampled | None = None
        params: tuple[SamplingParams, ...] = ()
        prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        with torch.inference_mode():
            self.tables.release(op.released)
            self.tables.apply(op.kv_updates)
            if isinstance(op, PreludeOp):
                self._prelude(op)
            elif isinstance(op, LoopOp):
                if op.head is not None:
                    sampled, params = self._fused_head(op.head, out), op.head.sampling
                signals = self._loop(op)
                if signals is not None:
                    signal_slot = out.add(signals[0])
                    lookahead_slot = out.add(signals[1]) if signals[1] is not None else -1
            else:
                sampled, prompt_logprobs = self._head(op, out)
                params = tuple(p for p, s in zip(op.sampling, op.sample) if s)
            fetched = out.fetch()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        token_ids: tuple[int, ...] = ()
        logprobs: tuple[TokenLogprobs | None, ...] = ()
        if sampled is not None:
            token_ids, logprobs = sampled.unpack(fetched, params)
        return StageResult(
            stage=self.stage,
            seq=op.seq,
            compute_s=time.perf_counter() - t0,
            signals=tuple(fetched[signal_slot]) if signal_slot >= 0 else (),
            lookahead=tuple(fetched[lookahead_slot]) if lookahead_slot >= 0 else (),
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _lines(self, rids: Sequence[int]) -> list[int] | None:
        """Device table lines when the stage has KV and every token is of a distinct request (a decode op)."""
        if self.pool is None or len(set(rids)) != len(rids):
            return None
        return self.tables.lines(rids)

    def _kv_for(
        self, rids: Sequence[int], positions: Sequence[int], lines: Tensor | None, pos: Tensor
    ) -> KVAccess | None:
        """The prelude's or head's KV (one depth slot): None without layers, ``DecodeKV`` for decode tokens."""
        if self.pool is None:
            return None
        if lines is not None:
            length = self._context_length(rids, positions)
            return DecodeKV(self.pool, self.tables.tensor, lines, pos, torch.zeros_like(pos), length)
        return PagedKV(self.pool, self.tables, rids, positions, [0] * len(rids))

    # Each op is host preparation (columns, checks), then a device part that is a fixed kernel sequence for its
    # width and context bucket: ``prelude_rows``, ``loop_decode``, ``fused_head``, ``head_rows`` (the fullgraph
    # test compiles each of them).
    def _prelude(self, op: PreludeOp) -> None:
        if not op.rows:
            return
        lines = self._lines(op.rids)
        cols, _ = self._columns(op.rows, op.token_ids, op.positions, *([lines] if lines is not None else []))
        kv = self._kv_for(op.rids, op.positions, cols[3] if lines is not None else None, cols[2])
        self.prelude_rows(cols, kv, op.init_seeds)

    def prelude_rows(self, cols: Sequence[Tensor], kv: KVAccess | None, init_seeds: Sequence[int]) -> None:
        """``cols`` (``[N]`` each): bank rows, token ids (-1: the token bank's), positions."""
        rows, ids, pos = cols[0], cols[1], cols[2]
        ids = torch.where(ids < 0, self.tokens.index_select(0, rows), ids)
        self._write(rows, self.model.prelude(ids, pos, kv, init_seeds))

    def _loop(self, op: LoopOp) -> tuple[Tensor, Tensor | None] | None:
        assert self.pool is not None
        for c in op.kv_copies:
            self.pool.copy_on_exit(self.tables.table(c.rid), c.position, c.from_slot)
        if not op.rows:
            return None
        if op.prefill:
            cols, _ = self._columns(op.rows, op.positions)
            rows, positions = cols[0], cols[1]
            x = self._read(rows)
            for s in range(op.num_steps):
                kv = PagedKV(self.pool, self.tables, op.rids, op.positions, [self.kv_layout.slot(s)] * len(op.rows))
                x, _, _ = self.model.loop_step(x, positions, torch.full_like(positions, s), kv)
            self._write(rows, x)
            return None
        length = self._context_length(op.rids, op.positions)
        cols, _ = self._columns(op.rows, op.positions, op.steps, self.tables.lines(op.rids))
        if self.graphs is not None:
            rows, x, signal, look = self.graphs.run(torch.stack(cols), len(op.rows), length)
            self._write(rows, x)
            return signal, look
        return self.loop_decode(cols, length)

    def loop_decode(self, cols: Sequence[Tensor], length: int) -> tuple[Tensor, Tensor | None]:
        """One loop step of decode tokens. ``cols`` (``[N]`` each): bank rows, positions, steps, table lines; ``length``
        the context bucket. Returns the exit signals ``[N]`` (and lookahead hazards)."""
        x, signal, look = self.loop_compute(cols, length)
        self._write(cols[0], x)
        return signal, look

    def loop_compute(self, cols: Sequence[Tensor], length: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """``loop_decode`` without the bank write: the new rows ``[N, W]``, signals, lookahead."""
        assert self.pool is not None
        rows, positions, steps, lines = cols[0], cols[1], cols[2], cols[3]
        kv = DecodeKV(self.pool, self.tables.tensor, lines, positions, self._slot_of_step[steps], length)
        return self.model.loop_step(self._read(rows), positions, steps, kv)

    def _fused_head(self, h: LoopHead, out: Outputs) -> Sampled:
        """A loop op's fused head (Ouro): sample the rows, then embed each successor's input into its row (a draft's:
        into the row of the successor drafted from it, ``LoopHead.embed_rows``)."""
        scols = SamplingColumns.build(h.sampling, h.token_index, self.device, h.masks)
        ends = -2 in h.embed_ids  # requests that end here have no successor to embed
        keep = [j for j, e in enumerate(h.embed_ids) if e != -2] if ends else []
        lp_rows = list(scols.logprob_rows) if len(scols.logprob_rows) < len(h.rows) else []
        (rows, positions, embed_ids, targets, keep_index, lp_index), table = self._columns(
            h.rows, h.positions, h.embed_ids, h.targets, keep, lp_rows, floats=scols.table
        )
        self._seed(h.rows, h.history)
        tokens, lp = self.fused_head(
            [rows, positions, embed_ids, targets],
            table,
            scols.any_sampled,
            scols.top_n if scols.logprob_rows else -1,
            keep_index if ends else None,
            lp_index if lp_rows else None,
            scols.processing,
        )
        return Sampled(out, tokens, lp, scols)

    def fused_head(
        self,
        cols: Sequence[Tensor],
        table: Tensor | None,
        any_sampled: bool,
        top_n: int,
        keep: Tensor | None = None,
        lp_rows: Tensor | None = None,
        processing: Processing | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``cols`` (``[N]`` each): bank rows, positions, embed ids (-1 the sampled id, >= 0 that id, -2 none), and
        the rows the embeddings (and sampled ids) go to (absent: the rows themselves); ``table [4, N]`` the
        sampling columns. ``keep``: the rows that embed a successor (None: all); ``top_n`` >= 0:
        logprob columns with that many alternatives for ``lp_rows`` (None: all rows)."""
        rows, positions, embed_ids = cols[0], cols[1], cols[2]
        targets = cols[3] if len(cols) > 3 else rows
        hidden = self.model.coda(self._read(rows), positions, None)  # [N, H]
        logits = self.model.logits(hidden)  # [N, V] float32
        tokens, lp = sample_with_history(logits, self.history, rows, table, any_sampled, top_n, lp_rows, processing)
        self.tokens.index_copy_(0, targets, tokens)
        ids = torch.where(embed_ids == -1, tokens, embed_ids)  # the successor's input: sampled, or recorded
        if keep is not None:
            targets, ids = targets[keep], ids[keep]
        self._write(targets, self.model.embed_input(ids))
        return tokens, lp

    def _seed(self, bank_rows: Sequence[int], seeds: Sequence[HistorySeed]) -> None:
        """Seed the histories of ``seeds`` (``seed.index`` into ``bank_rows``, the op's sampled rows)."""
        if not seeds:
            return
        if self.history is None:
            self.history = History(self.bank.shape[0], self.model.config.vocab_size, self.device)
        self.history.seed([bank_rows[s.index] for s in seeds], seeds)

    def _head(self, op: HeadOp, out: Outputs) -> tuple[Sampled | None, tuple[TokenLogprobs, ...]]:
        """Coda, LM head and sampling; with ``score_ids`` (prefill, echo) also the scored prompt tokens' logprobs."""
        if not op.rows:
            return None, ()
        lines = self._lines(op.rids)
        cols, _ = self._columns(op.rows, op.positions, *([lines] if lines is not None else []))
        rows, positions = cols[0], cols[1]
        kv = self._kv_for(op.rids, op.positions, cols[2] if lines is not None else None, positions)
        hidden = self.model.coda(self._read(rows), positions, kv)  # [N, H]
        scored: tuple[TokenLogprobs, ...] = ()
        if op.score_ids and any(t >= 0 for t in op.score_ids):
            which = [i for i, t in enumerate(op.score_ids) if t >= 0]
            parts: list[TokenLogprobs] = []
            for at in range(0, len(which), SCORE_SLICE):  # logits of a long prompt a slice at a time
                part = which[at : at + SCORE_SLICE]
                index, targets = self._columns(part, [op.score_ids[i] for i in part])[0]
                params = [op.sampling[i] for i in part]
                top_n = max(p.logprobs for p in params)
                packed = logprob_columns(self.model.logits(hidden[index]), targets, top_n).tolist()
                parts += [lp for lp in unpack_logprobs(packed, params, range(len(part)), len(part)) if lp is not None]
            scored = tuple(parts)
        picked = [i for i, s in enumerate(op.sample) if s]
        if not picked:
            return None, scored
        params = [op.sampling[i] for i in picked]
        masks = [op.masks[i] for i in picked] if op.masks else ()
        scols = SamplingColumns.build(params, [op.token_index[i] for i in picked], self.device, masks)
        fused = [j for j, i in enumerate(picked) if op.embed and op.embed[i]]
        lp_rows = list(scols.logprob_rows) if len(scols.logprob_rows) < len(picked) else []
        (index, embed, lp_index), table = self._columns(picked, fused, lp_rows, floats=scols.table)
        self._seed([op.rows[i] for i in picked], op.history)
        tokens, lp = self.head_rows(
            hidden,
            rows,
            index if len(picked) < len(op.rows) else None,
            table,
            scols.any_sampled,
            scols.top_n if scols.logprob_rows else -1,
            embed if fused else None,
            lp_index if lp_rows else None,
            scols.processing,
        )
        return Sampled(out, tokens, lp, scols), scored

    def head_rows(
        self,
        hidden: Tensor,
        rows: Tensor,
        picked: Tensor | None,
        table: Tensor | None,
        any_sampled: bool,
        top_n: int,
        embed: Tensor | None = None,
        lp_rows: Tensor | None = None,
        processing: Processing | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Sample the ``picked`` rows (None: all) of the coda's ``hidden [N, H]``; write their ids to the token bank
        and, for ``embed`` (indices among the picked), their successors' input embedding into the rows."""
        if picked is not None:
            hidden, rows = hidden[picked], rows[picked]
        logits = self.model.logits(hidden)  # [N, V] float32
        tokens, lp = sample_with_history(logits, self.history, rows, table, any_sampled, top_n, lp_rows, processing)
        self.tokens.index_copy_(0, rows, tokens)
        if embed is not None:
            self._write(rows[embed], self.model.embed_input(tokens[embed]))
        return tokens, lp
