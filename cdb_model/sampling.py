"""Token sampling whose randomness depends only on ``(params.seed, token_index)``, never on the batch.

Per token: greedy argmax when ``temperature == 0``; otherwise logits / temperature, min-p (the tokens less likely
than min_p times the most likely one dropped), top-k, top-p (the smallest set of most likely tokens whose mass
reaches p, at least one), then an inverse-CDF draw with ``u ~ U[0, 1)``
given by ``seeded_uniform(derive_seed(seed, token_index))`` (integer mixing). The math runs on CPU in float64,
so the same logits give the same token on every device and in every batch. Before all that, a request's
``LogitsProcessing`` (logit bias, min_tokens, repetition / frequency / presence penalties over its history). This
is the oracle of the batched sampler the stages run (``cdb_model.batched_sampling``), one row at a time. Logprobs
are ``log_softmax`` of the unmodified logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_scheduler.plan import derive_seed, seeded_uniform
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams, TokenLogprobs


def filtered_probs(logits: Tensor, p: SamplingParams) -> tuple[Tensor, Tensor]:
    """(token ids ``[K]``, probabilities ``[K]`` float64 summing to 1) left after temperature, top-k and top-p.

    With a filter the kept tokens are most likely first (ties in vocabulary order); without one, all tokens in
    vocabulary order. ``logits [V]``, ``p.temperature > 0``.
    """
    scaled = logits.double() / p.temperature  # [V]
    if p.min_p > 0.0:  # p_i < min_p * p_max  <=>  scaled_i < max(scaled) + log(min_p)
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), float("-inf"))
    if p.top_k <= 0 and p.top_p >= 1.0:  # no filter: the full distribution in vocabulary order (no sort)
        return torch.arange(scaled.shape[0]), torch.softmax(scaled, dim=-1)
    ids = torch.argsort(scaled, descending=True, stable=True)  # [V]
    if p.top_k > 0:
        ids = ids[: p.top_k]  # [K]
    probs = torch.softmax(scaled[ids], dim=-1)  # [K]
    if p.top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=-1) - probs  # [K]: mass of the strictly more likely tokens
        keep = int((mass_before < p.top_p).sum().clamp(min=1))
        ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
    return ids, probs


def draw(probs: Tensor, seed: int) -> int:
    """Index into ``probs [K]`` by inverse CDF with the uniform draw ``seeded_uniform(seed)``."""
    u = seeded_uniform(seed)
    cdf = torch.cumsum(probs, dim=-1)  # [K]
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(idx, probs.shape[0] - 1)


def processed(
    logits: Tensor, proc: LogitsProcessing, index: int, prompt: Sequence[int], output: Sequence[int]
) -> Tensor:
    """``logits [V]`` (float32) after ``proc`` for token ``index``, given the prompt and the ``output`` before it."""
    x = logits.clone()
    for token, bias in proc.logit_bias:
        x[token] += bias
    if index < proc.min_tokens:
        x[list(proc.stop_ids)] = float("-inf")
    if not proc.penalized:
        return x
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=x.shape[0]).to(x.dtype)  # [V]
    seen = counts > 0
    if proc.repetition_penalty != 1.0:
        seen_any = seen.clone()
        seen_any[list(prompt)] = True
        r = proc.repetition_penalty
        x = torch.where(seen_any, torch.where(x > 0, x / r, x * r), x)
    return x - proc.frequency_penalty * counts - proc.presence_penalty * seen.to(x.dtype)


def banned(x: Tensor, mask: bytes) -> Tensor:
    """``x [V]`` with the ids ``mask`` leaves out at -inf (``cdb_scheduler.plan.MASKS``); ``x`` itself for b""."""
    if not mask:
        return x
    bits = [(mask[i >> 3] >> (i & 7)) & 1 if i >> 3 < len(mask) else 0 for i in range(x.shape[0])]
    return x.masked_fill(torch.tensor(bits, dtype=torch.bool).logical_not(), float("-inf"))


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    token_index: Sequence[int],
    history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    masks: Sequence[bytes] = (),
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of ``logits [N, V]``; ``params[i]`` and stream index ``token_index[i]``;
    ``history[i]``: (prompt, output before this token) of the row, needed by penalties.

    ``masks[i]``: row i's structured output's mask (b"" or absent: none), applied after the processing.
    Returns the token ids and, where ``return_logprob`` or ``logprobs > 0`` is asked, their ``TokenLogprobs``.
    """
    if not len(params) == len(token_index) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(token_index)} indices")
    cpu = logits.detach().to(device="cpu", dtype=torch.float32)  # [N, V]
    greedy = cpu.argmax(dim=-1).tolist()  # [N]
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for i, (p, index) in enumerate(zip(params, token_index, strict=True)):
        row = cpu[i]
        if p.processing is not None:
            prompt, output = history[i] if history is not None else ((), ())
            row = processed(row, p.processing, index, prompt, output)
        mask = masks[i] if masks else b""
        row = banned(row, mask)
        if p.temperature == 0.0:
            tok = int(greedy[i]) if p.processing is None and not mask else int(row.argmax())
        else:
            ids, probs = filtered_probs(row, p)
            tok = int(ids[draw(probs, derive_seed(p.seed, index))])
        tokens.append(tok)
        if p.return_logprob or p.logprobs > 0:
            lp = torch.log_softmax(banned(cpu[i], mask).double(), dim=-1)  # [V]
            top = torch.topk(lp, min(p.logprobs, lp.shape[0])) if p.logprobs > 0 else None
            logprobs.append(
                TokenLogprobs(
                    logprob=float(lp[tok]),
                    top_ids=tuple(top.indices.tolist()) if top is not None else (),
                    top_logprobs=tuple(top.values.tolist()) if top is not None else (),
                )
            )
        else:
            logprobs.append(None)
    return tokens, logprobs
