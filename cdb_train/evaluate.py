"""Held-out evaluation: perplexity at each depth, of the exit-weighted mixture, and at the exit threshold.

Every token runs all loop steps with teacher forcing (depth-indexed context as trained), so each position has a
loss and a gate hazard at every depth. Windows are non-overlapping: ``seq + 1`` tokens, stride ``seq``, each
target scored once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cdb_model.ouro import OuroLM
from cdb_train.model import exit_log_pdf, loop_forward


def windows(ids: Sequence[int], seq: int, limit: int | None = None) -> Tensor:
    """Non-overlapping ``[W, seq + 1]`` windows of a token stream (the incomplete tail is dropped)."""
    n = (len(ids) - 1) // seq
    if limit is not None:
        n = min(n, limit)
    t = torch.tensor(list(ids[: n * seq + 1]), dtype=torch.long)
    return torch.stack([t[i * seq : i * seq + seq + 1] for i in range(n)]) if n else t.new_zeros((0, seq + 1))


@dataclass
class StepScores:
    """Per step and target token: cross-entropy ``ce [R, M]``, exit log-pdf ``log_pdf [R, M]``, gate hazards
    ``hazard [R, M]`` and lookahead hazards ``lookahead [R, M]`` (None without a lookahead gate)."""

    ce: Tensor
    log_pdf: Tensor
    hazard: Tensor
    lookahead: Tensor | None


@torch.no_grad()
def score(model: OuroLM, wins: Tensor, batch: int = 16) -> StepScores:
    ces, lps, hzs, las = [], [], [], []
    for i in range(0, wins.shape[0], batch):
        w = wins[i : i + batch]
        out = loop_forward(model, w[:, :-1])
        targets = w[:, 1:].reshape(-1)
        ces.append(torch.stack([F.cross_entropy(model.logits(h), targets, reduction="none") for h in out.states]))
        lps.append(exit_log_pdf(out.gate_logits.float()))
        hzs.append(torch.sigmoid(out.gate_logits.float()))
        if out.lookahead is not None:
            las.append(out.lookahead.float())
    return StepScores(torch.cat(ces, 1), torch.cat(lps, 1), torch.cat(hzs, 1), torch.cat(las, 1) if las else None)


def same_step_depths(log_pdf: Tensor, q: float, min_depth: int = 1) -> Tensor:
    """Served depth per token ``[M]``: the first depth >= ``min_depth`` whose exit CDF reaches ``q``."""
    cdf = torch.cumsum(log_pdf.exp(), dim=0)  # [R, M]
    cdf[-1] = 1.0
    cdf[: min_depth - 1] = 0.0
    reached = cdf >= q
    return reached.float().argmax(dim=0) + 1


def summarise(s: StepScores, q: float) -> dict[str, Any]:
    """The figures of the model card for one set of scores (threshold ``q`` for the served-depth figures)."""
    r, m = s.ce.shape
    mix = -torch.logsumexp(s.log_pdf - s.ce, dim=0)  # -log sum_t p_t softmax_t(y)
    pdf = s.log_pdf.exp()
    entropy = -(pdf * s.log_pdf).sum(0)
    depth = same_step_depths(s.log_pdf, q)
    served_ce = s.ce.gather(0, (depth - 1)[None]).squeeze(0)
    hist = torch.bincount(depth - 1, minlength=r)
    return {
        "tokens": m,
        "loss_per_depth": [round(float(c), 5) for c in s.ce.mean(1)],
        "ppl_per_depth": [round(math.exp(float(c)), 4) for c in s.ce.mean(1)],
        "ppl_mixture": round(math.exp(float(mix.mean())), 4),
        "expected_loss": round(float((pdf * s.ce).sum(0).mean()), 5),
        "exit_pdf_mean": [round(float(p), 4) for p in pdf.mean(1)],
        "exit_entropy_mean": round(float(entropy.mean()), 4),
        "threshold": q,
        "ppl_at_threshold": round(math.exp(float(served_ce.mean())), 4),
        "depth_histogram_at_threshold": [round(int(c) / m, 4) for c in hist],
        "mean_depth_at_threshold": round(float(depth.float().mean()), 4),
    }


def depth_profile(
    s: StepScores, targets: Tensor, decode: Callable[[int], str], q: float, min_count: int = 100, top: int = 12
) -> dict[str, Any]:
    """What the gate learned: the mean full-depth loss of the tokens served at each depth (same-step, threshold
    ``q``), and the frequent target tokens (``targets [M]``, at least ``min_count`` times) served shallowest and
    deepest on average. A depth belongs to the token it predicts, as in the served stream."""
    r = s.ce.shape[0]
    depth = same_step_depths(s.log_pdf, q).float()
    ce_full = s.ce[-1]
    per_depth = []
    for d in range(1, r + 1):
        sel = depth == d
        per_depth.append(round(float(ce_full[sel].mean()), 4) if bool(sel.any()) else None)
    counts = torch.bincount(targets, minlength=int(targets.max()) + 1)
    sums = torch.bincount(targets, weights=depth, minlength=counts.numel())
    ids = [i for i in range(counts.numel()) if int(counts[i]) >= min_count]
    ids.sort(key=lambda i: float(sums[i] / counts[i]))

    def row(i: int) -> dict[str, Any]:
        return {"token": decode(i), "count": int(counts[i]), "mean_depth": round(float(sums[i] / counts[i]), 3)}

    return {
        "threshold": q,
        "loss_at_full_depth_by_served_depth": per_depth,
        "shallowest_tokens": [row(i) for i in ids[:top]],
        "deepest_tokens": [row(i) for i in ids[::-1][:top]],
    }
