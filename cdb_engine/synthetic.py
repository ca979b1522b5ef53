"""Synthetic stages: everything a stage does except the model's arithmetic, which becomes modelled device time.

A synthetic stage keeps the session, the bank, the KV block tables (and checks every position has its block), the
fences and the replies of a real one; instead of running the model it waits, asleep (no interpreter lock held,
no CPU burnt), for the op's modelled device time. It exists to measure the host path at GPU op speeds on a
machine without a GPU: its tokens mean nothing.

The device is modelled as one in-order stream per stage: an op starts when the stage has it ready and the
previous op has finished (``max(ready, previous end)``) and lasts its modelled time; the stage replies at its end.

Cost of one op (µs), per stage, from a SPEC:
- explicit, ``loop=A:B:C,head=A:B:C,prelude=A:B:C`` (a stage left out costs nothing): ``A + B * tokens +
  C * context / 1000``, where ``tokens`` are the op's tokens (the head: the sampled ones) and ``context`` the
  KV positions they read (``position + 1`` per token of a stage with KV layers);
- a named profile ``DEVICE:MODEL`` (``h200:ouro-1.4b``, ``h200:huginn-3.5b``), from the released checkpoint's
  shape in bf16 and the device's memory bandwidth ``BW`` and dense bf16 peak ``F`` (roofline):
  ``max(W / BW, 2 * P * tokens / F) + KV * context / BW`` with ``P`` the stage's parameters per op
  (``ModelConfig.stage_param_counts``), ``W = 2 P`` bytes and ``KV`` the K and V bytes of one position in the
  stage's layers (one depth slot). A prefill loop op runs ``num_steps`` such steps.

Exit depths: each decode token's depth is drawn from ``(seed = rid, position)`` in ``[MIN, max depth]`` with mean
``MEAN`` (``MIN + Binomial(max - MIN, p)``; ``--synthetic-depths MEAN:MIN``, default 2.5:2 for Ouro, 6:3 for
Huginn). The loop stage reports the signals that make the family's exit rule, with the default one-ahead
horizon and any threshold strictly inside its range, exit at that depth (a same-step horizon exits one step
earlier); replayed depths (``replay_depths``) and full depth ignore them as usual. The head returns token ids
from a seeded stream of ``(rid, token index)`` that avoids the model's stop ids; a draft read (self-speculative
decoding: a row sampled for a successor in another row) ``k`` steps short of the token's drawn depth gives that
id with probability ``ACCEPT ** k`` (``--synthetic-depths MEAN:MIN:ACCEPT``, default 0.9), another id otherwise.
Both are computed after the op's modelled time has started, inside it: a GPU computes them while its host goes on.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any

import numpy as np
import torch
from torch import Tensor

from cdb_model.config import ModelConfig
from cdb_model.kv import BlockTables, KVLayout
from cdb_model.released import HUGINN_0125, OURO_14B
from cdb_scheduler.plan import (
    HeadOp,
    LoopHead,
    LoopOp,
    PreludeOp,
    SamplingParams,
    Stage,
    StageOp,
    StageResult,
    TokenLogprobs,
    derive_seed,
)


@dataclass(frozen=True, slots=True)
class Device:
    """What bounds a stage op on a device: memory bandwidth (bytes/s) and dense bf16 peak (FLOP/s)."""

    bandwidth: float
    flops: float


DEVICES = {"h200": Device(bandwidth=4.8e12, flops=989e12)}
MODELS: dict[str, dict[str, Any]] = {"ouro-1.4b": OURO_14B, "huginn-3.5b": HUGINN_0125}
_DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True, slots=True)
class OpCost:
    """Modelled device time of one op (µs): ``A + B * tokens`` (``roofline``: ``max(A, B * tokens)``) plus
    ``C * context / 1000``."""

    fixed_us: float = 0.0
    per_token_us: float = 0.0
    per_kctx_us: float = 0.0
    roofline: bool = False

    def seconds(self, tokens: int, context: int) -> float:
        work = self.per_token_us * tokens
        body = max(self.fixed_us, work) if self.roofline else self.fixed_us + work
        return 1e-6 * (body + self.per_kctx_us * context / 1000.0)

    def describe(self) -> str:
        op = "max" if self.roofline else "+"
        return f"{self.fixed_us:g}{op}{self.per_token_us:g}/tok+{self.per_kctx_us:g}/kctx µs"


@dataclass(frozen=True, slots=True)
class SyntheticCost:
    """Modelled op costs of the three stages (``parse_cost``)."""

    spec: str
    prelude: OpCost
    loop: OpCost
    head: OpCost

    def of(self, stage: Stage) -> OpCost:
        return (self.prelude, self.loop, self.head)[stage]

    def describe(self) -> str:
        return f"{self.spec} (" + ", ".join(f"{s.role} {self.of(s).describe()}" for s in Stage) + ")"


def profile_cost(device: str, model: str) -> SyntheticCost:
    """The named profile ``DEVICE:MODEL`` (see the module docstring for the formula)."""
    if device not in DEVICES:
        raise ValueError(f"synthetic cost: unknown device {device!r} (one of {', '.join(DEVICES)})")
    if model not in MODELS:
        raise ValueError(f"synthetic cost: unknown model {model!r} (one of {', '.join(MODELS)})")
    dev, c = DEVICES[device], ModelConfig.from_hf(MODELS[model], name=model)
    params = c.stage_param_counts()
    kv_layers = (c.num_prelude_layers, c.num_loop_layers, c.num_coda_layers)
    costs = []
    for stage in Stage:
        p, layers = params[stage], kv_layers[stage]
        weights_s = _DTYPE_BYTES * p / dev.bandwidth
        flops_s = 2 * p / dev.flops
        kv_bytes = 2 * c.kv_size * _DTYPE_BYTES * layers  # K and V of one position, one depth slot
        if stage is Stage.PRELUDE and p == 0:  # an embedding lookup: one row read per token
            weights_s, flops_s = 0.0, _DTYPE_BYTES * c.hidden_size / dev.bandwidth
        costs.append(OpCost(1e6 * weights_s, 1e6 * flops_s, 1e9 * kv_bytes / dev.bandwidth, roofline=True))
    return SyntheticCost(f"{device}:{model}", *costs)


def parse_cost(spec: str) -> SyntheticCost:
    """A SPEC (module docstring) as costs; ValueError naming what is wrong."""
    text = spec.strip()
    if not text:
        raise ValueError("synthetic cost: empty SPEC")
    if "=" not in text:
        device, sep, model = text.partition(":")
        if not sep:
            raise ValueError(f"synthetic cost {spec!r}: expected DEVICE:MODEL or stage=A:B:C,...")
        return profile_cost(device.strip().lower(), model.strip().lower())
    costs = {stage: OpCost() for stage in Stage}
    for part in text.split(","):
        role, _, values = part.partition("=")
        try:
            stage = Stage.from_role(role.strip())
        except ValueError as exc:
            raise ValueError(f"synthetic cost {spec!r}: {exc}") from None
        fields = values.split(":")
        try:
            numbers = [float(v) for v in fields]
        except ValueError:
            numbers = []
        if len(numbers) != 3 or any(not math.isfinite(v) or v < 0 for v in numbers):
            raise ValueError(f"synthetic cost {spec!r}: {stage.role} needs A:B:C, three numbers >= 0 (µs)")
        costs[stage] = OpCost(numbers[0], numbers[1], numbers[2])
    return SyntheticCost(text, costs[Stage.PRELUDE], costs[Stage.LOOP], costs[Stage.HEAD])


DRAFT_AGREEMENT = 0.9  # synthetic drafts: chance that one loop step more leaves a token's sample unchanged


@dataclass(frozen=True, slots=True)
class SyntheticDepths:
    """Drawn exit depths: mean and minimum (the maximum is the tree's max depth)."""

    mean: float
    min: int
    accept: float = DRAFT_AGREEMENT  # a draft read k steps short of the token's depth is right with accept ** k

    @classmethod
    def parse(cls, text: str, arch: str) -> SyntheticDepths:
        """``MEAN:MIN[:ACCEPT]``; empty: the family's default (Ouro 2.5:2, Huginn 6:3)."""
        if not text.strip():
            return cls(2.5, 2) if arch == "ouro" else cls(6.0, 3)
        mean, sep, rest = text.partition(":")
        low, sep2, accept = rest.partition(":")
        try:
            depths = cls(float(mean), int(low) if sep else 1, float(accept) if sep2 else DRAFT_AGREEMENT)
        except ValueError:
            raise ValueError(
                f"synthetic depths {text!r}: expected MEAN:MIN[:ACCEPT] (a number, an integer, a number)"
            ) from None
        if not math.isfinite(depths.mean) or depths.min < 1 or depths.mean < depths.min:
            raise ValueError(f"synthetic depths {text!r}: need MIN >= 1 and MEAN >= MIN")
        if not 0.0 <= depths.accept <= 1.0:
            raise ValueError(f"synthetic depths {text!r}: need 0 <= ACCEPT <= 1")
        return depths

    def draw(self, rid: int, position: int, max_depth: int) -> int:
        """The depth of token ``(rid, position)``: ``lo + Binomial(hi - lo, p)`` with the configured mean."""
        return int(self.draw_many(np.array([rid], np.uint64), np.array([position], np.uint64), max_depth)[0])

    def draw_many(self, rids: np.ndarray, positions: np.ndarray, max_depth: int) -> np.ndarray:
        """``draw`` over arrays (uint64): the same integers, in a few vector operations per op."""
        lo = min(self.min, max_depth)
        n = max_depth - lo
        if n == 0:
            return np.full(len(rids), lo, np.int64)
        p = min(1.0, max(0.0, (self.mean - lo) / n))
        below = np.uint64(min(math.ceil(p * 2**63), 2**64 - 1))  # integer x < p * 2**63  <=>  x < ceil(p * 2**63)
        base = _splitmix(rids, positions)
        if n == 1:
            return (_splitmix(base, 0) < below) + lo
        # every trial j of every token in one broadcast (tokens x trials): a Huginn-like tree draws ~30 per token
        hits = _splitmix(base[:, None], np.arange(n, dtype=np.uint64)[None, :]) < below
        return np.count_nonzero(hits, axis=1) + lo


def exit_signals(
    depths: SyntheticDepths,
    rids: Sequence[int],
    positions: Sequence[int],
    steps: Sequence[int],
    max_depth: int,
    *,
    ouro: bool = True,
) -> tuple[float, ...]:
    """The exit signal after each token's step that makes it leave at its drawn depth under a one-ahead decision
    (read one step early): Ouro a hazard that crosses any threshold below 1 (else 0), Huginn a latent difference of
    0 (else 1)."""
    drawn = depths.draw_many(np.array(rids, np.uint64), np.array(positions, np.uint64), max_depth)
    leave = (np.array(steps, np.int64) + 2 >= drawn).tolist()
    on, off = (_HIGH, 0.0) if ouro else (0.0, 1.0)
    return tuple(on if x else off for x in leave)


_M64 = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x7FFFFFFFFFFFFFFF)]


