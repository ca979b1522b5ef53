"""Sampling: greedy, top-k / top-p support, batch independence, distribution, logprobs."""

from __future__ import annotations

import math

import torch

from cdb_model.sampling import filtered_probs, sample
from cdb_scheduler.sampling import SamplingParams


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None]  # [1, V]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(logits, [SamplingParams()] * 6, list(range(6)))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert lps == [None] * 6


def test_top_k_support() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=5, seed=9)
    seen = {sample(logits, [p], [i])[0][0] for i in range(300)}
    assert seen == allowed


def test_top_p_support() -> None:
    logits = _logits([0.05, 0.5, 0.15, 0.3])

    def support(top_p: float) -> set[int]:
        return set(filtered_probs(logits[0], SamplingParams(temperature=1.0, top_p=top_p))[0].tolist())

    assert support(0.5) == {1}  # {1} already has mass 0.5
    assert support(0.7) == {1, 3}
    assert support(0.81) == {1, 3, 2}
    assert support(1e-9) == {1}  # always at least one token
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=4)
    assert {sample(logits, [p], [i])[0][0] for i in range(200)} == {1, 3}


def test_batch_independence() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 30, generator=gen)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=10, seed=s) for s in range(5)]
    index = [3, 0, 7, 7, 1]
    batched, _ = sample(logits, params, index)
    alone = [sample(logits[i : i + 1], [params[i]], [index[i]])[0][0] for i in range(5)]
    assert batched == alone
    reordered, _ = sample(logits.flip(0), params[::-1], index[::-1])
    assert reordered[::-1] == batched
    # The draw depends on (seed, index): different indices of one seed give different streams.
    many = {sample(logits[:1], [params[0]], [i])[0][0] for i in range(50)}
    assert len(many) > 1


def test_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = _logits(probs)
    n = 4000
    p = SamplingParams(temperature=1.0, seed=123)
    counts = [0] * 4
    for i in range(n):
        counts[sample(logits, [p], [i])[0][0]] += 1
    for c, q in zip(counts, probs, strict=True):
        assert abs(c / n - q) < 4 * math.sqrt(q * (1 - q) / n)
    # Temperature sharpens: at T = 0.25 the odds of token 3 vs 2 are (4/3)^4.
    p = SamplingParams(temperature=0.25, seed=5)
    counts = [0] * 4
    for i in range(n):
        counts[sample(logits, [p], [i])[0][0]] += 1
    ratio = counts[3] / counts[2]
    assert abs(ratio - (4 / 3) ** 4) < 0.5


def test_logprobs() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(return_logprob=True), SamplingParams(temperature=1.0, logprobs=3, seed=1)]
    tokens, lps = sample(logits, params, [0, 0])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert lps[0] is not None and lps[1] is not None
    assert math.isclose(lps[0].logprob, float(ref[0, tokens[0]]), rel_tol=1e-9)
    assert lps[0].top_ids == ()
    top = torch.topk(ref[1], 3)
    assert lps[1].top_ids == tuple(top.indices.tolist())
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(lps[1].top_logprobs, top.values.tolist(), strict=True))
    assert math.isclose(lps[1].logprob, float(ref[1, tokens[1]]), rel_tol=1e-9)
