"""The stages' sampler: every row of a logits batch sampled at once, where the logits are, with no host sync.

Per row exactly the math of the float64 oracle (``cdb_model.sampling``): greedy argmax at ``temperature == 0``;
otherwise logits / temperature in float64, top-k and top-p over the tokens sorted most likely first (stable, so
ties keep vocabulary order; a row with neither filter keeps vocabulary order), then the inverse-CDF draw of the
row's ``u``. The uniforms are computed on the host from ``(seed, token index)`` (``seeded_uniform``), so a row's
token depends only on its own logits and parameters, never on its batch. Logprobs are ``log_softmax`` of the
unmodified logits in float64, with the top alternatives.

What the host decides per op (``SamplingColumns``) is plain data: whether any row samples or wants logprobs and
how many alternatives at most. Everything per row is a tensor, so one op's sampling is one fixed sequence of
kernels for its width: capturable, and ``torch.compile(fullgraph=True)``-clean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch
from torch import Tensor

from cdb_scheduler.plan import derive_seed, seeded_uniform
from cdb_scheduler.sampling import SamplingParams, TokenLogprobs

_TEMPERATURE, _LOGPROBS, _PROCESSING = attrgetter("temperature"), attrgetter("logprobs"), attrgetter("processing")
_MIN_P = attrgetter("min_p")


def _wants_logprobs(p: SamplingParams) -> bool:
    return p.return_logprob or p.logprobs > 0


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """Per-row sampling inputs of one op, built on the host. ``table [4, N]`` float64 (on the host: the worker
    sends it with the op's columns, in one copy) holds temperature, top-k, top-p and the row's uniform draw (exact:
    top-k is an int below 2**53), and a fifth row, min-p, only when a row asks for it (``sample_rows`` reads the
    table's shape, known on the host: an op without min-p does none of its work)."""

    table: Tensor | None  # None when no row samples (all greedy)
    any_sampled: bool
    logprob_rows: tuple[int, ...]  # rows that asked for logprobs
    top_n: int  # the most alternatives any row asked for
    processing: Processing | None = None  # logit bias, min_tokens and penalties of the rows that ask for them

    @staticmethod
    def build(
        params: Sequence[SamplingParams],
        token_index: Sequence[int],
        device: torch.device,
        masks: Sequence[bytes] = (),
    ) -> SamplingColumns:
        """``masks``: per row its structured output's mask (``cdb_scheduler.plan.MASKS``; b"" none), or () none."""
        if len(params) != len(token_index):
            raise ValueError(f"{len(params)} sampling params for {len(token_index)} token indices")
        any_sampled = any(map(_TEMPERATURE, params))  # (C loops over the rows: this runs for every op)
        table = None
        if any_sampled:  # an all-greedy op needs no table: the argmax alone
            cols: list[tuple[float, ...]] = [
                (
                    p.temperature,
                    float(p.top_k),
                    p.top_p,
                    seeded_uniform(derive_seed(p.seed, i)) if p.temperature else 0.0,
                )
                for p, i in zip(params, token_index)
            ]
            if any(map(_MIN_P, params)):
                cols = [(*c, p.min_p) for c, p in zip(cols, params)]
            table = torch.tensor(cols, dtype=torch.float64).reshape(len(cols), len(cols[0])).T.contiguous()
        wants = list(map(_wants_logprobs, params))
        return SamplingColumns(
            table=table,
            any_sampled=any_sampled,
            logprob_rows=tuple(j for j, w in enumerate(wants) if w) if any(wants) else (),
            top_n=max(map(_LOGPROBS, params), default=0),
            processing=(
                Processing.build(params, token_index, device, masks) if masks or any(map(_PROCESSING, params)) else None
            ),
        )


@dataclass(frozen=True, slots=True)
class Processing:
    """The ``LogitsProcessing`` of one op's rows as tensors: additive entries ``(row, token, value)`` (logit bias,
    and -inf for the stop ids of rows below their ``min_tokens``), and per row the presence, frequency and
    repetition penalties ``[3, N]`` (neutral 0, 0, 1 for rows without), with whether any row is penalized."""

    add_rows: Tensor
    add_tokens: Tensor
    add_values: Tensor  # float32
    penalties: Tensor | None  # [3, N] float32
    penalized_rows: tuple[int, ...]
    penalized_index: Tensor  # the same, on the device
    mask_rows: Tensor | None = None  # structured output: the rows with a mask, and their allowed tokens [M, V']
    allowed: Tensor | None = None  # bool, V' >= V (the masks' bytes, unpacked)

    @staticmethod
    def build(
        params: Sequence[SamplingParams], token_index: Sequence[int], device: torch.device, masks: Sequence[bytes] = ()
    ) -> Processing:
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        penalties = [(0.0, 0.0, 1.0)] * len(params)
        penalized: list[int] = []
        masked = [j for j, m in enumerate(masks) if m]
        for j, (p, index) in enumerate(zip(params, token_index)):
            proc = p.processing
            if proc is None:
                continue
            for token, bias in proc.logit_bias:
                rows.append(j)
                tokens.append(token)
                values.append(bias)
            if index < proc.min_tokens:
                rows.extend([j] * len(proc.stop_ids))
                tokens.extend(proc.stop_ids)
                values.extend([float("-inf")] * len(proc.stop_ids))
            if proc.penalized:
                penalties[j] = (proc.presence_penalty, proc.frequency_penalty, proc.repetition_penalty)
                penalized.append(j)
        ints = torch.tensor([rows, tokens], dtype=torch.long).reshape(2, len(rows)).to(device, non_blocking=True)
        return Processing(
            add_rows=ints[0],
            add_tokens=ints[1],
            add_values=torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True),
            penalties=torch.tensor(penalties, dtype=torch.float32).T.contiguous().to(device) if penalized else None,
            penalized_rows=tuple(penalized),
            penalized_index=torch.tensor(penalized, dtype=torch.long).to(device, non_blocking=True),
            **(_masks([masks[j] for j in masked], masked, device) if masked else {}),
        )

    def apply(self, logits: Tensor, counts: Tensor | None, seen: Tensor | None) -> Tensor:
        """``logits [N, V]`` float32 processed (a new tensor). ``counts [N, V]``: each token's count in the row's
        output so far; ``seen [N, V]``: whether it is in the prompt or the output (needed with penalties)."""
        x = logits.index_put((self.add_rows, self.add_tokens), self.add_values, accumulate=True)
        if self.penalties is None:
            return self._ban(x)
        assert counts is not None and seen is not None
        presence, frequency, repetition = (
            self.penalties[0, :, None],
            self.penalties[1, :, None],
            self.penalties[2, :, None],
        )
        c = counts.to(x.dtype)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        return self._ban(x - frequency * c - presence * (c > 0).to(x.dtype))

    def _ban(self, x: Tensor) -> Tensor:
        """``x`` (owned) with every token a masked row's grammar leaves out at -inf."""
        if self.mask_rows is None or self.allowed is None:
            return x
        allowed = self.allowed[:, : x.shape[-1]]
        return x.index_put_((self.mask_rows,), x.index_select(0, self.mask_rows).masked_fill(~allowed, float("-inf")))

    def masked(self, logits: Tensor) -> Tensor:
        """``logits`` with only the masks applied (what logprobs are computed from); ``logits`` itself without."""
        return logits if self.mask_rows is None else self._ban(logits.clone())


def _masks(masks: Sequence[bytes], rows: list[int], device: torch.device) -> dict[str, Tensor]:
    """``Processing.mask_rows`` and ``allowed`` of ``rows`` and their ``masks`` (all of one length)."""
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(rows), len(masks[0]))
    bits = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")).to(device=device, dtype=torch.bool)
    return {"mask_rows": torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), "allowed": bits}