def sampled_ids(
    seeds: Sequence[int], rids: Sequence[int], token_index: Sequence[int], vocab: int, stops: frozenset[int]
) -> np.ndarray:
    """The synthetic head's token ids: ``derive_seed(derive_seed(seed, rid), token index) % vocab``, moved up past
    the model's stop ids (``(id + 1) % vocab`` until it is none), over arrays (int64)."""
    base = np.array([s & _MASK64 for s in seeds], np.uint64)
    ids = _splitmix(_splitmix(base, np.array(rids, np.uint64)), np.array(token_index, np.uint64)) % np.uint64(vocab)
    out = ids.astype(np.int64)
    if stops:
        banned = _banned(vocab, stops)
        for _ in range(len(stops) + 1):
            hit = banned[out]
            if not hit.any():
                break
            out[hit] = (out[hit] + 1) % vocab
    return out


@functools.lru_cache(maxsize=8)
def _banned(vocab: int, stops: frozenset[int]) -> np.ndarray:
    """A mask over the vocabulary, true at the stop ids (one lookup per sampled id instead of a set search)."""
    mask = np.zeros(vocab, bool)
    mask[[t for t in stops if 0 <= t < vocab]] = True
    mask.flags.writeable = False
    return mask


_MASK64 = (1 << 64) - 1


