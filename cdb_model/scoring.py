"""Prompt scoring: the logprob of given token ids under rows of logits (echo with prompt logprobs).

The math is the sampler's (``cdb_model.sampling``): ``log_softmax`` of the unmodified float32 logits, in float64 on
CPU, top alternatives by ``torch.topk``; a scored prompt token and a sampled token of the same logits get the same
numbers. One row's result depends on that row only, never on the others scored with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_scheduler.plan import TokenLogprobs


def score_rows(logits: Tensor, targets: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of id ``targets[i]`` under row ``i`` of ``logits [N, V]``, with ``top_n[i]`` alternatives
    (best first)."""
    if not len(targets) == len(top_n) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows, {len(targets)} targets, {len(top_n)} alternative counts")
    if not targets:
        return []
    lp = torch.log_softmax(logits.detach().to(device="cpu", dtype=torch.float32).double(), dim=-1)  # [N, V]
    picked = lp.gather(1, torch.tensor(list(targets), dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()  # [N]
    out = []
    for i, (value, n) in enumerate(zip(picked, top_n, strict=True)):
        top = torch.topk(lp[i], min(n, lp.shape[1])) if n > 0 else None
        out.append(
            TokenLogprobs(
                logprob=float(value),
                top_ids=tuple(top.indices.tolist()) if top is not None else (),
                top_logprobs=tuple(top.values.tolist()) if top is not None else (),
            )
        )
    return out