def sample_rows(logits: Tensor, table: Tensor | None, any_sampled: bool) -> Tensor:
    """Token ids ``[N]`` (long) of ``logits [N, V]`` under ``table [4 or 5, N]`` (see ``SamplingColumns``)."""
    greedy = logits.argmax(dim=-1)  # [N]
    if not any_sampled or table is None:
        return greedy
    temperature, top_k, top_p, u = table[0], table[1].long(), table[2], table[3]  # [N] each
    vocab = logits.shape[-1]
    is_greedy = temperature == 0.0
    scaled = logits.double() / torch.where(is_greedy, 1.0, temperature)[:, None]  # [N, V]
    if table.shape[0] > 4:  # min-p: p_i < min_p * p_max  <=>  scaled_i < max(scaled) + log(min_p), as the oracle
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(table[4])[:, None]  # -inf where min_p == 0
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    # Filtered rows: most likely first (stable); unfiltered rows keep vocabulary order, as the oracle does.
    filtered = ((top_k > 0) | (top_p < 1.0))[:, None]  # [N, 1]
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [N, V]
    rank = torch.arange(vocab, device=logits.device)  # [V]
    ids = torch.where(filtered, sorted_ids, rank[None, :])  # [N, V]
    vals = torch.where(filtered, sorted_vals, scaled)
    in_k = (top_k[:, None] <= 0) | (rank[None, :] < top_k[:, None])  # [N, V]
    probs = torch.softmax(vals.masked_fill(~in_k, float("-inf")), dim=-1)  # [N, V]
    # Top-p keeps the first n tokens, n = how many of the top-k have less mass before them than p (at least one).
    nucleus = top_p < 1.0  # [N]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # the mass of the strictly more likely tokens
    n_p = ((mass_before < top_p[:, None]) & in_k).sum(dim=-1).clamp(min=1)  # [N]
    n_keep = torch.where(nucleus, n_p, in_k.sum(dim=-1))  # [N]
    kept = torch.where(rank[None, :] < n_keep[:, None], probs, 0.0)
    kept = torch.where(nucleus[:, None], kept / kept.sum(dim=-1, keepdim=True), kept)
    cdf = torch.cumsum(kept, dim=-1)  # [N, V]
    last = (n_keep - 1)[:, None]  # [N, 1]: index of the last kept token
    idx = torch.searchsorted(cdf, u[:, None] * cdf.gather(1, last), right=True)  # [N, 1]
    idx = torch.minimum(idx, last)
    drawn = ids.gather(1, idx)[:, 0]  # [N]
    return torch.where(is_greedy, greedy, drawn)