def _splitmix(base: np.ndarray, index: np.ndarray | int) -> np.ndarray:
    """``derive_seed`` over uint64 arrays (products wrap modulo 2**64, as its masks do; array arithmetic wraps
    without a warning, and a scalar ``index`` is folded into the constant as a Python integer)."""
    a, b, c, low63 = _M64
    x: Any  # (uint64 throughout)
    if isinstance(index, np.ndarray):
        x = base * a + index * b + c
    else:
        x = base * a + np.uint64((int(index) * _B + _C) & _MASK64)
    x = (x ^ (x >> _S30)) * b
    x = (x ^ (x >> _S27)) * c
    return (x ^ (x >> _S31)) & low63


_B, _C = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


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
_HIGH = 0.999999  # an Ouro hazard that crosses any threshold q < 1 (q = 1.0 still means full depth)


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
            seconds = self._seconds(op.rids, op.positions, len(op.rows)) * (op.num_steps if op.prefill else 1)
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
            sampled = self._sample(h.rids, h.targets, (True,) * len(h.rows), h.sampling, h.token_index)
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
        result = self._sample(op.rids, op.rows, op.sample, op.sampling, op.token_index)
        return replace(result, prompt_logprobs=self._scores(op)) if op.score_ids else result

    def _check(self, rid: int, position: int) -> None:
        if position // self.block_size >= len(self.tables.table(rid)):
            raise IndexError(f"request {rid}: position {position} has no KV block")

    def _seconds(self, rids: Sequence[int], positions: Sequence[int], tokens: int) -> float:
        context = 0
        if self.has_kv and rids:
            held = self.tables.lengths(rids)  # every position's block is there (C-level maps over the op's rows)
            if any(map(operator.ge, map(operator.floordiv, positions, repeat(self.block_size)), held)):
                for rid, pos in zip(rids, positions):
                    self._check(rid, pos)  # (raises, naming the first that has not)
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
    ) -> StageResult:
        """Token ids from the seeded stream of ``(seed, rid, token index)`` (``sampled_ids``), one vector draw per op
        (a GPU draws them in the op; the host does not loop over tokens)."""
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
