"""What a synthetic stage's device "computes", drawn from seeds (``cdb_engine.synthetic``): exit depths, exit
signals and sampled token ids.

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

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_HIGH = 0.999999  # an Ouro hazard that crosses any threshold q < 1 (q = 1.0 still means full depth)
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


def masked_ids(ids: np.ndarray, masks: Sequence[bytes], stops: frozenset[int]) -> np.ndarray:
    """``ids`` with each masked one (structured output: ``masks[i]`` not b"") replaced by the allowed id at the draw's
    place among them (``id % count``): the ids that are no stop id, or the stop ids once only they are allowed. One
    vector pass over the masked rows."""
    rows = [i for i, m in enumerate(masks) if m]
    if not rows:
        return ids
    width = max(len(masks[i]) for i in rows)
    packed = np.frombuffer(b"".join(masks[i].ljust(width, b"\0") for i in rows), np.uint8).reshape(len(rows), width)
    allowed = np.unpackbits(packed, axis=1, bitorder="little").astype(bool)  # [M, 8 * width]
    going = allowed.copy()
    stop_ids = [t for t in stops if t < going.shape[1]]
    going[:, stop_ids] = False
    pool = np.where(going.any(axis=1, keepdims=True), going, allowed)
    counts = pool.sum(axis=1)
    k = ids[rows].astype(np.int64) % np.maximum(counts, 1)
    picked = (np.cumsum(pool, axis=1) > k[:, None]).argmax(axis=1)
    out = ids.copy()
    out[rows] = picked.astype(ids.dtype)
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