def logprob_columns(logits: Tensor, tokens: Tensor, top_n: int) -> Tensor:
    """``[N, 1 + 2 * top_n]`` float64: the sampled token's logprob, then the ids and logprobs of the ``top_n``
    most likely tokens (best first), from ``log_softmax`` of the unmodified logits."""
    lp = torch.log_softmax(logits.double(), dim=-1)  # [N, V]
    chosen = lp.gather(1, tokens[:, None])  # [N, 1]
    if top_n <= 0:
        return chosen
    top = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
    return torch.cat([chosen, top.indices.double(), top.values], dim=-1)


def unpack_logprobs(
    packed: Sequence[Sequence[float]], params: Sequence[SamplingParams], rows: Sequence[int], n: int
) -> list[TokenLogprobs | None]:
    """Per row of the op: its ``TokenLogprobs`` from the rows of ``logprob_columns`` (host lists), or None."""
    out: list[TokenLogprobs | None] = [None] * n
    width = (len(packed[0]) - 1) // 2 if packed else 0
    for values, j in zip(packed, rows):
        k = min(params[j].logprobs, width)
        out[j] = TokenLogprobs(
            logprob=float(values[0]),
            top_ids=tuple(int(t) for t in values[1 : 1 + k]),
            top_logprobs=tuple(float(v) for v in values[1 + width : 1 + width + k]),
        )
    return out
